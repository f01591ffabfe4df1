"""valen_runtime.gated_delta: chunked == per-token recurrence, and == transformers 5.4.0's fallback bitwise."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from valen_runtime.gated_delta import chunk_gated_delta_rule, recurrent_gated_delta_rule


# Tiny tensors: one thread is faster and immune to oversubscribed CI cores (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_inputs(B, T, H, Dk, Dv, seed, dtype=torch.float32, strong_decay=False):
    """Shapes and dtypes as GatedDeltaNet passes them: q/k/v/beta in the activation dtype, g fp32."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, Dk, generator=gen).to(dtype)
    k = torch.randn(B, T, H, Dk, generator=gen).to(dtype)
    v = torch.randn(B, T, H, Dv, generator=gen).to(dtype)
    beta = torch.rand(B, T, H, generator=gen).to(dtype)
    A = torch.empty(H).uniform_(1, 16 if strong_decay else 2, generator=gen)
    g = -A * F.softplus(torch.randn(B, T, H, generator=gen))
    state = torch.randn(B, H, Dk, Dv, generator=gen) * 0.5
    return q, k, v, g, beta, state


@given(
    T=st.integers(1, 140),
    B=st.integers(1, 2),
    with_state=st.booleans(),
    chunk_size=st.sampled_from([16, 64]),
    seed=st.integers(0, 2**16),
)
def test_chunked_matches_recurrent(T, B, with_state, chunk_size, seed):
    q, k, v, g, beta, state = make_inputs(B, T, 2, 8, 12, seed)
    init = state if with_state else None
    o_c, s_c = chunk_gated_delta_rule(q, k, v, g, beta, init, output_final_state=True, chunk_size=chunk_size)
    o_r, s_r = recurrent_gated_delta_rule(q, k, v, g, beta, init, output_final_state=True)
    assert o_c.shape == (B, T, 2, 12) and s_c.shape == (B, 2, 8, 12) and s_c.dtype == torch.float32
    # Tolerance: fp32 round-off of two summation orders (observed ~1e-6 at absmax ~1-3).
    torch.testing.assert_close(o_c, o_r, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(s_c, s_r, rtol=1e-5, atol=2e-5)


def test_chunked_continues_from_its_own_state():
    q, k, v, g, beta, _ = make_inputs(1, 150, 2, 8, 8, seed=3)
    whole, s_whole = chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True)
    first, s1 = chunk_gated_delta_rule(q[:, :70], k[:, :70], v[:, :70], g[:, :70], beta[:, :70], output_final_state=True)
    second, s2 = chunk_gated_delta_rule(q[:, 70:], k[:, 70:], v[:, 70:], g[:, 70:], beta[:, 70:], s1, True)
    torch.testing.assert_close(torch.cat([first, second], 1), whole, rtol=1e-5, atol=2e-5)  # fp32 round-off
    torch.testing.assert_close(s2, s_whole, rtol=1e-5, atol=2e-5)


def test_no_final_state_unless_asked():
    q, k, v, g, beta, _ = make_inputs(1, 5, 1, 4, 4, seed=0)
    assert chunk_gated_delta_rule(q, k, v, g, beta)[1] is None
    assert recurrent_gated_delta_rule(q, k, v, g, beta)[1] is None


from transformers.models.qwen3_5 import modeling_qwen3_5 as hf  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T, with_state", [(1, False), (63, True), (64, False), (130, True), (200, False)])
def test_chunked_equals_transformers_540_bitwise(dtype, T, with_state):
    q, k, v, g, beta, state = make_inputs(2, T, 3, 16, 8, seed=T, dtype=dtype, strong_decay=True)
    init = state if with_state else None
    ref_o, ref_s = hf.torch_chunk_gated_delta_rule(
        q, k, v, g=g, beta=beta, initial_state=init, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, init, output_final_state=True)
    assert o.dtype == dtype and s.dtype == torch.float32
    assert torch.equal(o, ref_o)  # tolerance 0: the same ops in the same order
    assert torch.equal(s, ref_s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recurrent_equals_transformers_540_bitwise(dtype):
    q, k, v, g, beta, state = make_inputs(1, 20, 2, 8, 8, seed=5, dtype=dtype)
    ref_o, ref_s = hf.torch_recurrent_gated_delta_rule(q, k, v, g, beta, state, True, use_qk_l2norm_in_kernel=True)
    o, s = recurrent_gated_delta_rule(q, k, v, g, beta, state, True)
    assert torch.equal(o, ref_o) and torch.equal(s, ref_s)


def test_bf16_l2norm_happens_before_the_fp32_cast():
    """5.4.0 normalises q/k in bf16; casting first (5.17+) gives different numbers."""
    q, k, v, g, beta, _ = make_inputs(1, 40, 2, 16, 8, seed=9, dtype=torch.bfloat16)
    o, _ = chunk_gated_delta_rule(q, k, v, g, beta)
    o_cast_first, _ = chunk_gated_delta_rule(q.float(), k.float(), v, g, beta)
    assert not torch.equal(o, o_cast_first.to(torch.bfloat16))
