"""Expected tensor inventories of a Qwen3.5 base and a Valen checkpoint, from `config.json`.

The names, shapes and LoRA targets live in one table (`tensor_table`); layer types, sizes and
their defaults come from the runtime's own config reader (`valen_runtime.config`). This module
answers "which tensors, which shapes" for the base (`model.language_model.*`, `model.visual.*`)
and for the Valen trainable set of stage `vision_top`; the fixture, the exporter and
`valen-verify` all use it.
"""

from __future__ import annotations

from . import tensor_table as table
from .tensor_table import LANGUAGE_PREFIX, VISION_PREFIX  # noqa: F401 - re-exported names

# Base tensors stored FP32 in the released Qwen3.5 dense checkpoints (2 per GDN layer).
FP32_IN_BASE_SUFFIXES = table.fp32_in_base_suffixes()

# Payload key prefixes of the Valen wrapper (children `backbone` and `head`); in-memory PEFT
# names carry the adapter name `.default` (peft 0.18.1).
PAYLOAD_LORA_PREFIX = "backbone.language_model.base_model.model."
PAYLOAD_VISION_PREFIX = "backbone.visual."
PAYLOAD_HEAD_PREFIX = "head."


def text_config(config: dict) -> dict:
    """The raw `text_config` object of a config.json dict (sizes read by hand, e.g. by the fixture)."""
    return config.get("text_config", config)


def layer_types(config: dict) -> list[str]:
    """text_config.layer_types as the runtime reads it (derived from full_attention_interval when absent)."""
    return list(table.model_config(config).text_config.layer_types)


def linear_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """{`layers.{i}.{module}`: (out_features, in_features)} for every LoRA target (language nn.Linear)."""
    return table.lora_targets(table.model_config(config))


def language_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Names (without prefix) and shapes of the language model's state dict (no lm_head)."""
    return table.expand(table.LANGUAGE, table.model_config(config))


def vision_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Names (without prefix) and shapes of the vision tower's state dict."""
    return table.expand(table.VISION, table.model_config(config))


def trained_vision_blocks(config: dict, last_n: int) -> list[int]:
    depth = table.model_config(config).vision_config.depth
    return list(range(max(0, depth - last_n), depth))


def trainable_shapes(config: dict, rule: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """Expected `payload["weights"]` keys -> (shape, dtype name) for stage `vision_top`.

    `rule` is the pins file's `trainable_inventory` (lora rank, trained block count, head size).
    """
    cfg = table.model_config(config)
    rank = rule["lora"]["rank"]
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for module, (o, i) in table.lora_targets(cfg).items():
        out[f"{PAYLOAD_LORA_PREFIX}{module}.lora_A.default.weight"] = ((rank, i), rule["lora"]["dtype"])
        out[f"{PAYLOAD_LORA_PREFIX}{module}.lora_B.default.weight"] = ((o, rank), rule["lora"]["dtype"])
    vshapes = table.expand(table.VISION, cfg)
    vdtype = rule["vision"]["dtype"]
    blocks = trained_vision_blocks(config, rule["vision"]["trained_blocks_from_end"])
    for name in table.overlaid_vision(cfg, blocks, rule["vision"].get("merger", True)):
        out[PAYLOAD_VISION_PREFIX + name] = (vshapes[name], vdtype)
    heads = table.expand(table.HEAD, cfg, table.symbols_for(cfg, projection_dim=rule["head"]["projection_dim"]))
    for name in rule["head"]["names"]:  # load_pins holds these to the table's head names
        out[PAYLOAD_HEAD_PREFIX + name] = (heads[name], rule["head"]["dtype"])
    return dict(sorted(out.items()))
