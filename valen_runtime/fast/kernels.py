"""The fast path's kernels: flash-linear-attention's gated delta rule, PyTorch SDPA, and the delta
rule wrapped as custom ops so a torch.compile'd layer stays one graph around it.

- `fla_chunk_gated_delta_rule`: FLA's Triton chunked kernel with the arguments of
  `gated_delta.chunk_gated_delta_rule`; q/k are L2-normalised first in the activation dtype
  exactly as transformers 5.4.0 does, so only the kernel's internal rounding differs.
- `gated_delta_rule_op` / `gated_delta_rule_varlen_op` / `gated_delta_rule_varlen_final_op`
  (`valen::gated_delta_rule[_varlen[_final]]`): the rule over a batch, or over sequences packed
  back to back in one row (with or without each sequence's final state), by `impl` "torch" (the
  reference rule, every device) or "fla" (CUDA, bf16).
- `sdpa_attention` / `sdpa_vision_attention`: scaled_dot_product_attention with the arguments of
  `qwen35.eager_attention` / `vision.bidirectional_attention`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..gated_delta import chunk_gated_delta_rule, l2norm
from .fla_tuning import use_shipped_configs

_FLA = None
_FLA_CONFIGS = None  # where FLA's kernel configurations come from (fla_tuning.use_shipped_configs)


def fla_available() -> bool:
    """True when CUDA is up and flash-linear-attention imports (pointed first at the kernel
    configurations tuned for this GPU, where there are some: fla_tuning.py)."""
    global _FLA, _FLA_CONFIGS
    if not torch.cuda.is_available():
        return False
    if _FLA is None:
        _FLA_CONFIGS = use_shipped_configs(torch.cuda.get_device_name(), fla_version())
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as kernel

            _FLA = kernel
        except Exception:  # ImportError, or a Triton/driver problem at import time
            _FLA = False
    return _FLA is not False


def fla_configs() -> str | None:
    """Where FLA's kernel configurations come from ("tuned for <GPU>", "autotuned", ...); None before FLA is loaded."""
    return _FLA_CONFIGS


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


def fla_varlen_gated_delta_rule(q, k, v, g, beta, initial_state, cu_seqlens, chunk_indices, output_final_state=False):
    """Packed sequences through FLA's varlen kernel; shapes as `gated_delta_rule_varlen_op`
    (-> out, and each sequence's final state [n, H, Dk, Dv] fp32 when asked for, else None).

    Capturable: `chunk_indices` comes from the host (FLA would otherwise build it with a host
    sync), and `cu_seqlens` is passed as a fresh view so FLA's identity-keyed memo of derived
    tensors recomputes them inside the graph instead of reusing a tensor it may later drop.
    """
    o, final = _run_fla(q, k, v, g, beta, initial_state, output_final_state, cu_seqlens=cu_seqlens.view(-1),
                        chunk_indices=chunk_indices)
    return o.to(v.dtype), (final.float() if output_final_state else None)


def torch_varlen_delta_rule(q, k, v, g, beta, initial_state, cu_seqlens, chunk_indices, output_final_state=False):
    """Packed sequences one after the other through the reference's chunked rule (reads
    cu_seqlens on the host, so it cannot be captured in a CUDA graph). Shapes as
    `gated_delta_rule_varlen_op`; chunk_indices is FLA's and unused here."""
    bounds = cu_seqlens.tolist()
    outs, finals = [], []
    for n, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        out, final = chunk_gated_delta_rule(
            q[:, start:end], k[:, start:end], v[:, start:end], g[:, start:end], beta[:, start:end],
            initial_state=initial_state[n : n + 1], output_final_state=output_final_state, use_qk_l2norm_in_kernel=False,
        )
        outs.append(out)
        finals.append(final)
    return torch.cat(outs, dim=1), (torch.cat(finals) if output_final_state else None)


DELTA_RULES = {"torch": chunk_gated_delta_rule, "fla": fla_chunk_gated_delta_rule}
VARLEN_DELTA_RULES = {"torch": torch_varlen_delta_rule, "fla": fla_varlen_gated_delta_rule}


@torch.library.custom_op("valen::gated_delta_rule", mutates_args=())
def gated_delta_rule_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    initial_state: torch.Tensor, impl: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k already L2-normalised [B, T, H, Dk]; v [B, T, H, Dv]; g, beta [B, T, H]; state [B, H, Dk, Dv] fp32
    -> out [B, T, H, Dv] and the final state."""
    out, final = DELTA_RULES[impl](
        q, k, v, g=g, beta=beta, initial_state=initial_state, output_final_state=True, use_qk_l2norm_in_kernel=False
    )
    return out.contiguous(), final.contiguous()


@gated_delta_rule_op.register_fake
def _(q, k, v, g, beta, initial_state, impl):
    return v.new_empty(v.shape), initial_state.new_empty(initial_state.shape)


@torch.library.custom_op("valen::gated_delta_rule_varlen", mutates_args=())
def gated_delta_rule_varlen_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    initial_state: torch.Tensor, cu_seqlens: torch.Tensor, chunk_indices: torch.Tensor, impl: str,
) -> torch.Tensor:
    """Packed sequences (batch 1): q, k [1, T, H, Dk] L2-normalised; v [1, T, H, Dv]; g, beta [1, T, H];
    initial_state [n, H, Dk, Dv] fp32, one per sequence; cu_seqlens [n + 1]; chunk_indices [NT, 2]
    (sequence, chunk) of every 64-token chunk -> out [1, T, H, Dv]."""
    out, _ = VARLEN_DELTA_RULES[impl](q, k, v, g, beta, initial_state, cu_seqlens, chunk_indices)
    return out.contiguous()


@gated_delta_rule_varlen_op.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, chunk_indices, impl):
    return v.new_empty(v.shape)


@torch.library.custom_op("valen::gated_delta_rule_varlen_final", mutates_args=())
def gated_delta_rule_varlen_final_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    initial_state: torch.Tensor, cu_seqlens: torch.Tensor, chunk_indices: torch.Tensor, impl: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`gated_delta_rule_varlen_op` that also returns every sequence's final state [n, H, Dk, Dv] fp32
    (the one-pass layout runs its requests' prefixes through it, then continues from those states)."""
    out, final = VARLEN_DELTA_RULES[impl](q, k, v, g, beta, initial_state, cu_seqlens, chunk_indices, output_final_state=True)
    return out.contiguous(), final.contiguous()


@gated_delta_rule_varlen_final_op.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, chunk_indices, impl):
    return v.new_empty(v.shape), initial_state.new_empty(initial_state.shape)


def sdpa_attention(q, k, v, mask, scaling):
    """q [B, Hq, T, D], k / v [B, Hk, S, D], additive mask [.., T, S] -> [B, T, Hq, D] (GQA in the kernel)."""
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2).contiguous()


def sdpa_vision_attention(q, k, v, scaling):
    """Vision (one frame, unmasked): q, k, v [1, Hh, n, D] -> [1, n, Hh, D]."""
    return F.scaled_dot_product_attention(q, k, v, scale=scaling).transpose(1, 2).contiguous()
