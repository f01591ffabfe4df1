"""Expected tensor inventories, derived from a Qwen3.5 `config.json` dict and never hard-coded.

One place answers "which tensors, which shapes": the base language and vision sets
(`model.language_model.*`, `model.visual.*`), the LoRA targets (every nn.Linear of the
language model, as the Valen reference wraps them) and the Valen trainable set of stage
`vision_top`. The fixture, the exporter and `valen-verify` all use it.
"""

from __future__ import annotations

LANGUAGE_PREFIX = "model.language_model."
VISION_PREFIX = "model.visual."

# Projections that are nn.Linear in transformers' Qwen3.5 layers, i.e. what the reference's
# LoRA wraps ("every nn.Linear under language_model"), by layer kind.
GDN_LINEARS = (
    "linear_attn.in_proj_qkv",
    "linear_attn.in_proj_z",
    "linear_attn.in_proj_b",
    "linear_attn.in_proj_a",
    "linear_attn.out_proj",
)
ATTENTION_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
MLP_LINEARS = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")

# Base tensors stored FP32 in the released Qwen3.5 dense checkpoints (2 per GDN layer).
FP32_IN_BASE_SUFFIXES = ("linear_attn.A_log", "linear_attn.norm.weight")


def text_config(config: dict) -> dict:
    return config.get("text_config", config)


def layer_types(tc: dict) -> list[str]:
    types = tc.get("layer_types")
    if types is None:
        interval = tc.get("full_attention_interval", 4)
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(tc["num_hidden_layers"])]
    return list(types)


def linear_shapes(tc: dict) -> dict[str, tuple[int, int]]:
    """{`layers.{i}.{module}`: (out_features, in_features)} for every language nn.Linear."""
    h, inter = tc["hidden_size"], tc["intermediate_size"]
    heads, kv, hd = tc["num_attention_heads"], tc["num_key_value_heads"], tc["head_dim"]
    kd = tc["linear_num_key_heads"] * tc["linear_key_head_dim"]
    vd = tc["linear_num_value_heads"] * tc["linear_value_head_dim"]
    vh = tc["linear_num_value_heads"]
    out: dict[str, tuple[int, int]] = {}
    for i, kind in enumerate(layer_types(tc)):
        p = f"layers.{i}."
        if kind == "linear_attention":
            out[p + "linear_attn.in_proj_qkv"] = (2 * kd + vd, h)
            out[p + "linear_attn.in_proj_z"] = (vd, h)
            out[p + "linear_attn.in_proj_b"] = (vh, h)
            out[p + "linear_attn.in_proj_a"] = (vh, h)
            out[p + "linear_attn.out_proj"] = (h, vd)
        elif kind == "full_attention":
            out[p + "self_attn.q_proj"] = (heads * hd * 2, h)  # query and output gate, per head
            out[p + "self_attn.k_proj"] = (kv * hd, h)
            out[p + "self_attn.v_proj"] = (kv * hd, h)
            out[p + "self_attn.o_proj"] = (h, heads * hd)
        else:
            raise ValueError(f"config.json: text_config.layer_types[{i}] = {kind!r}, expected linear_attention or full_attention")
        out[p + "mlp.gate_proj"] = (inter, h)
        out[p + "mlp.up_proj"] = (inter, h)
        out[p + "mlp.down_proj"] = (h, inter)
    return out


def language_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Names (without prefix) and shapes of the language model's state dict (no lm_head)."""
    tc = text_config(config)
    h = tc["hidden_size"]
    kd = tc["linear_num_key_heads"] * tc["linear_key_head_dim"]
    vd = tc["linear_num_value_heads"] * tc["linear_value_head_dim"]
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (tc["vocab_size"], h), "norm.weight": (h,)}
    for name, (o, i) in linear_shapes(tc).items():
        shapes[name + ".weight"] = (o, i)
    for i, kind in enumerate(layer_types(tc)):
        p = f"layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if kind == "linear_attention":
            shapes[p + "linear_attn.conv1d.weight"] = (2 * kd + vd, 1, tc["linear_conv_kernel_dim"])
            shapes[p + "linear_attn.A_log"] = (tc["linear_num_value_heads"],)
            shapes[p + "linear_attn.dt_bias"] = (tc["linear_num_value_heads"],)
            shapes[p + "linear_attn.norm.weight"] = (tc["linear_value_head_dim"],)
        else:
            shapes[p + "self_attn.q_norm.weight"] = (tc["head_dim"],)
            shapes[p + "self_attn.k_norm.weight"] = (tc["head_dim"],)
    return dict(sorted(shapes.items()))


def vision_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Names (without prefix) and shapes of the vision tower's state dict."""
    vc = config["vision_config"]
    h, out = vc["hidden_size"], vc["out_hidden_size"]
    merged = h * vc["spatial_merge_size"] ** 2
    shapes: dict[str, tuple[int, ...]] = {
        "patch_embed.proj.weight": (h, vc["in_channels"], vc["temporal_patch_size"], vc["patch_size"], vc["patch_size"]),
        "patch_embed.proj.bias": (h,),
        "pos_embed.weight": (vc["num_position_embeddings"], h),
        "merger.norm.weight": (h,),
        "merger.norm.bias": (h,),
        "merger.linear_fc1.weight": (merged, merged),
        "merger.linear_fc1.bias": (merged,),
        "merger.linear_fc2.weight": (out, merged),
        "merger.linear_fc2.bias": (out,),
    }
    for b in range(vc["depth"]):
        shapes.update(block_shapes(vc, b))
    return dict(sorted(shapes.items()))


def block_shapes(vc: dict, b: int) -> dict[str, tuple[int, ...]]:
    h, inter = vc["hidden_size"], vc["intermediate_size"]
    p = f"blocks.{b}."
    return {
        p + "norm1.weight": (h,),
        p + "norm1.bias": (h,),
        p + "norm2.weight": (h,),
        p + "norm2.bias": (h,),
        p + "attn.qkv.weight": (3 * h, h),
        p + "attn.qkv.bias": (3 * h,),
        p + "attn.proj.weight": (h, h),
        p + "attn.proj.bias": (h,),
        p + "mlp.linear_fc1.weight": (inter, h),
        p + "mlp.linear_fc1.bias": (inter,),
        p + "mlp.linear_fc2.weight": (h, inter),
        p + "mlp.linear_fc2.bias": (h,),
    }


def trained_vision_blocks(config: dict, last_n: int) -> list[int]:
    depth = config["vision_config"]["depth"]
    return list(range(max(0, depth - last_n), depth))


# Payload key prefixes of the Valen wrapper (children `backbone` and `head`); in-memory PEFT
# names carry the adapter name `.default` (peft 0.18.1).
PAYLOAD_LORA_PREFIX = "backbone.language_model.base_model.model."
PAYLOAD_VISION_PREFIX = "backbone.visual."
PAYLOAD_HEAD_PREFIX = "head."


def trainable_shapes(config: dict, rule: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """Expected `payload["weights"]` keys -> (shape, dtype name) for stage `vision_top`.

    `rule` is the pins file's `trainable_inventory` (lora rank, trained block count, head size).
    """
    tc = text_config(config)
    rank = rule["lora"]["rank"]
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for module, (o, i) in linear_shapes(tc).items():
        out[f"{PAYLOAD_LORA_PREFIX}{module}.lora_A.default.weight"] = ((rank, i), rule["lora"]["dtype"])
        out[f"{PAYLOAD_LORA_PREFIX}{module}.lora_B.default.weight"] = ((o, rank), rule["lora"]["dtype"])
    vshapes = vision_shapes(config)
    vdtype = rule["vision"]["dtype"]
    for b in trained_vision_blocks(config, rule["vision"]["trained_blocks_from_end"]):
        for name in block_shapes(config["vision_config"], b):
            out[PAYLOAD_VISION_PREFIX + name] = (vshapes[name], vdtype)
    if rule["vision"].get("merger", True):
        for name, shape in vshapes.items():
            if name.startswith("merger."):
                out[PAYLOAD_VISION_PREFIX + name] = (shape, vdtype)
    proj = rule["head"]["projection_dim"]
    for name in rule["head"]["names"]:
        out[PAYLOAD_HEAD_PREFIX + name] = ((proj, tc["hidden_size"]), rule["head"]["dtype"])
    return dict(sorted(out.items()))
