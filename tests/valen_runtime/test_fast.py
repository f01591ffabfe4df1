"""Fast paths against their reference paths: SDPA vs eager attention, FLA vs the chunked torch rule,
CUDA-graph replay vs direct execution, shared-prefix vs per-branch on an export.

CPU-runnable comparisons run everywhere; the CUDA ones are marked `gpu` and run on the GPU machine
(benchmarks/gpu_run.sh). Tolerances are written next to each comparison with the reason.
"""

from __future__ import annotations


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


def test_shared_prefix_equals_per_branch_fp32_cpu(tiny_export):
    """Exact in real arithmetic; fp32 rounding only (chunk boundaries and batching move)."""
    from valen_runtime.engine import Engine

    per = Engine.load(tiny_export["separate"], device="cpu", dtype="fp32", mode="per-branch").run(REQUEST)
    shared = Engine.load(tiny_export["separate"], device="cpu", dtype="fp32", mode="shared-prefix").run(REQUEST)
    for a, b in zip(per.logits, shared.logits):
        torch.testing.assert_close(b, a, rtol=0, atol=2e-5)
    assert per.response["usage"] == shared.response["usage"]


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
        base = Engine.load(tiny_export["separate"], device="cuda", dtype=dtype, mode="per-branch").run(REQUEST)
        for kernels, graphs in (("torch", False), ("fast", False), ("fast", True)):
            eng = Engine.load(tiny_export["separate"], device="cuda", dtype=dtype, mode="shared-prefix", kernels=kernels, graphs=graphs)
            for _ in range(3):  # graphs: capture on the first call, replay after
                res = eng.run(REQUEST)
            for a, b in zip(base.logits, res.logits):
                # fp32: FLA/SDPA reorder sums (TF32 off); bf16: per-branch vs shared-prefix chunking
                assert (a - b).abs().max().item() <= atol, (dtype, kernels, graphs, a, b)


@gpu
def test_graph_replay_is_bitwise_equal_to_direct_execution(tiny_export):
    from valen_runtime.engine import Engine

    direct = Engine.load(tiny_export["separate"], device="cuda", dtype="bf16", mode="shared-prefix", kernels="fast", graphs=False)
    graphed = Engine.load(tiny_export["separate"], device="cuda", dtype="bf16", mode="shared-prefix", kernels="fast", graphs=True)
    want = direct.run(REQUEST).logits
    for _ in range(3):
        got = graphed.run(REQUEST).logits
        for a, b in zip(want, got):
            assert torch.equal(a, b)
    captured = len(graphed.graphs)
    graphed.run(REQUEST)
    assert captured >= 1 and len(graphed.graphs) == captured  # the same shapes replay, nothing new is captured
