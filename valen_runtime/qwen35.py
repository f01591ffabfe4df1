"""Qwen3.5 text model (the `language_model` of Qwen3_5ForConditionalGeneration) as plain nn.Modules.

Parameter names equal the HF names with `model.language_model.` stripped, so an exported state dict
loads one-to-one (`load_state_dict(sd, strict=True, assign=True)` after a meta-device build). The
arithmetic mirrors transformers 5.4.0's eager path op for op (fp32 RMSNorm with 1 + w, gated
attention with eager fp32 softmax, interleaved M-RoPE, Gated DeltaNet on the torch fallback), and
every projection is a `LoRALinear` that computes PEFT 0.18.1's unmerged LoRA when adapters are
attached. `TextCache` carries per-layer state so a forward can continue from an earlier prefix.
File loading, tokenisation, the vision tower and the head live elsewhere; the CUDA fast path
(valen_runtime/fast/) is a second implementation built from these modules' weights, and nothing
here knows about it.

Shape letters:
    B batch, T tokens in this forward, S cached + new tokens (keys), H hidden size,
    Hq / Hk attention query / key-value heads, D attention head dim, R rotary dims,
    Hv / Hkl linear-attention value / key heads, Dk / Dv linear key / value head dims,
    C conv channels (2 * Hkl * Dk + Hv * Dv), K conv kernel, I MLP intermediate size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from valen_runtime.cancel import checkpoint
from valen_runtime.config import TextConfig
from valen_runtime.errors import WeightsError
from valen_runtime.gated_delta import chunk_gated_delta_rule

# --------------------------------------------------------------------------------------------
# Projections with optional unmerged LoRA


class LoRALinear(nn.Module):
    """Bias-free Linear with optional FP32 `lora_A` / `lora_B` children (PEFT's lora.Linear maths)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.register_module("lora_A", None)
        self.register_module("lora_B", None)
        self.lora_scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = F.linear(x, self.weight)
        if self.lora_A is None:
            return result
        # peft 0.18.1 lora.Linear.forward: input cast to the adapter dtype, B(A(x)) * scaling added to
        # the base result (bf16 + fp32 promotes to fp32), then one cast back to the base result dtype.
        result_dtype = result.dtype
        x = x.to(self.lora_A.weight.dtype)
        result = result + self.lora_B(self.lora_A(x)) * self.lora_scale
        return result.to(result_dtype)

    def extra_repr(self) -> str:
        text = f"in_features={self.in_features}, out_features={self.out_features}"
        return text if self.lora_A is None else f"{text}, lora_scale={self.lora_scale}"


def attach_lora(model: nn.Module, adapter: dict[str, torch.Tensor], scale: float) -> None:
    """Create FP32 `lora_A` / `lora_B` children on the named LoRALinear modules.

    Args:
        model: a `TextModel` (names are relative to it).
        adapter: `layers.{i}.{module}.lora_A.weight` / `.lora_B.weight` -> tensor, i.e. the exported
            adapter file with its `base_model.model.model.language_model.` prefix stripped.
        scale: lora_alpha / r, multiplied onto B(A(x)).
    Raises:
        WeightsError: unknown names, a missing A/B partner, a target that is not a projection,
            or shapes that do not fit; the model is left unchanged.
    The children hold the given tensors (cast to fp32 on the base weight's device if needed).
    """
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    unknown = []
    for name, tensor in adapter.items():
        for part in ("lora_A", "lora_B"):
            suffix = f".{part}.weight"
            if name.endswith(suffix):
                pairs.setdefault(name[: -len(suffix)], {})[part] = tensor
                break
        else:
            unknown.append(name)
    modules = dict(model.named_modules())
    unknown += sorted(f"{m}.lora_*.weight" for m in pairs if not isinstance(modules.get(m), LoRALinear))
    if unknown:
        raise WeightsError(f"adapter names that match no projection: {sorted(unknown)}")
    incomplete = sorted(m for m, p in pairs.items() if len(p) != 2)
    if incomplete:
        raise WeightsError(f"adapter modules without both lora_A and lora_B: {incomplete}")
    for name, p in sorted(pairs.items()):
        base, a, b = modules[name], p["lora_A"], p["lora_B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != base.in_features or b.shape != (base.out_features, a.shape[0]):
            raise WeightsError(
                f"{name}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit a "
                f"{base.in_features} -> {base.out_features} projection"
            )
    for name, p in pairs.items():
        base = modules[name]
        # Next to the base weight; on a meta-built model, wherever the adapter tensors already are.
        device = base.weight.device if base.weight.device.type != "meta" else p["lora_A"].device
        for part, (n_in, n_out) in (("lora_A", (base.in_features, p["lora_A"].shape[0])),
                                    ("lora_B", (p["lora_B"].shape[1], base.out_features))):
            child = nn.Linear(n_in, n_out, bias=False, device="meta")
            # Assigned like load_state_dict(assign=True): no copy when already fp32 on that device.
            child.weight = nn.Parameter(p[part].to(device=device, dtype=torch.float32))
            setattr(base, part, child)
        base.lora_scale = float(scale)


# --------------------------------------------------------------------------------------------
# Norms, rotary embedding, MLP


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3_5RMSNorm: normalise in fp32, scale by (1 + w) in fp32, one cast back."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).type_as(x)


def rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3_5RMSNormGated: plain weight; normalise in fp32, cast, times w, times silu(gate) in fp32."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    # w * h runs in the weight's dtype (bf16 x bf16 in the reference, whose weight is bf16-rounded).
    h = weight * h.to(dtype)
    h = h * F.silu(gate.to(torch.float32))
    return h.to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class RMSNormGated(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return rms_norm_gated(x, gate, self.weight, self.eps)


class TextRotaryEmbedding(nn.Module):
    """Interleaved M-RoPE cos/sin as Qwen3_5TextRotaryEmbedding (default rope type) computes them."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        rope = cfg.rope_parameters
        self.mrope_section = tuple(rope.mrope_section)
        dim = cfg.rotary_dim
        # Built on the CPU like HF's buffer (pow on another device may round differently) and kept out
        # of the state dict and of .to(dtype), so it stays fp32.
        exponent = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(dtype=torch.float) / dim
        self.inv_freq = 1.0 / (rope.rope_theta**exponent)  # [R/2] fp32
        self._inv_freq_by_device: dict[torch.device, torch.Tensor] = {}

    def _inv_freq(self, device: torch.device) -> torch.Tensor:
        if device not in self._inv_freq_by_device:
            self._inv_freq_by_device[device] = self.inv_freq.to(device)
        return self._inv_freq_by_device[device]

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [3, B, T] (temporal, height, width) -> cos, sin [B, T, R] in x's dtype."""
        inv_freq = self._inv_freq(x.device)
        position_ids = position_ids.to(x.device)
        inv = inv_freq[None, None, :, None].float().expand(3, position_ids.shape[1], -1, 1)  # [3, B, R/2, 1]
        pos = position_ids[:, :, None, :].float()  # [3, B, 1, T]
        device_type = x.device.type if x.device.type != "mps" else "cpu"
        with torch.autocast(device_type=device_type, enabled=False):
            # HF forms the angles with an fp32 matmul (K = 1), not a broadcast product.
            freqs = (inv.float() @ pos.float()).transpose(2, 3)  # [3, B, T, R/2]
            freqs = self._interleave(freqs)  # [B, T, R/2]
            emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, R]
            cos, sin = emb.cos(), emb.sin()  # attention_scaling is 1.0 for the default rope type
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)

    def _interleave(self, freqs: torch.Tensor) -> torch.Tensor:
        """Frequency j takes axis j % 3 (T, H, W) while j < 3 * section of that axis, else T."""
        out = freqs[0].clone()
        for axis in (1, 2):
            idx = slice(axis, self.mrope_section[axis] * 3, 3)
            out[..., idx] = freqs[axis, ..., idx]
        return out


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Partial RoPE on the first R dims of q, k [B, Hq|Hk, T, D]; cos, sin [B, T, R]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, T, R]
    r = cos.shape[-1]
    q_rot, q_pass = q[..., :r], q[..., r:]
    k_rot, k_pass = k[..., :r], k[..., r:]
    q_rot = (q_rot * cos) + (rotate_half(q_rot) * sin)
    k_rot = (k_rot * cos) + (rotate_half(k_rot) * sin)
    return torch.cat([q_rot, q_pass], dim=-1), torch.cat([k_rot, k_pass], dim=-1)


class MLP(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.gate_proj = LoRALinear(cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = LoRALinear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = LoRALinear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # [B, T, I] -> [B, T, H]


# --------------------------------------------------------------------------------------------
# Per-layer state for prefix reuse


class TextCache:
    """What a later forward needs from the tokens already run, per layer.

    Linear-attention layers: `conv_states[i]` [B, C, K-1] (the last K-1 conv inputs, activation
    dtype) and `recurrent_states[i]` [B, Hv, Dk, Dv] fp32. Full-attention layers: `keys[i]`,
    `values[i]` [B, Hk, S, D] after RoPE. Forwards replace these tensors and never write into them,
    so `expand()` can share one prefix among several continuations without copying.
    A continuation equals a one-shot forward up to round-off. Cutting the prefix at a multiple of the
    delta-rule chunk (64 tokens) keeps the chunks aligned; unaligned cuts reorder fp32 sums, which
    bf16 can amplify (tests/valen_runtime/test_qwen35.py measures both).
    """

    def __init__(self, layer_types: tuple[str, ...]):
        n = len(layer_types)
        self.layer_types = tuple(layer_types)
        self.num_tokens = 0
        self.conv_states: list[torch.Tensor | None] = [None] * n
        self.recurrent_states: list[torch.Tensor | None] = [None] * n
        self.keys: list[torch.Tensor | None] = [None] * n
        self.values: list[torch.Tensor | None] = [None] * n

    def _map(self, fn) -> "TextCache":
        new = TextCache(self.layer_types)
        new.num_tokens = self.num_tokens
        for name in ("conv_states", "recurrent_states", "keys", "values"):
            setattr(new, name, [None if t is None else fn(t) for t in getattr(self, name)])
        return new

    def expand(self, batch: int) -> "TextCache":
        """A batch-1 state seen as `batch` identical rows (views, no copy)."""
        return self._map(lambda t: t.expand(batch, *t.shape[1:]))

    def clone(self) -> "TextCache":
        return self._map(lambda t: t.clone())


# --------------------------------------------------------------------------------------------
# Gated full attention


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, Hk, S, D] -> [B, Hk * n_rep, S, D], each key/value head serving n_rep query heads."""
    if n_rep == 1:
        return x
    b, hk, s, d = x.shape
    return x[:, :, None, :, :].expand(b, hk, n_rep, s, d).reshape(b, hk * n_rep, s, d)


def eager_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scaling: float
) -> torch.Tensor:
    """5.4.0's eager_attention_forward: scores in the activation dtype, softmax in fp32, cast back.

    q [B, Hq, T, D], k / v [B, Hk, S, D], additive mask broadcastable to [B, 1, T, S] -> [B, T, Hq, D].
    """
    n_rep = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    scores = torch.matmul(q, k.transpose(2, 3)) * scaling  # [B, Hq, T, S]
    if mask is not None:
        scores = scores + mask
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v).transpose(1, 2).contiguous()  # [B, T, Hq, D]


def causal_mask(q_len: int, past: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive mask [1, 1, T, S]: 0 where key <= query position, dtype's min elsewhere (HF's eager mask)."""
    q_pos = torch.arange(q_len, device=device)[:, None] + past
    k_pos = torch.arange(past + q_len, device=device)[None, :]
    allowed = k_pos <= q_pos
    # torch.zeros, not torch.tensor(0.0, device=...): no host-to-device copy, so CUDA graphs can capture it.
    return torch.where(allowed, torch.zeros((), dtype=dtype, device=device), torch.finfo(dtype).min)[None, None]


class Attention(nn.Module):
    """Qwen3_5Attention: per-head query/gate split, q/k RMSNorm, partial M-RoPE, GQA, sigmoid output gate."""

    def __init__(self, cfg: TextConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = cfg.head_dim
        self.scaling = cfg.head_dim**-0.5
        self.q_proj = LoRALinear(cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim * 2)
        self.k_proj = LoRALinear(cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim)
        self.v_proj = LoRALinear(cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim)
        self.o_proj = LoRALinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        cache: TextCache | None = None,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        D = self.head_dim
        # q_proj packs [query | gate] per head: [B, T, Hq, 2D] -> two [B, T, Hq, D]
        q, gate = torch.chunk(self.q_proj(x).reshape(B, T, -1, D * 2), 2, dim=-1)
        gate = gate.reshape(B, T, -1)  # [B, T, Hq*D]
        q = self.q_norm(q.reshape(B, T, -1, D)).transpose(1, 2)  # [B, Hq, T, D]
        k = self.k_norm(self.k_proj(x).reshape(B, T, -1, D)).transpose(1, 2)  # [B, Hk, T, D]
        v = self.v_proj(x).reshape(B, T, -1, D).transpose(1, 2)  # [B, Hk, T, D]
        q, k = apply_rotary(q, k, cos, sin)

        if cache is not None:
            i = self.layer_idx
            if cache.keys[i] is not None:
                k = torch.cat([cache.keys[i], k], dim=2)  # [B, Hk, S, D]
                v = torch.cat([cache.values[i], v], dim=2)
            cache.keys[i], cache.values[i] = k, v

        out = eager_attention(q, k, v, mask, self.scaling)  # [B, T, Hq, D]
        out = out.reshape(B, T, -1).contiguous()
        out = out * torch.sigmoid(gate)
        return self.o_proj(out)


# --------------------------------------------------------------------------------------------
# Gated DeltaNet


class GatedDeltaNet(nn.Module):
    """Qwen3_5GatedDeltaNet on 5.4.0's torch fallback (F.conv1d conv, chunked delta rule)."""

    def __init__(self, cfg: TextConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_k_heads = cfg.linear_num_key_heads
        self.num_v_heads = cfg.linear_num_value_heads
        self.head_k_dim = cfg.linear_key_head_dim
        self.head_v_dim = cfg.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel_size = cfg.linear_conv_kernel_dim
        self.in_proj_qkv = LoRALinear(cfg.hidden_size, self.conv_dim)
        self.in_proj_z = LoRALinear(cfg.hidden_size, self.value_dim)
        self.in_proj_b = LoRALinear(cfg.hidden_size, self.num_v_heads)
        self.in_proj_a = LoRALinear(cfg.hidden_size, self.num_v_heads)
        # Depthwise causal conv: pad K-1 on both sides and keep the first T outputs, as HF does.
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, self.kernel_size,
            groups=self.conv_dim, padding=self.kernel_size - 1, bias=False,
        )
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = RMSNormGated(self.head_v_dim, cfg.rms_norm_eps)
        self.out_proj = LoRALinear(self.value_dim, cfg.hidden_size)

    def _conv(self, mixed: torch.Tensor, cache: TextCache | None) -> torch.Tensor:
        """Causal depthwise conv + SiLU over mixed [B, C, T]; updates the cached conv inputs."""
        T = mixed.shape[-1]
        i, keep = self.layer_idx, self.kernel_size - 1
        prev = cache.conv_states[i] if cache is not None else None
        if prev is None:
            out = F.silu(self.conv1d(mixed)[:, :, :T])
            if cache is not None:
                full = F.pad(mixed, (keep, 0))  # zero history, as the padded conv saw it
        else:
            # Continue from cached inputs like 5.4.0's torch_causal_conv1d_update (no padding).
            full = torch.cat([prev, mixed], dim=-1).to(self.conv1d.weight.dtype)  # [B, C, K-1+T]
            out = F.silu(F.conv1d(full, self.conv1d.weight, None, padding=0, groups=self.conv_dim)[:, :, -T:])
            out = out.to(mixed.dtype)
        if cache is not None:
            cache.conv_states[i] = full[:, :, full.shape[-1] - keep :]  # [B, C, K-1]
        return out

    def forward(self, x: torch.Tensor, cache: TextCache | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        mixed = self.in_proj_qkv(x).transpose(1, 2)  # [B, C, T]
        z = self.in_proj_z(x).reshape(B, T, -1, self.head_v_dim)  # [B, T, Hv, Dv]
        b, a = self.in_proj_b(x), self.in_proj_a(x)  # [B, T, Hv]

        mixed = self._conv(mixed, cache).transpose(1, 2)  # [B, T, C]
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(B, T, -1, self.head_k_dim)  # [B, T, Hkl, Dk]
        k = k.reshape(B, T, -1, self.head_k_dim)
        v = v.reshape(B, T, -1, self.head_v_dim)  # [B, T, Hv, Dv]

        g, beta = decay_and_beta(a, b, self.A_log, self.dt_bias)  # [B, T, Hv]: fp32 log decay, beta
        if self.num_v_heads // self.num_k_heads > 1:
            q = q.repeat_interleave(self.num_v_heads // self.num_k_heads, dim=2)  # [B, T, Hv, Dk]
            k = k.repeat_interleave(self.num_v_heads // self.num_k_heads, dim=2)

        initial = cache.recurrent_states[self.layer_idx] if cache is not None else None
        out, state = chunk_gated_delta_rule(
            q, k, v, g=g, beta=beta, initial_state=initial,
            output_final_state=cache is not None, use_qk_l2norm_in_kernel=True,
        )  # [B, T, Hv, Dv]
        if cache is not None:
            cache.recurrent_states[self.layer_idx] = state  # [B, Hv, Dk, Dv] fp32

        out = self.norm(out.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))  # [B*T*Hv, Dv]
        return self.out_proj(out.reshape(B, T, -1))  # [B, T, Hv*Dv] -> [B, T, H]


def decay_and_beta(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """g = -exp(A_log) * softplus(a + dt_bias) in fp32 (the log decay), beta = sigmoid(b)."""
    # A_log.float(): fp16 models would otherwise overflow; the decay is fp32 in every dtype.
    return -A_log.float().exp() * F.softplus(a.float() + dt_bias), b.sigmoid()


# --------------------------------------------------------------------------------------------
# Decoder and text model


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig, layer_idx: int):
        super().__init__()
        self.layer_type = cfg.layer_types[layer_idx]
        if self.layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg, layer_idx)
        else:
            self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask, cache=None):
        h = self.input_layernorm(x)
        if self.layer_type == "linear_attention":
            h = self.linear_attn(h, cache)
        else:
            h = self.self_attn(h, cos, sin, mask, cache)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class TextModel(nn.Module):
    """Qwen3_5TextModel without the LM head: embeddings, decoder layers, final norm."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = TextRotaryEmbedding(cfg)

    def new_cache(self) -> TextCache:
        return TextCache(self.config.layer_types)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, T] -> [B, T, H] in the embedding dtype."""
        return self.embed_tokens(input_ids)

    def forward(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, cache: TextCache | None = None) -> torch.Tensor:
        """Run the decoder stack.

        Args:
            inputs_embeds: [B, T, H] in the model dtype (image features already scattered in).
            position_ids: [3, B, T] (or [3, 1, T]) M-RoPE positions; the caller continues them
                after a cached prefix.
            cache: state of earlier tokens, continued and updated in place; None for one-shot runs.
        Returns:
            last_hidden_state [B, T, H] after the final norm.
        """
        B, T, _ = inputs_embeds.shape
        past = cache.num_tokens if cache is not None else 0
        cos, sin = self.rotary_emb(inputs_embeds, position_ids)  # [B, T, R]
        mask = causal_mask(T, past, inputs_embeds.dtype, inputs_embeds.device)  # [1, 1, T, S]
        h = inputs_embeds
        for layer in self.layers:
            checkpoint()  # a served request given up stops here (cancel.py)
            h = layer(h, cos, sin, mask, cache)
        if cache is not None:
            cache.num_tokens = past + T
        return self.norm(h)
