"""valen_runtime.fast.kernels against the reference's pieces: SDPA vs eager attention, the delta-rule
custom ops vs the chunked rule they wrap, FLA's kernel vs the chunked rule (CUDA)."""

from __future__ import annotations

import pytest
import torch

from valen_runtime.fast.kernels import (gated_delta_rule_op, gated_delta_rule_varlen_final_op, gated_delta_rule_varlen_op, sdpa_attention,
                                       sdpa_vision_attention)
from valen_runtime.gated_delta import chunk_gated_delta_rule, l2norm
from valen_runtime.qwen35 import causal_mask, eager_attention
from valen_runtime.vision import bidirectional_attention

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def rand_qkv(B, Hq, Hk, T, S, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, Hq, T, D, generator=g).to(dtype), torch.randn(B, Hk, S, D, generator=g).to(dtype),
            torch.randn(B, Hk, S, D, generator=g).to(dtype))


@pytest.mark.parametrize("T,past", [(7, 0), (5, 11), (1, 30)])
def test_sdpa_matches_eager_attention_cpu_fp32(T, past):
    q, k, v = rand_qkv(2, 4, 1, T, T + past, 32, torch.float32, seed=T)
    mask = causal_mask(T, past, torch.float32, torch.device("cpu"))
    # fp32: only the summation order differs
    torch.testing.assert_close(sdpa_attention(q, k, v, mask, 32**-0.5), eager_attention(q, k, v, mask, 32**-0.5), rtol=1e-5, atol=1e-5)


def test_sdpa_vision_matches_bidirectional_attention_cpu_fp32():
    q, k, v = rand_qkv(1, 2, 2, 13, 13, 16, torch.float32, seed=3)
    torch.testing.assert_close(sdpa_vision_attention(q, k, v, 0.25), bidirectional_attention(q, k, v, 0.25), rtol=1e-5, atol=1e-5)


def delta_inputs(T, H=3, D=8, B=2, seed=5):
    gen = torch.Generator().manual_seed(seed)
    q, k = (l2norm(torch.randn(B, T, H, D, generator=gen)) for _ in range(2))
    v = torch.randn(B, T, H, D, generator=gen)
    g, beta = -torch.rand(B, T, H, generator=gen), torch.rand(B, T, H, generator=gen)
    return q, k, v, g, beta, torch.randn(B, H, D, D, generator=gen)


def test_delta_rule_op_equals_the_torch_rule_it_wraps():
    q, k, v, g, beta, state = delta_inputs(19)
    out, final = gated_delta_rule_op(q, k, v, g, beta, state, "torch")
    want_out, want_final = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=False)
    assert torch.equal(out, want_out) and torch.equal(final, want_final)


def test_varlen_op_equals_one_run_per_sequence():
    """Sequences packed in one row, each from its own initial state, against one batched run each."""
    lengths = [5, 1, 70, 3]
    q, k, v, g, beta, _ = delta_inputs(sum(lengths), B=1, seed=8)
    states = torch.randn(len(lengths), 3, 8, 8, generator=torch.Generator().manual_seed(9))
    cu = torch.tensor([0, 5, 6, 76, 79])
    out = gated_delta_rule_varlen_op(q, k, v, g, beta, states, cu, torch.zeros(0, 2, dtype=torch.long), "torch")
    for n, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        want, _ = chunk_gated_delta_rule(q[:, start:end], k[:, start:end], v[:, start:end], g[:, start:end], beta[:, start:end],
                                         initial_state=states[n : n + 1], use_qk_l2norm_in_kernel=False)
        assert torch.equal(out[:, start:end], want)


def test_varlen_final_op_returns_each_sequences_final_state():
    """The prefixes' call of the one-pass layout: outputs as the varlen op, and per sequence the
    final state of one run of the chunked rule on it alone."""
    lengths = [64, 128, 3]
    q, k, v, g, beta, _ = delta_inputs(sum(lengths), B=1, seed=10)
    states = torch.randn(len(lengths), 3, 8, 8, generator=torch.Generator().manual_seed(11))
    cu = torch.tensor([0, 64, 192, 195])
    out, finals = gated_delta_rule_varlen_final_op(q, k, v, g, beta, states, cu, torch.zeros(0, 2, dtype=torch.long), "torch")
    assert torch.equal(out, gated_delta_rule_varlen_op(q, k, v, g, beta, states, cu, torch.zeros(0, 2, dtype=torch.long), "torch"))
    assert finals.shape == states.shape
    for n, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        _, want = chunk_gated_delta_rule(q[:, start:end], k[:, start:end], v[:, start:end], g[:, start:end], beta[:, start:end],
                                         initial_state=states[n : n + 1], output_final_state=True, use_qk_l2norm_in_kernel=False)
        assert torch.equal(finals[n : n + 1], want)


@pytest.mark.gpu
def test_fla_varlen_final_op_matches_the_torch_one():
    """The prefixes' final states through FLA's varlen kernel against the reference rule one
    sequence at a time; bf16 resolution as in test_fla_rule_matches_torch_chunk_rule."""
    from valen_runtime.fast.kernels import fla_available

    if not fla_available():
        pytest.skip("flash-linear-attention not importable")
    lengths = [64, 192, 128]
    gen = torch.Generator().manual_seed(13)
    T, H, D = sum(lengths), 4, 128
    q, k = (l2norm(torch.randn(1, T, H, D, generator=gen).cuda().bfloat16()) for _ in range(2))
    v = torch.randn(1, T, H, D, generator=gen).cuda().bfloat16()
    g, beta = (-torch.rand(1, T, H, generator=gen) * 0.5).cuda(), torch.rand(1, T, H, generator=gen).cuda().bfloat16()
    zeros = torch.zeros(len(lengths), H, D, D, device="cuda")
    cu = torch.tensor([0, 64, 256, 384], device="cuda")
    chunks = torch.tensor([[i, c] for i, n in enumerate(lengths) for c in range(n // 64)], device="cuda")
    want_out, want_final = gated_delta_rule_varlen_final_op(q, k, v, g, beta, zeros, cu, chunks, "torch")
    got_out, got_final = gated_delta_rule_varlen_final_op(q, k, v, g, beta, zeros, cu, chunks, "fla")
    assert (got_out.float() - want_out.float()).abs().max().item() <= 2e-2 * want_out.float().abs().max().item() + 1e-3
    assert (got_final - want_final).abs().max().item() <= 2e-2 * want_final.abs().max().item() + 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 37, 64, 200])
@pytest.mark.parametrize("with_state", [False, True])
def test_fla_rule_matches_torch_chunk_rule(T, with_state):
    from valen_runtime.fast.kernels import fla_available, fla_chunk_gated_delta_rule

    if not fla_available():
        pytest.skip("flash-linear-attention not importable")
    g = torch.Generator().manual_seed(T)
    B, H, D = 3, 4, 128
    q = torch.randn(B, T, H, D, generator=g).cuda().bfloat16()
    k = torch.randn(B, T, H, D, generator=g).cuda().bfloat16()
    v = torch.randn(B, T, H, D, generator=g).cuda().bfloat16()
    gate = -torch.rand(B, T, H, generator=g).cuda() * 0.5
    beta = torch.rand(B, T, H, generator=g).cuda().bfloat16()
    s0 = torch.randn(B, H, D, D, generator=g).cuda() * 0.1 if with_state else None
    ref_o, ref_s = chunk_gated_delta_rule(q, k, v, gate, beta, initial_state=s0, output_final_state=True)
    o, s = fla_chunk_gated_delta_rule(q, k, v, gate, beta, initial_state=s0, output_final_state=True)
    # bf16 inputs; FLA keeps bf16 operands in its tensor-core products where the torch rule
    # works in fp32, so agreement is at bf16 resolution relative to the output scale.
    scale = ref_o.float().abs().max().item()
    assert (o.float() - ref_o.float()).abs().max().item() <= 2e-2 * scale + 1e-3
    assert (s - ref_s).abs().max().item() <= 2e-2 * ref_s.abs().max().item() + 1e-3


@pytest.mark.gpu
def test_fla_varlen_op_matches_the_torch_varlen_op():
    """The one-pass layout's continuations through FLA's varlen kernel (host-built chunk indices)
    against the reference rule one sequence at a time; bf16 resolution as above."""
    from valen_runtime.fast.kernels import fla_available

    if not fla_available():
        pytest.skip("flash-linear-attention not importable")
    lengths = [70, 5, 130, 3]
    gen = torch.Generator().manual_seed(12)
    T, H, D = sum(lengths), 4, 128
    q, k = (l2norm(torch.randn(1, T, H, D, generator=gen).cuda().bfloat16()) for _ in range(2))
    v = torch.randn(1, T, H, D, generator=gen).cuda().bfloat16()
    g, beta = (-torch.rand(1, T, H, generator=gen) * 0.5).cuda(), torch.rand(1, T, H, generator=gen).cuda().bfloat16()
    states = (torch.randn(len(lengths), H, D, D, generator=gen) * 0.1).cuda()
    cu = torch.tensor([0, 70, 75, 205, 208], device="cuda")
    chunks = torch.tensor([[i, c] for i, n in enumerate(lengths) for c in range(-(-n // 64))], device="cuda")
    want = gated_delta_rule_varlen_op(q, k, v, g, beta, states, cu, chunks, "torch")
    got = gated_delta_rule_varlen_op(q, k, v, g, beta, states, cu, chunks, "fla")
    assert (got.float() - want.float()).abs().max().item() <= 2e-2 * want.float().abs().max().item() + 1e-3
