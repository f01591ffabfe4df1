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
    # Both fp32 forms against an fp64 evaluation of the definition, each within gamma_n *
    # max|truth|, n the longest chain of roundings one output goes through: every token's update
    # (a length-Dk product plus decay, gate and add) carried forward by a state map of norm <= 1
    # (decay <= 1, q/k unit length, beta in [0, 1]), then a chunk's intra-chunk sum and a Dv-wide read.
    o_64, s_64 = fp64_delta_rule(q, k, v, g, beta, init)
    bound = delta_rule_bound(T, chunk_size, q.shape[-1], v.shape[-1], o_64, s_64)
    for o, s in ((o_c, s_c), (o_r, s_r)):
        assert (o.double() - o_64).abs().max().item() <= bound
        assert (s.double() - s_64).abs().max().item() <= bound


def delta_rule_bound(T: int, chunk_size: int, Dk: int, Dv: int, o_64: torch.Tensor, s_64: torch.Tensor) -> float:
    n = T * (Dk + 3) + chunk_size + Dv
    return n * 2.0**-24 / (1 - n * 2.0**-24) * max(o_64.abs().max().item(), s_64.abs().max().item())


def fp64_delta_rule(q, k, v, g, beta, initial_state):
    """The gated delta rule in float64, token by token, written from its definition (q and k
    L2-normalised, q scaled by 1/sqrt(Dk)); the truth the fp32 forms are measured against."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) / q.shape[-1] ** 0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    B, T, H, Dk = k.shape
    state = torch.zeros(B, H, Dk, v.shape[-1], dtype=torch.float64) if initial_state is None else initial_state.double().clone()
    out = torch.zeros(B, T, H, v.shape[-1], dtype=torch.float64)
    for t in range(T):
        state = state * g[:, t].exp()[..., None, None]
        delta = (v[:, t] - torch.einsum("bhkv,bhk->bhv", state, k[:, t])) * beta[:, t, :, None]
        state = state + torch.einsum("bhk,bhv->bhkv", k[:, t], delta)
        out[:, t] = torch.einsum("bhkv,bhk->bhv", state, q[:, t])
    return out, state


def test_chunked_continues_from_its_own_state():
    q, k, v, g, beta, _ = make_inputs(1, 150, 2, 8, 8, seed=3)
    whole, s_whole = chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True)
    first, s1 = chunk_gated_delta_rule(q[:, :70], k[:, :70], v[:, :70], g[:, :70], beta[:, :70], output_final_state=True)
    second, s2 = chunk_gated_delta_rule(q[:, 70:], k[:, 70:], v[:, 70:], g[:, 70:], beta[:, 70:], s1, True)
    # Split or whole, both within the chunked form's round-off of the fp64 truth (as above, chunk 64).
    o_64, s_64 = fp64_delta_rule(q, k, v, g, beta, None)
    bound = delta_rule_bound(q.shape[1], 64, q.shape[-1], v.shape[-1], o_64, s_64)
    for o, s in ((torch.cat([first, second], 1), s2), (whole, s_whole)):
        assert (o.double() - o_64).abs().max().item() <= bound
        assert (s.double() - s_64).abs().max().item() <= bound


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
