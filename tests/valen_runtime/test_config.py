"""valen_runtime.config: values read from a qwen3_5 config.json, refusals of unsupported settings."""

import copy
import dataclasses
import json
from pathlib import Path

import pytest

from valen_runtime.config import ModelConfig
from valen_runtime.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def tiny_dict() -> dict:
    """A hand-written tiny config.json (no HF bookkeeping keys)."""
    return {
        "model_type": "qwen3_5",
        "image_token_id": 12, "video_token_id": 13, "vision_start_token_id": 9, "vision_end_token_id": 10,
        "tie_word_embeddings": True,
        "text_config": {
            "model_type": "qwen3_5_text", "vocab_size": 404, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 4,
            "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
            "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32,
            "linear_num_key_heads": 2, "linear_num_value_heads": 2, "linear_key_head_dim": 16,
            "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "hidden_act": "silu",
            "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "attention_bias": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                                "mrope_section": [2, 1, 1], "mrope_interleaved": True},
        },
        "vision_config": {
            "model_type": "qwen3_5", "depth": 4, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
            "in_channels": 3, "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2,
            "out_hidden_size": 64, "num_position_embeddings": 64, "hidden_act": "gelu_pytorch_tanh",
            "deepstack_visual_indexes": [],
        },
    }


def test_values_come_from_the_dict():
    cfg = ModelConfig.from_dict(tiny_dict())
    t, v = cfg.text_config, cfg.vision_config
    assert (t.hidden_size, t.num_attention_heads, t.num_key_value_heads, t.head_dim) == (64, 4, 1, 32)
    assert t.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert t.rope_parameters.rope_theta == 1e7 and isinstance(t.rope_parameters.rope_theta, float)
    assert t.rope_parameters.mrope_section == (2, 1, 1) and t.rotary_dim == 8
    assert (v.depth, v.hidden_size, v.num_heads, v.head_dim, v.num_grid_per_side) == (4, 32, 2, 16, 8)
    assert (cfg.image_token_id, cfg.vision_end_token_id, cfg.tie_word_embeddings) == (12, 10, True)
    assert cfg.unknown_keys == ()
    assert "text_config.model_type" in cfg.ignored_keys


def test_transformers_to_dict_round_trip():
    import transformers

    d = tiny_dict()
    hf = transformers.Qwen3_5Config(
        text_config={k: v for k, v in d["text_config"].items() if k != "model_type"},
        vision_config={k: v for k, v in d["vision_config"].items() if k not in ("model_type", "deepstack_visual_indexes")},
        **{k: d[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")},
    )
    cfg = ModelConfig.from_dict(json.loads(hf.to_json_string()), strict=True)
    want = ModelConfig.from_dict(d)
    # tie_word_embeddings was not passed to HF, which defaults it to false.
    assert cfg.text_config == dataclasses.replace(want.text_config, tie_word_embeddings=False)
    assert cfg.vision_config == want.vision_config


def test_presumed_2b_config_loads(tmp_path):
    path = REPO / "manifests" / "qwen3.5-2b.config.json"  # tracked: missing is a failure, not a skip
    cfg = ModelConfig.load(path, strict=True)
    t = cfg.text_config
    assert (t.hidden_size, t.num_hidden_layers, t.rotary_dim, t.rope_parameters.mrope_section) == (2048, 24, 64, (11, 11, 10))
    assert [i for i, k in enumerate(t.layer_types) if k == "full_attention"] == [3, 7, 11, 15, 19, 23]
    (tmp_path / "config.json").write_text(path.read_text())
    assert ModelConfig.load(tmp_path) == cfg  # a directory works too


def test_layer_types_default_from_interval():
    d = tiny_dict()
    del d["text_config"]["layer_types"]
    d["text_config"]["num_hidden_layers"] = 6
    d["text_config"]["full_attention_interval"] = 3
    cfg = ModelConfig.from_dict(d)
    assert cfg.text_config.layer_types == ("linear_attention", "linear_attention", "full_attention") * 2


def _set(d, path, value):
    *keys, last = path.split(".")
    for k in keys:
        d = d[k]
    if value is KeyError:
        del d[last]
    else:
        d[last] = value


@pytest.mark.parametrize(
    "path, value, phrase",
    [
        ("model_type", "qwen3_5_moe", "model_type = 'qwen3_5_moe'"),
        ("text_config.hidden_act", "gelu", "text_config.hidden_act = 'gelu'"),
        ("text_config.attention_bias", True, "text_config.attention_bias = True"),
        ("text_config.attn_output_gate", False, "attn_output_gate = False"),
        ("text_config.rope_parameters.mrope_section", [2, 2, 1], "mrope_section = [2, 2, 1]"),
        ("text_config.rope_parameters.rope_type", "yarn", "rope_type = 'yarn'"),
        ("text_config.rope_parameters.mrope_interleaved", False, "mrope_interleaved = False"),
        ("text_config.rope_parameters.factor", 2.0, "unsupported keys ['factor']"),
        ("text_config.layer_types", ["linear_attention"] * 3 + ["sliding_attention"], "layer_types[3] = 'sliding_attention'"),
        ("text_config.layer_types", ["linear_attention"] * 3, "layer_types has 3 entries"),
        ("text_config.num_key_value_heads", 3, "not a multiple of num_key_value_heads = 3"),
        ("text_config.hidden_size", KeyError, "text_config.hidden_size is missing"),
        ("text_config.hidden_size", "64", "text_config.hidden_size = '64'"),
        ("text_config.head_dim", 0, "text_config.head_dim = 0"),
        ("vision_config.deepstack_visual_indexes", [5, 11], "deepstack_visual_indexes = [5, 11]"),
        ("vision_config.hidden_act", "silu", "vision_config.hidden_act = 'silu'"),
        ("vision_config.num_position_embeddings", 60, "num_position_embeddings = 60"),
        ("vision_config.out_hidden_size", 32, "out_hidden_size = 32"),
        ("vision_config.patch_size", [16, 16], "patch_size = [16, 16]"),
        ("vision_config.rope_parameters", {"rope_theta": 500.0}, "rope_theta = 500.0"),
        ("image_token_id", KeyError, "config.image_token_id is missing"),
    ],
)
def test_unsupported_settings_are_refused(path, value, phrase):
    d = tiny_dict()
    _set(d, path, value)
    with pytest.raises(ConfigError) as err:
        ModelConfig.from_dict(d)
    assert phrase in str(err.value)


def test_unknown_keys_are_recorded_or_refused():
    d = tiny_dict()
    d["text_config"]["sliding_window"] = 128
    d["new_root_field"] = 1
    cfg = ModelConfig.from_dict(d)
    assert cfg.unknown_keys == ("config.new_root_field", "text_config.sliding_window")
    with pytest.raises(ConfigError, match="sliding_window"):
        ModelConfig.from_dict(copy.deepcopy(d), strict=True)


def test_load_errors(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        ModelConfig.load(tmp_path / "missing.json")
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.load(bad)
