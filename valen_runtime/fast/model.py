"""The fast model: Valen's text stack and vision tower run by the fast path's functions, built from
the reference modules' loaded weights (no copy but the fused projection matrices, which become
the modules' storage).

`FastText` answers the reference `TextModel`'s calls (`embed`, `new_cache`, a forward with an
optional `TextCache`) through the whole-layer functions of layers.py, and adds the one-pass
layout: the state's prefix and every branch's continuation in one row, one sweep of the layers.
`FastVision` answers `VisionModel`'s (`grid_tables`, `encode`, a forward) with SDPA per frame,
the patch conv as one GEMM where that computes the same numbers, and one compiled function for
every block. `FastModel.build` picks the kernels once, from the device and dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..cancel import checkpoint
from ..qwen35 import TextCache, TextModel, causal_mask, rms_norm
from ..vision import VisionBlock, VisionModel, frame_lengths, grid_list, per_frame
from .kernels import fla_available, fla_version, sdpa_vision_attention
from .layers import add, compile_layer_fns, gather_weights, make_layer_fns


def _dynamic(t: torch.Tensor, *dims: int) -> None:
    """Compile these dims symbolic from the first call (they vary per request; all other sizes stay
    static, so one compile per layer kind and cache shape serves every request)."""
    for d in dims:
        torch._dynamo.maybe_mark_dynamic(t, d)


# ---------------------------------------------------------------------------------------------
# Text


class OnePass(NamedTuple):
    """Where the rows of a one-pass forward come from: the prefixes' P rows lead (one per request
    that has one, back to back), then every branch's continuation (its state tail and suffix) of
    every request, packed back to back (R = P + T rows). plan.packed_indices builds them."""

    seq_ids: torch.Tensor  # [R] int64: the sequence of each row: continuation n >= 0, prefix of request g -1 - g
    offsets: torch.Tensor  # [R] int64: its position within that sequence
    conv_taps: torch.Tensor  # [K, R] int64: each row's causal-conv inputs, indices into [zeros (K-1) | row]
    cu_seqlens: torch.Tensor  # [n + 1] int64: the continuations' boundaries, counted from the first one
    chunk_indices: torch.Tensor  # [NT, 2] int64: (continuation, chunk) of every 64-token delta-rule chunk
    prefix_rows: torch.Tensor  # [P]: its length is the prefixes' total
    owners: torch.Tensor  # [R] int64: the request of each row
    prefix_cu_seqlens: torch.Tensor  # [m + 1] int64: the m non-empty prefixes' boundaries
    prefix_chunk_indices: torch.Tensor  # [NTp, 2] int64: (prefix, chunk) of every 64-token chunk of the prefixes
    initial_state_index: torch.Tensor  # [n] int64: each continuation's start: 0 the zero state, i prefix i-1's final state
    attention_rows: torch.Tensor  # [m, L] int64: each request's rows (prefix, then continuations), -1 pads to L
    attention_slots: torch.Tensor  # [R] int64: each row's place in the flattened [m, L]


def one_pass_mask(layout: OnePass, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive mask [m, 1, L, L] over each request's rows (`attention_rows`): a prefix row sees its
    prefix's earlier rows; a continuation row sees its request's whole prefix and its own sequence
    causally; a pad slot is seen by none and sees itself only (so no row is empty)."""
    rows = layout.attention_rows
    valid = rows >= 0
    index = rows.clamp(min=0)
    seq, offsets, owners = layout.seq_ids[index], layout.offsets[index], layout.owners[index]  # [m, L] each
    same = seq[:, :, None] == seq[:, None, :]
    causal = offsets[:, None, :] <= offsets[:, :, None]
    in_prefix = seq < 0
    same_request = owners[:, :, None] == owners[:, None, :]
    seen = ((same & causal) | (same_request & in_prefix[:, None, :] & ~in_prefix[:, :, None])) & valid[:, None, :]
    seen = seen | (torch.eye(rows.shape[1], dtype=torch.bool, device=device) & ~valid[:, :, None])
    return torch.where(seen, torch.zeros((), dtype=dtype, device=device), torch.finfo(dtype).min)[:, None]


class FastText:
    """The text stack on the whole-layer functions; weights are the reference `TextModel`'s."""

    def __init__(self, text: TextModel, delta_impl: str, compile: bool):
        self.config = text.config
        self.delta_impl = delta_impl
        self.embed_tokens = text.embed_tokens
        self.rotary_emb = text.rotary_emb
        self.norm_weight, self.eps = text.norm.weight, text.norm.eps
        self.layer_weights = [gather_weights(layer) for layer in text.layers]
        self.fns = make_layer_fns(text.config, delta_impl)
        self.final_norm = rms_norm
        if compile:
            self.fns = compile_layer_fns(self.fns)
            self.final_norm = torch.compile(rms_norm, dynamic=True, fullgraph=True)
        self._zeros: dict = {}  # zero conv history and recurrent state per (batch, dtype, device), read-only

    def new_cache(self) -> TextCache:
        return TextCache(self.config.layer_types)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def __call__(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, cache: TextCache | None = None) -> torch.Tensor:
        """As `TextModel.forward`: [B, T, H], positions [3, B, T], optional cache -> hidden [B, T, H]."""
        B, T, _ = inputs_embeds.shape
        past = cache.num_tokens if cache is not None else 0
        cos, sin = self.rotary_emb(inputs_embeds, position_ids)  # [B, T, R]
        mask = causal_mask(T, past, inputs_embeds.dtype, inputs_embeds.device)  # [1, 1, T, S]
        h = inputs_embeds
        for i in range(len(self.layer_weights)):
            checkpoint()  # a served request given up stops here (cancel.py)
            h = self.layer(i, h, cos, sin, mask, cache)
        if cache is not None:
            cache.num_tokens = past + T
        return self.final_norm(h, self.norm_weight, self.eps)

    def layer(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
              cache: TextCache | None = None) -> torch.Tensor:
        """Decoder layer i, as `DecoderLayer.forward`: x [B, T, H] -> [B, T, H], `cache` continued and
        updated in place (the layer function sees tensors only; this moves the entries in and out)."""
        _dynamic(x, 0, 1)
        w = self.layer_weights[i]
        if self.config.layer_types[i] == "linear_attention":
            return self._gdn(i, x, w, cache)
        return self._attention(i, x, w, cos, sin, mask, cache)

    def _gdn(self, i: int, x: torch.Tensor, w, cache: TextCache | None) -> torch.Tensor:
        prev = cache.conv_states[i] if cache is not None else None
        state = cache.recurrent_states[i] if cache is not None else None
        if prev is None:  # a fresh sequence: zero history, as the padded conv and a zero state
            prev, state = self._zero_history(x.shape[0], x)
        _dynamic(prev, 0)
        _dynamic(state, 0)
        x, tail, state = self.fns.gdn(x, prev, state, w)
        if cache is not None:
            cache.conv_states[i], cache.recurrent_states[i] = tail, state
        return x

    def _attention(self, i: int, x: torch.Tensor, w, cos, sin, mask, cache: TextCache | None) -> torch.Tensor:
        k_prev = cache.keys[i] if cache is not None else None
        v_prev = cache.values[i] if cache is not None else None
        _dynamic(cos, 0, 1)
        _dynamic(sin, 0, 1)
        _dynamic(mask, 2, 3)
        if k_prev is not None:
            _dynamic(k_prev, 0, 2)
            _dynamic(v_prev, 0, 2)
        x, k, v = self.fns.attention(x, cos, sin, mask, k_prev, v_prev, w)
        if cache is not None:
            cache.keys[i], cache.values[i] = k, v
        return x

    def one_pass(self, rows: torch.Tensor, position_ids: torch.Tensor, layout: OnePass) -> torch.Tensor:
        """The prefixes and every continuation in one sweep: rows [1, R, H], positions [3, 1, R] ->
        hidden [1, R, H]. Each GDN layer runs the delta rule over the prefixes from zero, then over
        the continuations, each from its prefix's final state; attention runs per request over its
        own rows, masked by `one_pass_mask`."""
        cos, sin = self.rotary_emb(rows, position_ids)  # [1, R, R_rot]
        mask = one_pass_mask(layout, rows.dtype, rows.device)  # [m, 1, L, L]
        _, zero_state = self._zero_history(1, rows)
        for t, dims in ((layout.conv_taps, (1,)), (layout.cu_seqlens, (0,)), (layout.chunk_indices, (0,)), (layout.prefix_rows, (0,)),
                        (layout.prefix_cu_seqlens, (0,)), (layout.prefix_chunk_indices, (0,)), (layout.initial_state_index, (0,)),
                        (layout.attention_rows, (0, 1)), (layout.attention_slots, (0,)), (mask, (0, 2, 3))):
            _dynamic(t, *dims)
        h = rows
        for i, w in enumerate(self.layer_weights):
            checkpoint()
            if self.config.layer_types[i] == "linear_attention":
                _dynamic(h, 0, 1)
                h = self.fns.gdn_one_pass(h, zero_state, layout.conv_taps, layout.prefix_rows, layout.prefix_cu_seqlens,
                                          layout.prefix_chunk_indices, layout.cu_seqlens, layout.chunk_indices,
                                          layout.initial_state_index, w)
            else:
                _dynamic(h, 0, 1)
                _dynamic(cos, 0, 1)
                _dynamic(sin, 0, 1)
                h = self.fns.attention_one_pass(h, cos, sin, mask, layout.attention_rows, layout.attention_slots, w)
        return self.final_norm(h, self.norm_weight, self.eps)

    def _zero_history(self, batch: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero conv history [B, C, K-1] and recurrent state [B, Hv, Dk, Dv] fp32, shared by all layers."""
        key = (batch, x.dtype, x.device)
        if key not in self._zeros:
            c = self.config
            conv_dim = 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
            self._zeros[key] = (
                x.new_zeros(batch, conv_dim, c.linear_conv_kernel_dim - 1),
                torch.zeros(batch, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim,
                            dtype=torch.float32, device=x.device),
            )
        return self._zeros[key]


# ---------------------------------------------------------------------------------------------
# Vision


def vision_block(block: VisionBlock, x: torch.Tensor, lengths: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`VisionBlock.forward` with SDPA for each frame's attention: x [N, E] -> [N, E]."""
    attn = block.attn
    q, k, v = attn.rotated_heads(block.norm1(x), cos, sin)  # [1, Hh, N, D]
    out = torch.cat([sdpa_vision_attention(qc, kc, vc, attn.scaling) for qc, kc, vc in per_frame(q, k, v, lengths)], dim=1)
    # The residual sums as layers.add: compiled, the first would otherwise reach norm2 unrounded.
    x = add(x, attn.proj(out.reshape(x.shape[0], -1).contiguous()))
    return add(x, block.mlp(block.norm2(x)))


def compiled_vision_block():
    """One torch.compile'd `vision_block` for every block (the block's weights are its inputs)."""
    compiled = torch.compile(vision_block, fullgraph=True, options={"emulate_precision_casts": True})

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


class FastVision:
    """The vision tower with SDPA, a GEMM patch embed and compiled blocks; weights are the reference's."""

    def __init__(self, vision: VisionModel, compile: bool):
        self.reference = vision
        weight = vision.patch_embed.proj.weight
        self.patch_gemm = patch_gemm_matches_conv(weight.dtype, weight.device)
        self.run_block = compiled_vision_block() if compile else vision_block

    def __call__(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        grids = grid_list(grid_thw)
        return self.encode(pixel_values, *self.grid_tables(grids), frame_lengths(grids))

    def grid_tables(self, grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.reference.grid_tables(grids)

    def encode(self, pixel_values: torch.Tensor, pos_embeds: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               lengths: list[int]) -> torch.Tensor:
        """As `VisionModel.encode` (capturable: no host work)."""
        x = self.patch_embed(pixel_values) + pos_embeds  # [N, E]
        for block in self.reference.blocks:
            checkpoint()
            x = self.run_block(block, x, lengths, cos, sin)
        return self.reference.merger(x)

    def patch_embed(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, P] -> [N, E]: the Conv3d (kernel = stride = one patch) as [N, P] @ [E, P]^T + b where
        that has the conv's products (cuBLAS instead of an implicit-GEMM conv)."""
        conv = self.reference.patch_embed.proj
        if not self.patch_gemm:
            return self.reference.patch_embed(pixel_values)
        w = conv.weight
        return F.linear(pixel_values.to(device=w.device, dtype=w.dtype), w.view(w.shape[0], -1), conv.bias)


# ---------------------------------------------------------------------------------------------


@dataclass
class FastModel:
    text: FastText
    vision: FastVision
    compiled: bool  # whether torch.compile runs its layer and block functions
    kernels: dict  # what runs where, for reports

    @classmethod
    def build(cls, model, compile: bool) -> "FastModel":
        """From a loaded model (weights.LoadedModel); several engines over one model can share the
        result (Engine's `fast` argument). FLA's products run in TF32 for fp32 inputs, so
        only bf16 models on CUDA take its delta rule; everything else keeps the reference rule."""
        use_fla = model.device.type == "cuda" and model.dtype != torch.float32 and fla_available()
        text = FastText(model.text, "fla" if use_fla else "torch", compile)
        vision = FastVision(model.vision, compile)
        kernels = {
            "gated_delta": f"fla-core {fla_version()}" if use_fla else "torch",
            "attention": "sdpa",
            "projections": "fused",
            "layers": "fused, torch.compile" if compile else "fused, eager",
            "vision_attention": "sdpa",
            "vision_blocks": "torch.compile" if compile else "eager",
            "patch_embed": "linear" if vision.patch_gemm else "conv (cuDNN, TF32 as in the reference)",
        }
        return cls(text, vision, compile, kernels)
