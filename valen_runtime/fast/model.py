"""The fast model: Valen's text stack and vision tower run by the fast path's functions, built from
the reference modules' loaded weights (no copy but the fused projection matrices, which become
the modules' storage).

`FastText` answers the reference `TextModel`'s calls (`embed`, `new_cache`, a forward with an
optional `TextCache`) through the whole-layer functions of layers.py, and adds the one-pass
layout (`layouts.one_pass`): the state's prefix and every branch's continuation in one row, one
sweep of the layers.
`FastVision` answers `VisionModel`'s (`grid_tables`, `encode`, a forward) with SDPA per frame,
the patch conv as one GEMM where that computes the same numbers, and one compiled function for
every block. `FastModel.build` takes its kernels from resolved `EngineOptions`; nothing here picks one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ..cancel import checkpoint
from ..layouts.one_pass import OnePass, one_pass_mask
from ..qwen35 import TextCache, TextModel, causal_mask, rms_norm
from ..vision import VisionBlock, VisionModel, frame_lengths, grid_list, per_frame
from .kernels import fla_available, fla_configs, fla_version, sdpa_vision_attention
from .layers import add, compile_layer_fns, gather_weights, make_layer_fns

if TYPE_CHECKING:
    from ..options import EngineOptions


def _dynamic(t: torch.Tensor, *dims: int) -> None:
    """Compile these dims symbolic from the first call (they vary per request; all other sizes stay
    static, so one compile per layer kind and cache shape serves every request)."""
    for d in dims:
        torch._dynamo.maybe_mark_dynamic(t, d)


# ---------------------------------------------------------------------------------------------
# Text


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
        the continuations, each from its prefix's final state; attention runs per group (a request
        with a prefix, or the requests without one) over its own rows, masked by `one_pass_mask`."""
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


class FastVision:
    """The vision tower with SDPA, a GEMM patch embed and compiled blocks; weights are the reference's."""

    def __init__(self, vision: VisionModel, patch_gemm: bool, compile: bool):
        self.reference = vision
        self.patch_gemm = patch_gemm  # the patch embed as one GEMM (EngineOptions.patch_embed == "linear")
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
    def build(cls, model, options: "EngineOptions") -> "FastModel":
        """From a loaded model (weights.LoadedModel) and the options it runs under (resolved:
        delta_kernel, patch_embed, compile); several engines over one model can share the result
        (Engine's `fast` argument)."""
        compile = options.compile
        if options.delta_kernel == "fla":
            fla_available()  # imports FLA (after choosing its kernel configurations) before anything runs
        text = FastText(model.text, options.delta_kernel, compile)
        vision = FastVision(model.vision, options.patch_embed == "linear", compile)
        kernels = {
            "gated_delta": f"fla-core {fla_version()}, {fla_configs()}" if options.delta_kernel == "fla" else "torch",
            "attention": "sdpa",
            "projections": "fused",
            "layers": "fused, torch.compile" if compile else "fused, eager",
            "vision_attention": "sdpa",
            "vision_blocks": "torch.compile" if compile else "eager",
            "patch_embed": "linear" if vision.patch_gemm else "conv (cuDNN, TF32 as in the reference)",
        }
        return cls(text, vision, compile, kernels)
