"""Exporter: values checked against independent computations (transformers' own loading, PEFT's
own merge), byte-identical re-export, and the atomic-output rules."""

from __future__ import annotations

import json

import torch
from peft import LoraConfig, get_peft_model
from transformers import Qwen3_5ForConditionalGeneration

from valen_export import inventory
from valen_export.export import export
from valen_export.verify import verify_export
from valen_runtime.safetensors_file import SafetensorsFile


def read_all(export_dir, manifest_key):
    m = json.loads((export_dir / "valen_export.json").read_text())
    files = m["language"]["files"] if manifest_key == "language" else [m[manifest_key]["file"]]
    out = {}
    for f in files:
        sf = SafetensorsFile(export_dir / f)
        out.update(dict(sf.iter_tensors()))
    return out


def hf_reference(fixture, dtype):
    """The reference's own load: from_pretrained(dtype) + PEFT on every language Linear + payload weights."""
    model, info = Qwen3_5ForConditionalGeneration.from_pretrained(
        fixture.base, dtype=dtype, attn_implementation="eager", local_files_only=True, output_loading_info=True
    )
    assert not any(info.values()), info
    backbone = model.model
    targets = [n for n, mod in backbone.language_model.named_modules() if isinstance(mod, torch.nn.Linear)]
    cfg = json.loads((fixture.checkpoint / "config.json").read_text())
    backbone.language_model = get_peft_model(
        backbone.language_model, LoraConfig(r=cfg["lora_rank"], lora_alpha=cfg["lora_alpha"], lora_dropout=0.0, target_modules=targets, bias="none")
    )
    payload = torch.load(fixture.checkpoint / "checkpoint.pt", weights_only=True)
    weights = {k[len("backbone."):]: v for k, v in payload["weights"].items() if k.startswith("backbone.")}
    result = backbone.load_state_dict(weights, strict=False)
    assert not result.unexpected_keys
    return backbone, payload


def test_exports_verify(tiny_export):
    for mode in ("separate", "merged"):
        assert verify_export(tiny_export[mode]) == []


def test_language_and_vision_equal_what_the_reference_computes_with(tiny_fixture, tiny_export):
    backbone, payload = hf_reference(tiny_fixture, torch.bfloat16)
    lang = read_all(tiny_export["separate"], "language")
    state = backbone.language_model.state_dict()
    for name, t in lang.items():
        rest = name[len(inventory.LANGUAGE_PREFIX):]
        module = rest[: -len(".weight")]
        key = f"base_model.model.{module}.base_layer.weight" if f"base_model.model.{module}.base_layer.weight" in state else f"base_model.model.{rest}"
        ref = state[key]
        assert ref.dtype == torch.bfloat16 and t.dtype == torch.bfloat16, name
        assert torch.equal(t, ref), name  # incl. A_log / gated norm rounded as from_pretrained(bf16) does
    vision = read_all(tiny_export["separate"], "vision")
    vstate = backbone.visual.state_dict()
    assert set(vision) == {inventory.VISION_PREFIX + k for k in vstate}
    for name, t in vision.items():
        assert torch.equal(t, vstate[name[len(inventory.VISION_PREFIX):]]), name
    # the overlay really happened: trained blocks differ from the base
    base = SafetensorsFile(tiny_fixture.base / "model.safetensors-00001-of-00001.safetensors")
    depth = json.loads((tiny_fixture.base / "config.json").read_text())["vision_config"]["depth"]
    trained = f"model.visual.blocks.{depth - 1}.attn.qkv.weight"
    untrained = f"model.visual.blocks.{depth - 5}.attn.qkv.weight"
    assert not torch.equal(vision[trained], base.read(trained))
    assert torch.equal(vision[untrained], base.read(untrained))


def test_separate_lora_is_the_fp32_payload_renamed(tiny_fixture, tiny_export):
    payload = torch.load(tiny_fixture.checkpoint / "checkpoint.pt", weights_only=True)
    lora = read_all(tiny_export["separate"], "lora")
    lora_payload = {k: v for k, v in payload["weights"].items() if ".lora_" in k}
    assert len(lora) == len(lora_payload)
    for k, v in lora_payload.items():
        new = k.replace("backbone.language_model.base_model.model.", "base_model.model.model.language_model.").replace(".default.weight", ".weight")
        assert lora[new].dtype == torch.float32
        assert torch.equal(lora[new], v), k
    head = read_all(tiny_export["separate"], "head")
    for n in ("decision.weight", "candidate.weight"):
        assert head[n].dtype == torch.float32 and torch.equal(head[n], payload["weights"]["head." + n])


def test_merged_equals_peft_fp32_merge_rounded_once(tiny_fixture, tiny_export):
    # Independent computation: PEFT's own merge on an FP32 load of the same base, then one BF16 cast.
    backbone, _ = hf_reference(tiny_fixture, torch.float32)
    merged_model = backbone.language_model.merge_and_unload()
    state = merged_model.state_dict()
    lang = read_all(tiny_export["merged"], "language")
    fp32_sources = read_all(tiny_export["separate"], "fp32_sources")
    n_lora = 0
    for name, t in lang.items():
        rest = name[len(inventory.LANGUAGE_PREFIX):]
        ref = state[rest]
        if name in fp32_sources:
            assert torch.equal(ref, fp32_sources[name])  # FP32 originals kept exactly
        assert torch.equal(t, ref.to(torch.bfloat16)), name
        n_lora += rest[: -len(".weight")] in inventory.linear_shapes(json.loads((tiny_fixture.base / "config.json").read_text()))
    assert n_lora == 31
    separate = read_all(tiny_export["separate"], "language")
    changed = [n for n in lang if not torch.equal(lang[n], separate[n])]
    assert len(changed) == n_lora  # the merge touched exactly the adapted Linears


def test_reexport_is_byte_identical(tiny_fixture, tiny_export, tmp_path):
    again = tmp_path / "again"
    export(tiny_fixture.checkpoint, tiny_fixture.base, again, lora_mode="separate", pins_path=tiny_fixture.pins, progress=False)
    first = sorted(p.name for p in tiny_export["separate"].iterdir())
    assert first == sorted(p.name for p in again.iterdir())
    for name in first:
        assert (again / name).read_bytes() == (tiny_export["separate"] / name).read_bytes(), name


def test_rlcd_reference_weights_are_never_exported(tmp_path):
    from valen_export.fixture import build_fixture

    fx = build_fixture(tmp_path / "fx", preset="tiny", seed=3, rlcd=True)
    out = tmp_path / "out"
    export(fx.checkpoint, fx.base, out, pins_path=fx.pins, progress=False)
    payload = torch.load(fx.checkpoint / "checkpoint.pt", weights_only=True)
    head = read_all(out, "head")
    assert torch.equal(head["decision.weight"], payload["weights"]["head.decision.weight"])
    assert not torch.equal(head["decision.weight"], payload["training_state"]["reference_weights"]["head.decision.weight"])


def test_manifest_records_decisions(tiny_export):
    m = json.loads((tiny_export["separate"] / "valen_export.json").read_text())
    assert m["format"] == "valen-native/1"
    assert m["lora"] == {**m["lora"], "mode": "separate", "rank": 32, "alpha": 64, "scale": 2.0, "pairs": 31, "dtype": "F32"}
    casts = {d["pattern"]: d["count"] for d in m["dtype_decisions"] if d["from"] == "F32" and d["to"] == "BF16"}
    assert casts == {"model.language_model.layers.*.linear_attn.A_log": 3, "model.language_model.layers.*.linear_attn.norm.weight": 3}
    assert "valen_export.json" not in m["files"]
    assert m["head"]["logit_scale"] == 1 / 16


def test_single_file_layout_without_index(tiny_fixture, tmp_path):
    out = tmp_path / "single"
    export(tiny_fixture.checkpoint, tiny_fixture.base, out, pins_path=tiny_fixture.pins, max_shard_bytes=0, progress=False)
    assert (out / "model.safetensors").exists() and not (out / "model.safetensors.index.json").exists()
    assert verify_export(out) == []


def test_sharding_splits_language_files_and_index_covers_them(tiny_fixture, tmp_path):
    out = tmp_path / "sharded"
    export(tiny_fixture.checkpoint, tiny_fixture.base, out, pins_path=tiny_fixture.pins, max_shard_bytes=100_000, progress=False)
    m = json.loads((out / "valen_export.json").read_text())
    assert len(m["language"]["files"]) > 2
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == sorted(m["language"]["files"])
    assert verify_export(out) == []
