"""The one table of a `valen-native/1` export: tensor names, shape formulas, dtypes, LoRA targets.

Everything that names or sizes an exported tensor reads this module: the inventory (what the
base and the checkpoint must hold), `plan_export` (what gets written), `valen-verify` (what a
finished export must hold) and the generated tables of docs/export-format.md
(`python -m valen_export.format_doc`). Shapes are formulas over `config.json` fields, evaluated
against the runtime's own parsed config (`valen_runtime.config.ModelConfig`), so the exporter and
the runtime cannot disagree about layer types or defaults.

Formula vocabulary: `text.X` is `config.json` -> `text_config.X`, `vision.X` is
`vision_config.X`; the derived names in `DERIVED` and the manifest values `rank`
(`lora.rank`) and `projection_dim` (`head.projection_dim`). Only integers, names, `+` and `*`.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import lru_cache

from valen_runtime.config import ModelConfig

LANGUAGE_PREFIX = "model.language_model."
VISION_PREFIX = "model.visual."
LORA_KEY_PREFIX = "base_model.model.model.language_model."  # the native lora.rs naming

# Which indices a row repeats over.
MODEL = "model"  # once
EVERY_LAYER = "every layer"  # i in 0 .. text.num_hidden_layers-1
LINEAR_ATTENTION = "linear_attention"  # layers i with text.layer_types[i] == "linear_attention"
FULL_ATTENTION = "full_attention"  # layers i with text.layer_types[i] == "full_attention"
EVERY_BLOCK = "every block"  # b in 0 .. vision.depth-1
LAYER_SCOPES = (EVERY_LAYER, LINEAR_ATTENTION, FULL_ATTENTION)

# Derived sizes, in the order they may refer to each other.
DERIVED: dict[str, str] = {
    "key_dim": "text.linear_num_key_heads * text.linear_key_head_dim",
    "value_dim": "text.linear_num_value_heads * text.linear_value_head_dim",
    "conv_dim": "2 * key_dim + value_dim",
    "merged_dim": "vision.hidden_size * vision.spatial_merge_size * vision.spatial_merge_size",
}
MANIFEST_SYMBOLS: dict[str, str] = {
    "rank": "lora.rank in the manifest (the checkpoint's lora_rank)",
    "projection_dim": "head.projection_dim in the manifest (the checkpoint's projection_dim)",
}


@dataclass(frozen=True)
class Row:
    """One tensor name pattern. `name` has no file prefix; `{i}` is a language layer, `{b}` a vision block."""

    name: str
    shape: tuple[str, ...]
    scope: str = MODEL
    lora_target: bool = False  # an nn.Linear the LoRA wraps: A [rank, shape[1]], B [shape[0], rank]
    base_dtype: str = "BF16"  # dtype in the released Qwen3.5 base checkpoint
    overlay: str | None = None  # vision: "trained blocks" / "merger" when the checkpoint replaces it


@dataclass(frozen=True)
class Group:
    """The tensors of one export file kind (language shards, vision file, head file)."""

    key: str  # manifest section
    prefix: str
    dtype: str  # dtype of every tensor in the exported file
    rows: tuple[Row, ...]


# Language model: Qwen3.5's decoder as transformers 5.4.0 names it (no lm_head: embeddings are tied).
LANGUAGE = Group(
    "language",
    LANGUAGE_PREFIX,
    "BF16",
    (
        Row("embed_tokens.weight", ("text.vocab_size", "text.hidden_size")),
        Row("norm.weight", ("text.hidden_size",)),
        Row("layers.{i}.input_layernorm.weight", ("text.hidden_size",), EVERY_LAYER),
        Row("layers.{i}.post_attention_layernorm.weight", ("text.hidden_size",), EVERY_LAYER),
        Row("layers.{i}.linear_attn.in_proj_qkv.weight", ("conv_dim", "text.hidden_size"), LINEAR_ATTENTION, lora_target=True),
        Row("layers.{i}.linear_attn.in_proj_z.weight", ("value_dim", "text.hidden_size"), LINEAR_ATTENTION, lora_target=True),
        Row("layers.{i}.linear_attn.in_proj_b.weight", ("text.linear_num_value_heads", "text.hidden_size"), LINEAR_ATTENTION, lora_target=True),
        Row("layers.{i}.linear_attn.in_proj_a.weight", ("text.linear_num_value_heads", "text.hidden_size"), LINEAR_ATTENTION, lora_target=True),
        Row("layers.{i}.linear_attn.out_proj.weight", ("text.hidden_size", "value_dim"), LINEAR_ATTENTION, lora_target=True),
        Row("layers.{i}.linear_attn.conv1d.weight", ("conv_dim", "1", "text.linear_conv_kernel_dim"), LINEAR_ATTENTION),
        Row("layers.{i}.linear_attn.A_log", ("text.linear_num_value_heads",), LINEAR_ATTENTION, base_dtype="F32"),
        Row("layers.{i}.linear_attn.dt_bias", ("text.linear_num_value_heads",), LINEAR_ATTENTION),
        Row("layers.{i}.linear_attn.norm.weight", ("text.linear_value_head_dim",), LINEAR_ATTENTION, base_dtype="F32"),
        # q_proj holds the query and the output gate, interleaved per head: 2 * head_dim rows per head.
        Row("layers.{i}.self_attn.q_proj.weight", ("2 * text.num_attention_heads * text.head_dim", "text.hidden_size"), FULL_ATTENTION, lora_target=True),
        Row("layers.{i}.self_attn.k_proj.weight", ("text.num_key_value_heads * text.head_dim", "text.hidden_size"), FULL_ATTENTION, lora_target=True),
        Row("layers.{i}.self_attn.v_proj.weight", ("text.num_key_value_heads * text.head_dim", "text.hidden_size"), FULL_ATTENTION, lora_target=True),
        Row("layers.{i}.self_attn.o_proj.weight", ("text.hidden_size", "text.num_attention_heads * text.head_dim"), FULL_ATTENTION, lora_target=True),
        Row("layers.{i}.self_attn.q_norm.weight", ("text.head_dim",), FULL_ATTENTION),
        Row("layers.{i}.self_attn.k_norm.weight", ("text.head_dim",), FULL_ATTENTION),
        Row("layers.{i}.mlp.gate_proj.weight", ("text.intermediate_size", "text.hidden_size"), EVERY_LAYER, lora_target=True),
        Row("layers.{i}.mlp.up_proj.weight", ("text.intermediate_size", "text.hidden_size"), EVERY_LAYER, lora_target=True),
        Row("layers.{i}.mlp.down_proj.weight", ("text.hidden_size", "text.intermediate_size"), EVERY_LAYER, lora_target=True),
    ),
)

_BLOCK = "trained blocks"
_MERGER = "merger"
VISION = Group(
    "vision",
    VISION_PREFIX,
    "BF16",
    (
        Row("patch_embed.proj.weight", ("vision.hidden_size", "vision.in_channels", "vision.temporal_patch_size", "vision.patch_size", "vision.patch_size")),
        Row("patch_embed.proj.bias", ("vision.hidden_size",)),
        Row("pos_embed.weight", ("vision.num_position_embeddings", "vision.hidden_size")),
        Row("blocks.{b}.norm1.weight", ("vision.hidden_size",), EVERY_BLOCK, overlay=_BLOCK),
        Row("blocks.{b}.norm1.bias", ("vision.hidden_size",), EVERY_BLOCK, overlay=_BLOCK),
        Row("blocks.{b}.norm2.weight", ("vision.hidden_size",), EVERY_BLOCK, overlay=_BLOCK),
        Row("blocks.{b}.norm2.bias", ("vision.hidden_size",), EVERY_BLOCK, overlay=_BLOCK),
        Row("blocks.{b}.attn.qkv.weight", ("3 * vision.hidden_size", "vision.hidden_size"), EVERY_BLOCK, overlay=_BLOCK),
        Row("blocks.{b}.attn.qkv.bias", ("3 * vision.hidden_size",), EVERY_BLOCK, overlay=_BLOCK),
        Row("blocks.{b}.attn.proj.weight", ("vision.hidden_size", "vision.hidden_size"), EVERY_BLOCK, overlay=_BLOCK),
        Row("blocks.{b}.attn.proj.bias", ("vision.hidden_size",), EVERY_BLOCK, overlay=_BLOCK),
        Row("blocks.{b}.mlp.linear_fc1.weight", ("vision.intermediate_size", "vision.hidden_size"), EVERY_BLOCK, overlay=_BLOCK),
        Row("blocks.{b}.mlp.linear_fc1.bias", ("vision.intermediate_size",), EVERY_BLOCK, overlay=_BLOCK),
        Row("blocks.{b}.mlp.linear_fc2.weight", ("vision.hidden_size", "vision.intermediate_size"), EVERY_BLOCK, overlay=_BLOCK),
        Row("blocks.{b}.mlp.linear_fc2.bias", ("vision.hidden_size",), EVERY_BLOCK, overlay=_BLOCK),
        Row("merger.norm.weight", ("vision.hidden_size",), overlay=_MERGER),
        Row("merger.norm.bias", ("vision.hidden_size",), overlay=_MERGER),
        Row("merger.linear_fc1.weight", ("merged_dim", "merged_dim"), overlay=_MERGER),
        Row("merger.linear_fc1.bias", ("merged_dim",), overlay=_MERGER),
        Row("merger.linear_fc2.weight", ("vision.out_hidden_size", "merged_dim"), overlay=_MERGER),
        Row("merger.linear_fc2.bias", ("vision.out_hidden_size",), overlay=_MERGER),
    ),
)

# Valen's bilinear decision head, FP32 as trained (no bias).
HEAD = Group(
    "head",
    "",
    "F32",
    (
        Row("candidate.weight", ("projection_dim", "text.hidden_size"), base_dtype="F32"),
        Row("decision.weight", ("projection_dim", "text.hidden_size"), base_dtype="F32"),
    ),
)

# The adapter file (separate mode): one A/B pair per LoRA target, FP32 as trained.
LORA_DTYPE = "F32"
LORA_A = "{module}.lora_A.weight"
LORA_B = "{module}.lora_B.weight"
LORA_RANK_LIMIT = 128  # the native lora.rs accepts ranks 1..=128


def head_names() -> list[str]:
    return [r.name for r in HEAD.rows]


def fp32_in_base_suffixes() -> tuple[str, ...]:
    """Language tensors the released base stores as FP32, as suffixes after `layers.{i}.`."""
    return tuple(r.name.split("{i}.", 1)[1] for r in LANGUAGE.rows if r.base_dtype == "F32")


def lora_target_modules(scope: str) -> list[str]:
    """Module names (after `layers.{i}.`, without `.weight`) wrapped by the LoRA in layers of `scope`."""
    return [r.name.split("{i}.", 1)[1][: -len(".weight")] for r in LANGUAGE.rows if r.lora_target and r.scope in (scope, EVERY_LAYER)]


# --- formula evaluation ---------------------------------------------------------------------

_SECTIONS = {"text": "text_config", "vision": "vision_config"}


@lru_cache(maxsize=None)
def _parse(formula: str) -> ast.expr:
    tree = ast.parse(formula, mode="eval").body
    for node in ast.walk(tree):
        allowed = isinstance(node, (ast.BinOp, ast.Add, ast.Mult, ast.Name, ast.Attribute, ast.Load)) or (
            isinstance(node, ast.Constant) and type(node.value) is int
        )
        if not allowed:
            raise ValueError(f"shape formula {formula!r}: only integers, names, + and * are allowed")
    return tree


def evaluate(formula: str, symbols: dict) -> int:
    """Value of a shape formula; `symbols` holds `text`/`vision` (config objects) and plain ints."""

    def ev(node) -> int:
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            return symbols[node.id]
        if isinstance(node, ast.Attribute):
            return int(getattr(symbols[node.value.id], node.attr))
        left, right = ev(node.left), ev(node.right)
        return left + right if isinstance(node.op, ast.Add) else left * right

    return ev(_parse(formula))


def model_config(config: dict) -> ModelConfig:
    """The runtime's parsed view of a `config.json` dict (its defaults and its refusals)."""
    return ModelConfig.from_dict(config)


def symbols_for(cfg: ModelConfig, rank: int | None = None, projection_dim: int | None = None) -> dict:
    symbols: dict = {"text": cfg.text_config, "vision": cfg.vision_config}
    for name, formula in DERIVED.items():
        symbols[name] = evaluate(formula, symbols)
    if rank is not None:
        symbols["rank"] = rank
    if projection_dim is not None:
        symbols["projection_dim"] = projection_dim
    return symbols


def _indices(scope: str, cfg: ModelConfig) -> list[dict[str, int]]:
    if scope == MODEL:
        return [{}]
    if scope == EVERY_BLOCK:
        return [{"b": b} for b in range(cfg.vision_config.depth)]
    return [{"i": i} for i, kind in enumerate(cfg.text_config.layer_types) if scope in (EVERY_LAYER, kind)]


def expand(group: Group, cfg: ModelConfig, symbols: dict | None = None) -> dict[str, tuple[int, ...]]:
    """{name without prefix: shape} of every tensor of `group` for this config, sorted by name."""
    symbols = symbols or symbols_for(cfg)
    out: dict[str, tuple[int, ...]] = {}
    for row in group.rows:
        shape = tuple(evaluate(f, symbols) for f in row.shape)
        for idx in _indices(row.scope, cfg):
            out[row.name.format(**idx)] = shape
    return dict(sorted(out.items()))


def lora_targets(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """{`layers.{i}.{module}`: (out_features, in_features)} for every LoRA target, in layer order."""
    symbols = symbols_for(cfg)
    out: dict[str, tuple[int, int]] = {}
    for i, kind in enumerate(cfg.text_config.layer_types):
        for row in LANGUAGE.rows:
            if row.lora_target and row.scope in (EVERY_LAYER, kind):
                o, n = (evaluate(f, symbols) for f in row.shape)
                out[row.name.format(i=i)[: -len(".weight")]] = (o, n)
    return out


def overlaid_vision(cfg: ModelConfig, trained_blocks: list[int], merger: bool) -> list[str]:
    """Vision tensor names (without prefix) the checkpoint replaces, sorted."""
    names = []
    for row in VISION.rows:
        if row.overlay == _BLOCK:
            names += [row.name.format(b=b) for b in trained_blocks]
        elif row.overlay == _MERGER and merger:
            names.append(row.name)
    return sorted(names)


# --- files of an export ---------------------------------------------------------------------

SINGLE_LANGUAGE_FILE = "model.safetensors"  # --max-shard-size 0: one file, no index
LANGUAGE_SHARD = "model-{k:05d}-of-{n:05d}.safetensors"  # k = 1..n
INDEX_FILE = "model.safetensors.index.json"
LORA_FILE = "adapter_model.safetensors"
VISION_FILE = "vision.safetensors"
HEAD_FILE = "valen_head.safetensors"
FP32_SOURCES_FILE = "fp32_sources.safetensors"
SAFETENSORS_METADATA = {"format": "pt"}  # the `__metadata__` of every safetensors file written
# Copied byte-for-byte from the base when present; the REQUIRED ones must be there.
COPIED_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "processor_config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
)
REQUIRED_COPIED_FILES = ("config.json", "tokenizer.json", "chat_template.jinja", "preprocessor_config.json")
