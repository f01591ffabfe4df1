"""valen_runtime.fast.rounding: the bit-level cast against torch's own fp32 -> bf16 conversion."""

from __future__ import annotations

import torch

from valen_runtime.fast.rounding import cast, round_to_bf16


def test_round_to_bf16_is_torchs_conversion():
    gen = torch.Generator().manual_seed(0)
    edges = [float("inf"), -float("inf"), 3.4e38, -3.4e38, 3.3961e38, 0.0, -0.0, 1e-40, -1e-40, 2.0**-133, 2.0**-149]
    # ties: 1 + 2^-8 sits halfway between 1 and 1 + 2^-7 (rounds down to even), 1 + 3 * 2^-8 rounds up
    edges += [1 + 2.0**-8, 1 + 3 * 2.0**-8, -(1 + 2.0**-8), -(1 + 3 * 2.0**-8), 1 + 2.0**-8 + 2.0**-20]
    x = torch.cat([torch.randn(200_000, generator=gen) * 10.0 ** torch.randint(-30, 30, (200_000,), generator=gen).float(),
                   torch.tensor(edges)])
    x = x[torch.isfinite(x) | torch.isinf(x)]
    got, want = round_to_bf16(x), x.to(torch.bfloat16).float()
    assert torch.equal(got, want)
    nan = round_to_bf16(torch.tensor([float("nan")]))
    assert nan.isnan().all()


def test_cast_is_a_plain_cast_but_for_bf16():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    assert cast(x, torch.float32) is x or torch.equal(cast(x, torch.float32), x)
    assert torch.equal(cast(x, torch.bfloat16), x.to(torch.bfloat16))
    b = x.to(torch.bfloat16)
    assert torch.equal(cast(b, torch.bfloat16), b)
