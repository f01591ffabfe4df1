"""Model configuration read from a `qwen3_5` HF `config.json`.

Holds `TextConfig`, `VisionConfig` and `ModelConfig` with the config.json field names, built by
`ModelConfig.from_dict(d)` / `ModelConfig.load(path)`. Every size comes from the file; the only
defaults are transformers 5.4.0's own class defaults for fields a hand-written config may omit.
Settings the runtime does not implement are refused with `ConfigError` naming the field and value.
Keys the runtime does not read are kept in `ignored_keys` (known HF bookkeeping) or
`unknown_keys` (anything else, also logged); `strict=True` refuses unknown keys instead.
Loading weights, tokenizers and processors is left to other modules.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from valen_runtime.errors import ConfigError

logger = logging.getLogger(__name__)

LAYER_TYPES = ("linear_attention", "full_attention")

# Keys written by PreTrainedConfig.to_dict() or by training code that change no arithmetic here.
_HF_BOOKKEEPING = frozenset(
    {
        "_name_or_path", "architectures", "transformers_version", "dtype", "torch_dtype",
        "model_type", "output_hidden_states", "output_attentions", "return_dict",
        "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id", "problem_type",
        "initializer_range", "use_cache", "pad_token_id", "bos_token_id", "eos_token_id",
        "tie_word_embeddings",
    }
)
_TEXT_IGNORED = _HF_BOOKKEEPING | {
    "attention_dropout",  # inference only: dropout is off
    "full_attention_interval",  # read only when layer_types is absent
    "mtp_num_hidden_layers", "mtp_use_dedicated_embeddings",  # mtp.* weights are dropped
    "mamba_ssm_dtype",  # 5.4.0's torch fallback ignores it (delta rule always in fp32)
    "partial_rotary_factor",  # read into rope_parameters (HF mirrors it at the root)
    "rope_theta",  # legacy spelling, read into rope_parameters when that is absent
}
_VISION_IGNORED = _HF_BOOKKEEPING | {"rope_parameters", "deepstack_visual_indexes"}
_ROOT_IGNORED = _HF_BOOKKEEPING


def _get(d: dict, key: str, where: str, kind: type | tuple, default: Any = ...) -> Any:
    """Read d[key], check its type, or fall back to an HF class default when one is given."""
    if key not in d or d[key] is None:
        if default is ...:
            raise ConfigError(f"{where}.{key} is missing")
        return default
    value = d[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        raise ConfigError(f"{where}.{key} = {value!r}: expected {kind}")
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kinds):
        raise ConfigError(f"{where}.{key} = {value!r}: expected {kind}")
    return value


def _positive(where: str, **values: int) -> None:
    for name, value in values.items():
        if value <= 0:
            raise ConfigError(f"{where}.{name} = {value!r}: must be > 0")


def _leftover(d: dict, read: set[str], ignored: frozenset, where: str) -> tuple[list, list]:
    rest = sorted(set(d) - read)
    known = [k for k in rest if k in ignored]
    unknown = [f"{where}.{k}" for k in rest if k not in ignored]
    return [f"{where}.{k}" for k in known], unknown


@dataclass(frozen=True)
class RopeParameters:
    """`text_config.rope_parameters`; only the `default` rope type with interleaved M-RoPE."""

    rope_type: str
    rope_theta: float
    partial_rotary_factor: float
    mrope_section: tuple[int, int, int]
    mrope_interleaved: bool


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_act: str
    rms_norm_eps: float
    max_position_embeddings: int
    attention_bias: bool
    attn_output_gate: bool
    layer_types: tuple[str, ...]
    linear_conv_kernel_dim: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    rope_parameters: RopeParameters
    tie_word_embeddings: bool

    @property
    def rotary_dim(self) -> int:
        """Number of leading head dims that get RoPE (HF: int(head_dim * partial_rotary_factor))."""
        return int(self.head_dim * self.rope_parameters.partial_rotary_factor)

    @classmethod
    def from_dict(cls, d: dict, where: str = "text_config") -> tuple["TextConfig", list, list]:
        read = set(cls.__dataclass_fields__) | {"rope_theta", "partial_rotary_factor", "full_attention_interval"}
        g = lambda key, kind, default=...: _get(d, key, where, kind, default)  # noqa: E731
        num_layers = g("num_hidden_layers", int)
        if d.get("layer_types") is not None:
            layer_types = g("layer_types", list)
        else:
            # Qwen3_5TextConfig.__post_init__: full attention every `full_attention_interval` layers.
            interval = g("full_attention_interval", int, 4)
            layer_types = [
                "linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers)
            ]
        for i, kind in enumerate(layer_types):
            if kind not in LAYER_TYPES:
                raise ConfigError(f"{where}.layer_types[{i}] = {kind!r}: expected one of {LAYER_TYPES}")
        if len(layer_types) != num_layers:
            raise ConfigError(
                f"{where}.layer_types has {len(layer_types)} entries, num_hidden_layers = {num_layers}"
            )
        cfg = cls(
            vocab_size=g("vocab_size", int),
            hidden_size=g("hidden_size", int),
            intermediate_size=g("intermediate_size", int),
            num_hidden_layers=num_layers,
            num_attention_heads=g("num_attention_heads", int),
            num_key_value_heads=g("num_key_value_heads", int),
            head_dim=g("head_dim", int),
            hidden_act=g("hidden_act", str, "silu"),
            rms_norm_eps=g("rms_norm_eps", float, 1e-6),
            max_position_embeddings=g("max_position_embeddings", int),
            attention_bias=g("attention_bias", bool, False),
            attn_output_gate=g("attn_output_gate", bool, True),
            layer_types=tuple(layer_types),
            linear_conv_kernel_dim=g("linear_conv_kernel_dim", int),
            linear_key_head_dim=g("linear_key_head_dim", int),
            linear_value_head_dim=g("linear_value_head_dim", int),
            linear_num_key_heads=g("linear_num_key_heads", int),
            linear_num_value_heads=g("linear_num_value_heads", int),
            rope_parameters=_rope_from_dict(d, where),
            tie_word_embeddings=g("tie_word_embeddings", bool, False),
        )
        cfg._validate(where)
        ignored, unknown = _leftover(d, read, _TEXT_IGNORED, where)
        return cfg, ignored, unknown

    def _validate(self, where: str) -> None:
        _positive(
            where, vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim, max_position_embeddings=self.max_position_embeddings,
            linear_conv_kernel_dim=self.linear_conv_kernel_dim, linear_key_head_dim=self.linear_key_head_dim,
            linear_value_head_dim=self.linear_value_head_dim, linear_num_key_heads=self.linear_num_key_heads,
            linear_num_value_heads=self.linear_num_value_heads,
        )
        if self.hidden_act != "silu":
            raise ConfigError(f"{where}.hidden_act = {self.hidden_act!r}: only 'silu' is supported")
        if self.attention_bias:
            raise ConfigError(f"{where}.attention_bias = True: the runtime has no attention biases")
        if not self.attn_output_gate:
            raise ConfigError(f"{where}.attn_output_gate = False: Qwen3.5 attention is always gated")
        if not self.rms_norm_eps > 0:
            raise ConfigError(f"{where}.rms_norm_eps = {self.rms_norm_eps!r}: must be > 0")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"{where}.num_attention_heads = {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads = {self.num_key_value_heads}"
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError(
                f"{where}.linear_num_value_heads = {self.linear_num_value_heads} is not a multiple of "
                f"linear_num_key_heads = {self.linear_num_key_heads}"
            )
        rope = self.rope_parameters
        rotary_dim = self.head_dim * rope.partial_rotary_factor
        if rotary_dim != int(rotary_dim) or int(rotary_dim) % 2 or not 0 < rotary_dim <= self.head_dim:
            raise ConfigError(
                f"{where}.rope_parameters.partial_rotary_factor = {rope.partial_rotary_factor}: "
                f"head_dim {self.head_dim} x factor must be an even number of dims in (0, head_dim]"
            )
        if sum(rope.mrope_section) != int(rotary_dim) // 2:
            raise ConfigError(
                f"{where}.rope_parameters.mrope_section = {list(rope.mrope_section)}: must sum to "
                f"head_dim * partial_rotary_factor / 2 = {int(rotary_dim) // 2}"
            )


def _rope_from_dict(d: dict, where: str) -> RopeParameters:
    rp = d.get("rope_parameters")
    if rp is None:
        # Legacy configs carry rope_theta at the text root (HF standardises it into rope_parameters).
        rp = {"rope_type": "default", "rope_theta": _get(d, "rope_theta", where, float)}
    if not isinstance(rp, dict):
        raise ConfigError(f"{where}.rope_parameters = {rp!r}: expected an object")
    w = f"{where}.rope_parameters"
    rope_type = _get(rp, "rope_type", w, str, "default")
    if rope_type != "default":
        raise ConfigError(f"{w}.rope_type = {rope_type!r}: only 'default' is supported")
    theta = _get(rp, "rope_theta", w, float)
    if not (math.isfinite(theta) and theta > 0):
        raise ConfigError(f"{w}.rope_theta = {theta!r}: must be finite and > 0")
    # Qwen3_5TextConfig sets partial_rotary_factor 0.25 when neither place carries it.
    root_factor = _get(d, "partial_rotary_factor", where, float, None)
    factor = _get(rp, "partial_rotary_factor", w, float, 0.25 if root_factor is None else root_factor)
    if root_factor is not None and root_factor != factor:
        raise ConfigError(
            f"{where}.partial_rotary_factor = {root_factor} disagrees with {w}.partial_rotary_factor = {factor}"
        )
    # Qwen3_5TextRotaryEmbedding falls back to [11, 11, 10]; the sum check in TextConfig catches misuse.
    section = _get(rp, "mrope_section", w, list, [11, 11, 10])
    if len(section) != 3 or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in section):
        raise ConfigError(f"{w}.mrope_section = {section!r}: expected three non-negative integers")
    # 5.4.0 applies the interleaved layout whatever this flag says; refuse the ambiguous `false`.
    interleaved = _get(rp, "mrope_interleaved", w, bool, True)
    if not interleaved:
        raise ConfigError(f"{w}.mrope_interleaved = False: only interleaved M-RoPE is supported")
    extra = sorted(set(rp) - {"rope_type", "rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved"})
    if extra:
        raise ConfigError(f"{w} has unsupported keys {extra}")
    return RopeParameters(rope_type, theta, factor, tuple(section), interleaved)


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    num_position_embeddings: int
    hidden_act: str

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def num_grid_per_side(self) -> int:
        return math.isqrt(self.num_position_embeddings)

    @classmethod
    def from_dict(cls, d: dict, where: str = "vision_config") -> tuple["VisionConfig", list, list]:
        g = lambda key, kind, default=...: _get(d, key, where, kind, default)  # noqa: E731
        deepstack = d.get("deepstack_visual_indexes") or []
        if deepstack:
            raise ConfigError(f"{where}.deepstack_visual_indexes = {deepstack!r}: deepstack is not supported")
        rope = d.get("rope_parameters") or {}
        # 5.4.0's Qwen3_5VisionRotaryEmbedding hard-codes theta 10000 and ignores this field.
        if rope.get("rope_theta", 10000.0) != 10000.0:
            raise ConfigError(
                f"{where}.rope_parameters.rope_theta = {rope['rope_theta']!r}: transformers 5.4.0 uses 10000"
            )
        for key in ("patch_size", "temporal_patch_size"):
            if isinstance(d.get(key), (list, tuple)):
                raise ConfigError(f"{where}.{key} = {d[key]!r}: only a single integer is supported")
        cfg = cls(
            depth=g("depth", int),
            hidden_size=g("hidden_size", int),
            intermediate_size=g("intermediate_size", int),
            num_heads=g("num_heads", int),
            in_channels=g("in_channels", int, 3),
            patch_size=g("patch_size", int),
            temporal_patch_size=g("temporal_patch_size", int),
            spatial_merge_size=g("spatial_merge_size", int),
            out_hidden_size=g("out_hidden_size", int),
            num_position_embeddings=g("num_position_embeddings", int),
            hidden_act=g("hidden_act", str, "gelu_pytorch_tanh"),
        )
        _positive(where, **{k: getattr(cfg, k) for k in cls.__dataclass_fields__ if k != "hidden_act"})
        if cfg.hidden_act != "gelu_pytorch_tanh":
            raise ConfigError(f"{where}.hidden_act = {cfg.hidden_act!r}: only 'gelu_pytorch_tanh' is supported")
        if cfg.hidden_size % cfg.num_heads or cfg.head_dim % 4:
            raise ConfigError(
                f"{where}.hidden_size = {cfg.hidden_size} with num_heads = {cfg.num_heads}: "
                "head dim must be an integer multiple of 4 (2-D rotary)"
            )
        if cfg.num_grid_per_side**2 != cfg.num_position_embeddings:
            raise ConfigError(
                f"{where}.num_position_embeddings = {cfg.num_position_embeddings}: must be a perfect square"
            )
        ignored, unknown = _leftover(d, set(cls.__dataclass_fields__), _VISION_IGNORED, where)
        return cfg, ignored, unknown


@dataclass(frozen=True)
class ModelConfig:
    text_config: TextConfig
    vision_config: VisionConfig
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    tie_word_embeddings: bool
    ignored_keys: tuple[str, ...] = field(default=(), compare=False)
    unknown_keys: tuple[str, ...] = field(default=(), compare=False)

    @classmethod
    def from_dict(cls, d: dict, strict: bool = False) -> "ModelConfig":
        """Build from a parsed `config.json` of `model_type` "qwen3_5".

        Args:
            d: the parsed JSON object.
            strict: refuse keys that are neither read nor in the known-unused lists.
        Returns:
            the config; `unknown_keys` lists unread keys when not strict.
        """
        if not isinstance(d, dict):
            raise ConfigError(f"config: expected a JSON object, got {type(d).__name__}")
        model_type = d.get("model_type")
        if model_type != "qwen3_5":
            raise ConfigError(f"model_type = {model_type!r}: expected 'qwen3_5'")
        for key in ("text_config", "vision_config"):
            if not isinstance(d.get(key), dict):
                raise ConfigError(f"{key} is missing or not an object")
        text, t_ign, t_unk = TextConfig.from_dict(d["text_config"])
        vision, v_ign, v_unk = VisionConfig.from_dict(d["vision_config"])
        if vision.out_hidden_size != text.hidden_size:
            raise ConfigError(
                f"vision_config.out_hidden_size = {vision.out_hidden_size} must equal "
                f"text_config.hidden_size = {text.hidden_size}"
            )
        g = lambda key, kind, default=...: _get(d, key, "config", kind, default)  # noqa: E731
        fields = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
        ids = {k: g(k, int) for k in fields}
        r_ign, r_unk = _leftover(d, set(fields) | {"text_config", "vision_config"}, _ROOT_IGNORED, "config")
        unknown = tuple(sorted(t_unk + v_unk + r_unk))
        if unknown and strict:
            raise ConfigError(f"config has keys the runtime does not read: {list(unknown)}")
        if unknown:
            logger.warning("config.json keys not read by the runtime: %s", ", ".join(unknown))
        return cls(
            text_config=text,
            vision_config=vision,
            tie_word_embeddings=g("tie_word_embeddings", bool, False),
            ignored_keys=tuple(sorted(t_ign + v_ign + r_ign)),
            unknown_keys=unknown,
            **ids,
        )

    @classmethod
    def load(cls, path: str | Path, strict: bool = False) -> "ModelConfig":
        """Read `config.json` (a file, or a directory holding one)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        return cls.from_dict(read_config_json(path), strict=strict)


def read_config_json(path: str | Path) -> dict:
    """A JSON object from one of a model folder's config files (config.json, tokenizer and
    preprocessor configs); a ConfigError naming the file when it cannot be read or is not one."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read ({getattr(e, 'strerror', None) or e})") from e
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return value
