"""Every refusal: exit code 2, one line naming the file/key and the expectation, nothing left in OUT."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import torch
from click.testing import CliRunner

from valen_export.cli import export_command, verify_command
from valen_runtime.safetensors_file import sha256_file


def run_export(fx_ckpt, fx_base, pins, out, *extra):
    result = CliRunner().invoke(
        export_command, ["--checkpoint", str(fx_ckpt), "--base", str(fx_base), "--pins", str(pins), "--out", str(out), "--no-progress", *extra]
    )
    return result


def assert_refused(result, out, *phrases):
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.output.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, result.output
    for p in phrases:
        assert p in lines[0], lines[0]
    assert "Traceback" not in result.output
    assert not out.exists() or not any(out.iterdir())
    assert not list(out.parent.glob(f".{out.name}.partial-*"))


@pytest.fixture()
def work(tiny_fixture, tmp_path):
    """A private copy of the fixture each test may damage."""
    root = tmp_path / "fx"
    shutil.copytree(tiny_fixture.root, root)
    return root


def repin(root, **checkpoint_fields):
    pins = json.loads((root / "pins.json").read_text())
    pins["checkpoint"].update(checkpoint_fields)
    (root / "pins.json").write_text(json.dumps(pins))


def rewrite_payload(root, mutate):
    path = root / "checkpoint" / "checkpoint.pt"
    payload = torch.load(path, weights_only=True)
    mutate(payload)
    path.unlink()
    torch.save(payload, path)
    repin(root, checkpoint_sha256=sha256_file(path))


def test_wrong_checkpoint_hash(work, tmp_path):
    repin(work, checkpoint_sha256="0" * 64)
    assert_refused(run_export(work / "checkpoint", work / "base", work / "pins.json", tmp_path / "out"), tmp_path / "out", "checkpoint.pt", "sha256", "pinned")


def test_wrong_base_revision(work, tmp_path):
    m = json.loads((work / "base" / "valen_manifest.json").read_text())
    m["revision"] = "f" * 40
    (work / "base" / "valen_manifest.json").write_text(json.dumps(m))
    assert_refused(run_export(work / "checkpoint", work / "base", work / "pins.json", tmp_path / "out"), tmp_path / "out", "valen_manifest.json", "revision")


def test_wrong_base_weight_hash(work, tmp_path):
    weights = work / "base" / "model.safetensors-00001-of-00001.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert_refused(run_export(work / "checkpoint", work / "base", work / "pins.json", tmp_path / "out"), tmp_path / "out", weights.name, "base_manifest.weight_sha256")


@pytest.mark.parametrize("field,value", [("stage", "joint"), ("lora_rank", 16), ("lora_alpha", 32), ("projection_dim", 128)])
def test_wrong_training_config(work, tmp_path, field, value):
    cfg = json.loads((work / "checkpoint" / "config.json").read_text())
    cfg[field] = value
    (work / "checkpoint" / "config.json").write_text(json.dumps(cfg))
    assert_refused(run_export(work / "checkpoint", work / "base", work / "pins.json", tmp_path / "out"), tmp_path / "out", "config.json", repr(field))


def _drop_one(p):
    del p["weights"]["head.candidate.weight"]


def _add_one(p):
    p["weights"]["backbone.visual.blocks.0.attn.qkv.weight"] = torch.zeros(96, 32, dtype=torch.bfloat16)


def _reshape_one(p):
    k = "backbone.language_model.base_model.model.layers.0.mlp.up_proj.lora_A.default.weight"
    p["weights"][k] = torch.zeros(16, 64)


def _recast_one(p):
    k = "backbone.language_model.base_model.model.layers.0.mlp.up_proj.lora_A.default.weight"
    p["weights"][k] = p["weights"][k].to(torch.bfloat16)


def _nan_one(p):
    k = "head.decision.weight"
    p["weights"][k][0, 0] = float("nan")


@pytest.mark.parametrize(
    "mutate,phrases",
    [
        (_drop_one, ["missing=[head.candidate.weight]"]),
        (_add_one, ["unexpected=[backbone.visual.blocks.0.attn.qkv.weight]"]),
        (_reshape_one, ["up_proj.lora_A.default.weight", "shape [16, 64]", "expected [32, 64]"]),
        (_recast_one, ["dtype torch.bfloat16", "expected F32"]),
        (_nan_one, ["head.decision.weight", "non-finite"]),
    ],
)
def test_bad_trainable_tensors(work, tmp_path, mutate, phrases):
    rewrite_payload(work, mutate)
    assert_refused(run_export(work / "checkpoint", work / "base", work / "pins.json", tmp_path / "out"), tmp_path / "out", *phrases)


class Exploit:
    def __reduce__(self):
        return (print, ("this would run arbitrary code",))


def test_pickle_that_needs_arbitrary_code(work, tmp_path):
    rewrite_payload(work, lambda p: p.__setitem__("progress", Exploit()))
    assert_refused(run_export(work / "checkpoint", work / "base", work / "pins.json", tmp_path / "out"), tmp_path / "out", "weights_only", "GLOBAL print")


def test_truncated_checkpoint(work, tmp_path):
    path = work / "checkpoint" / "checkpoint.pt"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    repin(work, checkpoint_sha256=sha256_file(path))
    assert_refused(run_export(work / "checkpoint", work / "base", work / "pins.json", tmp_path / "out"), tmp_path / "out", "checkpoint.pt", "truncated or corrupt")


def test_truncated_base_weights(work, tmp_path):
    weights = work / "base" / "model.safetensors-00001-of-00001.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    # keep the hashes consistent so the truncation itself is what is caught
    digest = sha256_file(weights)
    m = json.loads((work / "base" / "valen_manifest.json").read_text())
    m["weight_sha256"][weights.name] = digest
    (work / "base" / "valen_manifest.json").write_text(json.dumps(m))
    rewrite_payload(work, lambda p: p["base_manifest"]["weight_sha256"].__setitem__(weights.name, digest))
    assert_refused(run_export(work / "checkpoint", work / "base", work / "pins.json", tmp_path / "out"), tmp_path / "out", weights.name)


def test_existing_non_empty_out(work, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    result = run_export(work / "checkpoint", work / "base", work / "pins.json", out)
    assert result.exit_code == 2 and "not an empty directory" in result.output
    assert (out / "keep.txt").read_text() == "user data" and len(list(out.iterdir())) == 1


def test_out_inside_base_is_refused(work):
    out = work / "base" / "export"
    result = run_export(work / "checkpoint", work / "base", work / "pins.json", out)
    assert result.exit_code == 2 and "must not be inside" in result.output and not out.exists()


def test_bad_pins_file(work, tmp_path):
    (work / "pins.json").write_text("{not json")
    assert_refused(run_export(work / "checkpoint", work / "base", work / "pins.json", tmp_path / "out"), tmp_path / "out", "pins.json", "not valid JSON")


def test_verify_reports_each_failure(tiny_export, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_export["separate"], bad)
    (bad / "valen_head.safetensors").write_bytes(b"\0" * 10)
    (bad / "extra.bin").write_bytes(b"x")
    result = CliRunner().invoke(verify_command, [str(bad)])
    assert result.exit_code == 1
    fails = [ln for ln in result.output.splitlines() if ln.startswith("FAIL")]
    assert any("valen_head.safetensors: size" in ln for ln in fails)
    assert any("extra.bin: not listed" in ln for ln in fails)
    ok = CliRunner().invoke(verify_command, [str(tiny_export["merged"])])
    assert ok.exit_code == 0, ok.output


@pytest.mark.parametrize("size", ["nan", "-1", "inf"])
def test_bad_max_shard_size_is_one_line(work, tmp_path, size):
    out = tmp_path / "out"
    result = run_export(work / "checkpoint", work / "base", work / "pins.json", out, "--max-shard-size", size)
    assert_refused(result, out, "--max-shard-size", "finite number of GiB >= 0")


def test_base_config_the_runtime_refuses_is_refused_naming_the_file(work, tmp_path):
    config_path = work / "base" / "config.json"
    config = json.loads(config_path.read_text())
    config["text_config"]["layer_types"][0] = "sliding_attention"
    config_path.write_text(json.dumps(config))
    out = tmp_path / "out"
    result = run_export(work / "checkpoint", work / "base", work / "pins.json", out)
    assert result.exit_code == 2 and not out.exists()
    assert "config.json: text_config.layer_types[0]" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize(
    "change",
    [
        lambda c: c.update(text_config="qwen"),
        lambda c: c["text_config"].update(rope_parameters=[1]),
        lambda c: c["text_config"]["rope_parameters"].update(mrope_section="11,11,10"),
        lambda c: c["text_config"]["rope_parameters"].update(partial_rotary_factor="0.25"),
        lambda c: c["vision_config"].update(rope_parameters=[10000]),
        lambda c: c["text_config"]["rope_parameters"].update(partial_rotary_factor=0.3),
    ],
    ids=["text-config-not-object", "rope-not-object", "section-not-list", "factor-not-number", "vision-rope-not-object", "rotary-not-whole"],
)
def test_verify_refuses_odd_config_values_in_one_line(tiny_export, tmp_path, change):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_export["merged"], bad)
    config = json.loads((bad / "config.json").read_text())
    change(config)
    (bad / "config.json").write_text(json.dumps(config))
    manifest = json.loads((bad / "valen_export.json").read_text())
    data = (bad / "config.json").read_bytes()
    manifest["files"]["config.json"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    (bad / "valen_export.json").write_text(json.dumps(manifest, indent=2))
    result = CliRunner().invoke(verify_command, [str(bad)])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output  # a refusal, not a crash
    assert "config.json" in result.output and "Traceback" not in result.output


def test_synthetic_checkpoint_without_pins_says_to_pass_its_pins(tiny_fixture, tmp_path):
    """The built-in pins are the real release's; a fixture's own pins.json is what its checkpoint needs."""
    out = tmp_path / "out"
    result = CliRunner().invoke(export_command, ["--checkpoint", str(tiny_fixture.checkpoint), "--base", str(tiny_fixture.base), "--out", str(out), "--no-progress"])
    assert_refused(result, out, "checkpoint.pt: sha256", "does not match the pinned", "built-in pins are for the real Valen-Preview-0923", f"--pins {tiny_fixture.pins}")


def test_explicit_pins_mismatch_has_no_fixture_hint(work, tmp_path):
    repin(work, checkpoint_sha256="0" * 64)
    result = run_export(work / "checkpoint", work / "base", work / "pins.json", tmp_path / "out")
    assert_refused(result, tmp_path / "out", "does not match the pinned")
    assert "built-in pins" not in result.output
