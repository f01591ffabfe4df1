"""Host-side request compile time (JSON checks, base64, image decode and resize, tokenizer, prompt
layout) for the latency benchmark's requests. CPU only; not a test.

    python benchmarks/request_bench.py --export EXPORT [--iters 20] [--out request.json]

Builds nothing: point it at any export (the tiny fixture's is enough, the tokenizer and the
image settings are the released ones). Reports the median per request, warm (question-piece
cache filled) and cold (a fresh Compiler per request).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from bench_requests import benchmark_requests  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--export", type=Path, required=True)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    import torch

    from valen_runtime.request import Compiler

    torch.set_num_threads(1)
    report = {"machine": platform.processor() or platform.machine(), "python": platform.python_version(), "requests": {}}
    warm = Compiler.from_dir(args.export)
    for name, req in benchmark_requests().items():
        for _ in range(3):
            warm.compile(req)
        times = []
        for _ in range(args.iters):
            t = time.perf_counter()
            warm.compile(req)
            times.append(time.perf_counter() - t)
        cold = []
        for _ in range(max(3, args.iters // 4)):
            fresh = Compiler.from_dir(args.export)
            t = time.perf_counter()
            fresh.compile(req)
            cold.append(time.perf_counter() - t)
        entry = {"warm_median_ms": statistics.median(times) * 1e3, "cold_median_ms": statistics.median(cold) * 1e3}
        report["requests"][name] = entry
        print(f"{name}: warm {entry['warm_median_ms']:.2f} ms, cold {entry['cold_median_ms']:.2f} ms", flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
