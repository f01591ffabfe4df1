"""Fast paths against their reference paths: SDPA vs eager attention, FLA vs the chunked torch rule,
CUDA-graph replay vs direct execution, shared-prefix vs per-branch on an export.

CPU-runnable comparisons run everywhere; the CUDA ones are marked `gpu` and run on the GPU machine
(benchmarks/gpu_run.sh). Tolerances are written next to each comparison with the reason.
"""

from __future__ import annotations


import shutil

import pytest
import torch

from valen_runtime.gated_delta import chunk_gated_delta_rule
from valen_runtime.qwen35 import causal_mask, eager_attention


def rand_qkv(B, Hq, Hk, T, S, D, dtype, device="cpu", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(B, Hq, T, D, generator=g).to(device, dtype)
    k = torch.randn(B, Hk, S, D, generator=g).to(device, dtype)
    v = torch.randn(B, Hk, S, D, generator=g).to(device, dtype)
    return q, k, v


@pytest.mark.parametrize("T,past", [(7, 0), (5, 11), (1, 30)])
def test_sdpa_matches_eager_attention_cpu_fp32(T, past):
    from valen_runtime.fast import sdpa_attention

    q, k, v = rand_qkv(2, 4, 1, T, T + past, 32, torch.float32)
    mask = causal_mask(T, past, torch.float32, torch.device("cpu"))
    ref = eager_attention(q, k, v, mask, 32**-0.5)
    out = sdpa_attention(q, k, v, mask, 32**-0.5)
    # fp32: only summation order differs
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_projection_matches_separate_lora_linears(dtype):
    from valen_runtime.fast import FusedProjection
    from valen_runtime.qwen35 import LoRALinear, attach_lora

    g = torch.Generator().manual_seed(1)
    parent = torch.nn.Module()
    parent.a, parent.b = LoRALinear(32, 48), LoRALinear(32, 8)
    for m in (parent.a, parent.b):
        m.weight.data = torch.randn(m.out_features, 32, generator=g).to(dtype)
    attach_lora(parent, {n: torch.randn(s, generator=g) for n, s in {"a.lora_A.weight": (4, 32), "a.lora_B.weight": (48, 4), "b.lora_A.weight": (4, 32), "b.lora_B.weight": (8, 4)}.items()}, 2.0)
    x = torch.randn(3, 5, 32, generator=g).to(dtype)
    want = [parent.a(x), parent.b(x)]
    fused = FusedProjection([parent.a, parent.b])
    got = fused(x)
    assert parent.a.weight.data_ptr() == fused.weight.data_ptr()  # members are views, no second copy
    for w, o in zip(want, got):
        # fp32: the scale is folded into B (a few fp32 roundings move); bf16: one bf16 ulp
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
        torch.testing.assert_close(o, w, **tol)


def test_engine_rejects_graphs_on_cpu(tiny_export):
    from valen_runtime.compile import Compiler
    from valen_runtime.engine import Engine
    from valen_runtime.weights import load_model

    model = load_model(tiny_export["separate"], device="cpu", dtype="fp32")
    compiler = Compiler.from_dir(tiny_export["separate"])
    with pytest.raises(ValueError, match="CUDA graphs"):
        Engine(model, compiler, mode="shared-prefix", graphs=True)


REQUEST = {
    "model": "valen-preview-0923",
    "state": "The card was charged twice for one order.",
    "questions": {
        "q": {"type": "choice", "instructions": "What next?", "criteria": {"refund": "Refund it", "wait": "Wait", "escalate": "Escalate"}},
        "n": {"type": "noul", "instructions": "Is it a duplicate?"},
        "s": {"type": "score", "instructions": "How urgent?", "criteria": ["low", "medium", "high"]},
    },
}


def _png_data_url(width: int, height: int) -> str:
    import base64
    import io

    from PIL import Image

    img = Image.new("RGB", (width, height))
    img.putdata([((x * 7) % 256, (y * 3) % 256, (x * y) % 256) for y in range(height) for x in range(width)])
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


# An image and a state longer than one 64-token chunk: exercises the vision graph and the
# prefix + suffix phases (REQUEST's short state runs as one batched forward).
REQUEST_IMAGE_LONG = {
    "model": "valen-preview-0923",
    "state": {"messages": [{"role": "user", "content": [
        {"type": "image", "image": _png_data_url(96, 64)},
        {"type": "text", "text": " ".join(["the order was charged twice and the customer asked for a refund"] * 8)},
    ]}]},
    "questions": REQUEST["questions"],
}


def test_shared_prefix_equals_per_branch_fp32_cpu(tiny_export):
    """Exact in real arithmetic; fp32 rounding only (chunk boundaries and batching move)."""
    from valen_runtime.engine import Engine

    per_branch = Engine.load(tiny_export["separate"], device="cpu", dtype="fp32", mode="per-branch")
    shared_prefix = Engine.load(tiny_export["separate"], device="cpu", dtype="fp32", mode="shared-prefix")
    for request in (REQUEST, REQUEST_IMAGE_LONG):
        per, shared = per_branch.run(request), shared_prefix.run(request)
        for a, b in zip(per.logits, shared.logits):
            torch.testing.assert_close(b, a, rtol=0, atol=2e-5)
        assert per.response["usage"] == shared.response["usage"]
    assert len(shared_prefix.compiler.compile(REQUEST_IMAGE_LONG).state.input_ids) > 64  # a prefix phase ran


gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("T", [1, 37, 64, 200])
@pytest.mark.parametrize("with_state", [False, True])
def test_fla_rule_matches_torch_chunk_rule(T, with_state):
    from valen_runtime.fast import fla_available, fla_chunk_gated_delta_rule

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


@gpu
def test_cuda_paths_agree_with_per_branch(tiny_export):
    """On CUDA: per-branch (faithful torch) vs shared-prefix torch / fast / fast+graphs, fp32 and bf16."""
    from valen_runtime.engine import Engine

    for dtype, atol in (("fp32", 1e-3), ("bf16", 0.15)):
        per_branch = Engine.load(tiny_export["separate"], device="cuda", dtype=dtype, mode="per-branch")
        bases = [per_branch.run(r) for r in (REQUEST, REQUEST_IMAGE_LONG)]
        for kernels, graphs in (("torch", False), ("fast", False), ("fast", True)):
            eng = Engine.load(tiny_export["separate"], device="cuda", dtype=dtype, mode="shared-prefix", kernels=kernels, graphs=graphs)
            for request, base in zip((REQUEST, REQUEST_IMAGE_LONG), bases):
                for _ in range(3):  # graphs: capture on the first call, replay after
                    res = eng.run(request)
                for a, b in zip(base.logits, res.logits):
                    # fp32: FLA/SDPA/fused layers reorder sums (TF32 off); bf16: per-branch vs
                    # shared-prefix chunking and the fused layers' rounding
                    assert (a - b).abs().max().item() <= atol, (dtype, kernels, graphs, a, b)


def one_pass_accuracy(export, device: str, compile: bool) -> None:
    """The one-pass layout in bf16 must be about as accurate as the reference-shaped per-branch
    path in bf16, both measured against per-branch fp32 (two bf16 computations differ by their
    rounding, so neither is the yardstick for the other)."""
    from valen_runtime.engine import Engine

    truth = Engine.load(export, device=device, dtype="fp32", mode="per-branch")
    reference_shaped = Engine.load(export, device=device, dtype="bf16", mode="per-branch")
    one_pass = Engine.load(export, device=device, dtype="bf16", mode="shared-prefix", kernels="fast", layout="one-pass", compile=compile)
    assert one_pass._plan(one_pass.compiler.compile(REQUEST_IMAGE_LONG)).kind == "one-pass"
    for _ in range(2):  # on CUDA the second run replays the captured graph
        got = torch.cat(one_pass.run(REQUEST_IMAGE_LONG).logits)
    want, base = torch.cat(truth.run(REQUEST_IMAGE_LONG).logits), torch.cat(reference_shaped.run(REQUEST_IMAGE_LONG).logits)
    err_ref, err_fast = (base - want).abs(), (got - want).abs()
    assert err_fast.mean() <= 1.5 * err_ref.mean() + 1e-2, (err_fast, err_ref)
    assert err_fast.max() <= 2 * err_ref.max() + 2e-2, (err_fast, err_ref)


def test_one_pass_is_as_accurate_as_per_branch_cpu(tiny_export):
    one_pass_accuracy(tiny_export["separate"], "cpu", compile=False)


@gpu
def test_compiled_one_pass_is_as_accurate_as_per_branch_cuda(tiny_export):
    # The default layout passes no cache between compiled calls; whether that keeps it clear of the
    # compiled-continuation loss above had not been measured directly (docs/parity.md).
    one_pass_accuracy(tiny_export["separate"], "cuda", compile=True)


@gpu
def test_graph_replay_is_bitwise_equal_to_direct_execution(tiny_export):
    from valen_runtime.engine import Engine

    direct = Engine.load(tiny_export["separate"], device="cuda", dtype="bf16", mode="shared-prefix", kernels="fast", graphs=False)
    graphed = Engine.load(tiny_export["separate"], device="cuda", dtype="bf16", mode="shared-prefix", kernels="fast", graphs=True)
    for request in (REQUEST, REQUEST_IMAGE_LONG):
        want = direct.run(request).logits
        for _ in range(3):
            got = graphed.run(request).logits
            for a, b in zip(want, got):
                assert torch.equal(a, b)
    captured = len(graphed.graphs)
    assert captured == 3  # REQUEST's forward, the vision tower, REQUEST_IMAGE_LONG's forward
    graphed.run(REQUEST)
    graphed.run(REQUEST_IMAGE_LONG)
    assert len(graphed.graphs) == captured  # the same shapes replay, nothing new is captured


@pytest.mark.parametrize("allow_tf32", [True, False])
def test_patch_gemm_only_where_it_computes_what_the_conv_does(monkeypatch, allow_tf32):
    # cuDNN runs fp32 convolutions in TF32 unless told not to (the reference keeps torch's
    # default); our GEMMs never do. Every other combination has the conv's exact products.
    from valen_runtime.fast import patch_gemm_matches_conv

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", allow_tf32)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert patch_gemm_matches_conv(torch.float32, cuda) is (not allow_tf32)
    assert patch_gemm_matches_conv(torch.bfloat16, cuda) and patch_gemm_matches_conv(torch.float32, cpu)


@gpu
def test_patchify_on_cuda_is_bitwise_equal_to_cpu():
    from valen_runtime.image import ImageConfig, patchify

    gen = torch.Generator().manual_seed(3)
    batch = torch.randint(0, 256, (1, 3, 64, 96), generator=gen, dtype=torch.uint8)
    config = ImageConfig()
    assert torch.equal(patchify(batch.cuda(), config).pixel_values.cpu(), patchify(batch, config).pixel_values)


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


def _continuation_probabilities(model, head, prefix, tails) -> list[list[float]]:
    """A 64-token prefix into a cache, then 3 suffixes of 21 tokens continuing from it (the cache
    the compiled GDN prefix writes is where CUDA lost accuracy); per suffix, Valen's probabilities
    of the head on rows 4, 9, 14, 19 against the last row: [3][4]."""
    from parity.answers import probabilities

    device = prefix.device
    pos = lambda b, start, n: torch.arange(start, start + n, device=device).view(1, 1, -1).expand(3, b, -1).contiguous()  # noqa: E731
    dtype = model.embed_tokens.weight.dtype
    with torch.no_grad():
        cache = model.new_cache()
        model(prefix.to(dtype), pos(1, 0, 64), cache)
        hidden = model(tails.to(dtype), pos(3, 64, 21), cache.expand(3))  # [3, 21, H]
        return [probabilities(head.logits(h[[4, 9, 14, 19]], h[-1])) for h in hidden]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
def test_cached_continuation_is_as_accurate_as_the_module_path(tiny_export, device):
    """The fused layers (compiled on CUDA, eager on the CPU) on a cached continuation, against the
    fp32 module path, judged as the parity gate judges bf16: no worse than the bf16 module path's
    own error by the declared a and b. (On the H200 the compiled continuation's hidden states
    were 3.7x further from fp32 than the module path's at their maximum; this decides whether
    that reaches the probabilities.)"""
    from valen_runtime.fast import enable_fast_paths
    from valen_runtime.weights import load_model

    module_path = load_model(tiny_export["separate"], device=device, dtype="bf16")
    fused = load_model(tiny_export["separate"], device=device, dtype="bf16").text
    truth = load_model(tiny_export["separate"], device=device, dtype="fp32")
    compile = device == "cuda"
    assert enable_fast_paths(fused, dtype=torch.bfloat16, compile=compile)["layers"] == ("fused, torch.compile" if compile else "fused, eager")
    gen = torch.Generator().manual_seed(4)
    H = truth.text.config.hidden_size
    prefix, tails = torch.randn(1, 64, H, generator=gen).to(device), torch.randn(3, 21, H, generator=gen).to(device)
    head = truth.head  # fp32 in every model
    _truth_relative(_continuation_probabilities(fused, head, prefix, tails),
                    _continuation_probabilities(module_path.text, head, prefix, tails),
                    _continuation_probabilities(truth.text, head, prefix, tails))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
def test_batch_layout_with_a_cached_prefix_is_as_accurate_as_per_branch(tiny_export, device):
    """End to end: the batch layout runs the state's chunk-aligned prefix into a cache and every
    branch from it (compiled fused layers and CUDA graphs on CUDA); its probabilities against
    per-branch fp32, no worse than per-branch bf16's (the reference's shape) by the declared a, b."""
    from parity.answers import probabilities
    from valen_runtime.engine import Engine

    options = dict(mode="shared-prefix", kernels="fast", layout="batch")
    batch = Engine.load(tiny_export["separate"], device=device, dtype="bf16", **options)
    assert batch._plan(batch.compiler.compile(REQUEST_IMAGE_LONG)).sizes[1] > 0  # a cached prefix of cut > 0 tokens
    per_branch = Engine.load(tiny_export["separate"], device=device, dtype="bf16", mode="per-branch")
    truth = Engine.load(tiny_export["separate"], device=device, dtype="fp32", mode="per-branch")
    probs = lambda engine: [probabilities(lg) for lg in engine.run(REQUEST_IMAGE_LONG).logits]  # noqa: E731
    for _ in range(2 if device == "cuda" else 1):  # on CUDA the second run replays the captured graph
        got = probs(batch)
    _truth_relative(got, probs(per_branch), probs(truth))


@gpu
@pytest.mark.parametrize(
    "dtype, compile, attention",
    [
        ("fp32", True, "sdpa"),
        ("bf16", False, "sdpa"),
    ],
)
def test_fused_layers_match_module_path_cuda(tiny_export, dtype, compile, attention):
    """Whole-layer functions (eager, or torch.compile'd: inductor, Triton; fla-core in bf16) vs the
    module path on CUDA: one-shot, then a prefix continued by a batch of suffixes."""
    from valen_runtime.fast import enable_fast_paths
    from valen_runtime.weights import load_model

    reference = load_model(tiny_export["separate"], device="cuda", dtype=dtype).text
    fused = load_model(tiny_export["separate"], device="cuda", dtype=dtype).text
    layers = enable_fast_paths(fused, dtype=fused.embed_tokens.weight.dtype, compile=compile, fused_attention=attention)["layers"]
    assert layers == ("fused, torch.compile" if compile else "fused, eager")
    models = [reference, fused]
    if dtype == "bf16":  # the fp32 module path is the yardstick both bf16 paths are measured against
        models.append(load_model(tiny_export["separate"], device="cuda", dtype="fp32").text)
    gen = torch.Generator().manual_seed(4)
    H = reference.config.hidden_size
    prefix = torch.randn(1, 64, H, generator=gen).to("cuda", reference.embed_tokens.weight.dtype)
    tails = torch.randn(3, 21, H, generator=gen).to("cuda", reference.embed_tokens.weight.dtype)
    pos = lambda b, start, n: torch.arange(start, start + n, device="cuda").view(1, 1, -1).expand(3, b, -1).contiguous()  # noqa: E731
    with torch.no_grad():
        outs = []
        for model in models:
            cache, wdtype = model.new_cache(), model.embed_tokens.weight.dtype
            head = model(prefix.to(wdtype), pos(1, 0, 64), cache)
            outs.append([head.float(), model(tails.to(wdtype), pos(3, 64, 21), cache.expand(3)).float()])
    for i in range(2):
        want, got = outs[0][i], outs[1][i]
        if dtype == "fp32":  # summation order only (TF32 off), same bound as the CPU test
            diff = (got - want).abs()
            assert diff.max() <= 1e-4 * want.abs().max() + 5e-5, diff.max()
        else:
            # Two bf16 computations differ by their rounding, so each is measured against fp32:
            # the fast path must be about as accurate as the reference-shaped one.
            truth = outs[2][i]
            err_ref, err_fast = (want - truth).abs(), (got - truth).abs()
            assert err_fast.mean() <= 1.5 * err_ref.mean() + 1e-3, (i, err_fast.mean(), err_ref.mean())
            assert err_fast.max() <= 2 * err_ref.max() + 1e-2, (i, err_fast.max(), err_ref.max())


def assert_same_function(want_engine, got_engine, per_branch, dtype: str, atol: float) -> None:
    """got_engine's logits within atol of want_engine's and of the per-branch engine's, on both
    test requests; the usage counts equal per-branch's."""
    for request in (REQUEST, REQUEST_IMAGE_LONG):
        want, got, base = want_engine.run(request), got_engine.run(request), per_branch.run(request)
        for a, b, c in zip(want.logits, got.logits, base.logits):
            assert (a - b).abs().max().item() <= atol, (dtype, a, b)
            assert (c - b).abs().max().item() <= atol, (dtype, c, b)
        assert got.response["usage"] == base.response["usage"]


@pytest.mark.parametrize("dtype, atol", [("fp32", 2e-5), ("bf16", 0.15)])
def test_packed_branches_equal_padded_branches_cpu(tiny_export, dtype, atol):
    """layout="packed": the branches as varlen sequences in one row (no padding rows). Same function as
    the padded batch: fp32 round-off only; bf16 within the shared-prefix bf16 bound above."""
    from valen_runtime.engine import Engine

    padded = Engine.load(tiny_export["separate"], device="cpu", dtype=dtype, mode="shared-prefix", kernels="fast")
    assert padded.layout == "batch"  # the CPU default
    packed = Engine.load(tiny_export["separate"], device="cpu", dtype=dtype, mode="shared-prefix", kernels="fast", layout="packed")
    per_branch = Engine.load(tiny_export["separate"], device="cpu", dtype=dtype, mode="per-branch")
    assert_same_function(padded, packed, per_branch, dtype, atol)
    plan = packed._plan(packed.compiler.compile(REQUEST_IMAGE_LONG))
    P, cut, T = plan.sizes[:3]
    assert plan.kind == "packed" and cut > 0 and T % 8 == 0 and sum(plan.sizes[-1]) == T  # one row, no padding rows but < 8


@pytest.mark.parametrize("dtype, atol", [("fp32", 2e-5), ("bf16", 0.15)])
def test_one_pass_equals_the_packed_prefix_pass_cpu(tiny_export, dtype, atol):
    """layout="one-pass": the prefix rides in the packed row (one sweep, two delta-rule calls per GDN
    layer, a tree mask in attention). The same function as the prefix pass + packed branches."""
    from valen_runtime.engine import Engine

    options = dict(device="cpu", dtype=dtype, mode="shared-prefix", kernels="fast")
    packed = Engine.load(tiny_export["separate"], layout="packed", **options)
    one_pass = Engine.load(tiny_export["separate"], layout="one-pass", **options)
    per_branch = Engine.load(tiny_export["separate"], device="cpu", dtype=dtype, mode="per-branch")
    assert_same_function(packed, one_pass, per_branch, dtype, atol)
    plan = one_pass._plan(one_pass.compiler.compile(REQUEST_IMAGE_LONG))
    P, cut, T = plan.sizes[:3]
    assert plan.kind == "one-pass" and cut > 0
    rows_pos = plan.parts[3]
    assert rows_pos.shape[-1] == cut + T  # the prefix's rows lead the packed row
    short = one_pass._plan(one_pass.compiler.compile(REQUEST))
    assert short.sizes[1] == 0 and short.kind == "batch"  # no chunk-aligned prefix to share: the padded batch


def test_layout_is_checked(tiny_export):
    from valen_runtime.engine import Engine

    with pytest.raises(ValueError, match="layout 'tree' is not one of"):
        Engine.load(tiny_export["separate"], device="cpu", mode="shared-prefix", kernels="fast", layout="tree")


@pytest.mark.parametrize("layout", ["packed", "one-pass"])
def test_packed_layouts_need_the_fused_layers(tiny_export, layout):
    from valen_runtime.engine import Engine

    with pytest.raises(ValueError, match="fused layers"):
        Engine.load(tiny_export["separate"], device="cpu", mode="shared-prefix", kernels="torch", layout=layout)
    with pytest.raises(ValueError, match="fused layers"):
        Engine.load(tiny_export["separate"], device="cpu", mode="per-branch", kernels="fast", layout=layout)


@pytest.mark.slow
@pytest.mark.skipif(not (shutil.which("c++") or shutil.which("g++")), reason="inductor's CPU backend needs a C++ compiler")
def test_compiled_packed_branches_cpu(tiny_export):
    """The packed path through torch.compile (inductor C++ here), fp32, against the eager padded one."""
    from valen_runtime.engine import Engine

    eager = Engine.load(tiny_export["separate"], device="cpu", dtype="fp32", mode="shared-prefix", kernels="fast")
    compiled = Engine.load(tiny_export["separate"], device="cpu", dtype="fp32", mode="shared-prefix", kernels="fast", layout="packed", compile=True)
    for request in (REQUEST, REQUEST_IMAGE_LONG, REQUEST):
        for a, b in zip(eager.run(request).logits, compiled.run(request).logits):
            assert (a - b).abs().max().item() <= 2e-5, (a, b)


@pytest.mark.slow
@pytest.mark.skipif(not (shutil.which("c++") or shutil.which("g++")), reason="inductor's CPU backend needs a C++ compiler")
def test_compiled_one_pass_cpu(tiny_export):
    """The one-pass layout through torch.compile (inductor C++ here), fp32, against the eager padded path."""
    from valen_runtime.engine import Engine

    eager = Engine.load(tiny_export["separate"], device="cpu", dtype="fp32", mode="shared-prefix", kernels="fast")
    compiled = Engine.load(tiny_export["separate"], device="cpu", dtype="fp32", mode="shared-prefix", kernels="fast",
                           layout="one-pass", compile=True)
    assert compiled._plan(compiled.compiler.compile(REQUEST_IMAGE_LONG)).kind == "one-pass"
    for a, b in zip(eager.run(REQUEST_IMAGE_LONG).logits, compiled.run(REQUEST_IMAGE_LONG).logits):
        assert (a - b).abs().max().item() <= 2e-5, (a, b)


def test_with_fused_layers_only_the_final_norm_gets_a_compiled_norm(tiny_export):
    # The fused layer functions bypass the modules' norm seams, so compiled norms there would be
    # dead weight; the final norm still runs through its module.
    from valen_runtime import qwen35
    from valen_runtime.fast import enable_fast_paths
    from valen_runtime.weights import load_model

    fused = load_model(tiny_export["separate"], device="cpu", dtype="fp32").text
    assert enable_fast_paths(fused, dtype=torch.float32, compile=True)["elementwise"] == "torch.compile (final norm)"
    assert fused.norm.norm_fn is not qwen35.rms_norm
    assert all(layer.input_layernorm.norm_fn is qwen35.rms_norm for layer in fused.layers)
    modules = load_model(tiny_export["separate"], device="cpu", dtype="fp32").text
    enable_fast_paths(modules, dtype=torch.float32, compile=True, fuse_layers=False)
    assert all(layer.input_layernorm.norm_fn is not qwen35.rms_norm for layer in modules.layers)


def test_unknown_fused_attention_is_refused_in_one_line(tiny_export):
    from valen_runtime.fast import enable_fast_paths
    from valen_runtime.weights import load_model

    model = load_model(tiny_export["separate"], device="cpu", dtype="fp32").text
    with pytest.raises(ValueError, match="fused_attention 'flash' is not one of"):
        enable_fast_paths(model, dtype=torch.float32, compile=False, fused_attention="flash")


@gpu
def test_bf16x3_lora_on_tensor_cores_is_as_accurate_as_fp32_cuda():
    """The split LoRA through cuBLAS's bf16 GEMMs with fp32 output (eager and compiled) against
    fp64, next to the fp32 LoRA on CUDA cores (TF32 off)."""
    from valen_runtime.fused_layers import project, projection, split_lora_factors
    from valen_runtime.qwen35 import LoRALinear, attach_lora

    gen = torch.Generator().manual_seed(30)
    parent = torch.nn.Module()
    parent.proj = LoRALinear(2048, 1024)
    parent.proj.weight.data = (torch.randn(1024, 2048, generator=gen) * 0.02).to(torch.bfloat16)
    attach_lora(parent, {"proj.lora_A.weight": torch.randn(32, 2048, generator=gen) * 0.02,
                         "proj.lora_B.weight": torch.randn(1024, 32, generator=gen) * 0.02}, 2.0)
    parent = parent.cuda()
    m = parent.proj
    x = torch.randn(64, 2048, generator=gen).to("cuda", torch.bfloat16)
    exact = (x.double() @ m.lora_A.weight.double().T) @ m.lora_B.weight.double().T * m.lora_scale
    fp32 = m.lora_B(m.lora_A(x.float())) * m.lora_scale
    plain = projection([m])
    split = split_lora_factors(plain)
    want = project(x, plain)  # bf16 output of the fp32 LoRA
    for fn in (project, torch.compile(project, fullgraph=True)):
        got = fn(x, split)  # the bf16 rounding hides the fp32-order differences but on ties
        assert got.dtype == torch.bfloat16 and (got != want).float().mean() < 0.01
    from valen_runtime.fused_layers import _split_lora_delta

    err_split = (_split_lora_delta(x, split).double() - exact).abs()
    err_fp32 = (fp32.double() - exact).abs()
    assert err_split.max() <= 2 * err_fp32.max(), (err_split.max(), err_fp32.max())
