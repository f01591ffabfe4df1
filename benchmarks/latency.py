"""End-to-end latency on one GPU (issue #5): reference path vs runtime modes, in ONE run.

Builds the `2b` preset (Qwen3.5-2B shapes, random weights) unless it exists, exports it, then
measures per request (compile + vision + text + head + answers, CUDA-synchronised):
- reference: pinned transformers 5.4.0 + PEFT unmerged, eager, one forward per branch, in its own
  process with flash-linear-attention blocked (benchmarks/reference_latency.py);
- runtime per-branch (pure PyTorch, reference-shaped);
- runtime shared-prefix: the reference modules / the fast path (fused layers, FLA, SDPA; compiled)
  / the fast path replayed from CUDA graphs (the default on CUDA), and that default on the
  merged-LoRA export; the layout each request ran (one-pass, or batch for a state under 64 tokens)
  is recorded with it.
`--only TEXT` keeps the configurations whose label contains TEXT, `--skip-reference` drops the
reference process (for A/B runs; the speed-ups need it).
Reports median and p90, speed-up over the reference, the physical floor estimate and the ratio,
and the fast mode's max |Δp| and decision agreement against the reference. Not a test.

    python benchmarks/latency.py --work /tmp/bench --out results.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from artifacts import fixture_and_exports  # noqa: E402
from bench_requests import benchmark_requests  # noqa: E402

# Physical floor (docs/benchmarks.md): text linear weights 2.75 GB
# streamed at 4.8 TB/s, 3.48 us of dense compute per token, ~0.7 ms of vision per 784 patches.
WEIGHT_READ_S = 2.75e9 / 4.8e12
COMPUTE_PER_TOKEN_S = 3.48e-6
VISION_PER_PATCH_S = 0.7e-3 / 784


def floor_s(compiled) -> float:
    """Shared-prefix floor: every logical token once, vision once."""
    tokens = compiled.logical_tokens
    patches = 0 if compiled.state.image_grid_thw is None else int(compiled.state.image_grid_thw.prod(-1).sum())
    return max(WEIGHT_READ_S, tokens * COMPUTE_PER_TOKEN_S) + patches * VISION_PER_PATCH_S


def stats(times: list[float]) -> dict:
    s = sorted(times)
    return {"median_ms": statistics.median(s) * 1e3, "p90_ms": s[min(len(s) - 1, int(0.9 * len(s)))] * 1e3, "n": len(s)}


def probs(logits) -> list[list[float]]:
    return [torch.softmax(torch.as_tensor(lg, dtype=torch.float32), -1).tolist() for lg in logits]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_engine(engine, req, iters: int, warmup: int):
    times, result = [], None
    for i in range(warmup + iters):
        sync()
        t = time.perf_counter()
        result = engine.run(req)  # includes compile (tokenizer, image preprocessing) and answers
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return times, result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/valen-bench"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--ref-iters", type=int, default=5)
    ap.add_argument("--skip-reference", action="store_true")
    ap.add_argument("--preset", choices=["2b", "tiny"], default="2b", help="tiny: a CPU smoke run of this script")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--only", action="append", default=[], metavar="TEXT",
                    help="keep only configurations whose label contains TEXT (repeatable)")
    args = ap.parse_args()

    from valen_runtime.engine import Engine

    fx_dir, exports = fixture_and_exports(args.work, args.preset)
    exp, exp_merged = exports["separate"], exports["merged"]

    reqs = benchmark_requests()
    report = {
        "hardware": torch.cuda.get_device_name(0) if args.device == "cuda" else platform.processor() or "cpu",
        "preset": args.preset,
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
        "iters": args.iters,
        "warmup": args.warmup,
        "requests": {},
    }
    ref = {}
    if not args.skip_reference:
        from parity.isolation import clean_environment

        ref_out = args.work / "reference.json"
        cmd = [sys.executable, str(HERE / "reference_latency.py"), "--checkpoint", str(fx_dir / "checkpoint"), "--base", str(fx_dir / "base"),
               "--out", str(ref_out), "--iters", str(args.ref_iters), "--warmup", "2", "--device", args.device]
        env = clean_environment()
        env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        t = time.perf_counter()
        subprocess.run(cmd, check=True, env=env)
        ref = json.loads(ref_out.read_text())
        report["reference_environment"] = ref.pop("environment")
        print(f"reference done in {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)

    # EngineOptions per configuration (device and dtype added below), and whether it runs the merged export.
    configs = [
        ("runtime per-branch (torch)", dict(mode="per-branch", kernels="torch", graphs=False), False),
        ("shared-prefix (torch)", dict(mode="shared-prefix", kernels="torch", graphs=False), False),
        ("shared-prefix (fast kernels)", dict(mode="shared-prefix", kernels="fast", graphs=False), False),
        ("shared-prefix (fast + CUDA graphs)", dict(mode="shared-prefix", kernels="fast", graphs=True), False),
        ("merged LoRA: shared-prefix (fast + CUDA graphs)", dict(mode="shared-prefix", kernels="fast", graphs=True), True),
    ]
    if args.device != "cuda":  # a CPU smoke run: everything but the graphs
        configs = [c for c in configs if not c[1]["graphs"]]
    if args.only:
        configs = [c for c in configs if any(t in c[0] for t in args.only)]
    from valen_runtime.fast.model import FastModel
    from valen_runtime.manifest import Manifest
    from valen_runtime.options import EngineOptions
    from valen_runtime.request import Compiler
    from valen_runtime.weights import load_model

    prompt = Manifest.load(exp).data["prompt"]
    compiler = Compiler.from_dir(exp, max_length=prompt["max_length"], media_kwargs=prompt.get("media_kwargs") or {})

    # One loaded model per export and one fast model built from it, shared by its engines (one
    # compile of the fast path per export); one engine per configuration, reused across requests so
    # its CUDA graphs are too.
    models, fast_models, engines = {}, {}, {}
    for label, kw, merged in configs:
        if merged not in models:
            models[merged] = load_model(exp_merged if merged else exp, device=args.device, dtype="bf16")
        try:
            options = EngineOptions(device=args.device, dtype="bf16", **kw)
            if options.kernels == "fast" and merged not in fast_models:
                fast_models[merged] = FastModel.build(models[merged], options)
            engines[label] = Engine(models[merged], compiler, options, fast=fast_models.get(merged) if options.kernels == "fast" else None)
        except ValueError as e:  # recorded per request below
            print(f"{label}: not available: {e}", file=sys.stderr, flush=True)
    for name, req in reqs.items():
        row = {"modes": {}}
        if name in ref:
            row["modes"]["reference (transformers 5.4.0, eager, per branch)"] = stats(ref[name]["times_s"])
        compiled = compiler.compile(req)
        for label, kw, _ in configs:
            engine = engines.get(label)
            if engine is None:
                row["modes"][label] = {"error": "configuration not available on this machine"}
                continue
            if args.device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            try:
                # Reference-shaped and un-graphed configurations are slow and only context: fewer repeats.
                slow = kw["mode"] == "per-branch" or not kw.get("graphs")
                times, result = time_engine(engine, req, 3 if slow else args.iters, 1 if slow else args.warmup)
            except Exception as e:  # record, don't hide: a failing configuration is a result too
                row["modes"][label] = {"error": f"{type(e).__name__}: {e}"}
                print(f"{name} {label}: ERROR {e}", file=sys.stderr, flush=True)
                continue
            entry = stats(times)
            entry["kernels"] = engine.kernels
            entry["layout"] = engine.plan(compiled).kind if kw["mode"] == "shared-prefix" else "per-branch"  # as run for this request
            entry["prepare_ms"] = result.timings["prepare_s"] * 1e3  # request parsing, tokenizer, image preprocessing (last run)
            if args.device == "cuda":
                entry["peak_gpu_gib"] = torch.cuda.max_memory_allocated() / 2**30
            if name in ref:
                rp, fp = probs(ref[name]["logits"]), probs(result.logits)
                entry["max_abs_dp_vs_reference"] = max(abs(a - b) for x, y in zip(rp, fp) for a, b in zip(x, y))
                entry["decisions_agree"] = [max(range(len(x)), key=x.__getitem__) == max(range(len(y)), key=y.__getitem__) for x, y in zip(rp, fp)]
            row["modes"][label] = entry
            print(f"{name} {label}: median {entry['median_ms']:.2f} ms", file=sys.stderr, flush=True)
        row["state_tokens"] = len(compiled.state.input_ids)
        row["branches"] = sum(len(q.branches) for q in compiled.questions)
        row["logical_tokens"] = compiled.logical_tokens
        row["compute_tokens"] = compiled.compute_tokens
        row["floor_ms"] = floor_s(compiled) * 1e3
        ref_ms = row["modes"].get("reference (transformers 5.4.0, eager, per branch)", {}).get("median_ms")
        for entry in row["modes"].values():
            if "median_ms" in entry:
                entry["ratio_to_floor"] = entry["median_ms"] / row["floor_ms"]
                if ref_ms:
                    entry["speedup_vs_reference"] = ref_ms / entry["median_ms"]
        report["requests"][name] = row
        args.out.write_text(json.dumps(report, indent=2))  # after every request: a timeout keeps what was measured
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
