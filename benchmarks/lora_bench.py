"""The separate export's FP32 LoRA products at the 2B shapes, as the runtime computes them and as
two candidate formulations on bf16 tensor cores, with each one's error against fp64 truth. Not a
test; it decides whether a formulation is worth putting into `fast/projections.py`.

    python benchmarks/lora_bench.py [--rows 896 3408] [--iters 50] [--out lora.json]

Per fused projection of a GDN and an attention layer (random weights at the released scale,
rank 32, scale folded into B as `projections.fuse` does), the LoRA delta x -> B(A(x)) in fp32:

- fp32: what `projections.project` runs now (A: an fp32 GEMM of the bf16 input cast to fp32;
  B: an fp32 batched GEMM), cuBLAS's CUDA-core kernels since TF32 stays off;
- split-a: A's fp32 weights as the sum of three bf16 parts (hi + mid + lo carry all 24 bits), so
  A(x) is one bf16 GEMM against the three parts stacked, accumulated and returned in fp32
  (torch.mm's out_dtype). The input is bf16, so every product is exact in fp32; only the
  accumulation order differs from the fp32 GEMM. B as fp32;
- split-ab: split-a, and B(h) with both factors split (h is fp32): the six part products whose
  orders sum to at most two (hi*hi, hi*mid, mid*hi, hi*lo, mid*mid, lo*hi), one bf16 GEMM over
  their stacked parts; the three dropped products are below 2^-24 of the result.

Errors are max |delta - truth| / max |truth| per projection (truth: the same factors in fp64).
On the CPU (a smoke run) torch.mm has no out_dtype, so the bf16 parts are multiplied in fp32.
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

from layer_bench import random_layer  # noqa: E402
from valen_runtime.config import TextConfig  # noqa: E402
from valen_runtime.fast.layers import gather_weights  # noqa: E402

LAYERS = {"gdn": ("linear_attention", 18), "attention": ("full_attention", 6)}  # kind, count in the 2B stack


def parts3(w: torch.Tensor) -> list[torch.Tensor]:
    """fp32 w as hi + mid + lo, each bf16 (exact while no part underflows)."""
    hi = w.bfloat16()
    mid = (w - hi.float()).bfloat16()
    lo = (w - hi.float() - mid.float()).bfloat16()
    return [hi, mid, lo]


def mm32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ b [K, N], bf16 operands, fp32 accumulation and result."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


class Formulations:
    """The three ways of one projection's delta; the weights' parts are prepared once."""

    def __init__(self, p):
        self.p = p
        r = p.lora_b.shape[-1]
        self.r, self.groups = r, list(p.groups)
        self.a_parts = torch.cat(parts3(p.lora_a)).t().contiguous()  # [in, 3*n*r] bf16
        b = p.lora_b.transpose(1, 2)  # [G, r, Nb]
        hi, mid, lo = parts3(b)
        self.b_stack = torch.cat([hi, mid, lo, hi, mid, hi], dim=1)  # [G, 6r, Nb]: partners of h's parts below

    def a_fp32(self, x):
        return torch.nn.functional.linear(x.float(), self.p.lora_a)  # [M, n*r]

    def a_split(self, x):
        h3 = mm32(x, self.a_parts)  # [M, 3*n*r]
        k = h3.shape[1] // 3
        return h3[:, :k] + h3[:, k : 2 * k] + h3[:, 2 * k :]

    def per_block(self, h):
        return h.reshape(h.shape[0], -1, self.r)[:, self.groups].transpose(0, 1)  # [G, M, r]

    def b_fp32(self, h):
        return torch.bmm(self.per_block(h), self.p.lora_b.transpose(1, 2))  # [G, M, Nb]

    def b_split(self, h):
        hi, mid, lo = parts3(self.per_block(h))
        lhs = torch.cat([hi, hi, hi, mid, mid, lo], dim=2)  # [G, M, 6r]
        if lhs.is_cuda:
            return torch.bmm(lhs, self.b_stack, out_dtype=torch.float32)
        return torch.bmm(lhs.float(), self.b_stack.float())

    def run(self, name, x):
        h = self.a_fp32(x) if name == "fp32" else self.a_split(x)
        return self.b_split(h) if name == "split-ab" else self.b_fp32(h)

    def truth(self, x):
        h = torch.nn.functional.linear(x.double(), self.p.lora_a.double())
        return torch.bmm(h.reshape(h.shape[0], -1, self.r)[:, self.groups].transpose(0, 1), self.p.lora_b.double().transpose(1, 2))


def timed(call, device: str, iters: int) -> float:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(3):
        call()
    sync()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        call()
        sync()
        times.append((time.perf_counter() - t) * 1e6)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[896, 3408], help="one-pass rows ((a) and (c) with shape buckets)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--config", type=Path, default=HERE.parent / "manifests" / "qwen3.5-2b.config.json")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)

    cfg, _, _ = TextConfig.from_dict(json.loads(args.config.read_text())["text_config"])
    names = ("fp32", "split-a", "split-ab")
    results = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__, "runs": {}}
    with torch.no_grad():
        for layer, (kind, count) in LAYERS.items():
            w = gather_weights(random_layer(cfg, kind, "separate", args.device, seed=0))
            projections = {"in_proj": w.in_proj, "out_proj": w.out_proj} if layer == "gdn" else {"qkv": w.qkv, "o_proj": w.o_proj}
            projections |= {"gate_up": w.mlp.gate_up, "down": w.mlp.down}
            for rows in args.rows:
                totals = dict.fromkeys(names, 0.0)
                for pname, p in projections.items():
                    f = Formulations(p)
                    gen = torch.Generator().manual_seed(rows)
                    x = torch.randn(rows, p.weight.shape[1], generator=gen).to(device=args.device, dtype=torch.bfloat16)
                    truth = f.truth(x)
                    scale = truth.abs().max().item()
                    entry = {}
                    for name in names:
                        err = (f.run(name, x).double() - truth).abs().max().item() / scale
                        us = timed(lambda: f.run(name, x), args.device, args.iters)
                        entry[name] = {"us": round(us, 2), "rel_err": err}
                        totals[name] += us
                    results["runs"][f"{layer} {pname} ({rows} rows)"] = entry
                    print(f"{layer:9s} {pname:8s} {rows:5d} rows: " + "  ".join(f"{n} {e['us']:7.1f} us err {e['rel_err']:.1e}" for n, e in entry.items()), flush=True)
                whole = {n: round(t * count / 1e3, 3) for n, t in totals.items()}
                results["runs"][f"{layer} x{count} ({rows} rows), ms"] = whole
                print(f"  {layer} x{count} at {rows} rows, whole stack: " + ", ".join(f"{n} {v:.2f} ms" for n, v in whole.items()), flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
