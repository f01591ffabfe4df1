"""valen_runtime.fused_layers (whole-layer functions) against the module path of qwen35.py.

Same weights (the tiny fixture's exports, LoRA separate and merged), same inputs, one-shot and
prefix-then-batched-suffix runs. The functions compute the same ops; what may differ is the
causal conv (K shifted fp32 products instead of F.conv1d) and, compiled, inductor's fused
rounding. Tolerances at each assert.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from valen_runtime.fast import enable_fast_paths
from valen_runtime.fused_layers import causal_conv_silu, gated_delta_rule_op
from valen_runtime.weights import load_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def pair(export_dir, dtype: str, compile: bool = False, attention: str = "sdpa"):
    reference = load_model(export_dir, dtype=dtype)
    fused = load_model(export_dir, dtype=dtype)
    enabled = enable_fast_paths(fused.text, dtype=fused.dtype, compile=compile, fuse_layers=True, fused_attention=attention)
    assert enabled["layers"].startswith("fused")
    assert all(layer.fused_forward is not None for layer in fused.text.layers)
    return reference.text, fused.text


def inputs(model, batch: int, length: int, start: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    embeds = torch.randn(batch, length, model.config.hidden_size, generator=gen).to(model.embed_tokens.weight.dtype)
    pos = torch.arange(start, start + length).view(1, 1, -1).expand(3, batch, -1).contiguous()
    return embeds, pos


# fp32: only the conv's summation order and the fused projections' scale folding differ, a few
# fp32 ulps per layer that the next layers carry on (observed max 1.5e-5 at |x| ~ 2.5).
FP32 = dict(rtol=1e-4, atol=5e-5)


def close(got, want, dtype):
    if dtype == "fp32":
        torch.testing.assert_close(got, want, **FP32)
    else:
        # bf16: a few-ulp rounding difference in one place can propagate through the layers;
        # the module path itself differs from fp32 by far more (tests/valen_runtime/test_qwen35.py).
        diff = (got.float() - want.float()).abs()
        assert diff.mean() < 0.02 and diff.max() < 0.25, (diff.mean(), diff.max())


@pytest.mark.parametrize("mode", ["separate", "merged"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_one_shot_forward_matches_module_path(tiny_export, mode, dtype):
    reference, fused = pair(tiny_export[mode], dtype)
    embeds, pos = inputs(reference, 2, 37, 0, seed=1)
    close(fused(embeds, pos), reference(embeds, pos), dtype)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_prefix_then_batched_suffixes_match_module_path(tiny_export, dtype, attention):
    reference, fused = pair(tiny_export["separate"], dtype, attention=attention)
    prefix, prefix_pos = inputs(reference, 1, 64, 0, seed=2)
    tails, tails_pos = inputs(reference, 3, 21, 64, seed=3)
    outs = []
    for model in (reference, fused):
        cache = model.new_cache()
        head = model(prefix, prefix_pos, cache)
        outs.append((head, model(tails, tails_pos, cache.expand(3)), cache))
    (ref_head, ref_tail, ref_cache), (head, tail, cache) = outs
    close(head, ref_head, dtype)
    close(tail, ref_tail, dtype)
    for i, kind in enumerate(ref_cache.layer_types):  # the cache the suffix continued from
        pairs = ((cache.conv_states[i], ref_cache.conv_states[i]), (cache.recurrent_states[i], ref_cache.recurrent_states[i])) \
            if kind == "linear_attention" else ((cache.keys[i], ref_cache.keys[i]), (cache.values[i], ref_cache.values[i]))
        for got, want in pairs:
            assert got.shape == want.shape and got.dtype == want.dtype
            close(got, want, dtype)


def test_causal_conv_continues_exactly_like_one_pass():
    gen = torch.Generator().manual_seed(4)
    C, K = 12, 4
    weight = torch.randn(C, 1, K, generator=gen)
    x = torch.randn(2, 30, C, generator=gen)
    conv = torch.nn.functional.conv1d(x.transpose(1, 2), weight, padding=K - 1, groups=C)[:, :, :30]
    want = torch.nn.functional.silu(conv).transpose(1, 2)
    whole, tail = causal_conv_silu(x, torch.zeros(2, C, K - 1), weight)
    torch.testing.assert_close(whole, want, **FP32)
    first, mid = causal_conv_silu(x[:, :11], torch.zeros(2, C, K - 1), weight)
    second, end = causal_conv_silu(x[:, 11:], mid, weight)
    torch.testing.assert_close(torch.cat([first, second], dim=1), want, **FP32)
    assert torch.equal(end, tail) and torch.equal(tail, x[:, -(K - 1):].transpose(1, 2))


def test_delta_rule_op_equals_the_torch_rule_it_wraps():
    from valen_runtime.gated_delta import chunk_gated_delta_rule, l2norm

    gen = torch.Generator().manual_seed(5)
    B, T, H, D = 2, 19, 3, 8
    q, k, v = (torch.randn(B, T, H, D, generator=gen) for _ in range(3))
    q, k = l2norm(q), l2norm(k)
    g, beta = -torch.rand(B, T, H, generator=gen), torch.rand(B, T, H, generator=gen)
    state = torch.randn(B, H, D, D, generator=gen)
    out, final = gated_delta_rule_op(q, k, v, g, beta, state, "torch")
    want_out, want_final = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=False)
    assert torch.equal(out, want_out) and torch.equal(final, want_final)


@pytest.mark.slow
@pytest.mark.skipif(not (shutil.which("c++") or shutil.which("g++")), reason="inductor's CPU backend needs a C++ compiler")
def test_compiled_layers_match_module_path_cpu(tiny_export, roundoff_bound):
    """torch.compile (inductor, C++ on the CPU) of the same functions; fp32.

    Inductor's generated C++ vectorizes and reassociates reductions differently per CPU, so the
    bound is the computation's own fp32 round-off (tests/conftest.py), not a fixed number."""
    reference, fused = pair(tiny_export["separate"], "fp32", compile=True)
    config = reference.config
    widest = max(config.hidden_size, config.intermediate_size)
    for batch, length, seed in ((1, 64, 6), (3, 21, 7)):
        embeds, pos = inputs(reference, batch, length, 0, seed=seed)
        bound = roundoff_bound(lambda x: reference(x, pos), embeds, widest, stages=config.num_hidden_layers)
        diff = (fused(embeds, pos) - reference(embeds, pos)).abs().max().item()
        assert diff <= bound, (diff, bound)


def lora_members(sizes, in_features: int, rank: int, gen, weight_dtype=torch.float32, factor_scale: float = 1.0):
    """LoRALinear projections of one input (PEFT-style FP32 adapters, scale 2) and their fused Projection."""
    from valen_runtime.fast import FusedProjection
    from valen_runtime.fused_layers import projection
    from valen_runtime.qwen35 import LoRALinear, attach_lora

    parent = torch.nn.Module()
    names = [f"m{i}" for i in range(len(sizes))]
    for name, n in zip(names, sizes):
        setattr(parent, name, LoRALinear(in_features, n))
        getattr(parent, name).weight.data = torch.randn(n, in_features, generator=gen).to(weight_dtype)
    adapter = {}
    for name, n in zip(names, sizes):
        adapter[f"{name}.lora_A.weight"] = torch.randn(rank, in_features, generator=gen) * factor_scale
        adapter[f"{name}.lora_B.weight"] = torch.randn(n, rank, generator=gen) * factor_scale
    attach_lora(parent, adapter, 2.0)
    members = [getattr(parent, name) for name in names]
    return members, (FusedProjection(members).projection if len(members) > 1 else projection(members))


@pytest.mark.parametrize("sizes", [[768, 256, 8, 8], [512, 512], [300], [16, 8]])
def test_grouped_lora_projection_equals_separate_lora_linears(sizes):
    """fused_layers.project: wide members cut into equal row blocks for one batched B GEMM, narrow
    trailing members block-diagonal; each output must equal its own PEFT-style LoRALinear."""
    from valen_runtime.fused_layers import project

    gen = torch.Generator().manual_seed(len(sizes))
    members, p = lora_members(sizes, 32, 4, gen)
    x = torch.randn(3, 5, 32, generator=gen)
    want = torch.cat([m(x) for m in members], dim=-1)
    if sizes == [768, 256, 8, 8]:
        assert p.groups == (0, 0, 0, 1) and p.lora_b.shape == (4, 256, 4) and p.lora_b_small.shape == (16, 8)
    torch.testing.assert_close(project(x, p), want, rtol=1e-5, atol=1e-5)  # fp32: scale folding only


def test_bf16x3_split_is_exact_across_magnitudes():
    from valen_runtime.fused_layers import split_bf16x3

    gen = torch.Generator().manual_seed(11)
    t = torch.randn(4096, generator=gen) * torch.exp2(torch.randint(-60, 60, (4096,), generator=gen).float())
    # Exact wherever the pieces stay normal and t1 finite: |t| in [2^-100, 2^127), far beyond any
    # LoRA factor or activation (the top bf16 binade rounds up to inf, the bottom to subnormals).
    t = torch.cat([t, torch.tensor([0.0, -0.0, 1.0, -3.0, 1 + 2**-23, -(1 - 2**-24), 2**-100, 2.0**126])])
    t1, t2, t3 = split_bf16x3(t)
    assert t1.dtype == t2.dtype == t3.dtype == torch.bfloat16
    assert torch.equal((t1.float() + t2.float()) + t3.float(), t)


@pytest.mark.parametrize("sizes", [[768, 256, 8, 8], [512, 512], [300]])
def test_bf16x3_lora_equals_the_fp32_lora(sizes):
    """lora_gemm="bf16x3": A(x) from exact products of bf16 x and the split A, B(h) from the 8
    exact piece products of the split h and B that reach fp32; only fp32 rounding differs from
    PEFT's fp32 GEMMs. Checked on the delta itself (before the bf16 rounding hides it) and on the output."""
    from valen_runtime.fused_layers import _split_lora_delta, project, split_lora_factors

    gen = torch.Generator().manual_seed(20 + len(sizes))
    members, p = lora_members(sizes, 64, 8, gen, weight_dtype=torch.bfloat16, factor_scale=0.1)
    x = torch.randn(3, 5, 64, generator=gen).to(torch.bfloat16)
    split = split_lora_factors(p)
    assert split.lora_a.dtype == torch.bfloat16 and split.lora_a.shape[0] == 3 * p.lora_a.shape[0]
    # PEFT's fp32 delta B(A(x)) * scale and the split one, both measured against fp64: the split
    # must be as accurate as fp32 GEMMs (they differ from each other by fp32 summation order).
    want_delta = torch.cat([m.lora_B(m.lora_A(x.float())) * m.lora_scale for m in members], dim=-1)
    exact = torch.cat([(x.double() @ m.lora_A.weight.double().T) @ m.lora_B.weight.double().T * m.lora_scale
                       for m in members], dim=-1)
    got_delta = _split_lora_delta(x, split)
    assert got_delta.dtype == torch.float32
    err_split, err_fp32 = (got_delta.double() - exact).abs(), (want_delta.double() - exact).abs()
    assert err_split.max() <= 2 * err_fp32.max(), (err_split.max(), err_fp32.max())
    assert err_split.mean() <= 2 * err_fp32.mean(), (err_split.mean(), err_fp32.mean())
    # After the one rounding to bf16 the outputs agree except where the delta sits on a tie.
    want = torch.cat([m(x) for m in members], dim=-1)
    got = project(x, split)
    assert got.dtype == torch.bfloat16
    assert (got != want).float().mean() < 0.01
    torch.testing.assert_close(got.float(), want.float(), rtol=8e-3, atol=0)


def test_bf16x3_lora_in_fused_layers_matches_module_path(tiny_export):
    reference = load_model(tiny_export["separate"], dtype="bf16")
    fused = load_model(tiny_export["separate"], dtype="bf16")
    enabled = enable_fast_paths(fused.text, dtype=fused.dtype, compile=False, lora_gemm="bf16x3")
    assert enabled["lora"].startswith("bf16x3")
    layer = fused.text.layers[0].fused_forward
    assert layer.weights.mlp.down.lora_a.dtype == torch.bfloat16  # single projections split too
    embeds, pos = inputs(reference.text, 2, 37, 0, seed=5)
    close(fused.text(embeds, pos), reference.text(embeds, pos), "bf16")


def test_bf16x3_lora_is_refused_for_fp32_models(tiny_export):
    fused = load_model(tiny_export["separate"], dtype="fp32")
    with pytest.raises(ValueError, match="needs a bf16 model"):
        enable_fast_paths(fused.text, dtype=fused.dtype, compile=False, lora_gemm="bf16x3")


def test_packed_conv_and_delta_rule_equal_per_sequence_runs():
    """The packed forms against the batched ones, one sequence at a time, all from one history."""
    from valen_runtime.fused_layers import causal_conv_silu_packed, gated_delta_rule_varlen_op
    from valen_runtime.gated_delta import l2norm

    gen = torch.Generator().manual_seed(8)
    C, K, H, D = 6, 4, 2, 8
    lengths = [5, 1, 70, 3]
    T = sum(lengths)
    weight = torch.randn(C, 1, K, generator=gen)
    prev = torch.randn(1, C, K - 1, generator=gen)
    mixed = torch.randn(1, T, C, generator=gen)
    offsets = torch.cat([torch.arange(n) for n in lengths])
    rows = torch.arange(T)
    taps = torch.stack([torch.where(offsets + j >= K - 1, rows + j, offsets + j) for j in range(K)])
    packed = causal_conv_silu_packed(mixed, prev, weight, taps)
    q, k = (l2norm(torch.randn(1, T, H, D, generator=gen)) for _ in range(2))
    v = torch.randn(1, T, H, D, generator=gen)
    g, beta = -torch.rand(1, T, H, generator=gen), torch.rand(1, T, H, generator=gen)
    state = torch.randn(1, H, D, D, generator=gen)
    cu = torch.tensor([0, 5, 6, 76, 79])
    out = gated_delta_rule_varlen_op(q, k, v, g, beta, state.expand(4, -1, -1, -1).contiguous(), cu, torch.zeros(0, 2, dtype=torch.long), "torch")
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        want, _ = causal_conv_silu(mixed[:, start:end], prev, weight)
        # Same products in the same order; vectorised kernels may fuse a multiply-add differently (1 ulp).
        torch.testing.assert_close(packed[:, start:end], want, rtol=1e-6, atol=1e-7)
        from valen_runtime.gated_delta import chunk_gated_delta_rule

        want_o, _ = chunk_gated_delta_rule(q[:, start:end], k[:, start:end], v[:, start:end], g[:, start:end], beta[:, start:end],
                                           initial_state=state, use_qk_l2norm_in_kernel=False)
        assert torch.equal(out[:, start:end], want_o)
