"""Whole decoder layers as functions of tensors, so one torch.compile serves all 24 layers.

The reference modules (qwen35.py) launch ~60 kernels per layer: every norm, cast, gate, residual
and LoRA add is its own launch, and at Valen's request sizes launches, not FLOPs, are the cost.
Here a layer is one function of tensors only (weights passed in as NamedTuples, no module state,
no cache object), so one compiled `gdn_layer` / `attention_layer` serves every layer and shape,
and inductor fuses everything between the GEMMs, the delta rule (one opaque custom op) and
attention into a few kernels. The elementwise pieces are the reference's (qwen35.py,
gated_delta.py) with every bf16 rounding eager makes written as `rounding.cast`, which a compiler
cannot fuse away (torch.compile drops some of them otherwise, and the compiled layers then stop
computing the reference's numbers); eagerly they compute the same bits as the reference. What
differs is the fused projections (projections.py), SDPA, and the causal conv written as K shifted
fp32 products summed and rounded once (what F.conv1d computes), which also reads a tap index so
packed sequences can share one history.

Shape letters as in qwen35.py; W weights.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from ..qwen35 import DecoderLayer, decay_and_beta, rotate_half
from .kernels import gated_delta_rule_op, gated_delta_rule_varlen_final_op, gated_delta_rule_varlen_op, sdpa_attention
from .projections import Projection, fuse, project
from .rounding import cast

# ---------------------------------------------------------------------------------------------
# Weights, gathered once from the reference modules (NamedTuples: the compiler flattens them into
# plain tensor inputs, so one compiled function serves every layer).


class MlpWeights(NamedTuple):
    post_norm: torch.Tensor
    gate_up: Projection  # [2I, H]
    down: Projection


class GdnWeights(NamedTuple):
    input_norm: torch.Tensor
    in_proj: Projection  # [C + Hv*Dv + Hv + Hv, H]: qkv | z | b | a
    conv: torch.Tensor  # [C, 1, K]
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    gated_norm: torch.Tensor
    out_proj: Projection
    mlp: MlpWeights


class AttentionWeights(NamedTuple):
    input_norm: torch.Tensor
    qkv: Projection  # [Hq*2D + 2*Hk*D, H]: q|gate, k, v
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    o_proj: Projection
    mlp: MlpWeights


def gather_weights(layer: DecoderLayer) -> GdnWeights | AttentionWeights:
    """One decoder layer's tensors in the order the layer functions read them (the fused
    projections become the modules' storage; see projections.fuse)."""
    mlp = layer.mlp
    mlp_w = MlpWeights(layer.post_attention_layernorm.weight, fuse([mlp.gate_proj, mlp.up_proj]), fuse([mlp.down_proj]))
    if layer.layer_type == "linear_attention":
        gdn = layer.linear_attn
        in_proj = fuse([gdn.in_proj_qkv, gdn.in_proj_z, gdn.in_proj_b, gdn.in_proj_a])
        return GdnWeights(layer.input_layernorm.weight, in_proj, gdn.conv1d.weight, gdn.A_log, gdn.dt_bias,
                          gdn.norm.weight, fuse([gdn.out_proj]), mlp_w)
    att = layer.self_attn
    return AttentionWeights(layer.input_layernorm.weight, fuse([att.q_proj, att.k_proj, att.v_proj]), att.q_norm.weight,
                            att.k_norm.weight, fuse([att.o_proj]), mlp_w)


# ---------------------------------------------------------------------------------------------
# The reference's elementwise pieces with eager's roundings as `cast` (a bf16 op rounds its fp32
# result once; `.float()` of a bf16 or fp32 value is exact). For fp32 inputs every cast is a no-op.


def add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x + y in x's dtype (a residual)."""
    return cast(x.float() + y.float(), x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """qwen35.rms_norm: normalise in fp32, scale by (1 + w) in fp32, one cast back."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return cast(h * (1.0 + weight.float()), x.dtype)


def rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """qwen35.rms_norm_gated: normalise in fp32, cast, times w in w's dtype, times silu(gate) in fp32."""
    h = x.float()
    h = cast(h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps), x.dtype)
    h = cast(weight.float() * h.float(), weight.dtype)
    return cast(h.float() * F.silu(gate.float()), x.dtype)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """gated_delta.l2norm: x * rsqrt(sum(x * x) + eps), every step in x's dtype."""
    dt = x.dtype
    sq = cast(x.float() * x.float(), dt)
    total = cast(cast(sq.float().sum(dim=-1, keepdim=True), dt).float() + eps, dt)
    return cast(x.float() * cast(torch.rsqrt(total.float()), dt).float(), dt)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """qwen35.apply_rotary (partial RoPE on the first R dims of q, k [B, H, T, D]; cos, sin [B, T, R])."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    r = cos.shape[-1]

    def rotate(t):
        dt = t.dtype
        rot = t[..., :r]
        turned = add(cast(rot.float() * cos.float(), dt), cast(rotate_half(rot).float() * sin.float(), dt))
        return torch.cat([turned, t[..., r:]], dim=-1)

    return rotate(q), rotate(k)


def silu_times(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """F.silu(gate) * up in gate's dtype (the MLP's activation)."""
    dt = gate.dtype
    return cast(cast(F.silu(gate.float()), dt).float() * up.float(), dt)


def sigmoid_gate(out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """out * torch.sigmoid(gate) in out's dtype (attention's output gate)."""
    return cast(out.float() * cast(torch.sigmoid(gate.float()), gate.dtype).float(), out.dtype)


def mlp_residual(x: torch.Tensor, eps: float, w: MlpWeights) -> torch.Tensor:
    """x + MLP(post_attention_layernorm(x)) with the gate and up projections as one GEMM."""
    h = rms_norm(x, w.post_norm, eps)
    gate, up = project(h, w.gate_up).chunk(2, dim=-1)  # [B, T, I] each
    return add(x, project(silu_times(gate, up), w.down))


def causal_conv_silu(mixed: torch.Tensor, prev: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU, continuing from the last K-1 inputs.

    mixed [B, T, C], prev [B, C, K-1] (zeros at the start), weight [C, 1, K] ->
    out [B, T, C] (conv summed in fp32, rounded once, then SiLU as F.silu does on it) and the new
    tail [B, C, K-1].
    """
    K, T = weight.shape[-1], mixed.shape[1]
    full = torch.cat([prev.transpose(1, 2).to(mixed.dtype), mixed], dim=1)  # [B, K-1+T, C]
    out = _conv_taps_silu([full[:, j : j + T] for j in range(K)], weight, mixed.dtype)
    return out, full[:, T:].transpose(1, 2)  # tail [B, C, K-1]


def causal_conv_silu_taps(mixed: torch.Tensor, weight: torch.Tensor, taps: torch.Tensor) -> torch.Tensor:
    """`causal_conv_silu` for sequences packed in one row, each reading its own earlier rows or
    before its start its history's (another sequence's last rows in the row, or zeros).

    mixed [1, T, C], weight [C, 1, K], taps [K, T] (indices into [zeros (K-1) | mixed] of each
    output's K inputs) -> out [1, T, C]. Same products and order as the unpacked form.
    """
    # Padding the rows with zeros keeps the source in mixed's layout (concatenating a [C, K-1]
    # history read it transposed: 154 -> 122 us per layer at 3408 rows on the H200).
    src = F.pad(mixed, (0, 0, weight.shape[-1] - 1, 0))  # [1, K-1+T, C]
    return _conv_taps_silu([src[:, taps[j]] for j in range(weight.shape[-1])], weight, mixed.dtype)


def _conv_taps_silu(taps: list[torch.Tensor], weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """silu(sum_j taps[j] * weight[:, 0, j]) with the sum in fp32 and one rounding to `dtype`;
    taps[j] [.., T, C] holds every output's j-th conv input."""
    w = weight[:, 0, :].float()  # [C, K]
    acc = taps[0].float() * w[:, 0]
    for j in range(1, len(taps)):
        acc = acc + taps[j].float() * w[:, j]
    return cast(F.silu(cast(acc, dtype).float()), dtype)


# ---------------------------------------------------------------------------------------------
# The layers


class LayerFns(NamedTuple):
    gdn: Callable  # (x, conv_prev, state_prev, w) -> (x, conv tail, state)
    gdn_one_pass: Callable  # (x, state_zero, taps, prefix_rows, prefix_cu_seqlens, prefix_chunk_indices,
    #                          cu_seqlens, chunk_indices, initial_state_index, w) -> x
    attention: Callable  # (x, cos, sin, mask, k_prev, v_prev, w) -> (x, keys, values)
    attention_one_pass: Callable  # (x, cos, sin, mask, rows, slots, w) -> x


def make_layer_fns(cfg, delta_impl: str) -> LayerFns:
    """The layer functions for one text config; sizes are closure constants to the compiler and
    `delta_impl` ("torch" or "fla") picks the delta rule behind the custom ops."""
    eps = cfg.rms_norm_eps
    Hkl, Hv, Dk, Dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    key_dim, value_dim = Hkl * Dk, Hv * Dv
    in_splits = [2 * key_dim + value_dim, value_dim, Hv, Hv]
    D, Hq, Hk = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    qkv_splits = [Hq * D * 2, Hk * D, Hk * D]
    scaling = D**-0.5

    def gdn_body(x, w: GdnWeights, conv: Callable, rule: Callable):
        """The GDN layer around its two sequence-mixing steps: conv(mixed) -> (mixed, tail) and
        rule(q, k, v, g, beta) -> (out, state), which differ between batched and packed rows."""
        B, T, _ = x.shape
        h = rms_norm(x, w.input_norm, eps)
        mixed, z, b, a = project(h, w.in_proj).split(in_splits, dim=-1)
        mixed, conv_tail = conv(mixed)  # [B, T, C]
        q, k, v = mixed.split([key_dim, key_dim, value_dim], dim=-1)
        q, k = l2norm(q.reshape(B, T, Hkl, Dk)), l2norm(k.reshape(B, T, Hkl, Dk))  # in the activation dtype
        if Hv // Hkl > 1:
            q, k = q.repeat_interleave(Hv // Hkl, dim=2), k.repeat_interleave(Hv // Hkl, dim=2)
        g, beta = decay_and_beta(a, b, w.A_log, w.dt_bias)  # [B, T, Hv]
        core, state = rule(q, k, v.reshape(B, T, Hv, Dv), g, beta)
        out = rms_norm_gated(core.reshape(-1, Dv), z.reshape(-1, Dv), w.gated_norm, eps).reshape(B, T, -1)
        x = add(x, project(out, w.out_proj))
        return mlp_residual(x, eps, w.mlp), conv_tail, state

    def gdn_layer(x, conv_prev, state_prev, w: GdnWeights):
        """x [B, T, H], conv_prev [B, C, K-1], state_prev [B, Hv, Dk, Dv] fp32 -> (x, conv tail, state)."""
        return gdn_body(
            x, w, lambda mixed: causal_conv_silu(mixed, conv_prev, w.conv),
            lambda q, k, v, g, beta: gated_delta_rule_op(q, k, v, g, beta, state_prev, delta_impl),
        )

    def gdn_layer_one_pass(x, state_zero, taps, prefix_rows, prefix_cu_seqlens, prefix_chunk_indices, cu_seqlens,
                           chunk_indices, initial_state_index, w: GdnWeights):
        """One pass over [prefixes (P rows) | packed continuations]: x [1, P + T, H]. The prefixes
        run from zero history, each continuation from its own prefix's final state (or zero
        without one), computed in this very layer (two varlen delta-rule calls); taps index
        [zeros (K-1) | row]; initial_state_index [n] picks from [zero state | prefix final states]. -> x."""
        P = prefix_rows.shape[0]

        def rule(q, k, v, g, beta):
            states = state_zero  # [1, Hv, Dk, Dv]
            if P > 0:
                zeros = state_zero.expand(prefix_cu_seqlens.shape[0] - 1, *state_zero.shape[1:]).contiguous()
                out_p, finals = gated_delta_rule_varlen_final_op(q[:, :P], k[:, :P], v[:, :P], g[:, :P], beta[:, :P], zeros,
                                                                 prefix_cu_seqlens, prefix_chunk_indices, delta_impl)
                states = torch.cat([state_zero, finals])  # [1 + m, Hv, Dk, Dv]
            initial = states.index_select(0, initial_state_index)  # [n, Hv, Dk, Dv]
            out_c = gated_delta_rule_varlen_op(q[:, P:], k[:, P:], v[:, P:], g[:, P:], beta[:, P:], initial, cu_seqlens,
                                               chunk_indices, delta_impl)
            return (torch.cat([out_p, out_c], dim=1) if P > 0 else out_c), None

        out, _, _ = gdn_body(x, w, lambda mixed: (causal_conv_silu_taps(mixed, w.conv, taps), None), rule)
        return out

    def attention_body(x, cos, sin, w: AttentionWeights, attend: Callable):
        """The attention layer around its sequence-mixing step attend(q [B, Hq, T, D], k, v [B, Hk, T, D])
        -> (out [B, T, Hq*D], keys, values), which differs between cached, batched and packed rows."""
        B, T, _ = x.shape
        h = rms_norm(x, w.input_norm, eps)
        q_out, k_out, v_out = project(h, w.qkv).split(qkv_splits, dim=-1)
        q, gate = torch.chunk(q_out.reshape(B, T, -1, D * 2), 2, dim=-1)
        q = rms_norm(q.reshape(B, T, -1, D), w.q_norm, eps).transpose(1, 2)  # [B, Hq, T, D]
        k = rms_norm(k_out.reshape(B, T, -1, D), w.k_norm, eps).transpose(1, 2)  # [B, Hk, T, D]
        v = v_out.reshape(B, T, -1, D).transpose(1, 2)
        q, k = apply_rotary(q, k, cos, sin)
        out, k, v = attend(q, k, v)
        out = sigmoid_gate(out, gate.reshape(B, T, -1))
        x = add(x, project(out, w.o_proj))
        return mlp_residual(x, eps, w.mlp), k, v

    def attention_layer(x, cos, sin, mask, k_prev, v_prev, w: AttentionWeights):
        """x [B, T, H], cos / sin [B, T, R], k_prev / v_prev [B, Hk, S-T, D] or None -> (x, keys, values)."""
        B, T, _ = x.shape

        def attend(q, k, v):
            if k_prev is not None:
                k, v = torch.cat([k_prev, k], dim=2), torch.cat([v_prev, v], dim=2)  # [B, Hk, S, D]
            return sdpa_attention(q, k, v, mask, scaling).reshape(B, T, -1), k, v  # [B, T, Hq*D]

        return attention_body(x, cos, sin, w, attend)

    def attention_layer_one_pass(x, cos, sin, mask, rows, slots, w: AttentionWeights):
        """Packed rows of m attention groups (`one_pass.OnePass`): x [1, R, H]; rows [m, L] (each
        group's rows, -1 pads), slots [R] (each row's place in the flattened [m, L]), mask [m, 1, L, L].
        With m > 1 attention runs per group on its own L rows (sum of L^2 work, not R^2); m = 1 is the
        plain packed row. -> x."""
        R = x.shape[1]

        def attend(q, k, v):
            m, L = rows.shape
            if m == 1:
                return sdpa_attention(q, k, v, mask, scaling).reshape(1, R, -1), k, v
            flat = rows.clamp(min=0).reshape(-1)  # pads read row 0; the mask hides them
            per_request = [t[0][:, flat].unflatten(1, (m, L)).transpose(0, 1) for t in (q, k, v)]  # [m, H, L, D]
            out = sdpa_attention(*per_request, mask, scaling).reshape(m * L, -1)  # [m * L, Hq*D]
            return out[slots][None], k, v  # [1, R, Hq*D]

        out, _, _ = attention_body(x, cos, sin, w, attend)
        return out

    return LayerFns(gdn_layer, gdn_layer_one_pass, attention_layer, attention_layer_one_pass)


def compile_layer_fns(fns: LayerFns) -> LayerFns:
    """torch.compile every layer function the way the fast model runs them."""
    # Each (batch 1 / batch N, with / without cached keys, LoRA / merged) combination is one
    # compiled variant per function; the default limit of 8 would silently fall back to eager.
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, 64)
    # emulate_precision_casts: keep eager's bf16 roundings between fused ops.
    return LayerFns(*(torch.compile(fn, fullgraph=True, options={"emulate_precision_casts": True}) for fn in fns))
