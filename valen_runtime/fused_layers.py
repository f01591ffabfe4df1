"""Whole decoder layers as pure tensor functions, so torch.compile can fuse them (CUDA fast path).

The module path (qwen35.py) launches ~60 kernels per layer: every norm, cast, gate, residual
and LoRA add is its own launch, and at Valen's request sizes launches, not FLOPs, are the cost.
Here a layer is one function of tensors only (weights passed in, no module state, no cache
object), so one torch.compile of `gdn_layer` / `attention_layer` serves all 24 layers and every
shape, and inductor fuses everything between the GEMMs, the delta-rule kernel and attention into
a few kernels. The delta rule enters as one opaque custom op (FLA's Triton kernel or the PyTorch
chunked rule), so the graph is whole.

The arithmetic is the module path's, call for call (the same helpers from qwen35 and
gated_delta); the differences are inductor's fused rounding (bf16 intermediate casts are kept:
`emulate_precision_casts`) and the causal conv written as K shifted products in fp32. Compared
with the module path eagerly and compiled (inductor's C++ backend) on the CPU and, in the
gpu-marked tests, compiled on CUDA; the CPU parity gate runs these functions against the
reference (`--kernels fast`). On the H200 a (b)-sized forward went from ~60 to ~26 kernels per
layer (docs/benchmarks.md).

Shape letters as in qwen35.py; W weights, A / B the FP32 LoRA factors (B pre-scaled, None when
the export is merged).
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from .gated_delta import chunk_gated_delta_rule, l2norm
from .qwen35 import apply_rotary, decay_and_beta, rms_norm, rms_norm_gated

# ---------------------------------------------------------------------------------------------
# The delta rule as one custom op (opaque to the compiler)

def torch_varlen_delta_rule(q, k, v, g, beta, initial_state, cu_seqlens, chunk_indices):
    """Packed sequences one after the other through the chunked PyTorch rule (reads cu_seqlens on
    the host, so it cannot be captured in a CUDA graph). Shapes as `gated_delta_rule_varlen_op`."""
    bounds = cu_seqlens.tolist()
    outs = []
    for n, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        out, _ = chunk_gated_delta_rule(
            q[:, start:end], k[:, start:end], v[:, start:end], g[:, start:end], beta[:, start:end],
            initial_state=initial_state[n : n + 1], output_final_state=False, use_qk_l2norm_in_kernel=False,
        )
        outs.append(out)
    return torch.cat(outs, dim=1)


_DELTA_RULES: dict[str, Callable] = {"torch": chunk_gated_delta_rule}
_VARLEN_DELTA_RULES: dict[str, Callable] = {"torch": torch_varlen_delta_rule}


def register_delta_rule(name: str, fn: Callable, varlen: Callable | None = None) -> None:
    """Make `fn` (gated_delta.chunk_gated_delta_rule's signature) selectable as impl=`name`, and
    `varlen` (torch_varlen_delta_rule's) for packed sequences."""
    _DELTA_RULES[name] = fn
    if varlen is not None:
        _VARLEN_DELTA_RULES[name] = varlen


@torch.library.custom_op("valen::gated_delta_rule", mutates_args=())
def gated_delta_rule_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    initial_state: torch.Tensor, impl: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k already L2-normalised [B, T, H, Dk]; v [B, T, H, Dv]; g, beta [B, T, H]; state [B, H, Dk, Dv] fp32."""
    out, final = _DELTA_RULES[impl](
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
    initial_state [n, H, Dk, Dv] fp32, one per sequence; cu_seqlens [n + 1]; -> out [1, T, H, Dv]."""
    return _VARLEN_DELTA_RULES[impl](q, k, v, g, beta, initial_state, cu_seqlens, chunk_indices).contiguous()


@gated_delta_rule_varlen_op.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, chunk_indices, impl):
    return v.new_empty(v.shape)


# ---------------------------------------------------------------------------------------------
# Shared pieces


def project(x: torch.Tensor, p: "Projection") -> torch.Tensor:
    """x @ W^T for projections fused along the output, plus each member's FP32 LoRA.

    The LoRA B products run as one batched GEMM over equal row blocks of the members
    ([G, M, r] @ [G, r, Nb]) rather than one block-diagonal GEMM whose zero blocks would multiply
    the work by the member count; each output is still one r-term fp32 sum, as in PEFT.
    """
    out = F.linear(x, p.weight)
    if p.lora_a is None:
        return out
    if p.lora_a.dtype != torch.float32:  # the factors as exact bf16 splits (split_lora_factors)
        return (out + _split_lora_delta(x, p)).to(out.dtype)
    h = F.linear(x.float(), p.lora_a)  # [..., n*r]: every member's A(x)
    delta = _grouped_lora_b(h, p, p.lora_b.shape[-1], lambda t: t, torch.bmm, F.linear)
    return (out + delta).to(out.dtype)


def _grouped_lora_b(h: torch.Tensor, p: "Projection", r: int, prepare: Callable, bmm: Callable, linear: Callable) -> torch.Tensor:
    """Every member's B(A(x)) [..., N] from h = A(x) [..., n*r] fp32: the wide members as one
    batched GEMM over their Nb-row blocks, the narrow trailing ones as one block-diagonal GEMM.
    `prepare` lays an h piece out for the factors' form (identity, or the bf16x3 pairs) and
    bmm / linear are the GEMMs that take it."""
    lead = h.shape[:-1]
    per_member = h.reshape(-1, h.shape[-1] // r, r)  # [M, n, r]
    lhs = prepare(per_member[:, list(p.groups)].transpose(0, 1))  # [G, M, r (or 8r)]: each block's member
    delta = bmm(lhs, p.lora_b.transpose(1, 2)).transpose(0, 1).reshape(*lead, -1)  # [..., G*Nb]
    if p.lora_b_small is not None:  # trailing members too narrow to block (GDN's b and a: Hv rows)
        n_big = p.groups[-1] + 1
        delta = torch.cat([delta, linear(prepare(h[..., n_big * r :]), p.lora_b_small)], dim=-1)
    return delta


# ---------------------------------------------------------------------------------------------
# The FP32 LoRA on bf16 tensor cores, without giving up fp32 (opt-in: lora_gemm="bf16x3")
#
# Every fp32 number is the exact sum of three bf16 numbers (8 + 8 + 8 significant bits, each
# remainder at most half an ulp of the previous piece). A product of two bf16 numbers is exact in
# fp32, so A(x) for bf16 x is a sum of exact products, and B(h) for the split h and B one of the
# 8 of 9 pairs of pieces that reach fp32 precision; the tensor cores accumulate in fp32. The
# result differs from fp32 GEMMs by fp32 roundings only: against fp64 on the CPU its max error
# was 2.0e-7 where PEFT's fp32 GEMMs had 3.0e-7 (tests/valen_runtime/test_fused_layers.py).


def split_bf16x3(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 t -> bf16 (t1, t2, t3) with t == (t1 + t2) + t3 exactly in fp32, for |t| in
    [2^-100, 2^127) (smaller pieces would be subnormal; the top binade rounds to inf)."""
    t1 = t.to(torch.bfloat16)
    rest = t - t1.float()
    t2 = rest.to(torch.bfloat16)
    return t1, t2, (rest - t2.float()).to(torch.bfloat16)


# The (i, j) pairs of h_i * B_j that matter (h3 * B3 is 2^-32 of the result), smallest first, so a
# GEMM that sums along K in order adds the small terms before the large ones.
_PAIRS = ((2, 1), (1, 2), (2, 0), (1, 1), (0, 2), (1, 0), (0, 1), (0, 0))


def _paired(pieces, side: int) -> torch.Tensor:
    """Three pieces laid along the last dim in _PAIRS order, for the left (0) or right (1) factor:
    lhs_k * rhs_k summed over k is sum h_i * B_j over the pairs."""
    return torch.cat([pieces[pair[side]] for pair in _PAIRS], dim=-1)


def _linear_f32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w^T for bf16 x [..., K], w [N, K], accumulated and returned in fp32 (cuBLAS on CUDA;
    elsewhere the same exact products through an fp32 GEMM)."""
    if x.is_cuda:
        flat = torch.mm(x.reshape(-1, x.shape[-1]), w.t(), out_dtype=torch.float32)
        return flat.view(*x.shape[:-1], w.shape[0])
    return F.linear(x.float(), w.float())


def _bmm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.bmm(a, b, out_dtype=torch.float32) if a.is_cuda else torch.bmm(a.float(), b.float())


def _split_lora_delta(x: torch.Tensor, p: "Projection") -> torch.Tensor:
    """`project`'s fp32 LoRA delta [..., N] from the split factors; x must be bf16."""
    nr = p.lora_a.shape[0] // 3
    h3 = _linear_f32(x, p.lora_a)  # [..., 3*n*r]: x.A1 | x.A2 | x.A3
    h = (h3[..., :nr] + h3[..., nr : 2 * nr]) + h3[..., 2 * nr :]  # [..., n*r] = A(x), fp32
    r = p.lora_b.shape[-1] // len(_PAIRS)
    return _grouped_lora_b(h, p, r, lambda t: _paired(split_bf16x3(t), 0), _bmm_f32, _linear_f32)


def split_lora_factors(p: "Projection") -> "Projection":
    """The projection with its FP32 LoRA factors in the bf16x3 form `project` runs on tensor
    cores: A as [A1; A2; A3] rows, B (and the narrow block) as the _PAIRS pieces along r."""
    if p.lora_a is None or p.lora_a.dtype != torch.float32:
        return p
    lora_a = torch.cat(split_bf16x3(p.lora_a))  # [3*n*r, in]
    lora_b = _paired(split_bf16x3(p.lora_b), 1)  # [G, Nb, 8r]
    small = None if p.lora_b_small is None else _paired(split_bf16x3(p.lora_b_small), 1)
    return p._replace(lora_a=lora_a, lora_b=lora_b, lora_b_small=small)


def map_projections(weights, fn: Callable):
    """Apply fn to every Projection inside a layer's weight NamedTuples."""
    if isinstance(weights, Projection):
        return fn(weights)
    if isinstance(weights, tuple) and hasattr(weights, "_fields"):
        return weights._replace(**{k: map_projections(v, fn) for k, v in zip(weights._fields, weights)})
    return weights


def mlp_residual(x: torch.Tensor, eps: float, w: "MlpWeights") -> torch.Tensor:
    """x + MLP(post_attention_layernorm(x)) with the gate and up projections as one GEMM."""
    h = rms_norm(x, w.post_norm, eps)
    gate, up = project(h, w.gate_up).chunk(2, dim=-1)  # [B, T, I] each
    return x + project(F.silu(gate) * up, w.down)


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


def _conv_taps_silu(taps: list[torch.Tensor], weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """silu(sum_j taps[j] * weight[:, 0, j]) with the sum in fp32 and one rounding to `dtype`;
    taps[j] [.., T, C] holds every output's j-th conv input."""
    w = weight[:, 0, :].float()  # [C, K]
    acc = taps[0].float() * w[:, 0]
    for j in range(1, len(taps)):
        acc = acc + taps[j].float() * w[:, j]
    return F.silu(acc.to(dtype))


def causal_conv_silu_packed(mixed: torch.Tensor, prev: torch.Tensor, weight: torch.Tensor, taps: torch.Tensor) -> torch.Tensor:
    """`causal_conv_silu` for packed sequences that all continue the same history.

    mixed [1, T, C], prev [1, C, K-1], weight [C, 1, K], taps [K, T] (indices into
    [prev | mixed] of each output's K inputs: a token's own sequence, or the shared history
    before its start) -> out [1, T, C]. Same products and order as the unpacked form.
    """
    src = torch.cat([prev.transpose(1, 2).to(mixed.dtype), mixed], dim=1)  # [1, K-1+T, C]
    return _conv_taps_silu([src[:, taps[j]] for j in range(weight.shape[-1])], weight, mixed.dtype)


# ---------------------------------------------------------------------------------------------
# Weights, gathered once from the loaded modules (the fused projections' storage; the LoRA factors
# are small fp32 copies with the scale folded into B). NamedTuples, because the compiler flattens
# them into plain tensor inputs: one compiled function serves every layer.


class Projection(NamedTuple):
    """Projections of one input fused along the output, with their LoRA factors (None when merged)."""

    weight: torch.Tensor  # [sum N_i, in]
    lora_a: torch.Tensor | None  # [n*r, in] fp32: every member's A, stacked
    lora_b: torch.Tensor | None  # [G, Nb, r] fp32, scale folded: the wide members cut into Nb-row blocks
    lora_b_small: torch.Tensor | None  # [sum N_small, n_small*r] block-diagonal, the narrow trailing members
    groups: tuple[int, ...]  # the member each Nb block belongs to


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


NARROW = 256  # members with fewer output rows are not worth a block of their own


def projection(members: list, weight: torch.Tensor | None = None) -> Projection:
    """One projection's tensors: `weight` is the members' fused matrix (a lone member's own if None)."""
    if weight is None:
        if len(members) > 1:
            raise ValueError("several members need their fused weight (fast.FusedProjection)")
        weight = members[0].weight
    if all(m.lora_A is None for m in members):
        return Projection(weight, None, None, None, ())
    if any(m.lora_A is None for m in members):
        raise ValueError("cannot fuse projections where only some carry a LoRA adapter")
    ranks = {m.lora_A.weight.shape[0] for m in members}
    if len(ranks) != 1:
        raise ValueError(f"fused projections need one LoRA rank, got {sorted(ranks)}")
    (r,) = ranks
    sizes = [m.out_features for m in members]
    n_wide = len(sizes)
    while n_wide > 1 and sizes[n_wide - 1] < NARROW:
        n_wide -= 1
    block = math.gcd(*sizes[:n_wide])
    groups = tuple(i for i in range(n_wide) for _ in range(sizes[i] // block))
    scaled = [m.lora_B.weight.detach() * m.lora_scale for m in members]  # [N_i, r] fp32
    lora_b = torch.cat([b.view(-1, block, r) for b in scaled[:n_wide]])  # [G, Nb, r]
    small = torch.block_diag(*scaled[n_wide:]) if n_wide < len(members) else None
    lora_a = torch.cat([m.lora_A.weight.detach() for m in members])
    return Projection(weight, lora_a, lora_b, small, groups)


def gather_weights(layer) -> GdnWeights | AttentionWeights:
    """One decoder layer's tensors in the order the layer functions read them (no weight copies)."""
    mlp = layer.mlp
    mlp_w = MlpWeights(layer.post_attention_layernorm.weight, _fused(mlp.fused_gate_up), projection([mlp.down_proj]))
    if layer.layer_type == "linear_attention":
        gdn = layer.linear_attn
        return GdnWeights(layer.input_layernorm.weight, _fused(gdn.fused_in_proj), gdn.conv1d.weight, gdn.A_log,
                          gdn.dt_bias, gdn.norm.weight, projection([gdn.out_proj]), mlp_w)
    att = layer.self_attn
    return AttentionWeights(layer.input_layernorm.weight, _fused(att.fused_qkv), att.q_norm.weight,
                            att.k_norm.weight, projection([att.o_proj]), mlp_w)


def _fused(fused) -> Projection:
    if fused is None:
        raise ValueError("fused layers need the fused projections first (fast.fuse_projections)")
    return fused.projection


# ---------------------------------------------------------------------------------------------
# The layers


def make_layer_fns(cfg, attention_core: Callable, delta_impl: str):
    """gdn_layer / attention_layer, and the GDN layer's packed (continuations of a cached prefix)
    and tree (prefix and continuations in one pass) forms, for one text config; sizes are closure
    constants to the compiler."""
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
        x = x + project(out, w.out_proj)
        return mlp_residual(x, eps, w.mlp), conv_tail, state

    def gdn_layer(x, conv_prev, state_prev, w: GdnWeights):
        """x [B, T, H], conv_prev [B, C, K-1], state_prev [B, Hv, Dk, Dv] fp32 -> (x, conv tail, state)."""
        return gdn_body(
            x, w, lambda mixed: causal_conv_silu(mixed, conv_prev, w.conv),
            lambda q, k, v, g, beta: gated_delta_rule_op(q, k, v, g, beta, state_prev, delta_impl),
        )

    def gdn_layer_packed(x, conv_prev, initial, taps, cu_seqlens, chunk_indices, w: GdnWeights):
        """Packed rows: x [1, T, H], conv_prev [1, C, K-1], initial [n, Hv, Dk, Dv] fp32 -> x."""
        out, _, _ = gdn_body(
            x, w, lambda mixed: (causal_conv_silu_packed(mixed, conv_prev, w.conv, taps), None),
            lambda q, k, v, g, beta: (gated_delta_rule_varlen_op(q, k, v, g, beta, initial, cu_seqlens, chunk_indices, delta_impl), None),
        )
        return out

    def gdn_layer_tree(x, conv_zero, state_zero, taps, prefix_rows, cu_seqlens, chunk_indices, w: GdnWeights):
        """One pass over [prefix (P rows) | packed continuations]: x [1, P + T, H]; the prefix starts
        from zero history, the continuations from the prefix's final state, computed in this very
        layer (two delta-rule calls); taps index [zeros (K-1) | row]. -> x."""
        P = prefix_rows.shape[0]

        def rule(q, k, v, g, beta):
            out_p, state = gated_delta_rule_op(q[:, :P], k[:, :P], v[:, :P], g[:, :P], beta[:, :P], state_zero, delta_impl)
            initial = state.expand(cu_seqlens.shape[0] - 1, *state.shape[1:]).contiguous()  # [n, Hv, Dk, Dv]
            out_c = gated_delta_rule_varlen_op(q[:, P:], k[:, P:], v[:, P:], g[:, P:], beta[:, P:], initial, cu_seqlens,
                                               chunk_indices, delta_impl)
            return torch.cat([out_p, out_c], dim=1), None

        out, _, _ = gdn_body(x, w, lambda mixed: (causal_conv_silu_packed(mixed, conv_zero, w.conv, taps), None), rule)
        return out

    def attention_layer(x, cos, sin, mask, k_prev, v_prev, w: AttentionWeights):
        """x [B, T, H], cos / sin [B, T, R], k_prev / v_prev [B, Hk, S-T, D] or None -> (x, keys, values)."""
        B, T, _ = x.shape
        h = rms_norm(x, w.input_norm, eps)
        q_out, k_out, v_out = project(h, w.qkv).split(qkv_splits, dim=-1)
        q, gate = torch.chunk(q_out.reshape(B, T, -1, D * 2), 2, dim=-1)
        q = rms_norm(q.reshape(B, T, -1, D), w.q_norm, eps).transpose(1, 2)  # [B, Hq, T, D]
        k = rms_norm(k_out.reshape(B, T, -1, D), w.k_norm, eps).transpose(1, 2)  # [B, Hk, T, D]
        v = v_out.reshape(B, T, -1, D).transpose(1, 2)
        q, k = apply_rotary(q, k, cos, sin)
        if k_prev is not None:
            k, v = torch.cat([k_prev, k], dim=2), torch.cat([v_prev, v], dim=2)  # [B, Hk, S, D]
        out = attention_core(q, k, v, mask, scaling).reshape(B, T, -1)  # [B, T, Hq*D]
        out = out * torch.sigmoid(gate.reshape(B, T, -1))
        x = x + project(out, w.o_proj)
        return mlp_residual(x, eps, w.mlp), k, v

    return gdn_layer, attention_layer, gdn_layer_packed, gdn_layer_tree


def _dynamic(t: torch.Tensor, *dims: int) -> None:
    for d in dims:
        torch._dynamo.maybe_mark_dynamic(t, d)


class FusedLayer:
    """Stands in for a DecoderLayer's forward (the `fused_forward` seam): moves the cache entries in
    and out of the layer function, which sees tensors only."""

    def __init__(self, layer, fn: Callable, zeros: dict | None = None, packed_fn: Callable | None = None,
                 tree_fn: Callable | None = None):
        self.layer_idx = layer.linear_attn.layer_idx if layer.layer_type == "linear_attention" else layer.self_attn.layer_idx
        self.kind = layer.layer_type
        self.weights = gather_weights(layer)
        self.fn = fn
        self.packed_fn = packed_fn
        self.tree_fn = tree_fn
        self.zeros = zeros if zeros is not None else {}
        if self.kind == "linear_attention":
            gdn = layer.linear_attn
            self.conv_shape = (gdn.conv_dim, gdn.kernel_size - 1)
            self.state_shape = (gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim)

    def _zero_history(self, batch: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero conv history and recurrent state, shared by all layers (the functions only read them)."""
        key = (batch, x.dtype, x.device)
        if key not in self.zeros:
            self.zeros[key] = (x.new_zeros(batch, *self.conv_shape),
                               torch.zeros(batch, *self.state_shape, dtype=torch.float32, device=x.device))
        return self.zeros[key]

    def __call__(self, x, cos, sin, mask, cache=None, packing=None):
        i = self.layer_idx
        # Batch and lengths vary per request: compile those dims symbolic from the start (all other
        # sizes stay static, so one compile per layer kind and cache shape serves every request).
        _dynamic(x, 0, 1)
        if self.kind == "linear_attention":
            B = x.shape[0]
            prev = cache.conv_states[i] if cache is not None else None
            state = cache.recurrent_states[i] if cache is not None else None
            if prev is None:  # a fresh sequence: zero history, as the padded conv and a zero state
                prev, state = self._zero_history(B, x)
            if packing is not None:
                _dynamic(packing.conv_taps, 1)
                _dynamic(packing.cu_seqlens, 0)
                _dynamic(packing.chunk_indices, 0)
                if packing.prefix_rows is not None:  # prefix and continuations, one pass
                    if self.tree_fn is None or cache is not None:
                        raise ValueError("a one-pass packing needs this layer's tree form and no cache")
                    _dynamic(packing.prefix_rows, 0)
                    return self.tree_fn(x, prev, state, packing.conv_taps, packing.prefix_rows, packing.cu_seqlens,
                                        packing.chunk_indices, self.weights)
                if self.packed_fn is None:
                    raise ValueError("this fused layer has no packed form")
                # Every packed sequence starts from the same (batch-1) history.
                initial = state.expand(packing.cu_seqlens.shape[0] - 1, *state.shape[1:]).contiguous()
                _dynamic(initial, 0)
                return self.packed_fn(x, prev, initial, packing.conv_taps, packing.cu_seqlens, packing.chunk_indices, self.weights)
            _dynamic(prev, 0)
            _dynamic(state, 0)
            x, tail, state = self.fn(x, prev, state, self.weights)
            if cache is not None:
                cache.conv_states[i], cache.recurrent_states[i] = tail, state
            return x
        k_prev = cache.keys[i] if cache is not None else None
        v_prev = cache.values[i] if cache is not None else None
        _dynamic(cos, 0, 1)
        _dynamic(sin, 0, 1)
        _dynamic(mask, 2, 3)
        if k_prev is not None:
            _dynamic(k_prev, 0, 2)
            _dynamic(v_prev, 0, 2)
        x, k, v = self.fn(x, cos, sin, mask, k_prev, v_prev, self.weights)
        if cache is not None:
            cache.keys[i], cache.values[i] = k, v
        return x


def compile_layer_fn(fn: Callable) -> Callable:
    """torch.compile one layer function the way the fused layers run it."""
    # Each (batch 1 / batch N, with / without cached keys, LoRA / merged) combination is one
    # compiled variant per function; the default limit of 8 would silently fall back to eager.
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, 64)
    # emulate_precision_casts: keep eager's bf16 roundings between fused ops.
    return torch.compile(fn, fullgraph=True, options={"emulate_precision_casts": True})


def enable_fused_layers(text_model, attention_core: Callable, delta_impl: str, compile: bool = True,
                        lora_gemm: str = "fp32") -> None:
    """Route every decoder layer through the (compiled) layer functions; lora_gemm="bf16x3" runs
    the FP32 LoRA factors as exact bf16 splits on tensor cores (bf16 models only)."""
    gdn_layer, attention_layer, gdn_layer_packed, gdn_layer_tree = make_layer_fns(text_model.config, attention_core, delta_impl)
    if compile:
        gdn_layer, attention_layer, gdn_layer_packed, gdn_layer_tree = (
            compile_layer_fn(fn) for fn in (gdn_layer, attention_layer, gdn_layer_packed, gdn_layer_tree))
    zeros: dict = {}  # one zero history per batch size for every layer
    for layer in text_model.layers:
        if layer.layer_type == "linear_attention":
            layer.fused_forward = FusedLayer(layer, gdn_layer, zeros, packed_fn=gdn_layer_packed, tree_fn=gdn_layer_tree)
        else:
            layer.fused_forward = FusedLayer(layer, attention_layer, zeros)
        if lora_gemm == "bf16x3":
            layer.fused_forward.weights = map_projections(layer.fused_forward.weights, split_lora_factors)
