"""The gated delta rule of Qwen3.5's linear-attention layers, in plain PyTorch.

`chunk_gated_delta_rule` reproduces transformers 5.4.0's `torch_chunk_gated_delta_rule` op for op
(the fallback the pinned reference ran: q/k L2-normalised in the input dtype, then fp32, T padded
to a multiple of the chunk size, forward-substitution loop). `recurrent_gated_delta_rule` is the
per-token definition, kept as the reference the chunked form is tested against. The fast path
(valen_runtime/fast/kernels.py) calls flash-linear-attention's chunked kernel with the same
arguments and is tested against `chunk_gated_delta_rule`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, in x's dtype (5.4.0 normalises before the fp32 cast)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta, use_qk_l2norm_in_kernel):
    """Normalise q/k in the input dtype, then move heads first and cast everything to fp32."""
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    # [B, T, H, D] -> [B, H, T, D]; [B, T, H] -> [B, H, T]
    return [x.transpose(1, 2).contiguous().to(torch.float32) for x in (q, k, v, beta, g)]


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = True,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked gated delta rule, bitwise equal to transformers 5.4.0's torch fallback.

    Per head, with state S [Dk, Dv] (fp32) and q scaled by 1/sqrt(Dk):
    S = exp(g_t) S;  S = S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t.

    Shapes:
        q, k:           [B, T, H, Dk]   (activation dtype)
        v:              [B, T, H, Dv]
        g, beta:        [B, T, H]       (g is the log decay, fp32 in Qwen3.5)
        initial_state:  [B, H, Dk, Dv]  (cast to fp32)
        returns o:      [B, T, H, Dv]   in q's dtype, and the final state [B, H, Dk, Dv] fp32 or None
    """
    out_dtype = q.dtype
    q, k, v, beta, g = _prepare(q, k, v, g, beta, use_qk_l2norm_in_kernel)
    B, H, T, Dk = k.shape
    Dv = v.shape[-1]
    C = chunk_size

    pad = (C - T % C) % C
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = F.pad(beta, (0, pad)), F.pad(g, (0, pad))
    n_chunks = (T + pad) // C
    q = q * (1 / (q.shape[-1] ** 0.5))

    v_beta = v * beta.unsqueeze(-1)
    k_beta = k * beta.unsqueeze(-1)
    # [B, H, T, D] -> [B, H, N, C, D]
    q, k, v, k_beta, v_beta = (x.reshape(B, H, -1, C, x.shape[-1]) for x in (q, k, v, k_beta, v_beta))
    g = g.reshape(B, H, -1, C).cumsum(dim=-1)  # [B, H, N, C] cumulative log decay inside each chunk

    # decay_mask[i, j] = exp(g_i - g_j) for j <= i, else 0
    decay_mask = ((g.unsqueeze(-1) - g.unsqueeze(-2)).tril().exp().float()).tril()  # [B, H, N, C, C]
    upper_incl_diag = torch.triu(torch.ones(C, C, dtype=torch.bool, device=q.device), diagonal=0)
    attn = -((k_beta @ k.transpose(-1, -2)) * decay_mask).masked_fill(upper_incl_diag, 0)
    # Forward substitution: attn becomes (I + strictly-lower part)^-1 - I, row by row as in 5.4.0.
    for i in range(1, C):
        row = attn[..., i, :i].clone()
        sub = attn[..., :i, :i].clone()
        attn[..., i, :i] = row + (row.unsqueeze(-1) * sub).sum(-2)
    attn = attn + torch.eye(C, dtype=attn.dtype, device=attn.device)
    u = attn @ v_beta  # [B, H, N, C, Dv] pseudo-values
    w = attn @ (k_beta * g.exp().unsqueeze(-1))  # [B, H, N, C, Dk] decayed keys

    if initial_state is None:
        state = torch.zeros(B, H, Dk, Dv).to(u)
    else:
        state = initial_state.to(u)
    out = torch.zeros_like(u)
    strict_upper = torch.triu(torch.ones(C, C, dtype=torch.bool, device=q.device), diagonal=1)
    for n in range(n_chunks):
        q_n, k_n, u_n = q[:, :, n], k[:, :, n], u[:, :, n]
        g_n = g[:, :, n]  # [B, H, C]
        intra = (q_n @ k_n.transpose(-1, -2) * decay_mask[:, :, n]).masked_fill_(strict_upper, 0)
        v_new = u_n - w[:, :, n] @ state  # [B, H, C, Dv]
        inter = (q_n * g_n[..., None].exp()) @ state
        out[:, :, n] = inter + intra @ v_new
        state = state * g_n[..., -1, None, None].exp() + (
            k_n * (g_n[..., -1, None] - g_n).exp()[..., None]
        ).transpose(-1, -2) @ v_new

    out = out.reshape(B, H, -1, Dv)[:, :, :T]  # [B, H, T, Dv]
    out = out.transpose(1, 2).contiguous().to(out_dtype)  # [B, T, H, Dv]
    return out, (state if output_final_state else None)


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule one token at a time (fp32); the definition `chunk_gated_delta_rule` must match.

    Shapes:
        q, k:           [B, T, H, Dk]
        v:              [B, T, H, Dv]
        g, beta:        [B, T, H]
        initial_state:  [B, H, Dk, Dv]
        returns o:      [B, T, H, Dv] in q's dtype, and the final state [B, H, Dk, Dv] fp32 or None
    """
    out_dtype = q.dtype
    q, k, v, beta, g = _prepare(q, k, v, g, beta, use_qk_l2norm_in_kernel)
    B, H, T, Dk = k.shape
    Dv = v.shape[-1]
    q = q * (1 / (Dk**0.5))
    state = torch.zeros(B, H, Dk, Dv, dtype=torch.float32, device=v.device)
    if initial_state is not None:
        state = initial_state.to(state)
    out = torch.zeros(B, H, T, Dv, dtype=torch.float32, device=v.device)
    for t in range(T):
        state = state * g[:, :, t].exp()[..., None, None]  # decay
        kv_mem = (state * k[:, :, t, :, None]).sum(dim=-2)  # S^T k   [B, H, Dv]
        delta = (v[:, :, t] - kv_mem) * beta[:, :, t, None]
        state = state + k[:, :, t, :, None] * delta[:, :, None, :]
        out[:, :, t] = (state * q[:, :, t, :, None]).sum(dim=-2)  # S^T q
    out = out.transpose(1, 2).contiguous().to(out_dtype)
    return out, (state if output_final_state else None)
