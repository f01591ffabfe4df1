"""Where a warm fast-path request spends its time on the GPU (issue #5). Not a test.

For each benchmark request and each engine configuration: the phase breakdown of a warm request
(the request compile on the CPU, vision tower, text + head, answers; CUDA-synchronised between phases), the
replay time of every captured CUDA graph alone, and a torch.profiler kernel table (kernel count,
summed kernel time, top kernels) of one warm request. Builds/exports the 2b preset like latency.py.

    python benchmarks/profile_fast.py --work build/gpu-bench --out profile.json [--tables DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from artifacts import fixture_and_exports  # noqa: E402
from bench_requests import benchmark_requests  # noqa: E402


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def phases(engine, req) -> dict:
    """One request run phase by phase (the work of Engine.run, with the vision tower started after
    the request compile rather than inside it, so each phase is timed alone), seconds per phase."""
    sync()
    t0 = time.perf_counter()
    compiled = engine.compiler.compile(req)
    t1 = time.perf_counter()
    images = compiled.state.image_inputs
    features = None if images is None else engine.vision_features(images)
    sync()
    t2 = time.perf_counter()
    logits = engine.execute(compiled, features)
    sync()
    t3 = time.perf_counter()
    engine.finish(compiled, engine.queue_outputs(compiled, logits).cpu(), {})
    t4 = time.perf_counter()
    return {"request": t1 - t0, "vision": t2 - t1, "text_and_head": t3 - t2, "answers": t4 - t3, "total": t4 - t0}


def graph_replays(engine, iters: int = 20) -> dict:
    out = {}
    if engine.graphs is None:
        return out
    for key, (graph, *_) in engine.graphs.graphs.items():
        sync()
        t = time.perf_counter()
        for _ in range(iters):
            graph.replay()
        sync()
        out[repr(key)] = (time.perf_counter() - t) / iters * 1e3
    return out


def kernel_profile(call) -> tuple[dict, str]:
    """torch.profiler over one `call()`: kernel count, summed kernel time and the largest kernels
    by name (memcpy / memset counted apart), and the profiler's own table."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        call()
        sync()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = [e for e in events if "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]
    per_name: dict[str, list[float]] = {}
    for e in kernels:
        per_name.setdefault(e.name, []).append(e.device_time)
    top = sorted(per_name.items(), key=lambda kv: -sum(kv[1]))[:40]
    summary = {
        "kernels": len(kernels),
        "kernel_time_ms": sum(e.device_time for e in kernels) / 1e3,
        "memcpy_memset": len(events) - len(kernels),
        "top": [{"name": n[:120], "count": len(v), "total_us": sum(v), "mean_us": sum(v) / len(v)} for n, v in top],
    }
    if kernels:
        start = min(e.time_range.start for e in kernels)
        end = max(e.time_range.end for e in kernels)
        summary["gpu_span_ms"] = (end - start) / 1e3
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=60)
    return summary, table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("build/gpu-bench"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tables", type=Path, default=None, help="write profiler tables here")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--preset", choices=["2b", "tiny"], default="2b", help="tiny: a CPU smoke run of this script")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--requests", default="a_image448_7branch,b_text48_choice2,d_image1024_choice4,c_text2000_8q")
    ap.add_argument("--configs", default="fast+graphs,fast+graphs merged",
                    help="comma-separated: fast[+graphs][ merged] (the fast path, compiled; +graphs: replayed from CUDA graphs)")
    args = ap.parse_args()

    from valen_runtime.engine import Engine
    from valen_runtime.options import EngineOptions

    _, exports = fixture_and_exports(args.work, args.preset)

    reqs = benchmark_requests()
    report = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu", "results": {}}
    for config in args.configs.split(","):
        merged = " merged" in config
        options = EngineOptions(device=args.device, dtype="bf16", mode="shared-prefix", kernels="fast", graphs=config.startswith("fast+graphs"))
        engine = Engine.load(exports["merged" if merged else "separate"], options)
        for name in args.requests.split(","):
            req = reqs[name]
            t = time.perf_counter()
            for _ in range(3):
                engine.run(req)
            warm_s = time.perf_counter() - t
            runs = [phases(engine, req) for _ in range(args.iters)]
            entry = {"warmup_s": warm_s, "phases_ms": {k: statistics.median(r[k] for r in runs) * 1e3 for k in runs[0]}}
            entry["graph_replay_ms"] = graph_replays(engine)
            entry["profile"], table = kernel_profile(lambda: engine.run(req))
            if args.tables:
                args.tables.mkdir(parents=True, exist_ok=True)
                (args.tables / f"{name}-{config.replace(' ', '_').replace('+', '_')}.txt").write_text(table)
            report["results"].setdefault(name, {})[config] = entry
            p = entry["phases_ms"]
            print(f"{name} [{config}] total {p['total']:.2f} ms = request {p['request']:.2f} + vision {p['vision']:.2f} + text {p['text_and_head']:.2f}"
                  f" + answers {p['answers']:.2f}; kernels {entry['profile']['kernels']} summing {entry['profile']['kernel_time_ms']:.2f} ms;"
                  f" replays {entry['graph_replay_ms']}", file=sys.stderr, flush=True)
            args.out.write_text(json.dumps(report, indent=2))
        del engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    from torch._dynamo.utils import counters

    report["dynamo"] = {k: dict(v) for k, v in counters.items() if k in ("stats", "recompiles", "graph_break")}
    print(f"dynamo: {report['dynamo']}", file=sys.stderr, flush=True)
    args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
