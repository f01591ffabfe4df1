"""Conformance vectors: a float32 reader lands inside every declared bound; the bounds are tight
enough that the two LoRA modes, a doubled scale or a wrong head formula land outside them; the
head readout agrees with the runtime's own DecisionHead; the CLI refuses bad input in one line."""

from __future__ import annotations

import json
import math

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from valen_export.vectors import U32, gamma, main, write_vectors
from valen_runtime.head import DecisionHead


def tensor(export_dir, name: str) -> torch.Tensor:
    m = json.loads((export_dir / "valen_export.json").read_text())
    for f in list(m["language"]["files"]) + [x for x in (m["lora"]["file"], m["head"]["file"]) if x]:
        with safe_open(export_dir / f, framework="pt") as st:
            if name in st.keys():
                return st.get_tensor(name)
    raise KeyError(name)


def fp32_projection(export_dir, probe, scale=None) -> torch.Tensor:
    """What a float32 reader computes for a projection probe (torch on CPU, its own summation order)."""
    x = torch.tensor(probe["input"], dtype=torch.float32)
    y = x @ tensor(export_dir, probe["weight"]).float().T
    if probe["mode"] == "separate":
        s = probe["scale"] if scale is None else scale
        y = y + torch.tensor(s, dtype=torch.float32) * ((x @ tensor(export_dir, probe["lora_a"]).T) @ tensor(export_dir, probe["lora_b"]).T)
    return y


def fp32_logits(export_dir, head) -> torch.Tensor:
    cand = torch.tensor(head["candidate_hidden"], dtype=torch.float32)
    dec = torch.tensor(head["decision_hidden"], dtype=torch.float32)
    c = cand @ tensor(export_dir, "candidate.weight").T
    d = tensor(export_dir, "decision.weight") @ dec
    return (c * d).sum(-1) * torch.tensor(head["logit_scale"], dtype=torch.float32)


def excess(got: torch.Tensor, expected, bound) -> float:
    """max over elements of |got - expected| / bound (<= 1 means inside every bound)."""
    err = (got.double() - torch.tensor(expected, dtype=torch.float64)).abs()
    return float((err / torch.tensor(bound, dtype=torch.float64)).max())


@pytest.fixture(scope="module")
def vectors(tiny_export, tmp_path_factory):
    root = tmp_path_factory.mktemp("vectors")
    out = {}
    for mode, export_dir in tiny_export.items():
        write_vectors(export_dir, root / f"{mode}.json")
        out[mode] = json.loads((root / f"{mode}.json").read_text())
    return out


@pytest.mark.parametrize("mode", ["separate", "merged"])
def test_a_float32_reader_is_inside_every_bound(tiny_export, vectors, mode):
    v = vectors[mode]
    export_dir = tiny_export[mode]
    row = tensor(export_dir, v["embedding"]["tensor"])[v["embedding"]["token_id"]].float()
    assert row.tolist() == v["embedding"]["expected"] and v["embedding"]["bound"] == 0.0
    assert excess(fp32_logits(export_dir, v["head"]), v["head"]["expected_logits"], v["head"]["bound"]) <= 1
    assert len(v["projections"]) == 3
    for probe in v["projections"]:
        assert probe["mode"] == mode
        assert excess(fp32_projection(export_dir, probe), probe["expected"], probe["bound"]) <= 1, probe["module"]


def test_the_bounds_separate_what_must_differ(tiny_export, vectors):
    sep, mer = vectors["separate"], vectors["merged"]
    assert sep["manifest_sha256"] != mer["manifest_sha256"]
    for ps, pm in zip(sep["projections"], mer["projections"]):
        assert ps["input"] == pm["input"]  # one seed, one config: the same inputs for both modes
        # The merged weights' BF16 rounding moves the result by more than the separate bound allows.
        assert excess(torch.tensor(pm["expected"]), ps["expected"], ps["bound"]) > 1, ps["module"]
        # A loader applying twice the scale is far outside.
        twice = fp32_projection(tiny_export["separate"], ps, scale=2 * ps["scale"])
        assert excess(twice, ps["expected"], ps["bound"]) > 10, ps["module"]
    # A head that forgets the logit scale is outside its bound.
    unscaled = fp32_logits(tiny_export["separate"], dict(sep["head"], logit_scale=1.0))
    assert excess(unscaled, sep["head"]["expected_logits"], sep["head"]["bound"]) > 1


def test_the_head_readout_is_the_runtime_heads(tiny_export, vectors):
    h = vectors["separate"]["head"]
    hidden = len(h["decision_hidden"])
    wc = tensor(tiny_export["separate"], "candidate.weight")
    head = DecisionHead(hidden, wc.shape[0])
    head.candidate.weight.data.copy_(wc)
    head.decision.weight.data.copy_(tensor(tiny_export["separate"], "decision.weight"))
    with torch.no_grad():
        got = head.logits(torch.tensor(h["candidate_hidden"]), torch.tensor(h["decision_hidden"]))
    assert excess(got, h["expected_logits"], h["bound"]) <= 1


def test_bound_formula():
    # gamma_n = n u / (1 - n u); for the tiny head (H = 64, P = 256) n = 2H + P + 2 = 386.
    assert gamma(386, U32) == pytest.approx(386 * 2**-24 / (1 - 386 * 2**-24), rel=1e-15)
    assert math.isclose(gamma(1, U32), 2**-24, rel_tol=1e-6)


def test_same_seed_same_document_other_seed_other_inputs(tiny_export, vectors, tmp_path):
    again = write_vectors(tiny_export["merged"], tmp_path / "again.json")
    assert again == vectors["merged"]
    other = write_vectors(tiny_export["merged"], tmp_path / "other.json", seed=1)
    assert other["head"]["decision_hidden"] != vectors["merged"]["head"]["decision_hidden"]


def test_cli_refuses_a_directory_that_is_not_an_export(tmp_path):
    result = CliRunner().invoke(main, [str(tmp_path), str(tmp_path / "v.json")])
    assert result.exit_code == 2
    assert result.output.count("\n") == 1 and "valen_export.json" in result.output
    assert not (tmp_path / "v.json").exists()
