"""Casts to bf16 that a compiler cannot drop.

Eager PyTorch rounds every bf16 op's result to bf16; a compiler fusing ops may keep the fp32 value
and round only at the kernel's end. torch.compile's `emulate_precision_casts` is meant to keep
eager's roundings, but measured on the H200 (torch 2.11) and on the CPU (torch 2.14) it drops some
of them inside the GDN layer (the causal conv's cast before SiLU among them), so the compiled fast
path stopped computing the reference's numbers. Rounding with integer ops on the bits cannot be
fused away: `round_to_bf16(x)` is the bf16 value nearest to fp32 x (ties to even), still held
in fp32, so the cast that follows (`cast`) is exact.
"""

from __future__ import annotations

import torch

_LOW16 = -65536  # 0xFFFF0000 as int32: keeps sign, exponent and bf16's 7 fraction bits


def round_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 x -> fp32 holding the nearest bf16 value (round half to even; inf stays inf, NaN stays NaN)."""
    bits = x.view(torch.int32)
    lsb = (bits >> 16) & 1  # the last kept bit: a tie rounds to make it 0
    rounded = ((bits + (0x7FFF + lsb)) & _LOW16).view(torch.float32)
    return torch.where(x.isnan(), x, rounded)


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x.to(dtype) for fp32 x, with the rounding to bf16 done on the bits (see the module docstring)."""
    if dtype == torch.bfloat16 and x.dtype == torch.float32:
        x = round_to_bf16(x)
    return x.to(dtype)
