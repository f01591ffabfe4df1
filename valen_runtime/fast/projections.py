"""Projections that read one input as one GEMM, with their FP32 LoRA adapters grouped.

GDN's in_proj_qkv | z | b | a, attention's q | k | v and the MLP's gate | up each become one
matrix, and the reference modules' weights become row-block views of it (no second copy). Their
FP32 LoRA adapters (PEFT's unmerged form, `qwen35.LoRALinear`) become one A GEMM and one batched
B GEMM over equal row blocks of the members; each output is still one r-term fp32 sum, as in
PEFT, added to the base result in fp32 and cast once (only the order of a few fp32 roundings
moves: the scale is folded into B).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..qwen35 import LoRALinear
from .rounding import cast

NARROW = 256  # members with fewer output rows are not worth a block of their own


class Projection(NamedTuple):
    """Projections of one input fused along the output, with their LoRA factors (None when merged)."""

    weight: torch.Tensor  # [sum N_i, in]
    lora_a: torch.Tensor | None  # [n*r, in] fp32: every member's A, stacked
    lora_b: torch.Tensor | None  # [G, Nb, r] fp32, scale folded: the wide members cut into Nb-row blocks
    lora_b_small: torch.Tensor | None  # [sum N_small, n_small*r] block-diagonal, the narrow trailing members
    groups: tuple[int, ...]  # the member each Nb block belongs to


def fuse(members: list[LoRALinear]) -> Projection:
    """One Projection for `members` (in output order). With several members, their weights are
    concatenated once and each member's `weight` becomes a view of its rows."""
    if len(members) == 1:
        weight = members[0].weight
    else:
        weight = torch.cat([m.weight.detach() for m in members])  # [sum N_i, in]
        row = 0
        for m in members:
            m.weight = nn.Parameter(weight[row : row + m.out_features], requires_grad=False)
            row += m.out_features
    if all(m.lora_A is None for m in members):
        return Projection(weight, None, None, None, ())
    if any(m.lora_A is None for m in members):
        raise ValueError("cannot fuse projections where only some carry a LoRA adapter")
    ranks = {m.lora_A.weight.shape[0] for m in members}
    if len(ranks) != 1:
        raise ValueError(f"fused projections need one LoRA rank, got {sorted(ranks)}")
    (r,) = ranks
    sizes = [m.out_features for m in members]
    n_wide = len(sizes)
    while n_wide > 1 and sizes[n_wide - 1] < NARROW:
        n_wide -= 1
    block = math.gcd(*sizes[:n_wide])
    groups = tuple(i for i in range(n_wide) for _ in range(sizes[i] // block))
    scaled = [m.lora_B.weight.detach() * m.lora_scale for m in members]  # [N_i, r] fp32
    lora_b = torch.cat([b.view(-1, block, r) for b in scaled[:n_wide]])  # [G, Nb, r]
    small = torch.block_diag(*scaled[n_wide:]) if n_wide < len(members) else None
    lora_a = torch.cat([m.lora_A.weight.detach() for m in members])
    return Projection(weight, lora_a, lora_b, small, groups)


def project(x: torch.Tensor, p: Projection) -> torch.Tensor:
    """x [..., in] -> [..., sum N_i]: x @ W^T plus each member's FP32 LoRA delta, cast once.

    The B products run as one batched GEMM over the members' Nb-row blocks ([G, M, r] @
    [G, r, Nb]) rather than one block-diagonal GEMM whose zero blocks would multiply the work
    by the member count; the narrow trailing members (GDN's b and a) share one small
    block-diagonal GEMM.
    """
    out = F.linear(x, p.weight)
    if p.lora_a is None:
        return out
    h = F.linear(x.float(), p.lora_a)  # [..., n*r]: every member's A(x)
    r = p.lora_b.shape[-1]
    lead = h.shape[:-1]
    per_member = h.reshape(-1, h.shape[-1] // r, r)  # [M, n, r]
    lhs = per_member[:, list(p.groups)].transpose(0, 1)  # [G, M, r]: each block's member
    delta = torch.bmm(lhs, p.lora_b.transpose(1, 2)).transpose(0, 1).reshape(*lead, -1)  # [..., G*Nb]
    if p.lora_b_small is not None:
        n_wide = p.groups[-1] + 1
        delta = torch.cat([delta, F.linear(h[..., n_wide * r :], p.lora_b_small)], dim=-1)
    return cast(out.float() + delta, out.dtype)
