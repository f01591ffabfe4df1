"""Tune flash-linear-attention's kernels on this GPU for the shapes valen-serve runs, and write the
chosen configurations where the runtime looks for them (valen_runtime/fast/fla_tuning.py).

FLA autotunes every kernel from scratch here (its config lookup off, an empty Triton cache) while an
eager fast-path engine runs valen-serve's full warmup, its requests and then its batches of up to --max-batch;
each kernel's chosen configurations are then written to OUT/<GPU name>/ in FLA's config-file
format, with tuned.json (GPU, fla-core, Triton and torch versions). Commit that folder under
valen_runtime/fast/fla_configs/ to ship it; the runtime uses it on that GPU with that fla-core.

    python benchmarks/tune_fla.py --export build/gpu-bench/export-2b-separate [--build 2b] [--out valen_runtime/fast/fla_configs]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--export", type=Path, required=True, help="an export folder (2b shapes: the tuned sizes are the model's)")
    ap.add_argument("--out", type=Path, default=REPO / "valen_runtime" / "fast" / "fla_configs",
                    help="where the GPU's folder is written (default: the runtime's own)")
    ap.add_argument("--build", choices=["2b"], default=None, help="build the synthetic fixture and its separate export at --export when missing")
    ap.add_argument("--max-batch", type=int, default=8, help="the warmup's batches up to this size run too")
    args = ap.parse_args()

    # Before torch, Triton or FLA are imported: FLA must autotune (not read configs), Triton must
    # compile and time every candidate (not find an earlier result on disk).
    os.environ["FLA_CACHE_MODE"] = "disabled"
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="valen-tune-fla-triton-")
    os.environ.setdefault("TRITON_PRINT_AUTOTUNING", "1")  # each kernel's tuning time and choice, on stdout

    if args.build and not (args.export / "valen_export.json").exists():
        sys.path.insert(0, str(REPO / "benchmarks"))
        from serve_load import build_export

        build_export(args.export, args.build)

    import torch

    from valen_runtime.engine import Engine
    from valen_runtime.errors import ValenError
    from valen_runtime.fast import fla_tuning
    from valen_runtime.options import EngineOptions
    from valen_runtime.serve.warmup import run_warmup_step, warmup_requests, warmup_steps

    if not torch.cuda.is_available():
        sys.exit("tune_fla: needs a CUDA GPU")
    # Eager and without graphs: FLA's kernels are called with the same shapes, dtypes and flags as
    # in the compiled, captured path (its tuning keys), without a minute of torch.compile first.
    try:
        engine = Engine.load(args.export, EngineOptions(compile=False, graphs=False))
    except (OSError, ValueError, ValenError) as exc:  # a missing or damaged export, options this machine cannot run
        sys.exit(f"tune_fla: {args.export}: {exc}")
    if engine.kernels.get("gated_delta", "torch") == "torch":
        sys.exit(f"tune_fla: the engine does not run FLA here (kernels {engine.kernels})")
    started = time.perf_counter()
    for step in warmup_steps(warmup_requests(True), args.max_batch if engine.batches else 1):
        run_warmup_step(engine, step)
    warmup_s = time.perf_counter() - started
    name = torch.cuda.get_device_name()
    # Every kernel whose candidates were timed must be written (a kernel missed here would be
    # autotuned at every cold start without anyone noticing).
    timed = {kernel for kernel, was_timed in fla_tuning.kernels_configured().items() if was_timed}
    if not timed:
        sys.exit("tune_fla: FLA timed no kernel's candidates (were they tuned before, in TRITON_CACHE_DIR?); nothing written")
    folder = args.out / fla_tuning.gpu_folder_name(name)
    counts = fla_tuning.dump(folder, name)
    if timed - set(counts):
        sys.exit(f"tune_fla: {sorted(timed - set(counts))} were tuned but not written to {folder}")
    print(json.dumps({"event": "tuned", "gpu": name, "folder": str(folder), "warmup_s": round(warmup_s, 1), "kernels": counts}))


if __name__ == "__main__":
    main()
