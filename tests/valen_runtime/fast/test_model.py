"""valen_runtime.fast.model end to end against the reference modules it is built from.

The text stack on the tiny fixture's exports (one-shot, a prefix continued by a batch of
suffixes, the one-pass layout against one reference forward per sequence) and the vision tower
(SDPA, the GEMM patch embed, compiled blocks). fp32 must agree to round-off; bf16 differs by
rounding at other places, so there both bf16 paths are measured against the fp32 reference and
the fast one must be about as accurate (two bf16 computations are no yardstick for each other).
"""

from __future__ import annotations

import shutil

import pytest
import torch

from valen_runtime.fast.model import FastModel
from valen_runtime.layouts import packed_indices
from valen_runtime.options import EngineOptions, patch_gemm_matches_conv
from valen_runtime.weights import load_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def build_fast(model, compile: bool):
    """The fast model as an engine with kernels="fast" on this model's device and dtype builds it."""
    dtype = {torch.float32: "fp32", torch.bfloat16: "bf16"}[model.dtype]
    return FastModel.build(model, EngineOptions(device=model.device.type, dtype=dtype, mode="shared-prefix", kernels="fast", compile=compile))


def positions(batch: int, start: int, length: int, device="cpu") -> torch.Tensor:
    return torch.arange(start, start + length, device=device).view(1, 1, -1).expand(3, batch, -1).contiguous()


def random_rows(hidden: int, batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randn(batch, length, hidden, generator=torch.Generator().manual_seed(seed))


def assert_fp32_close(got: torch.Tensor, want: torch.Tensor, bound: float) -> None:
    """Summation order only: within `bound`, the reference's own fp32 round-off at these inputs
    (tests/conftest.py `roundoff_bound`: how much the stack passes on of one rounding per stage)."""
    diff = (got - want).abs().max().item()
    assert diff <= bound, (diff, bound)


def text_stack_bound(roundoff_bound, text, fn, x) -> float:
    """roundoff_bound for a text-stack computation fn(x): a stage per layer, the widest reduction."""
    cfg = text.config
    return roundoff_bound(fn, x, max(cfg.hidden_size, cfg.intermediate_size), stages=cfg.num_hidden_layers)


def assert_as_accurate(got: torch.Tensor, want: torch.Tensor, truth: torch.Tensor, slack_mean: float = 1e-3, slack_max: float = 1e-2) -> None:
    """The fast bf16 result about as accurate as the reference bf16 one, both against fp32 truth:
    mean error within 1.5x and max error within 2x of the reference's (plus a slack of a small
    fraction of a bf16 ulp at the outputs' magnitude, for errors that are both near zero)."""
    err_ref, err_fast = (want.float() - truth).abs(), (got.float() - truth).abs()
    assert err_fast.mean() <= 1.5 * err_ref.mean() + slack_mean, (err_fast.mean(), err_ref.mean())
    assert err_fast.max() <= 2 * err_ref.max() + slack_max, (err_fast.max(), err_ref.max())


def text_runs(text, prefix: torch.Tensor, tails: torch.Tensor) -> list[torch.Tensor]:
    """One-shot over the prefix, then the tails continuing its cache (expanded to their batch)."""
    dtype = text.embed_tokens.weight.dtype
    device = text.embed_tokens.weight.device
    prefix, tails = prefix.to(device, dtype), tails.to(device, dtype)
    cache = text.new_cache()
    head = text(prefix, positions(1, 0, prefix.shape[1], device), cache)
    tail = text(tails, positions(tails.shape[0], prefix.shape[1], tails.shape[1], device), cache.expand(tails.shape[0]))
    return [head.float().cpu(), tail.float().cpu()]


@pytest.mark.parametrize("lora", ["separate", "merged"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_text_matches_the_reference_one_shot_and_continued(tiny_export, lora, dtype, roundoff_bound):
    model = load_model(tiny_export[lora], dtype=dtype)
    fast = build_fast(model, compile=False)
    assert fast.kernels["layers"] == "fused, eager" and fast.kernels["gated_delta"] == "torch"
    H = model.config.text_config.hidden_size
    prefix, tails = random_rows(H, 1, 64, seed=2), random_rows(H, 3, 21, seed=3)
    want, got = text_runs(model.text, prefix, tails), text_runs(fast.text, prefix, tails)
    if dtype == "fp32":
        flat = lambda p: torch.cat([o.reshape(-1) for o in text_runs(model.text, p, tails)])  # noqa: E731
        bound = text_stack_bound(roundoff_bound, model.text, flat, prefix)
        for g, w in zip(got, want):
            assert_fp32_close(g, w, bound)
    else:
        truth = text_runs(load_model(tiny_export[lora], dtype="fp32").text, prefix, tails)
        for g, w, t in zip(got, want, truth):
            assert_as_accurate(g, w, t)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_one_pass_equals_one_reference_forward_per_sequence(tiny_export, dtype, roundoff_bound):
    """[prefix | three continuations] in one sweep against the reference run once per sequence on
    prefix + continuation from position 0 (chunks line up: the prefix is 64 tokens)."""
    model = load_model(tiny_export["separate"], dtype=dtype)
    fast = build_fast(model, compile=False)
    cfg = model.config.text_config
    P, lengths = 64, [21, 5, 13]
    prefix = random_rows(cfg.hidden_size, 1, P, seed=4)
    conts = [random_rows(cfg.hidden_size, 1, n, seed=5 + n) for n in lengths]
    layout = packed_indices([(P, lengths)], cfg.linear_conv_kernel_dim)
    rows = torch.cat([prefix, *conts], dim=1)
    rows_pos = torch.cat([positions(1, 0, P)] + [positions(1, P, n) for n in lengths], dim=2)
    wdtype = model.text.embed_tokens.weight.dtype

    def per_sequence(text, prefix=prefix):
        dtype = text.embed_tokens.weight.dtype
        outs = [text(torch.cat([prefix, c], dim=1).to(dtype), positions(1, 0, P + c.shape[1])).float() for c in conts]
        return torch.cat([outs[0][:, :P]] + [o[:, P:] for o in outs], dim=1)  # rows in the one-pass order

    got = fast.text.one_pass(rows.to(wdtype), rows_pos, layout).float()
    want = per_sequence(model.text)
    if dtype == "fp32":
        assert_fp32_close(got, want, text_stack_bound(roundoff_bound, model.text, lambda p: per_sequence(model.text, p), prefix))
    else:
        assert_as_accurate(got, want, per_sequence(load_model(tiny_export["separate"], dtype="fp32").text))


GROUPS = [(64, [21, 5]), (0, [13, 9]), (128, [7, 30])]  # (prefix rows, continuation lengths) per request


def several_requests_rows(groups, seed: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random rows [1, R, H] in the one-pass order (prefixes, then every continuation) and their
    positions [3, 1, R] (a prefix from 0, its continuations from the prefix's end)."""
    R = sum(cut + sum(lengths) for cut, lengths in groups)
    rows = random_rows(hidden, 1, R, seed)
    pos = [positions(1, 0, cut) for cut, _ in groups] + [positions(1, cut, n) for cut, lengths in groups for n in lengths]
    return rows, torch.cat(pos, dim=2)


def per_sequence_of_groups(text, rows: torch.Tensor, groups) -> torch.Tensor:
    """The reference run once per sequence (its request's prefix + the continuation, from position 0)
    on the rows of `several_requests_rows`; hidden states put back in the one-pass order."""
    dtype = text.embed_tokens.weight.dtype
    starts, row = [], 0
    for cut, _ in groups:
        starts.append(row)
        row += cut
    prefix_out, cont_out = [], []
    for (cut, lengths), start in zip(groups, starts):
        prefix = rows[:, start : start + cut]
        for k, n in enumerate(lengths):
            seq = torch.cat([prefix, rows[:, row : row + n]], dim=1)
            out = text(seq.to(dtype), positions(1, 0, cut + n)).float()
            if k == 0:
                prefix_out.append(out[:, :cut])
            cont_out.append(out[:, cut:])
            row += n
    return torch.cat(prefix_out + cont_out, dim=1)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_one_pass_of_several_requests_equals_one_reference_forward_per_sequence(tiny_export, dtype, roundoff_bound):
    """Three requests' rows in one sweep (prefixes of 64 and 128 rows, and one request with none)
    against the reference run once per sequence, every row compared (the first rows of each
    continuation are where a wrong prefix state, conv history or mask would show)."""
    model = load_model(tiny_export["separate"], dtype=dtype)
    fast = build_fast(model, compile=False)
    cfg = model.config.text_config
    rows, rows_pos = several_requests_rows(GROUPS, seed=21, hidden=cfg.hidden_size)
    layout = packed_indices(GROUPS, cfg.linear_conv_kernel_dim)
    got = fast.text.one_pass(rows.to(model.text.embed_tokens.weight.dtype), rows_pos, layout).float()
    want = per_sequence_of_groups(model.text, rows, GROUPS)
    if dtype == "fp32":
        bound = text_stack_bound(roundoff_bound, model.text, lambda r: per_sequence_of_groups(model.text, r, GROUPS), rows)
        assert_fp32_close(got, want, bound)
    else:
        assert_as_accurate(got, want, per_sequence_of_groups(load_model(tiny_export["separate"], dtype="fp32").text, rows, GROUPS))


def vision_inputs(model, grids, seed: int):
    from valen_runtime.vision import frame_lengths

    cfg = model.config.vision_config
    n = sum(t * h * w for t, h, w in grids)
    pixels = torch.randn(n, cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size**2, generator=torch.Generator().manual_seed(seed))
    return pixels, torch.tensor(grids), frame_lengths(grids)


# Image grids, and a video's (t = 4 frame pairs: long_video_request's grid).
GRIDS = ([[1, 4, 4]], [[1, 6, 10], [2, 2, 4]], [[1, 12, 12]], [[4, 4, 6]])


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_vision_matches_the_reference(tiny_export, dtype, roundoff_bound):
    model = load_model(tiny_export["separate"], dtype=dtype)
    fast = build_fast(model, compile=False)
    assert fast.vision.patch_gemm  # on the CPU the GEMM has the conv's products
    truth = load_model(tiny_export["separate"], dtype="fp32").vision if dtype == "bf16" else None
    for seed, grids in enumerate(GRIDS):
        pixels, grid, _ = vision_inputs(model, grids, seed)
        want, got = model.vision(pixels, grid).float(), fast.vision(pixels, grid).float()
        if dtype == "fp32":
            cfg = model.vision.config
            assert_fp32_close(got, want, roundoff_bound(lambda p: model.vision(p, grid).float(), pixels, cfg.intermediate_size, stages=cfg.depth))
        else:
            assert_as_accurate(got, want, truth(pixels, grid))


def test_patch_embed_gemm_matches_the_conv(tiny_export):
    """The Conv3d (kernel = stride) as one GEMM: the same products, summed in another order (fp32)."""
    model = load_model(tiny_export["separate"], dtype="fp32")
    fast = build_fast(model, compile=False)
    pixels, _, _ = vision_inputs(model, [[1, 4, 6]], seed=9)
    torch.testing.assert_close(fast.vision.patch_embed(pixels), model.vision.patch_embed(pixels), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("allow_tf32", [True, False])
def test_patch_gemm_only_where_it_computes_what_the_conv_does(monkeypatch, allow_tf32):
    # cuDNN runs fp32 convolutions in TF32 unless told not to (the reference keeps torch's
    # default); our GEMMs never do. Every other combination has the conv's exact products.
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", allow_tf32)
    assert patch_gemm_matches_conv("fp32", "cuda") is (not allow_tf32)
    assert patch_gemm_matches_conv("bf16", "cuda:1") and patch_gemm_matches_conv("fp32", "cpu")
    # and it is the fast path's default (resolving options needs no GPU)
    fast_fp32_cuda = EngineOptions(device="cuda", dtype="fp32", mode="shared-prefix", kernels="fast", compile=False, graphs=False)
    assert fast_fp32_cuda.patch_embed == ("conv" if allow_tf32 else "linear")


@pytest.mark.inductor
@pytest.mark.slow
@pytest.mark.skipif(not (shutil.which("c++") or shutil.which("g++")), reason="inductor's CPU backend needs a C++ compiler")
def test_compiled_vision_blocks_match_the_reference_cpu(tiny_export, roundoff_bound):
    """One torch.compile'd block function for all blocks (inductor, C++ on the CPU), fp32: fused
    kernels reorder fp32 sums only, differently per CPU, so the bound is the tower's own fp32
    round-off (tests/conftest.py: a stage per block, the MLP's reduction the widest)."""
    model = load_model(tiny_export["separate"], dtype="fp32")
    fast = build_fast(model, compile=True)
    config = model.vision.config
    for seed, grids in enumerate(GRIDS[:2]):
        pixels, grid, _ = vision_inputs(model, grids, seed)
        bound = roundoff_bound(lambda p: model.vision(p, grid), pixels, config.intermediate_size, stages=config.depth)
        assert (fast.vision(pixels, grid) - model.vision(pixels, grid)).abs().max().item() <= bound


@pytest.mark.gpu
@pytest.mark.parametrize(
    "dtype, compile",
    # Compiled bf16 is judged by the truth-relative criterion (test_cached_continuation_... below):
    # its hidden states on a cached continuation are further from fp32 than the reference's.
    [("fp32", True), ("bf16", False)],
)
def test_text_matches_the_reference_cuda(tiny_export, dtype, compile, roundoff_bound):
    """The fast text stack on CUDA (eager, or torch.compile'd: inductor, Triton; fla-core in bf16)
    against the reference modules on CUDA: a prefix, then a batch of suffixes on its cache."""
    model = load_model(tiny_export["separate"], device="cuda", dtype=dtype)
    fast = build_fast(model, compile=compile)
    assert fast.kernels["layers"] == ("fused, torch.compile" if compile else "fused, eager")
    gen, H = torch.Generator().manual_seed(4), model.config.text_config.hidden_size
    prefix, tails = torch.randn(1, 64, H, generator=gen), torch.randn(3, 21, H, generator=gen)
    want, got = text_runs(model.text, prefix, tails), text_runs(fast.text, prefix, tails)
    if dtype == "fp32":  # summation order only (TF32 off): the stack's own fp32 round-off (tests/conftest.py)
        config = model.text.config
        flat = lambda p: torch.cat([o.reshape(-1) for o in text_runs(model.text, p, tails)])  # noqa: E731
        bound = roundoff_bound(flat, prefix.to("cuda"), max(config.hidden_size, config.intermediate_size), stages=config.num_hidden_layers)
        for g, w in zip(got, want):
            assert (g - w).abs().max().item() <= bound, (g - w).abs().max()
    else:
        truth = text_runs(load_model(tiny_export["separate"], device="cuda", dtype="fp32").text, prefix, tails)
        for g, w, t in zip(got, want, truth):
            assert_as_accurate(g, w, t)


def _truth_relative(got: list[list[float]], reference: list[list[float]], truth: list[list[float]]) -> None:
    """The parity gate's truth-relative rule with the declared a and b (manifests/tolerances.json):
    per option |p - p_truth| <= a * E + b, E the bf16 reference-shaped path's largest error."""
    from parity.tolerances import load, select

    gate = select(load(), "separate", "bf16", "cuda", "shared-prefix")
    scale = max(abs(r - t) for rq, tq in zip(reference, truth) for r, t in zip(rq, tq))
    bound = gate["a"] * scale + gate["b"]
    worst = max(abs(g - t) for gq, tq in zip(got, truth) for g, t in zip(gq, tq))
    print(f"truth-relative: worst {worst:.3g} <= bound {bound:.3g} (reference-shaped error {scale:.3g})")
    assert worst <= bound, (worst, bound, scale)


def _continuation_probabilities(text, head, prefix, tails) -> list[list[float]]:
    """A 64-token prefix into a cache, then 3 suffixes of 21 tokens continuing from it (the cache
    the compiled GDN prefix writes is where CUDA lost accuracy); per suffix, Valen's probabilities
    of the head on rows 4, 9, 14, 19 against the last row: [3][4]."""
    from parity.answers import probabilities

    device = prefix.device
    dtype = text.embed_tokens.weight.dtype
    cache = text.new_cache()
    text(prefix.to(dtype), positions(1, 0, 64, device), cache)
    hidden = text(tails.to(dtype), positions(3, 64, 21, device), cache.expand(3))  # [3, 21, H]
    return [probabilities(head.logits(h[[4, 9, 14, 19]], h[-1])) for h in hidden]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_cached_continuation_is_as_accurate_as_the_reference_modules(tiny_export, device):
    """The fast layers (compiled on CUDA, eager on the CPU) on a cached continuation, against the
    fp32 reference modules, judged as the parity gate judges bf16: no worse than the bf16
    reference modules' own error by the declared a and b. (On the H200 the compiled continuation's
    hidden states were 3.7x further from fp32 than the reference's at their maximum; this decides
    whether that reaches the probabilities.)"""
    model = load_model(tiny_export["separate"], device=device, dtype="bf16")
    compile = device == "cuda"
    fast = build_fast(model, compile=compile)
    assert fast.kernels["layers"] == ("fused, torch.compile" if compile else "fused, eager")
    truth = load_model(tiny_export["separate"], device=device, dtype="fp32")
    gen = torch.Generator().manual_seed(4)
    H = truth.text.config.hidden_size
    prefix, tails = torch.randn(1, 64, H, generator=gen).to(device), torch.randn(3, 21, H, generator=gen).to(device)
    head = truth.head  # fp32 in every model
    _truth_relative(_continuation_probabilities(fast.text, head, prefix, tails),
                    _continuation_probabilities(model.text, head, prefix, tails),
                    _continuation_probabilities(truth.text, head, prefix, tails))


@pytest.mark.parametrize("state", ["long_image_request", "long_video_request"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_batch_layout_with_a_cached_prefix_is_as_accurate_as_per_branch(tiny_export, state, device, request):
    """End to end: the batch layout runs the state's chunk-aligned prefix into a cache and every
    branch from it (the fast path, compiled with CUDA graphs on CUDA, where it is fp32's layout);
    its probabilities against per-branch fp32, no worse than per-branch bf16's (the reference's
    shape) by the declared a, b."""
    from parity.answers import probabilities
    from valen_runtime.engine import Engine
    from valen_runtime.options import EngineOptions
    from valen_runtime.layouts import choose

    long_request = request.getfixturevalue(state)  # an image or a video state, longer than one chunk
    export = tiny_export["separate"]
    fast = Engine.load(export, EngineOptions(device=device, dtype="bf16", mode="shared-prefix", kernels="fast"))
    per_branch = Engine.load(export, EngineOptions(device=device, dtype="bf16", mode="per-branch"))
    truth = Engine.load(export, EngineOptions(device=device, dtype="fp32", mode="per-branch"))
    compiled, features = fast.prepare(long_request)
    plan = choose(compiled, fast.model.config, "batch")
    assert plan.kind == "batch" and plan.shape.cut > 0  # a cached prefix of cut > 0 tokens
    for _ in range(2 if device == "cuda" else 1):  # on CUDA the second run replays the captured graph
        got = [probabilities(lg.float().cpu()) for lg in fast.execute_plan(compiled, plan, features)]
    probs = lambda engine: [probabilities(lg) for lg in engine.run(long_request).logits]  # noqa: E731
    _truth_relative(got, probs(per_branch), probs(truth))
