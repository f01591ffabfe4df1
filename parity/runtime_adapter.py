"""The runtime side: every place the harness builds, configures or looks inside a
`valen_runtime` Engine is in this module (`load_engine` is the one that constructs it), so a change
of the runtime's API is one edit here.
"""

from __future__ import annotations

import platform
import sys
import time
import traceback
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import torch

from .errors import UsageProblem

KERNELS = ("torch", "fast")
LAYOUTS = ("batch", "one-pass")


@dataclass(frozen=True)
class RuntimeOptions:
    """How the runtime runs; None leaves the choice to the engine (its default for the device)."""

    device: str = "cpu"
    dtype: str = "bf16"
    mode: str = "per-branch"
    kernels: str | None = None  # "torch" | "fast"
    graphs: bool | None = None  # CUDA-graph replay
    layout: str | None = None  # shared-prefix layout: "batch" | "one-pass"

    def with_dtype(self, dtype: str) -> "RuntimeOptions":
        return RuntimeOptions(self.device, dtype, self.mode, self.kernels, self.graphs, self.layout)

    def label(self) -> str:
        parts = [self.dtype, self.mode]
        if self.kernels:
            parts.append(f"{self.kernels} kernels")
        if self.layout:
            parts.append(self.layout)
        if self.graphs is False:
            parts.append("no graphs")
        return ", ".join(parts)

    def to_json(self) -> dict:
        return {"device": self.device, "dtype": self.dtype, "mode": self.mode, "kernels": self.kernels, "graphs": self.graphs, "layout": self.layout}


def module_path_options(options: RuntimeOptions) -> RuntimeOptions:
    """The runtime's fp32 shared-prefix run with the PyTorch kernels (no fused layers, no graphs):
    the anchor of a merged export's dual check."""
    return RuntimeOptions(options.device, "fp32", "shared-prefix", kernels="torch", graphs=False if options.device.startswith("cuda") else None)


def load_engine(export: Path, options: RuntimeOptions):
    """The runtime Engine on `export`, configured by `options`."""
    from valen_runtime.engine import Engine
    from valen_runtime.errors import ValenError

    chosen = {k: v for k, v in (("kernels", options.kernels), ("graphs", options.graphs), ("layout", options.layout)) if v is not None}
    try:
        return Engine.load(export, device=options.device, dtype=options.dtype, verify="size", mode=options.mode, **chosen)
    except (ValenError, OSError, ValueError, TypeError) as e:
        raise UsageProblem(f"runtime could not load {export}: {e}") from None


@dataclass
class Outcome:
    """The runtime's answer to one request: a result, or a rejection (RequestError), or a crash."""

    result: object | None = None  # valen_runtime.engine.RunResult
    rejected: str | None = None
    crashed: str | None = None
    detail: str | None = None  # the crash's last traceback line
    rotary: dict | None = None  # {"positions": [3, T] int64, "tables": [2, T, R] fp32} of the first branch


@dataclass
class RuntimeRun:
    """One runtime configuration over a request set."""

    options: RuntimeOptions
    export: Path
    outcomes: dict[str, Outcome]
    environment: dict
    seconds: float
    problems: list[str] = field(default_factory=list)


def rotary_tables(engine, compiled) -> dict:
    """The position ids of the request's first branch and the cos / sin tables the runtime's text
    rotary embedding makes of them, in fp32 (what the reference process records for its side)."""
    from valen_runtime.positions import rope_index

    st = compiled.state
    branch = compiled.questions[0].branches[0]
    ids = st.input_ids + branch.suffix_ids
    types = st.mm_token_type_ids + [0] * len(branch.suffix_ids)
    positions, _ = rope_index(ids, types, st.image_grid_thw, engine.model.config.vision_config.spatial_merge_size)
    device = engine.model.device
    probe = torch.zeros(1, dtype=torch.float32, device=device)
    with torch.no_grad():
        cos, sin = engine.model.text.rotary_emb(probe, positions[:, None, :].to(device))
    return {"positions": positions, "tables": torch.stack([cos[0], sin[0]]).float().cpu()}


def run_requests(engine, requests: list[tuple[str, str, dict]]) -> dict[str, Outcome]:
    """Every request through `engine.run`; {request id: Outcome}. A crash is recorded, not raised."""
    from valen_runtime.errors import RequestError

    out = {}
    for case, name, req in requests:
        outcome = Outcome()
        try:
            outcome.result = engine.run(req)
            outcome.rotary = rotary_tables(engine, outcome.result.compiled)
        except RequestError as e:
            outcome.rejected = f"RequestError: {e}"
        except Exception as e:  # a runtime crash on a request is a parity failure, reported per request
            message = str(e).splitlines()[0] if str(e) else ""
            outcome.crashed = f"{type(e).__name__}: {message}"
            outcome.result = None
            outcome.detail = traceback.format_exception_only(type(e), e)[-1].strip()
        out[f"{case}/{name}"] = outcome
    return out


def run(export: Path, options: RuntimeOptions, requests: list[tuple[str, str, dict]], engine=None, threads: int | None = None) -> RuntimeRun:
    """Load (unless given) an engine and run every request."""
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        t0 = time.perf_counter()
        engine = engine if engine is not None else load_engine(export, options)
        outcomes = run_requests(engine, requests)
        return RuntimeRun(options, Path(export), outcomes, environment(engine), time.perf_counter() - t0)
    finally:
        torch.set_num_threads(previous)


def _dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def environment(engine) -> dict:
    """What the runtime ran with (recorded in every report)."""
    import valen_runtime

    return {
        "python": platform.python_version(),
        "versions": {"torch": torch.__version__, "tokenizers": _dist_version("tokenizers"), "pillow": _dist_version("pillow"), "valen_runtime": _dist_version("valen-native")},
        "runtime_package": str(Path(valen_runtime.__file__).resolve().parent),
        "transformers_imported": "transformers" in sys.modules,
        "device": str(engine.model.device),
        "dtype": str(engine.model.dtype).removeprefix("torch."),
        "mode": engine.mode,
        "tf32": {"cuda.matmul.allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32), "cudnn.allow_tf32": bool(torch.backends.cudnn.allow_tf32)},
        "torch_num_threads": torch.get_num_threads(),
        # What the engine runs at its seams: {"gated_delta": "torch" | "fla-core X", "attention": "eager" | "sdpa", ...}.
        "kernels": dict(getattr(engine, "kernels", None) or {"gated_delta": "torch", "attention": "eager"}),
        "layout": getattr(engine, "layout", None),
        "cuda_graphs": getattr(engine, "graphs", None) is not None,
    }
