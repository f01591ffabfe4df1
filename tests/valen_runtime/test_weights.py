"""Loader: one-to-one names, dtype choices (bf16 as exported, fp32 with the FP32 sources), LoRA attach."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from valen_runtime.errors import WeightsError
from valen_runtime.safetensors_file import SafetensorsFile
from valen_runtime.weights import load_model


def test_bf16_load_uses_the_exported_tensors_unchanged(tiny_export):
    m = load_model(tiny_export["separate"], dtype="bf16")
    lang = SafetensorsFile(tiny_export["separate"] / "model-00001-of-00001.safetensors")
    for name in lang.names():
        want = lang.read(name)
        got = m.text.state_dict()[name[len("model.language_model."):]]
        assert got.dtype == torch.bfloat16 and torch.equal(got, want), name
    layer = m.text.layers[0].mlp.gate_proj
    assert layer.lora_A.weight.dtype == torch.float32 and layer.lora_scale == 2.0
    assert m.head.decision.weight.dtype == torch.float32


def test_fp32_load_takes_the_fp32_originals(tiny_export, tiny_fixture):
    m = load_model(tiny_export["separate"], dtype="fp32")
    base = SafetensorsFile(tiny_fixture.base / "model.safetensors-00001-of-00001.safetensors")
    a_log = m.text.layers[0].linear_attn.A_log
    assert a_log.dtype == torch.float32
    assert torch.equal(a_log, base.read("model.language_model.layers.0.linear_attn.A_log"))  # not the bf16-rounded value
    assert not torch.equal(a_log, a_log.to(torch.bfloat16).float())


def test_merged_export_has_no_adapters(tiny_export):
    m = load_model(tiny_export["merged"], dtype="bf16")
    assert all(mod.lora_A is None for mod in m.text.modules() if hasattr(mod, "lora_A"))


def test_adapter_rank_must_match_the_manifest(tiny_export, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_export["separate"], bad)
    manifest = json.loads((bad / "valen_export.json").read_text())
    manifest["lora"]["rank"] = 16
    (bad / "valen_export.json").write_text(json.dumps(manifest))
    with pytest.raises(WeightsError, match="differ from the manifest's lora.rank 16"):
        load_model(bad)


def test_unknown_dtype_is_refused(tiny_export):
    with pytest.raises(WeightsError, match="dtype 'fp16'"):
        load_model(tiny_export["separate"], dtype="fp16")


from hypothesis import given, strategies as st  # noqa: E402


@given(
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32, torch.float64]),
    n=st.integers(0, 300),
    specials=st.lists(st.tuples(st.integers(0, 299), st.sampled_from([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e4])), max_size=3),
)
def test_all_finite_agrees_with_isfinite(dtype, n, specials):
    from valen_runtime.safetensors_file import all_finite

    x = torch.randn(n, dtype=torch.float64).to(dtype)
    for i, v in specials:
        if i < n:
            x[i] = v
    assert all_finite(x, chunk=7) == bool(torch.isfinite(x).all())
