"""manifests/valen-native-1.schema.json: every export the tests make validates (the exporter checks
its own manifest before writing it); the schema is closed, so a field it does not describe, a
wrong type or a mode-inconsistent LoRA section fails with jsonschema itself."""

from __future__ import annotations

import copy
import json

import jsonschema
import pytest

from valen_export.verify import SCHEMA_PATH, schema_problems


@pytest.fixture(scope="module")
def validator():
    schema = json.loads(SCHEMA_PATH.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def manifest(export_dir) -> dict:
    return json.loads((export_dir / "valen_export.json").read_text())


@pytest.mark.parametrize("mode", ["separate", "merged"])
def test_exports_validate(validator, tiny_export, mode):
    validator.validate(manifest(tiny_export[mode]))


def break_it(m: dict, how: str) -> dict:
    m = copy.deepcopy(m)
    if how == "extra-field":
        m["lora"]["dropout"] = 0.0
    elif how == "uppercase-hash":
        name = next(iter(m["files"]))
        m["files"][name]["sha256"] = m["files"][name]["sha256"].upper()
    elif how == "path-in-files":
        m["files"]["sub/x.bin"] = {"sha256": "0" * 64, "size": 1}
    elif how == "separate-without-file":
        m["lora"]["file"] = None
    elif how == "rank-too-large":
        m["lora"]["rank"] = 129
    elif how == "head-dtype":
        m["head"]["tensors"]["decision.weight"]["dtype"] = "BF16"
    elif how == "missing-vision-field":
        del m["vision"]["trained_merger"]
    return m


@pytest.mark.parametrize(
    "how", ["extra-field", "uppercase-hash", "path-in-files", "separate-without-file", "rank-too-large", "head-dtype", "missing-vision-field"]
)
def test_broken_manifests_fail(validator, tiny_export, how):
    bad = break_it(manifest(tiny_export["separate"]), how)
    assert not validator.is_valid(bad)
    assert schema_problems(bad)  # valen-verify reports the same


def test_merged_section_must_not_name_an_adapter(validator, tiny_export):
    m = manifest(tiny_export["merged"])
    m["lora"]["file"] = "adapter_model.safetensors"
    assert not validator.is_valid(m)
