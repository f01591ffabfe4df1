"""CUDA fast paths behind the model's seams, and CUDA-graph replay of whole forwards.

- `fla_chunk_gated_delta_rule`: flash-linear-attention's Triton chunked kernel with the same
  signature as `gated_delta.chunk_gated_delta_rule`. q/k are L2-normalised first in the
  activation dtype exactly as transformers 5.4.0 does, so only the kernel's internal rounding
  differs from the reference path.
- `sdpa_attention`: PyTorch's scaled_dot_product_attention with the same signature as
  `qwen35.eager_attention` (GQA handled by the kernel).
- `FusedProjection`: projections that read the same input (GDN qkv/z/b/a, attention q/k/v, MLP
  gate/up) as one GEMM, and their FP32 LoRA adapters as one A GEMM and one grouped B GEMM
  (`fused_layers.project`; scale folded into B).
- `enable_fused_layers` (fused_layers.py): every decoder layer as one torch.compile'd function.
- `compile_elementwise`: the norm and gate chains as torch.compile'd kernels (one launch each
  instead of ~8) where the module path still runs them (with fused layers: the final norm).
- `compiled_vision_block`, `patch_gemm_matches_conv`: the vision blocks compiled, and the patch
  conv as one GEMM where that computes the same numbers.
- `GraphCache`: captures a forward once per input-shape key and replays it, so a warm request
  launches one graph instead of thousands of kernels.
Nothing here changes what is computed; valen-parity measures the rounding difference under its
own declared tolerance entry. The pure-PyTorch paths stay the CPU path and the fallback.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from . import qwen35
from .fused_layers import enable_fused_layers, project, projection, register_delta_rule, split_lora_factors
from .gated_delta import l2norm

log = logging.getLogger(__name__)

_FLA = None


def fla_available() -> bool:
    """True when CUDA is up and flash-linear-attention imports (VALEN_DISABLE_FLA=1 turns it off)."""
    global _FLA
    if os.environ.get("VALEN_DISABLE_FLA") == "1" or not torch.cuda.is_available():
        return False
    if _FLA is None:
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as kernel

            _FLA = kernel
        except Exception:  # ImportError, or a Triton/driver problem at import time
            _FLA = False
    return _FLA is not False


def fla_version() -> str | None:
    try:
        from importlib import metadata

        return metadata.version("fla-core")
    except Exception:
        return None


def fla_chunk_gated_delta_rule(
    q, k, v, g, beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=True, chunk_size=64
):
    """Shapes as `gated_delta.chunk_gated_delta_rule`: q, k [B, T, H, Dk]; v [B, T, H, Dv]; g, beta [B, T, H]."""
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)  # in the activation dtype, as the pinned reference does
    o, final = _run_fla(q, k, v, g, beta, initial_state, output_final_state)
    return o.to(v.dtype), (final.float() if output_final_state else None)


def _run_fla(q, k, v, g, beta, initial_state, output_final_state: bool, **varlen):
    """FLA's chunked kernel on contiguous inputs (g and the state in fp32), q and k already
    normalised; `varlen`: cu_seqlens and chunk_indices for packed sequences."""
    if not fla_available():
        raise RuntimeError("flash-linear-attention is not importable on this machine")
    if initial_state is not None:
        initial_state = initial_state.float().contiguous()
    return _FLA(
        q.contiguous(), k.contiguous(), v.contiguous(), g.float().contiguous(), beta.contiguous(),
        scale=q.shape[-1] ** -0.5, initial_state=initial_state, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=False, **varlen,
    )


def fla_varlen_gated_delta_rule(q, k, v, g, beta, initial_state, cu_seqlens, chunk_indices):
    """Packed sequences through FLA's varlen kernel; shapes as `fused_layers.gated_delta_rule_varlen_op`.

    Capturable: `chunk_indices` comes from the host (FLA would otherwise build it with a host
    sync), and `cu_seqlens` is passed as a fresh view so FLA's identity-keyed memo of derived
    tensors recomputes them inside the graph instead of reusing a tensor it may later drop.
    """
    o, _ = _run_fla(q, k, v, g, beta, initial_state, False, cu_seqlens=cu_seqlens.view(-1), chunk_indices=chunk_indices)
    return o.to(v.dtype)


def sdpa_vision_attention(q, k, v, scaling):
    """Vision (one image, unmasked): q, k, v [1, Hh, n, D] -> [1, n, Hh, D]."""
    return F.scaled_dot_product_attention(q, k, v, scale=scaling).transpose(1, 2).contiguous()


def sdpa_attention(q, k, v, mask, scaling):
    """q [B, Hq, T, D], k / v [B, Hk, S, D], additive mask [.., T, S] -> [B, T, Hq, D]."""
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2).contiguous()


class FusedProjection(nn.Module):
    """Several bias-free projections of one input as one GEMM; outputs split back in order.

    The members' weights become row-block views of the fused matrix (no second copy). Their FP32
    LoRA adapters, if any, become one A GEMM and one grouped B GEMM (`fused_layers.projection`),
    added to the base result in fp32 and cast once, as PEFT does per projection (only the order
    of a few fp32 roundings differs).
    """

    def __init__(self, members: list):
        super().__init__()
        self.splits = [m.out_features for m in members]
        weight = torch.cat([m.weight.detach() for m in members])  # [sum(out), in]
        row = 0
        for m in members:
            m.weight = nn.Parameter(weight[row : row + m.out_features], requires_grad=False)
            row += m.out_features
        self.register_buffer("weight", weight, persistent=False)
        self.projection = projection(members, weight)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return list(project(x, self.projection).split(self.splits, dim=-1))


def fuse_projections(text_model, split_lora: bool = False) -> None:
    for layer in text_model.layers:
        if hasattr(layer, "linear_attn"):
            gdn = layer.linear_attn
            gdn.fused_in_proj = first = FusedProjection([gdn.in_proj_qkv, gdn.in_proj_z, gdn.in_proj_b, gdn.in_proj_a])
        else:
            att = layer.self_attn
            att.fused_qkv = first = FusedProjection([att.q_proj, att.k_proj, att.v_proj])
        layer.mlp.fused_gate_up = FusedProjection([layer.mlp.gate_proj, layer.mlp.up_proj])
        if split_lora:
            for fused in (first, layer.mlp.fused_gate_up):
                fused.projection = split_lora_factors(fused.projection)


class _CompiledOr:
    """torch.compile(fn), falling back to fn for good (with a warning) if compilation fails."""

    def __init__(self, fn):
        self.fn = fn
        self.compiled = torch.compile(fn, dynamic=True, fullgraph=True)
        self.failed = None

    def __call__(self, *args):
        if self.failed is None:
            try:
                return self.compiled(*args)
            except Exception as e:  # an inductor/triton problem must not take the engine down
                self.failed = f"{type(e).__name__}: {e}"
                log.warning("torch.compile of %s failed, using eager: %s", self.fn.__name__, self.failed)
        return self.fn(*args)


def compile_elementwise(text_model, final_norm_only: bool = False) -> dict:
    """Compiled norm / gate functions at the modules' seams; final_norm_only when fused layers run
    everything else (their own compiled functions bypass these seams)."""
    fns = {name: _CompiledOr(getattr(qwen35, name)) for name in ("rms_norm", "rms_norm_gated", "decay_and_beta")}
    for module in [text_model.norm] if final_norm_only else text_model.modules():
        if isinstance(module, qwen35.RMSNorm):
            module.norm_fn = fns["rms_norm"]
        elif isinstance(module, qwen35.RMSNormGated):
            module.norm_fn = fns["rms_norm_gated"]
        elif isinstance(module, qwen35.GatedDeltaNet):
            module.gates_fn = fns["decay_and_beta"]
    return fns


def compiled_vision_block() -> Callable:
    """One torch.compile'd function for every vision block (the block's weights are its inputs)."""

    def run_block(block, x, lengths, cos, sin):
        return block(x, lengths, cos, sin)

    compiled = torch.compile(run_block, fullgraph=True, options={"emulate_precision_casts": True})

    def run(block, x, lengths, cos, sin):
        for t in (x, cos, sin):  # patch count varies per image: symbolic from the first compile
            torch._dynamo.maybe_mark_dynamic(t, 0)
        return compiled(block, x, lengths, cos, sin)

    return run


def patch_gemm_matches_conv(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the patch conv may run as a GEMM without changing its numbers.

    Only fp32 on CUDA differs: cuDNN convolutions use TF32 unless torch.backends.cudnn.allow_tf32
    is off (torch's default is on, and the reference keeps it), while our matmuls keep TF32 off.
    On the H200 the GEMM left fp32 image answers up to 6e-5 from the reference (text ones within 1e-5).
    """
    return not (dtype == torch.float32 and device.type == "cuda" and torch.backends.cudnn.allow_tf32)


def enable_fast_paths(
    text_model, vision_model=None, dtype: torch.dtype = torch.bfloat16, compile: bool = True, fuse_layers: bool = True,
    fused_attention: str = "sdpa", lora_gemm: str = "fp32",
) -> dict:
    """Swap the CUDA kernels in at the model's seams; returns what was enabled (for reports).

    fused_attention: the fused layers' attention core, "sdpa" or "eager" (the reference's
    formula, bf16 scores and an fp32 softmax, left to inductor to fuse; for diagnosing the
    compiled bf16 continuation's accuracy, docs/parity.md).
    lora_gemm: "fp32" (FP32 GEMMs, CUDA cores: TF32 stays off) or "bf16x3" (the same FP32 LoRA
    as exact bf16 splits on tensor cores, fused_layers.split_lora_factors; bf16 models only;
    opt-in until measured on the GPU).

    fuse_layers routes every decoder layer through fused_layers' whole-layer functions, compiled
    (with the norms and the vision blocks) when compile=True; eager they compute the same thing
    and are what the CPU parity gate checks. FLA's Triton products run in TF32 for fp32 inputs,
    so fp32 models keep the PyTorch delta rule.
    """
    enabled = {"gated_delta": "torch", "attention": "eager", "projections": "fused", "elementwise": "eager",
               "vision_attention": "eager", "layers": "modules"}
    use_fla = fla_available() and dtype != torch.float32
    for layer in text_model.layers:
        if hasattr(layer, "linear_attn") and use_fla:
            layer.linear_attn.delta_rule = fla_chunk_gated_delta_rule
            enabled["gated_delta"] = f"fla-core {fla_version()}"
        if hasattr(layer, "self_attn"):
            layer.self_attn.attention_core = sdpa_attention
            enabled["attention"] = "sdpa"
    if lora_gemm not in ("fp32", "bf16x3"):
        raise ValueError(f"lora_gemm {lora_gemm!r} is not fp32 or bf16x3")
    if lora_gemm == "bf16x3" and dtype != torch.bfloat16:
        raise ValueError("lora_gemm='bf16x3' needs a bf16 model (its products are exact only for bf16 activations)")
    fuse_projections(text_model, split_lora=lora_gemm == "bf16x3")
    if lora_gemm == "bf16x3":
        enabled["lora"] = "bf16x3 splits, tensor cores"
    if vision_model is not None:
        for block in vision_model.blocks:
            block.attn.attention_core = sdpa_vision_attention
        enabled["vision_attention"] = "sdpa"
        device = next(vision_model.parameters()).device
        if patch_gemm_matches_conv(dtype, device):
            vision_model.patch_embed.as_linear = True
            enabled["patch_embed"] = "linear"
        else:
            enabled["patch_embed"] = "conv (cuDNN, TF32 as in the reference)"
    if compile:
        compile_elementwise(text_model, final_norm_only=fuse_layers)
        enabled["elementwise"] = "torch.compile (final norm)" if fuse_layers else "torch.compile"
        if vision_model is not None:
            vision_model.run_block = compiled_vision_block()
            enabled["vision_blocks"] = "torch.compile"
    if fuse_layers:
        if use_fla:
            register_delta_rule("fla", fla_chunk_gated_delta_rule, varlen=fla_varlen_gated_delta_rule)
        cores = {"sdpa": sdpa_attention, "eager": qwen35.eager_attention}
        if fused_attention not in cores:
            raise ValueError(f"fused_attention {fused_attention!r} is not one of {sorted(cores)}")
        enable_fused_layers(text_model, cores[fused_attention], "fla" if use_fla else "torch", compile=compile, lora_gemm=lora_gemm)
        enabled["layers"] = "fused, torch.compile" if compile else "fused, eager"
        if fused_attention != "sdpa":
            enabled["attention"] = f"{fused_attention} (fused layers)"
    return enabled


class GraphCache:
    """Capture `fn(*inputs) -> tuple of tensors` per shape key and replay it.

    Inputs are copied into static buffers; outputs are the graph's own buffers, valid until the
    next replay of the same key (callers use them before the next request). The first call of a
    key warms up on a side stream (Triton autotuning, cuBLAS handles), then captures. Each entry
    keeps `fn`, so tensors `fn` closes over (which the graph reads) live as long as the graph.
    """

    def __init__(self, pool=None, max_graphs: int = 64):
        self.graphs: OrderedDict = OrderedDict()  # least recently replayed first
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        self.max_graphs = max_graphs

    def __len__(self) -> int:
        return len(self.graphs)

    def __contains__(self, key) -> bool:
        return key in self.graphs

    def run(self, key, fn: Callable, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        entry = self.graphs.get(key)
        if entry is not None:
            self.graphs.move_to_end(key)
        else:
            while len(self.graphs) >= self.max_graphs:  # a server sees unbounded shape variety
                self.graphs.popitem(last=False)
            static_in = [t.clone() for t in inputs]
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    fn(*static_in)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                static_out = fn(*static_in)
            entry = self.graphs[key] = (graph, static_in, static_out, fn)
        graph, static_in, static_out, _ = entry
        for dst, src in zip(static_in, inputs):
            dst.copy_(src, non_blocking=True)
        graph.replay()
        return static_out
