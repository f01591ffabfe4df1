"""How precise would a tensor-core LoRA be? Each candidate formulation of the bf16 fast path's LoRA
delta, scale * B(A x), against an fp64 computation on an export's own weights. Not a test; no GPU.

The bf16 fast path adds the delta to the bf16 projection W x and casts the sum to bf16 once, so a
formulation may replace the FP32 one only where its error stays at most 2^-12 of the projection
output's magnitude: 16x below half a bf16 ulp of that sum (docs/benchmarks.md says the rule). Here
a row's magnitude is the RMS of its fp64 output (W x + delta), the error the largest element's.

Formulations (x, the layer's input, is bf16, so it is exact as a bf16 or TF32 operand):
- fp32: the runtime's own (`fast/projections.project`): both products in IEEE fp32.
- tf32: A, then h = A x, and scale * B, rounded to TF32 (10-bit mantissa, nearest-even) with
  fp32 accumulation: one pass of tensor-core GEMMs with TF32 on.
- bf16: the same with every operand rounded to bf16.
- bf16x3: operands split into bf16 high and low parts, the small cross term dropped (A x: 2 GEMMs,
  since x needs no low part; B h: 3) -- five bf16 GEMMs.
- tf32x3: the same split with TF32 parts.
Products of two bf16 or two TF32 values are exact in fp32, so a CPU GEMM on the rounded operands
computes what a tensor core computes, up to the order of the fp32 accumulation (whose own error,
about K * 2^-24, sits far below these bounds); a GPU run should confirm the numbers before a
formulation is adopted.

    python benchmarks/lora_precision.py --export build/gpu-bench/export-2b-separate --out lora-precision.json

The export must be a separate-LoRA export (the 2b fixture's: `benchmarks/artifacts.py`). Its
layers' inputs are drawn as RMS-normalised rows (N(0, 1), then the layer's input norm weight),
--rows per projection.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from valen_runtime.qwen35 import LoRALinear  # noqa: E402
from valen_runtime.weights import load_model  # noqa: E402

BOUND = 2.0**-12


def round_mantissa(t: torch.Tensor, bits: int) -> torch.Tensor:
    """fp32 -> fp32 holding the nearest value with `bits` explicit mantissa bits (ties to even)."""
    drop = 23 - bits
    raw = t.float().contiguous().view(torch.int32)
    lsb = (raw >> drop) & 1
    rounded = (raw + ((1 << (drop - 1)) - 1) + lsb) & ~((1 << drop) - 1)
    return rounded.view(torch.float32)


def as_tf32(t: torch.Tensor) -> torch.Tensor:
    return round_mantissa(t, 10)


def as_bf16(t: torch.Tensor) -> torch.Tensor:
    return t.float().to(torch.bfloat16).float()


def split(t: torch.Tensor, rounding) -> tuple[torch.Tensor, torch.Tensor]:
    high = rounding(t)
    return high, rounding(t.float() - high)


def deltas(x: torch.Tensor, a: torch.Tensor, b_scaled: torch.Tensor) -> dict[str, torch.Tensor]:
    """x [M, in] bf16, a [r, in] fp32, b_scaled [out, r] fp32 -> each formulation's delta [M, out] fp32."""
    xf = x.float()  # exact: bf16 values are TF32 and bf16 operands alike
    out = {"fp32": F.linear(F.linear(xf, a), b_scaled)}
    for name, rounding in (("tf32", as_tf32), ("bf16", as_bf16)):
        h = F.linear(xf, rounding(a))
        out[name] = F.linear(rounding(h), rounding(b_scaled))
        a_hi, a_lo = split(a, rounding)
        h = F.linear(xf, a_hi) + F.linear(xf, a_lo)
        (h_hi, h_lo), (b_hi, b_lo) = split(h, rounding), split(b_scaled, rounding)
        out[f"{name}x3"] = F.linear(h_hi, b_hi) + (F.linear(h_hi, b_lo) + F.linear(h_lo, b_hi))
    return out


def measure(proj: LoRALinear, x: torch.Tensor) -> dict:
    """One projection: per formulation the largest error relative to its row's output RMS and to the delta's largest value."""
    a, b = proj.lora_A.weight.detach().float(), proj.lora_B.weight.detach().float()
    b_scaled = b * proj.lora_scale  # the fast path folds the scale into B
    x64 = x.double()
    delta64 = F.linear(F.linear(x64, a.double()), b.double()) * proj.lora_scale
    out64 = F.linear(x64, proj.weight.detach().double()) + delta64
    row_rms = out64.pow(2).mean(-1, keepdim=True).sqrt()
    report = {"in": a.shape[1], "out": b.shape[0], "rank": a.shape[0],
              "delta_rms_over_output_rms": float(delta64.pow(2).mean().sqrt() / out64.pow(2).mean().sqrt())}
    for name, delta in deltas(x, a, b_scaled).items():
        err = (delta.double() - delta64).abs()
        report[name] = {"of_output": float((err / row_rms).max()), "of_delta_max": float(err.max() / delta64.abs().max())}
    return report


def layer_inputs(norm_weight: torch.Tensor, rows: int, seed: int) -> torch.Tensor:
    """RMS-normalised rows times the (zero-centred) RMSNorm weight, bf16: what a projection reads."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, norm_weight.shape[0], generator=g)
    x = x / x.pow(2).mean(-1, keepdim=True).sqrt()
    return (x * (1.0 + norm_weight.float())).to(torch.bfloat16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--export", type=Path, required=True, help="a separate-LoRA export")
    ap.add_argument("--layers", default="0,3", help="decoder layers to measure (default: the first GDN and the first attention layer of the 2B)")
    ap.add_argument("--rows", type=int, default=640)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    model = load_model(args.export, device="cpu", dtype="bf16")
    results = {"export": str(args.export), "rows": args.rows, "bound": BOUND, "projections": {}}
    for index in (int(i) for i in args.layers.split(",")):
        layer = model.text.layers[index]
        # the attention / GDN projections read input_layernorm's output, the MLP post_attention_layernorm's
        for name, module in layer.named_modules():
            if not isinstance(module, LoRALinear) or module.lora_A is None:
                continue
            norm = layer.post_attention_layernorm if name.startswith("mlp.") else layer.input_layernorm
            if name.endswith(("down_proj", "out_proj", "o_proj")):
                # these read the block's inner activations, not a normalised row: unit-RMS rows stand in
                norm_weight = torch.zeros(module.in_features)
            else:
                norm_weight = norm.weight.detach()
            key = f"layers.{index}.{name}"
            results["projections"][key] = measure(module, layer_inputs(norm_weight, args.rows, seed=index * 100 + len(results["projections"])))
            r = results["projections"][key]
            line = "  ".join(f"{f} {r[f]['of_output']:.2e}" for f in ("fp32", "tf32", "bf16", "bf16x3", "tf32x3"))
            print(f"{key:40s} [{r['in']}->{r['out']}] delta/out {r['delta_rms_over_output_rms']:.2f}  {line}", flush=True)
    worst = {f: max(r[f]["of_output"] for r in results["projections"].values()) for f in ("fp32", "tf32", "bf16", "bf16x3", "tf32x3")}
    results["worst_of_output"] = worst
    results["within_bound"] = {f: v <= BOUND for f, v in worst.items()}
    print("worst error / output RMS:", "  ".join(f"{f} {v:.2e} ({'within' if v <= BOUND else 'OVER'} 2^-12)" for f, v in worst.items()))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
