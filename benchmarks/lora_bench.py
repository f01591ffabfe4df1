"""The separate FP32 LoRA of each Qwen3.5-2B fused projection: the cuBLAS form (projections.project,
torch.compile'd as the layers run it) against the Triton kernels (lora_triton.py), per row count.
CUDA only; not a test (tests/valen_runtime/fast/test_lora_triton.py holds the two to fp64).

    python benchmarks/lora_bench.py [--rows 59 625 2377 8000] [--out lora.json]

Times one call of each form, base GEMM included, replayed from a CUDA graph (no launch gaps),
median of 50 replays; also reports the largest difference between the two forms' outputs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from valen_runtime.fast.projections import fuse, project  # noqa: E402
from valen_runtime.qwen35 import LoRALinear, attach_lora  # noqa: E402

# (name, member sizes, in): every fused projection of one Qwen3.5-2B layer pair
PROJECTIONS = [
    ("gdn in_proj (qkv|z|b|a)", [6144, 2048, 16, 16], 2048),
    ("gdn out_proj", [2048], 2048),
    ("attn q|k|v", [4096, 512, 512], 2048),
    ("attn o_proj", [2048], 2048),
    ("mlp gate|up", [6144, 6144], 2048),
    ("mlp down", [2048], 6144),
]


def members(sizes, d_in, gen):
    parent, adapter = torch.nn.Module(), {}
    for i, n in enumerate(sizes):
        setattr(parent, f"m{i}", LoRALinear(d_in, n))
        getattr(parent, f"m{i}").weight.data = (torch.randn(n, d_in, generator=gen) / d_in**0.5).to(torch.bfloat16)
        adapter[f"m{i}.lora_A.weight"] = torch.randn(32, d_in, generator=gen) / d_in**0.5
        adapter[f"m{i}.lora_B.weight"] = torch.randn(n, 32, generator=gen) * 1e-2
    attach_lora(parent, adapter, 2.0)
    return [getattr(parent, f"m{i}").cuda() for i in range(len(sizes))]


def graph_time(fn, x, replays: int = 50) -> float:
    """Median ms of one replay of fn(x) captured in a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(x)
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[59, 625, 2377, 8000])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator().manual_seed(0)
    torch._dynamo.config.recompile_limit = 256  # one compile per projection shape and form
    compiled = torch.compile(project, fullgraph=True, dynamic=True, options={"emulate_precision_casts": True})
    results = []
    for name, sizes, d_in in PROJECTIONS:
        ms = members(sizes, d_in, gen)
        cublas, triton_form = fuse(ms), fuse(ms, lora_kernel="triton")
        merged_like = cublas._replace(lora_a=None)  # the base GEMM alone: what a merged export pays
        for rows in args.rows:
            x = torch.randn(rows, d_in, generator=gen).to("cuda", torch.bfloat16)
            row = {"projection": name, "rows": rows,
                   "base_only_ms": graph_time(lambda t: compiled(t, merged_like), x),
                   "cublas_ms": graph_time(lambda t: compiled(t, cublas), x),
                   "triton_ms": graph_time(lambda t: compiled(t, triton_form), x)}
            diff = (compiled(x, cublas).float() - compiled(x, triton_form).float()).abs()
            row["max_abs_diff"] = diff.max().item()
            row["differing_fraction"] = (diff > 0).float().mean().item()
            results.append(row)
            print(f"{name:26s} rows {rows:5d}: base {row['base_only_ms']:.4f} ms, cuBLAS LoRA {row['cublas_ms']:.4f} ms, "
                  f"triton LoRA {row['triton_ms']:.4f} ms; outputs differ in {row['differing_fraction']:.2%} "
                  f"(max {row['max_abs_diff']:.2e})", flush=True)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results}
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
