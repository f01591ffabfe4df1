"""CUDA fast paths behind the model's seams, and CUDA-graph replay of whole forwards.

- `fla_chunk_gated_delta_rule`: flash-linear-attention's Triton chunked kernel with the same
  signature as `gated_delta.chunk_gated_delta_rule`. q/k are L2-normalised first in the
  activation dtype exactly as transformers 5.4.0 does, so only the kernel's internal rounding
  differs from the reference path.
- `sdpa_attention`: PyTorch's scaled_dot_product_attention with the same signature as
  `qwen35.eager_attention` (GQA handled by the kernel).
- `GraphCache`: captures a forward once per input-shape key and replays it, so a warm request
  launches one graph instead of hundreds of kernels.
Nothing here changes what is computed; valen-parity measures the rounding difference under its
own declared tolerance entry. The pure-PyTorch paths stay the CPU path and the fallback.
"""

from __future__ import annotations

import os
from typing import Callable

import torch
import torch.nn.functional as F

from .gated_delta import l2norm

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
    if not fla_available():
        raise RuntimeError("flash-linear-attention is not importable on this machine")
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)  # in the activation dtype, as the pinned reference does
    if initial_state is not None:
        initial_state = initial_state.float().contiguous()
    o, final = _FLA(
        q.contiguous(), k.contiguous(), v.contiguous(), g.float().contiguous(), beta.contiguous(),
        scale=q.shape[-1] ** -0.5, initial_state=initial_state, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=False,
    )
    return o.to(v.dtype), (final.float() if output_final_state else None)


def sdpa_attention(q, k, v, mask, scaling):
    """q [B, Hq, T, D], k / v [B, Hk, S, D], additive mask [.., T, S] -> [B, T, Hq, D]."""
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2).contiguous()


def enable_fast_paths(text_model, vision_model=None) -> dict:
    """Swap the CUDA kernels in at the model's seams; returns what was enabled (for reports)."""
    enabled = {"gated_delta": "torch", "attention": "eager"}
    use_fla = fla_available()
    for layer in text_model.layers:
        if hasattr(layer, "linear_attn") and use_fla:
            layer.linear_attn.delta_rule = fla_chunk_gated_delta_rule
            enabled["gated_delta"] = f"fla-core {fla_version()}"
        if hasattr(layer, "self_attn"):
            layer.self_attn.attention_core = sdpa_attention
            enabled["attention"] = "sdpa"
    return enabled


class GraphCache:
    """Capture `fn(*inputs) -> tuple of tensors` per shape key and replay it.

    Inputs are copied into static buffers; outputs are the graph's own buffers, valid until the
    next replay of the same key (callers use them before the next request). The first call of a
    key warms up on a side stream (Triton autotuning, cuBLAS handles), then captures.
    """

    def __init__(self, pool=None):
        self.graphs: dict = {}
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()

    def __len__(self) -> int:
        return len(self.graphs)

    def run(self, key, fn: Callable, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        entry = self.graphs.get(key)
        if entry is None:
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
            entry = self.graphs[key] = (graph, static_in, static_out)
        graph, static_in, static_out = entry
        for dst, src in zip(static_in, inputs):
            dst.copy_(src, non_blocking=True)
        graph.replay()
        return static_out
