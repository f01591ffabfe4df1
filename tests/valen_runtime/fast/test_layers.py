"""valen_runtime.fast.layers against the reference modules, one decoder layer at a time.

Each layer of the tiny fixture's exports (LoRA separate and merged) gets fresh random inputs and
runs twice: through `qwen35.DecoderLayer.forward` and through the fast model's layer function on
the same weights, first as a 64-token prefix from an empty cache, then as a batch of 3 suffixes
continuing the expanded cache. Outputs and the cache entries each writes must agree within the
rounding the fast formulation moves (declared at each assert). The causal conv, the one piece
written differently, is checked against F.conv1d directly.
"""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from valen_runtime.fast.layers import causal_conv_silu, causal_conv_silu_taps
from valen_runtime.fast.model import FastModel
from valen_runtime.layouts import packed_indices
from valen_runtime.options import EngineOptions
from valen_runtime.qwen35 import causal_mask
from valen_runtime.weights import load_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def fast_options(model, compile: bool) -> EngineOptions:
    dtype = {torch.float32: "fp32", torch.bfloat16: "bf16"}[model.dtype]
    return EngineOptions(device=model.device.type, dtype=dtype, mode="shared-prefix", kernels="fast", compile=compile)


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def random_rows(model, batch: int, length: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, length, model.config.hidden_size, generator=gen).to(model.embed_tokens.weight.dtype)


def rope(model, x, start: int):
    B, T, _ = x.shape
    pos = torch.arange(start, start + T).view(1, 1, -1).expand(3, B, -1).contiguous()
    return model.rotary_emb(x, pos)


# The longest chain of fp32 roundings one layer output goes through on the tiny fixture: the delta
# rule's per-token update over the 64-token prefix (Dk = 16, plus decay, gate and add), a chunk's
# intra-chunk sum and a value-wide read (tests/valen_runtime/test_gated_delta.py), then the
# projections' reductions (the 128-wide MLP, the LoRA's rank and the scale).
FP32_CHAIN = 64 * (16 + 3) + 64 + 16 + 128 + 32 + 2


def assert_layer_close(got: torch.Tensor, want: torch.Tensor, dtype: str, what: str) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, what
    diff = (got.float() - want.float()).abs()
    scale = want.float().abs().max().item()
    if dtype == "fp32":
        # The conv's and the grouped LoRA's summation order and the scale folded into B: two
        # fp32 evaluations of one layer differ by at most twice gamma_n of the output's magnitude
        # (n = FP32_CHAIN); on average by the probabilistic sqrt(n) * u (Higham & Mary, 2019).
        u = 2.0**-24
        bound_max = 2 * FP32_CHAIN * u / (1 - FP32_CHAIN * u) * scale
        bound_mean = 2 * FP32_CHAIN**0.5 * u * scale
    else:
        # bf16: SDPA keeps the scores and probabilities in fp32 where the reference rounds them
        # to bf16 (the GDN layers come out bitwise equal); a flipped rounding is one bf16 ulp
        # (2^-7 relative), and a flip in an intermediate plus one in the output is two. Flips
        # are sparse: on average under one ulp of the largest value.
        bound_max, bound_mean = 2**-6 * scale, 2**-8 * scale
    assert diff.max().item() <= bound_max and diff.mean().item() <= bound_mean, (what, diff.max().item(), diff.mean().item(), scale)


@pytest.mark.parametrize("lora", ["separate", "merged"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_every_layer_matches_its_reference_module(tiny_export, lora, dtype):
    model = load_model(tiny_export[lora], dtype=dtype)
    reference = model.text
    fast = FastModel.build(model, fast_options(model, compile=False)).text
    for i, layer in enumerate(reference.layers):
        prefix, tails = random_rows(reference, 1, 64, seed=10 + i), random_rows(reference, 3, 21, seed=20 + i)
        caches = [reference.new_cache(), fast.new_cache()]
        outs = []
        for run, cache in zip((layer, lambda *a: fast.layer(i, *a)), caches):
            cos, sin = rope(reference, prefix, 0)
            head = run(prefix, cos, sin, causal_mask(64, 0, prefix.dtype, prefix.device), cache)
            cos, sin = rope(reference, tails, 64)
            outs.append((head, run(tails, cos, sin, causal_mask(21, 64, tails.dtype, tails.device), cache.expand(3))))
        for name, got, want in (("prefix", outs[1][0], outs[0][0]), ("suffixes", outs[1][1], outs[0][1])):
            assert_layer_close(got, want, dtype, f"layer {i} ({layer.layer_type}) {name}")
        ref_cache, fast_cache = caches
        entries = ("conv_states", "recurrent_states") if layer.layer_type == "linear_attention" else ("keys", "values")
        for entry in entries:  # what the prefix left for the suffixes
            assert_layer_close(getattr(fast_cache, entry)[i], getattr(ref_cache, entry)[i], dtype, f"layer {i} {entry}")


def test_causal_conv_continues_exactly_like_one_pass():
    gen = torch.Generator().manual_seed(4)
    C, K = 12, 4
    weight = torch.randn(C, 1, K, generator=gen)
    x = torch.randn(2, 30, C, generator=gen)
    want = F.silu(F.conv1d(x.transpose(1, 2), weight, padding=K - 1, groups=C)[:, :, :30]).transpose(1, 2)
    whole, tail = causal_conv_silu(x, torch.zeros(2, C, K - 1), weight)
    torch.testing.assert_close(whole, want, rtol=1e-5, atol=1e-6)  # fp32: K products, summed in another order
    first, mid = causal_conv_silu(x[:, :11], torch.zeros(2, C, K - 1), weight)
    second, end = causal_conv_silu(x[:, 11:], mid, weight)
    # A continuation computes the same products in the same order; vectorised kernels may fuse a
    # multiply-add differently at other lengths (1 ulp).
    torch.testing.assert_close(torch.cat([first, second], dim=1), whole, rtol=1e-6, atol=1e-7)
    assert torch.equal(end, tail) and torch.equal(tail, x[:, -(K - 1):].transpose(1, 2))


def test_tap_indexed_conv_equals_one_conv_per_sequence():
    """Prefixes and continuations packed in one row (as layouts.packed_indices lays them out): the tap
    index reads each sequence's own rows, before its start its prefix's last rows, or zeros."""
    gen = torch.Generator().manual_seed(8)
    C, K = 6, 4
    groups = [(64, [5, 1, 70]), (0, [3, 2]), (128, [1, 9])]  # prefixed, without a prefix, prefixed again
    weight = torch.randn(C, 1, K, generator=gen)
    R = sum(cut + sum(lengths) for cut, lengths in groups)
    mixed = torch.randn(1, R, C, generator=gen)
    index = packed_indices(groups, K)
    taps, cu = index.conv_taps, index.cu_seqlens
    packed = causal_conv_silu_taps(mixed, weight, taps)
    zeros = torch.zeros(1, C, K - 1)
    prefix_ends, row = [], 0
    for cut, _ in groups:
        want, _ = causal_conv_silu(mixed[:, row : row + cut], zeros, weight)
        torch.testing.assert_close(packed[:, row : row + cut], want, rtol=1e-6, atol=1e-7)
        row += cut
        prefix_ends.append(row)
    total_cut, sequence = row, 0
    for (cut, lengths), end in zip(groups, prefix_ends):
        history = mixed[:, end - (K - 1) : end].transpose(1, 2) if cut else zeros  # [1, C, K-1]
        for _ in lengths:
            start, stop = total_cut + cu[sequence].item(), total_cut + cu[sequence + 1].item()
            want, _ = causal_conv_silu(mixed[:, start:stop], history, weight)
            # Same products in the same order; vectorised kernels may fuse a multiply-add differently (1 ulp).
            torch.testing.assert_close(packed[:, start:stop], want, rtol=1e-6, atol=1e-7)
            sequence += 1
    assert sequence == len(cu) - 1


@pytest.mark.inductor
@pytest.mark.slow
@pytest.mark.skipif(not (shutil.which("c++") or shutil.which("g++")), reason="inductor's CPU backend needs a C++ compiler")
def test_compiled_layers_match_the_reference_cpu(tiny_export, roundoff_bound):
    """torch.compile (inductor, C++ on the CPU) of the same layer functions, fp32, the whole stack
    against the reference modules: inductor's fused kernels reorder fp32 sums, nothing more. Its
    generated C++ vectorizes differently per CPU, so the bound is the stack's own fp32 round-off
    at the input (tests/conftest.py), not a number measured on one machine."""
    model = load_model(tiny_export["separate"], dtype="fp32")
    compiled = FastModel.build(model, fast_options(model, compile=True)).text
    config = model.text.config
    widest = max(config.hidden_size, config.intermediate_size)
    for batch, length, seed in ((1, 64, 6), (3, 21, 7)):
        x = random_rows(model.text, batch, length, seed)
        pos = torch.arange(length).view(1, 1, -1).expand(3, batch, -1).contiguous()
        bound = roundoff_bound(lambda inputs: model.text(inputs, pos), x, widest, stages=config.num_hidden_layers)
        diff = (compiled(x, pos) - model.text(x, pos)).abs().max().item()
        assert diff <= bound, (f"batch {batch}, {length} tokens", diff, bound)


@pytest.mark.inductor
@pytest.mark.slow
@pytest.mark.skipif(not (shutil.which("c++") or shutil.which("g++")), reason="inductor's CPU backend needs a C++ compiler")
@pytest.mark.parametrize("emulate_precision_casts", [True, False])
def test_compiled_bf16_layers_equal_the_eager_ones_bit_for_bit(tiny_export, emulate_precision_casts):
    """bf16: every rounding eager makes is written as rounding.cast, so a compiler that keeps fused
    intermediates in fp32 still computes eager's bits (decoder layers and the vision block). Without `emulate_precision_casts` inductor
    keeps them all in fp32 (the CPU's stand-in for what the H200's compiled layers did with it on:
    a GDN layer's conv output differed from eager in a quarter of its elements); with it, as the
    fast path compiles. Both must equal the eager layers exactly."""
    model = load_model(tiny_export["separate"], dtype="bf16")
    text = FastModel.build(model, fast_options(model, compile=False)).text
    fns = text.fns
    options = {"emulate_precision_casts": True} if emulate_precision_casts else {}
    compiled = type(fns)(*(torch.compile(fn, fullgraph=True, options=options) for fn in fns))
    kinds = text.config.layer_types
    gdn, attention = kinds.index("linear_attention"), kinds.index("full_attention")
    x = random_rows(text, 2, 37, seed=8)
    cos, sin = rope(text, x, 0)
    mask = causal_mask(37, 0, x.dtype, x.device)
    conv_zero, state_zero = text._zero_history(2, x)
    K = text.config.linear_conv_kernel_dim
    row = random_rows(text, 1, 64 + 45 + 9, seed=9)  # two requests: a 64-row prefix with two continuations, one without
    index = packed_indices([(64, [20, 25]), (0, [9])], K)
    taps, cu_seqlens, chunk_indices, prefix_rows = index.conv_taps, index.cu_seqlens, index.chunk_indices, index.prefix_rows
    prefix_cu_seqlens, prefix_chunks, initial = index.prefix_cu_seqlens, index.prefix_chunk_indices, index.initial_state_index
    _, one_state = text._zero_history(1, row)
    calls = {
        "gdn": lambda f: f.gdn(x, conv_zero, state_zero, text.layer_weights[gdn]),
        "attention": lambda f: f.attention(x, cos, sin, mask, None, None, text.layer_weights[attention]),
        "gdn one-pass": lambda f: f.gdn_one_pass(row, one_state, taps, prefix_rows, prefix_cu_seqlens, prefix_chunks,
                                                 cu_seqlens, chunk_indices, initial, text.layer_weights[gdn]),
    }
    from valen_runtime.fast.model import vision_block

    grids = [(1, 6, 8)]  # one frame of 48 patches (6 x 8: not square)
    _, vcos, vsin = model.vision.grid_tables(grids)
    patches = torch.randn(48, model.vision.config.hidden_size, generator=torch.Generator().manual_seed(12)).to(x.dtype)
    compiled_block = torch.compile(vision_block, fullgraph=True, options=options)
    calls["vision block"] = lambda f: (vision_block if f is fns else compiled_block)(model.vision.blocks[0], patches, [48], vcos, vsin)
    for name, call in calls.items():
        want, got = call(fns), call(compiled)
        for i, (w, g) in enumerate(zip(want if isinstance(want, tuple) else (want,), got if isinstance(got, tuple) else (got,))):
            if w is not None:
                assert torch.equal(w, g), (name, i, (w.float() - g.float()).abs().max().item(), (w != g).float().mean().item())
