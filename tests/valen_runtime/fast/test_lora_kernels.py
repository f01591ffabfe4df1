"""valen_runtime.fast.lora_kernels: the Triton FP32 LoRA against projections.project's torch
formulation and an fp64 truth, on the CPU through Triton's interpreter (the same kernel source the
GPU compiles) and on CUDA (gpu-marked).

Bound: both compute each output as cast(base + sum of r fp32 products of sums of K fp32 products),
in different orders. The fp32 error of a K-term dot is at most about K * 2^-24 of the sum of
|terms| (the classic bound gamma_K); with K <= 128 here that is < 1e-5 relative to the terms'
magnitude, so 1e-5 * sum|terms| (computed in fp64) bounds |triton - truth| and |torch - truth|.
A bf16 base then rounds once: the two may land on neighbouring bf16 values near a tie, one ulp.
"""

from __future__ import annotations

import pytest
import torch

from valen_runtime.fast import lora_kernels
from valen_runtime.fast.projections import fuse, project

from .test_projections import lora_members

pytestmark = pytest.mark.usefixtures("one_torch_thread")

triton = pytest.importorskip("triton")


@pytest.fixture
def interpreted(monkeypatch):
    """The kernels built under Triton's interpreter (numpy on the CPU)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return lora_kernels.build_kernels()


def truth_and_scale(x, p):
    """fp64 base + LoRA and the fp64 sum of |terms| of each output's LoRA (the bound's scale)."""
    x64 = x.double().reshape(-1, x.shape[-1])
    r = p.lora_b_rows.shape[1]
    h = x64 @ p.lora_a.double().T  # [M, n*r]
    h_abs = x64.abs() @ p.lora_a.double().abs().T
    members = p.column_member.long()
    cols = members[:, None] * r + torch.arange(r)[None, :]  # [N, r]: each column's h entries
    delta = (h[:, cols] * p.lora_b_rows.double()[None]).sum(-1)  # [M, N]
    terms = (h_abs[:, cols] * p.lora_b_rows.double().abs()[None]).sum(-1)
    return delta, terms


# Sizes that hit the kernels' edges: members not a multiple of the 64-column tile (a tile on a
# member boundary), narrow trailing members, rows not a multiple of either row tile, K over a
# split boundary, a rank below tl.dot's 16.
CASES = [
    ([96, 40, 8, 8], 80, 16, 37),
    ([128, 64], 600, 32, 70),
    ([50], 40, 4, 5),
]


@pytest.mark.parametrize("sizes,in_features,rank,rows", CASES)
def test_triton_lora_matches_truth_in_fp32(interpreted, sizes, in_features, rank, rows):
    members = lora_members(sizes, in_features, rank, seed=rows)
    p = fuse(members)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows + 1))
    base = torch.nn.functional.linear(x, p.weight)
    got = lora_kernels.lora_add(base, x, p.lora_a, p.lora_b_rows, p.column_member, kernels=interpreted)
    delta, terms = truth_and_scale(x, p)
    err = (got.double() - base.double() - delta).abs()
    assert (err <= 1e-5 * terms + 1e-6 * base.double().abs()).all(), err.max()
    torch_err = (project(x, p).double() - base.double() - delta).abs()
    assert (torch_err <= 1e-5 * terms + 1e-6 * base.double().abs()).all()  # the same bound holds the torch path


def test_triton_lora_rounds_a_bf16_base_once(interpreted):
    """bf16 x and W: the base rounds in F.linear, the LoRA adds in fp32 and rounds once more."""
    members = lora_members([96, 40], 64, 32, seed=3, dtype=torch.bfloat16)
    p = fuse(members)
    x = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(4)).bfloat16()
    base = torch.nn.functional.linear(x, p.weight)
    got = lora_kernels.lora_add(base, x, p.lora_a, p.lora_b_rows, p.column_member, kernels=interpreted)
    want = project(x, p)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    ulp = (want.float().abs() * 2.0**-7).clamp(min=2.0**-133)
    assert ((got.float() - want.float()).abs() <= ulp).all()
    assert (got == want).float().mean() > 0.9  # mostly the same bf16 value: only near-ties may differ


def test_split_count_fills_the_gpu_and_keeps_slices_long():
    assert lora_kernels.split_count(896, 2048) == 8  # 28 row tiles x 8 = 224 programs
    assert lora_kernels.split_count(64, 2048) == 8  # capped by the 256-long slice
    assert lora_kernels.split_count(64, 6144) == 16
    assert lora_kernels.split_count(3408, 2048) == 2
    assert lora_kernels.split_count(5, 40) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [64, 896, 3408])
def test_triton_lora_on_cuda_matches_truth_at_2b_shapes(rows):
    """GDN's in_proj (qkv | z | b | a) at 2B widths, rank 32, bf16 activations."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    members = lora_members([6144, 2048, 16, 16], 2048, 32, seed=rows, dtype=torch.bfloat16)
    for m in members:
        m.cuda()
    p = fuse(members)
    x = torch.randn(rows, 2048, generator=torch.Generator().manual_seed(1)).bfloat16().cuda()
    base = torch.nn.functional.linear(x, p.weight)
    got = lora_kernels.lora_add_op(base, x, p.lora_a, p.lora_b_rows, p.column_member)
    want = project(x, p)
    ulp = (want.float().abs() * 2.0**-7).clamp(min=2.0**-133)
    assert ((got.float() - want.float()).abs() <= ulp).all()
    # fp32 output before the cast, against fp64: the kernels on fp32 base
    base32 = base.float()
    got32 = lora_kernels.lora_add_op(base32, x, p.lora_a, p.lora_b_rows, p.column_member)
    delta, terms = truth_and_scale(x.cpu(), p._replace(**{k: getattr(p, k).cpu() for k in ("lora_a", "lora_b_rows", "column_member")}))
    err = (got32.double().cpu() - base32.double().cpu() - delta).abs()
    assert (err <= 1e-5 * terms + 1e-6 * base32.double().cpu().abs()).all(), err.max()
    assert torch.equal(got, lora_kernels.lora_add_op(base, x, p.lora_a, p.lora_b_rows, p.column_member))  # deterministic
