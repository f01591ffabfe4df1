"""CI parity gate: `python -m parity.gate OUTDIR` (`make parity-gate`).

Builds the tiny synthetic fixture under OUTDIR (removing any previous OUTDIR), exports it in both
LoRA modes, and runs the `valen-parity` comparison (`parity.cli.run`, the code behind the
command) with every built-in case on the CPU for fp32 and bf16, per-branch and shared-prefix:
8 combinations, plus the 4 shared-prefix ones again as CUDA runs them by default: the fast
path's kernels (fused layers, eager on the CPU; the one-pass layout). The reference is built once per dtype (its results are shared through a reference
cache; the reference does not depend on the export or the runtime's execution mode). Reports go
to OUTDIR/reports/<lora>-<dtype>-<mode>.json, a summary to OUTDIR/summary.json. Exit 0 only when
all pass; 1 on any parity failure; 2 on a usage error. `--device cuda` runs the same
combinations on a GPU (both sides) against the CUDA tolerance entries.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

COMBOS = [(dtype, lora, mode) for dtype in ("fp32", "bf16") for lora in ("separate", "merged") for mode in ("per-branch", "shared-prefix")]
# Shared-prefix again the way CUDA runs it by default: the fast path's kernels (its fused layer
# functions run eagerly on the CPU; the engine picks the one-pass layout); judged by the same
# entries. On CUDA the engine's own choice already is that path.
FAST_COMBOS = [(dtype, lora, "shared-prefix", "fast") for dtype in ("fp32", "bf16") for lora in ("separate", "merged")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m parity.gate", description=__doc__.splitlines()[0])
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--tolerances", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=1, help="torch threads on both sides (default 1: the tiny model gains nothing from more)")
    ap.add_argument("--case", default="all")
    ap.add_argument("--kernels", choices=["torch", "fast"], default=None, help="runtime kernels (default: the engine's choice)")
    ap.add_argument("--no-cuda-graphs", action="store_true", help="turn the runtime's CUDA-graph replay off")
    ap.add_argument("--device", default="cpu", help="cpu (the CI gate) or cuda (GPU measurements; CUDA tolerance entries)")
    args = ap.parse_args(argv)

    from . import harness, tolerances
    from .cli import run
    from valen_export.export import export
    from valen_export.fixture import build_fixture

    t0 = time.perf_counter()
    out = args.outdir
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    fx = build_fixture(out / "fixture", preset="tiny", seed=0)
    exports = {}
    for lora in ("separate", "merged"):
        exports[lora] = out / f"export-{lora}"
        export(fx.checkpoint, fx.base, exports[lora], lora_mode=lora, pins_path=fx.pins, progress=False)
    print(f"fixture and exports ready in {time.perf_counter() - t0:.1f} s", flush=True)

    summary = {}
    failed = []
    (out / "reports").mkdir()
    combos = [(*c, args.kernels) for c in COMBOS]
    if args.device == "cpu" and args.kernels is None:
        combos += FAST_COMBOS
    for dtype, lora, mode, kernels in combos:
        t1 = time.perf_counter()
        try:
            report = run(
                exports[lora], fx.checkpoint, fx.base, args.case, None, args.device, dtype, mode, fx.pins, None,
                args.tolerances or tolerances.DEFAULT_PATH, args.threads, out / "reference-cache",
                kernels=kernels, graphs=False if args.no_cuda_graphs else None,
            )
        except harness.UsageProblem as e:
            print(f"error: {lora}/{dtype}/{mode}: {e}", file=sys.stderr)
            return 2
        name = f"{lora}-{dtype}-{mode}" + (f"-{kernels}" if kernels else "")
        (out / "reports" / f"{name}.json").write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        table = harness.table(report)
        if report["verdict"] == "pass":
            label = f"[{kernels} kernels] " if kernels else ""
            print(label + table.splitlines()[-1] + f"  [{time.perf_counter() - t1:.1f} s]", flush=True)
        else:
            failed.append(name)
            print(table, flush=True)
        summary[name] = {"verdict": report["verdict"], **report["summary"], "tolerance": report["tolerance"], "reference_cached": report["reference"]["cached"]}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    total = time.perf_counter() - t0
    if failed:
        print(f"parity gate FAILED: {', '.join(failed)} ({total:.1f} s); reports in {out / 'reports'}", file=sys.stderr)
        return 1
    print(f"parity gate passed: {len(combos)} combinations, every built-in case ({total:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
