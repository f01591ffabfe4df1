"""Shared fixtures: one tiny synthetic Valen fixture and its exports per test session.

They are built by the same `valen-fixture` / `valen-export` code users run.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import platform
import shutil
import tempfile
from importlib import metadata
from pathlib import Path

import pytest
from hypothesis import settings

# torch is imported where it is used, not here: the pytest runs that tests/native starts in child
# processes collect only torch-free modules and would otherwise pay its import (seconds) each.

# Hypothesis: "ci" (the default, and what `make test` selects) is derandomized with no example
# database, so a run never depends on an earlier one; `make fuzz` selects "fuzz": random search,
# many more examples, failures kept in .hypothesis/ for replay.
settings.register_profile("ci", derandomize=True, database=None, max_examples=25, deadline=None, print_blob=True)
settings.register_profile("fuzz", derandomize=False, max_examples=1000, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# The workers and CLIs the tests start keep their compile caches in the system's temporary
# directory, beside inductor's own default, not in the user's ~/.cache/valen (the default of
# --compile-cache); the tests of that default set their own environment.
os.environ.setdefault("VALEN_COMPILE_CACHE", os.path.join(tempfile.gettempdir(), f"valen-tests-compile-cache-{os.getuid()}"))


def _v(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "absent"


def pytest_report_header(config):
    import torch

    cuda = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA"
    return (
        f"python {platform.python_version()}, torch {torch.__version__}, transformers {_v('transformers')}, "
        f"peft {_v('peft')}, tokenizers {_v('tokenizers')}, torchvision {_v('torchvision')}, fla-core {_v('fla-core')}; {cuda}"
    )


def pytest_collection_modifyitems(config, items):
    # The CPU compiles first: pytest-xdist's work stealing hands each worker a contiguous share of
    # this order, so one worker runs them all in turn (sharing inductor's caches) while the other
    # takes the rest, and no minute-long compile starts last and becomes the run's tail.
    items.sort(key=lambda item: "inductor" not in item.keywords)
    gpu = [item for item in items if "gpu" in item.keywords]
    if not gpu:
        return
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs CUDA")
        for item in gpu:
            item.add_marker(skip)


@pytest.fixture()
def one_torch_thread():
    """Run a test on one torch thread and restore the previous count afterwards."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def write_minimal_config(directory: Path, ids: dict) -> None:
    """The config.json a caller writes beside the text assets (model_type qwen3_5 decides the tokenizer class)."""
    import json

    config = {
        "model_type": "qwen3_5",
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "image_token_id": ids["image_token_id"],
        "video_token_id": ids["video_token_id"],
        "vision_start_token_id": ids["vision_start_token_id"],
        "vision_end_token_id": ids["vision_end_token_id"],
        "text_config": {"model_type": "qwen3_5_text", "vocab_size": ids["vocab_size"]},
        "vision_config": {"model_type": "qwen3_5"},
    }
    (directory / "config.json").write_text(json.dumps(config), encoding="utf-8")


@pytest.fixture(scope="session")
def text_assets(tmp_path_factory):
    """(folder, token ids): the fixture's tokenizer/processor files plus a minimal config.json. Read-only."""
    from valen_export.fixture_files import write_text_assets

    directory = tmp_path_factory.mktemp("text_assets")
    ids = write_text_assets(directory)
    write_minimal_config(directory, ids)
    return directory, ids


@contextlib.contextmanager
def run_wide(tmp_path_factory, name: str):
    """(directory, fill): a directory that every pytest-xdist worker of this run shares, held under
    a lock; fill is True for the first worker, which must build in it, and False once it is built.

    Session fixtures that cost seconds (references) or that such results are keyed on (the tiny
    fixture) are built once per run this way instead of once per worker. The directory lies in the
    run's own base temporary directory, so nothing carries over from an earlier run."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):  # one process: its own session is the run
        yield tmp_path_factory.mktemp(name), True
        return
    root = tmp_path_factory.getbasetemp().parent  # xdist gives each worker <run's basetemp>/<worker>
    directory, done = root / f"run-wide-{name}", root / f"run-wide-{name}.done"
    with open(root / f"run-wide-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also when a worker dies
        fill = not done.exists()
        if fill:  # never built, or a worker failed half-way through: start afresh
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir()
        yield directory, fill
        if fill:
            done.touch()


@pytest.fixture(scope="session")
def tiny_fixture(tmp_path_factory):
    """The tiny fixture, built once per run (run_wide). Read-only."""
    from valen_export.fixture import Fixture, build_fixture

    with run_wide(tmp_path_factory, "fixture") as (directory, fill):
        out = directory / "tiny"
        return build_fixture(out, preset="tiny", seed=0) if fill else Fixture.at(out)


@pytest.fixture(scope="session")
def tiny_export(tiny_fixture, tmp_path_factory):
    """{"separate": Path, "merged": Path} exports of the tiny fixture, built once per run. Read-only."""
    from valen_export.export import export

    with run_wide(tmp_path_factory, "exports") as (root, fill):
        out = {mode: root / mode for mode in ("separate", "merged")}
        if fill:
            for mode, path in out.items():
                export(tiny_fixture.checkpoint, tiny_fixture.base, path, lora_mode=mode, pins_path=tiny_fixture.pins, progress=False)
        return out


def copy_tree(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def fp32_roundoff_bound(fn, x: torch.Tensor, reduction_length: int, stages: int, draws: int = 3) -> float:
    """How far two fp32 implementations of `fn` that differ only in rounding order may drift apart at x.

    Derivation (no machine-specific constant): a length-n fp32 reduction carries a relative error of
    about sqrt(n) * u (u = 2^-24; the probabilistic bound of Higham & Mary, 2019), and every stage
    (layer) of `fn` adds such an error to what the next stages receive. We measure how `fn` itself
    passes on one stage's worth of that error, by perturbing its input by sqrt(n) * u with random
    signs, and allow it once per stage and per side: 2 * stages * the largest response seen. The
    bound thus follows the computation's own conditioning on whatever CPU runs it.
    """
    import torch

    scale = reduction_length**0.5 * 2.0**-24
    gen = torch.Generator().manual_seed(0)
    want = fn(x).double()
    worst = 0.0
    for _ in range(draws):
        signs = torch.randint(0, 2, x.shape, generator=gen, dtype=torch.int8).to(device=x.device, dtype=x.dtype) * 2 - 1
        got = fn(x * (1 + scale * signs)).double()
        worst = max(worst, (got - want).abs().max().item())
    return 2 * stages * worst


@pytest.fixture()
def roundoff_bound():
    """fp32_roundoff_bound for tests that compare two fp32 implementations of one function."""
    return fp32_roundoff_bound
