"""valen_runtime.fast.projections: fused projections with grouped FP32 LoRA against the reference's
own `LoRALinear` (PEFT's unmerged maths), member by member."""

from __future__ import annotations

import pytest
import torch

from valen_runtime.fast.projections import fuse, project
from valen_runtime.qwen35 import LoRALinear, attach_lora

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def lora_members(sizes, in_features: int, rank: int, seed: int, dtype=torch.float32, with_lora: bool = True):
    """LoRALinear projections of one input with PEFT-style FP32 adapters (scale 2)."""
    gen = torch.Generator().manual_seed(seed)
    parent = torch.nn.Module()
    names = [f"m{i}" for i in range(len(sizes))]
    for name, n in zip(names, sizes):
        setattr(parent, name, LoRALinear(in_features, n))
        getattr(parent, name).weight.data = torch.randn(n, in_features, generator=gen).to(dtype)
    if with_lora:
        adapter = {}
        for name, n in zip(names, sizes):
            adapter[f"{name}.lora_A.weight"] = torch.randn(rank, in_features, generator=gen)
            adapter[f"{name}.lora_B.weight"] = torch.randn(n, rank, generator=gen)
        attach_lora(parent, adapter, 2.0)
    return [getattr(parent, name) for name in names]


@pytest.mark.parametrize("sizes", [[768, 256, 8, 8], [512, 512], [300], [16, 8]])
def test_grouped_lora_projection_equals_separate_lora_linears(sizes):
    """Wide members cut into equal row blocks for one batched B GEMM, narrow trailing members
    block-diagonal; each output must equal its own LoRALinear."""
    members = lora_members(sizes, 32, 4, seed=len(sizes))
    x = torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(1))
    want = torch.cat([m(x) for m in members], dim=-1)
    p = fuse(members)
    if sizes == [768, 256, 8, 8]:
        assert p.groups == (0, 0, 0, 1) and p.lora_b.shape == (4, 256, 4) and p.lora_b_small.shape == (16, 8)
    torch.testing.assert_close(project(x, p), want, rtol=1e-5, atol=1e-5)  # fp32: the scale folded into B only


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_members_are_views_and_compute_what_they_did(dtype):
    members = lora_members([48, 8], 32, 4, seed=7, dtype=dtype)
    x = torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(2)).to(dtype)
    want = [m(x) for m in members]
    p = fuse(members)
    assert members[0].weight.data_ptr() == p.weight.data_ptr()  # no second copy of the weights
    assert torch.equal(members[1].weight, p.weight[48:])
    for m, w, got in zip(members, want, project(x, p).split([48, 8], dim=-1)):
        assert torch.equal(m(x), w)  # the reference module computes exactly what it did before
        # fp32: the scale folded into B; bf16: one bf16 ulp where the fp32 sum lands near a tie
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
        torch.testing.assert_close(got, w, **tol)


def test_merged_projection_is_one_gemm():
    members = lora_members([24, 24, 8], 16, 4, seed=3, with_lora=False)
    x = torch.randn(2, 16, generator=torch.Generator().manual_seed(4))
    p = fuse(members)
    assert p.lora_a is None
    # The same products in one GEMM; a GEMM kernel may block the fp32 sums differently by width.
    torch.testing.assert_close(project(x, p), torch.cat([m(x) for m in members], dim=-1), rtol=1e-6, atol=1e-6)


def test_partial_adapters_are_refused():
    members = lora_members([16, 16], 8, 2, seed=5, with_lora=False)
    parent = torch.nn.Module()
    parent.a, parent.b = members
    attach_lora(parent, {"a.lora_A.weight": torch.zeros(2, 8), "a.lora_B.weight": torch.zeros(16, 2)}, 1.0)
    with pytest.raises(ValueError, match="only some carry a LoRA adapter"):
        fuse(members)
