"""Candidate formulations of two fast-path pieces at the 2B shapes, each checked against the
runtime's own and timed by its kernels (profile_fast.kernel_profile): the evidence for moving one
into `fast/`. Not a test; random inputs, no fixture, about a minute on the H200.

    python benchmarks/kernel_variants.py [--group lora-a conv] [--out variants.json]

- lora-a: the FP32 LoRA's A product x [M, in] -> [M, n*r] (projections.project's
  `F.linear(x.float(), lora_a)`, cuBLAS's CUDA-core kernels with TF32 off) against the same
  product with K split s ways (one batched fp32 GEMM, then a sum over the s partial products:
  s times the thread blocks for these narrow outputs) and against the transposed product
  (A @ x^T, the long side as N). All stay IEEE fp32; errors are against fp64.
- conv: the one-pass causal conv + SiLU (layers.causal_conv_silu_taps: K gathers through the
  tap index) against K shifted slices of the zero-padded rows (contiguous loads) with the first
  K-1 rows of every sequence, which read another sequence's rows or zeros, recomputed through
  the tap index and written over them. Same products in the same order: the outputs must agree
  to the bit, or to 1 ulp where the compiler fuses a multiply-add differently.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from layer_bench import CASES  # noqa: E402
from profile_fast import kernel_profile  # noqa: E402
from valen_runtime.fast.layers import _conv_taps_silu, causal_conv_silu_taps  # noqa: E402
from valen_runtime.layouts import packed_indices  # noqa: E402

# (name, in, n*r) of every LoRA A product in a 2B layer: GDN in_proj (4 members), out_proj,
# the MLP's gate|up and down, attention's q|k|v and o_proj; rank 32.
LORA_A = [("gdn in_proj", 2048, 128), ("gdn out_proj", 2048, 32), ("mlp gate_up", 2048, 64), ("mlp down", 6144, 32),
          ("attn qkv", 2048, 96), ("attn o_proj", 2048, 32)]
K_CONV, C_CONV = 4, 6144  # the 2B GDN conv: kernel 4 over q|k|v channels


def kernel_ms(call, repeats: int = 5) -> float:
    for _ in range(3):
        call()
    return statistics.median(kernel_profile(call)[0]["kernel_time_ms"] for _ in range(repeats))


def lora_a_variants() -> dict:
    return {
        "linear (runtime)": lambda x, a: F.linear(x.float(), a),
        "transposed": lambda x, a: (a @ x.float().t()).t().contiguous(),
        **{f"split-k {s}": (lambda s: lambda x, a: torch.bmm(x.float().unflatten(1, (s, -1)).transpose(0, 1),
                                                           a.unflatten(1, (s, -1)).permute(1, 2, 0)).sum(0))(s) for s in (2, 4, 8)},
    }


def run_lora_a(rows: list[int], device: str) -> dict:
    out = {}
    gen = torch.Generator().manual_seed(0)
    for name, k, n in LORA_A:
        a = (torch.randn(n, k, generator=gen) * 0.02).to(device)
        for m in rows:
            x = torch.randn(m, k, generator=gen).to(device=device, dtype=torch.bfloat16)
            truth = F.linear(x.double(), a.double())
            entry = {}
            for variant, fn in lora_a_variants().items():
                got = fn(x, a)
                err = ((got.double() - truth).abs().max() / truth.abs().max()).item()
                entry[variant] = {"kernel_us": round(kernel_ms(lambda: fn(x, a)) * 1e3, 2) if device == "cuda" else None, "rel_err": err}
            out[f"{name} [{m}, {k}] -> {n}"] = entry
            print(f"{name:13s} M={m:5d}: " + "  ".join(f"{v} {e['kernel_us']} us {e['rel_err']:.1e}" for v, e in entry.items()), flush=True)
    return out


def conv_fixups(lengths: list[int], taps: torch.Tensor, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows whose shifted slices would read outside their own sequence (its first K-1
    rows; a shorter sequence repeats its last row so the count is (K-1) per sequence) and
    their taps [K, F]."""
    rows, start = [], 0
    for n in lengths:
        rows += [start + min(i, n - 1) for i in range(K - 1)]
        start += n
    rows = torch.tensor(rows)
    return rows, taps[:, rows]


def conv_slices(mixed, weight, fix_rows, fix_taps):
    """causal_conv_silu_taps by shifted slices, then its sequences' first rows fixed up."""
    K, T = weight.shape[-1], mixed.shape[1]
    src = F.pad(mixed, (0, 0, K - 1, 0))  # [1, K-1+T, C]
    out = _conv_taps_silu([src[:, j : j + T] for j in range(K)], weight, mixed.dtype)
    fixed = _conv_taps_silu([src[:, fix_taps[j]] for j in range(K)], weight, mixed.dtype)  # [1, F, C]
    return out.index_copy(1, fix_rows, fixed)


def run_conv(cases: list[str], device: str) -> dict:
    out = {}
    taps_fn = torch.compile(causal_conv_silu_taps, fullgraph=True, options={"emulate_precision_casts": True})
    slices_fn = torch.compile(conv_slices, fullgraph=True, options={"emulate_precision_casts": True})
    gen = torch.Generator().manual_seed(1)
    for case in cases:
        cut, lengths = CASES[case]
        layout = packed_indices([(cut, lengths)], K_CONV)
        taps = layout.conv_taps
        fix_rows, fix_taps = conv_fixups([cut] + lengths, taps, K_CONV)
        R = cut + sum(lengths)
        mixed = torch.randn(1, R, C_CONV, generator=gen).to(device=device, dtype=torch.bfloat16)
        weight = (torch.randn(C_CONV, 1, K_CONV, generator=gen) * 0.3).to(device=device, dtype=torch.bfloat16)
        taps, fix_rows, fix_taps = taps.to(device), fix_rows.to(device), fix_taps.to(device)
        want = taps_fn(mixed, weight, taps)
        got = slices_fn(mixed, weight, fix_rows, fix_taps)
        ulps = ((got.float() - want.float()).abs() / want.float().abs().clamp(min=1e-30)).max().item() * 2**7
        entry = {"max_ulps_bf16": ulps, "bitwise": bool(torch.equal(got, want))}
        if device == "cuda":
            entry |= {"taps_us": round(kernel_ms(lambda: taps_fn(mixed, weight, taps)) * 1e3, 2),
                      "slices_us": round(kernel_ms(lambda: slices_fn(mixed, weight, fix_rows, fix_taps)) * 1e3, 2)}
        out[f"({case}) {R} rows"] = entry
        print(f"conv ({case}) {R} rows: {entry}", flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--group", nargs="+", default=["lora-a", "conv"], choices=["lora-a", "conv"])
    ap.add_argument("--rows", type=int, nargs="+", default=[896, 3408])
    ap.add_argument("--case", nargs="+", default=["a", "c"], choices=sorted(CASES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    results = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__}
    with torch.no_grad():
        if "lora-a" in args.group:
            results["lora-a"] = run_lora_a(args.rows, args.device)
        if "conv" in args.group:
            results["conv"] = run_conv(args.case, args.device)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
