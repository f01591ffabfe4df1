"""Requests shared by the engine-level tests (valen_runtime/test_engine.py, test_layouts.py), and
the valen-serve process the serve tests start."""

from __future__ import annotations

import base64
import io
import signal
import subprocess
import sys

import pytest

QUESTIONS = {
    "q": {"type": "choice", "instructions": "What next?", "criteria": {"refund": "Refund it", "wait": "Wait", "escalate": "Escalate"}},
    "n": {"type": "noul", "instructions": "Is it a duplicate?"},
    "s": {"type": "score", "instructions": "How urgent?", "criteria": ["low", "medium", "high"]},
}


def png_data_url(width: int, height: int) -> str:
    from PIL import Image

    img = Image.new("RGB", (width, height))
    img.putdata([((x * 7) % 256, (y * 3) % 256, (x * y) % 256) for y in range(height) for x in range(width)])
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="session")
def short_request() -> dict:
    """A text state shorter than one 64-token delta-rule chunk: nothing to share, one batched forward."""
    return {"model": "valen-preview-0923", "state": "The card was charged twice for one order.", "questions": QUESTIONS}


@pytest.fixture(scope="session")
def long_image_request() -> dict:
    """An image and a state longer than one chunk: the vision tower and a shared prefix."""
    text = " ".join(["the order was charged twice and the customer asked for a refund"] * 8)
    state = {"messages": [{"role": "user", "content": [{"type": "image", "image": png_data_url(96, 64)}, {"type": "text", "text": text}]}]}
    return {"model": "valen-preview-0923", "state": state, "questions": QUESTIONS}


def mp4_data_url(seconds: float = 3, width: int = 64, height: int = 48, rate: int = 10, **options) -> str:
    """A real H.264 MP4 clip (valen_export.clips) as a data:video/mp4 URL."""
    from valen_export.clips import encode_clip

    clip = encode_clip("mp4", "libx264", rate, round(seconds * rate), width, height, **options)
    return "data:video/mp4;base64," + base64.b64encode(clip).decode()


@pytest.fixture(scope="session")
def video_request() -> dict:
    """A video alone (3 s, 64 x 48: 3 frame pairs of 4 tokens, with their stamps under one chunk)."""
    return {"model": "valen-preview-0923", "state": {"video": mp4_data_url()}, "questions": QUESTIONS}


@pytest.fixture(scope="session")
def long_video_request() -> dict:
    """A message-list video and a state longer than one chunk: the tower on t > 1 and a shared prefix."""
    text = " ".join(["the parcel in the clip was left at the wrong door and the customer wants a refund"] * 6)
    state = {"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": mp4_data_url(4, 96, 64)}},
                                                       {"type": "text", "text": text}]}]}
    return {"model": "valen-preview-0923", "state": state, "questions": QUESTIONS}


@pytest.fixture(scope="session")
def batch_requests(short_request, long_image_request) -> list[dict]:
    """A mix for batched runs: an image with a long text (a prefix), a short text (none), a long
    text (two 64-token chunks of prefix), an image alone with one question (one branch)."""
    long_text = " ".join(["a second and much longer account of the same order and of its two charges"] * 10)
    image_only = {"model": "valen-preview-0923", "state": {"image": png_data_url(64, 48)}, "questions": {"q": QUESTIONS["q"]}}
    return [long_image_request, short_request, dict(short_request, state=long_text), image_only]


def answer_probabilities(response: dict) -> list[float]:
    """Every probability a response states, flattened in order (a noul answer states p(true))."""
    out = []
    for answer in response["answers"].values():
        out += list(answer["probabilities"].values()) if "probabilities" in answer else [answer["noul"]]
    return out


@pytest.fixture(scope="session")
def assert_truth_relative():
    """check(got, truth, reference, requests, device): every probability of the responses `got`
    (one per request) within the parity gate's truth-relative bound a * E + b of the fp32 truth
    engine's answer (manifests/tolerances.json: separate LoRA, bf16, shared-prefix), E the bf16
    reference-shaped engine's largest probability error against that truth on the same requests."""
    from parity.tolerances import load, select

    def check(got: list[dict], truth, reference, requests: list[dict], device: str) -> None:
        gate = select(load(), "separate", "bf16", device, "shared-prefix")
        truths = [answer_probabilities(truth.run(request).response) for request in requests]
        E = max(abs(r - t) for request, tq in zip(requests, truths)
                for r, t in zip(answer_probabilities(reference.run(request).response), tq))
        bound = gate["a"] * E + gate["b"]
        for response, tq in zip(got, truths):
            gq = answer_probabilities(response)
            assert len(gq) == len(tq)
            worst = max(abs(g - t) for g, t in zip(gq, tq))
            assert worst <= bound, (worst, bound, E)

    return check


def start_serve(*args: str, script: str | None = None, stdin=subprocess.DEVNULL, env: dict | None = None,
                sighup=signal.SIG_DFL) -> subprocess.Popen:
    """`python -m valen_runtime.serve ARGS` (or `python -c SCRIPT ARGS`), stderr piped as text, with
    SIGHUP (`sighup`) and SIGINT at their default actions, as under a terminal. An ignored signal
    stays ignored across exec: in a suite run under nohup (SIGHUP) or in pytest-xdist's workers
    (SIGINT) the worker would rightly keep ignoring it, and a test that stops it so would wait forever."""

    def terminal_signals() -> None:
        signal.signal(signal.SIGHUP, sighup)
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    program = ["-c", script] if script is not None else ["-m", "valen_runtime.serve"]
    return subprocess.Popen([sys.executable, *program, *args], stdin=stdin, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=env, preexec_fn=terminal_signals)


def rest_of_stderr(proc: subprocess.Popen, timeout: float = 60.0) -> str:
    """What `proc` writes to stderr until it exits, within `timeout` seconds; past it the process
    is killed and the test fails (a worker that did not stop must not hang the suite)."""
    try:
        return proc.communicate(timeout=timeout)[1]
    except subprocess.TimeoutExpired:
        proc.kill()
        rest = proc.communicate()[1]
        pytest.fail(f"valen-serve did not exit within {timeout} s of being stopped; its stderr ends: {rest[-2000:]}")


def cpu_graphs(max_graphs: int = 64):
    """fast.graphs.GraphCache on the CPU with CUDA-graph replay semantics: its own policy (when to
    capture, eviction) over a "capture" that keeps the function, static inputs and
    outputs, and a replay that reruns the function on the static inputs and writes into the
    static outputs, so stale buffers and aliasing show as they would on CUDA."""
    from valen_runtime.fast.graphs import GraphCache

    class CpuGraphs(GraphCache):
        captures = 0

        def _warm_up(self, fn, static_in):
            fn(*static_in)

        def _record(self, fn, static_in):
            static_out = fn(*static_in)
            self.captures += 1

            class Replay:
                def replay(self):
                    for dst, src in zip(static_out, fn(*static_in)):
                        dst.copy_(src)

            return Replay(), static_out

    return CpuGraphs(pool="no CUDA memory pool on the CPU", max_graphs=max_graphs)
