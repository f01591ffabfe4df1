"""The runtime side: every place the harness builds, configures or looks inside a
`valen_runtime` Engine is in this module (`load_engine` is the one that constructs it), so a change
of the runtime's API is one edit here.
"""

from __future__ import annotations

import dataclasses
import platform
import sys
import time
import traceback
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import torch

from valen_runtime.options import KERNELS, EngineOptions

from .errors import UsageProblem


def runtime_options(device: str | None = "cpu", dtype: str = "bf16", mode: str | None = "per-branch", kernels: str | None = None,
                    graphs: bool | None = None, compile: bool | None = None, temperature: float | None = None) -> EngineOptions:
    """The runtime's EngineOptions (None: the engine's default for the device); an impossible
    combination is a usage problem (one line, exit 2)."""
    try:
        return EngineOptions(device=device, dtype=dtype, mode=mode, kernels=kernels, graphs=graphs, compile=compile, temperature=temperature)
    except ValueError as e:
        raise UsageProblem(str(e)) from None


def with_dtype(options: EngineOptions, dtype: str) -> EngineOptions:
    """The same runtime configuration (mode, kernels, graphs, compile, temperature) in another
    dtype, with the choices that follow from the dtype (delta kernel, patch embed, layout,
    batching) resolved afresh for it: bf16's FLA or GEMM patch embed is not fp32's."""
    return dataclasses.replace(options, dtype=dtype, layout=None, delta_kernel=None, patch_embed=None, batching=None)


def label(options: EngineOptions) -> str:
    parts = [options.dtype, options.mode, f"{options.kernels} kernels"]
    if options.device.startswith("cuda") and options.mode == "shared-prefix":
        parts.append("graphs" if options.graphs else "no graphs")
    return ", ".join(parts)


def module_path_options(options: EngineOptions) -> EngineOptions:
    """The runtime's fp32 shared-prefix run on the reference modules (no fast path, no graphs):
    the anchor of a merged export's dual check."""
    return EngineOptions(options.device, "fp32", "shared-prefix", kernels="torch", graphs=False, temperature=options.temperature)


def load_engine(export: Path, options: EngineOptions):
    """The runtime Engine on `export`, configured by `options` (the only place the harness builds one)."""
    from valen_runtime.engine import Engine
    from valen_runtime.errors import ValenError

    try:
        return Engine.load(export, options, verify="size")
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

    options: EngineOptions
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
    positions, _ = rope_index(ids, types, st.image_grid_thw, engine.model.config.vision_config.spatial_merge_size,
                              video_grid_thw=st.video_grid_thw)
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


def run(export: Path, options: EngineOptions, requests: list[tuple[str, str, dict]], engine=None, threads: int | None = None) -> RuntimeRun:
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
        "kernels": dict(engine.kernels),
        # The shared-prefix layout the engine plans for a state of 64 tokens or more (valen_runtime.layouts):
        # "one-pass" or "batch"; a shorter state runs as "rows" in either.
        "layout": ("one-pass" if engine.one_pass else "batch") if engine.mode == "shared-prefix" else None,
        "cuda_graphs": engine.graphs is not None,
        "engine_options": engine.options.to_json(),
    }
