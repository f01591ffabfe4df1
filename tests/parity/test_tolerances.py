"""manifests/tolerances.json and its validator."""

from __future__ import annotations

import copy
import json

import pytest

from parity import tolerances
from parity.tolerances import ToleranceError


def shipped() -> dict:
    return json.loads(tolerances.DEFAULT_PATH.read_text(encoding="utf-8"))


def test_shipped_file_covers_every_combination_with_the_intended_gate():
    entries = tolerances.load()
    assert len({g.key for g in entries}) == 16
    for lora in ("separate", "merged"):
        for dtype in ("fp32", "bf16"):
            for device in ("cpu", "cuda"):
                for mode in ("per-branch", "shared-prefix"):
                    g = tolerances.select(entries, lora, dtype, device, mode)
                    assert g.why and all(g.reasons.values())
                    if lora == "separate" and mode == "per-branch":
                        assert g.kind == "exact" and g["max_abs_dp"] <= 1e-6  # the reference's own shape
                    elif lora == "separate" and dtype == "fp32":
                        assert g.kind == "fp32-rounding"
                    else:
                        assert g.kind == "truth-relative"
                        assert g.roundings == (2 if lora == "merged" and dtype == "bf16" else 1)
                    # Every fast path (shared-prefix) is also checked in fp32 against an exact anchor.
                    if mode == "shared-prefix" and not (lora == "separate" and dtype == "fp32"):
                        assert g.dual == ("reference" if lora == "separate" else "module-path")
                        assert g.dual_gate.kind == "fp32-rounding" and g.dual_gate.dtype == "fp32"
                    else:
                        assert g.dual is None and g.dual_gate is None
                    assert g.pixel_values_max_abs == 0 and g.rotary_max_abs == 0
                    assert g.answer_formula_max_abs == (0 if device == "cpu" else 1e-6)
    assert tolerances.select(entries, "merged", "bf16", "cuda:0", "per-branch").device == "cuda"


def test_shipped_parameters_are_the_declared_standard():
    g = tolerances.select(tolerances.load(), "separate", "bf16", "cuda", "shared-prefix")
    assert (g["a"], g["b"], g["margin_floor"]) == (2, 0.01, 0.05)  # System1-Omni's native bf16 gate
    assert g.dual_gate["factor"] * 2.0**-16 <= 2.0**-9  # the fp32 bound stays far below the bf16 error


def _write(tmp_path, data):
    p = tmp_path / "tol.json"
    p.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return p


def _mutate(fn):
    data = copy.deepcopy(shipped())
    fn(data)
    return data


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.update(extra=1), "unknown top-level key(s) ['extra']"),
        (lambda d: d.update(schema="valen-parity-tolerances/1"), "schema must be"),
        (lambda d: d.update(entries=[]), "entries must be a non-empty list"),
        (lambda d: d["gates"].pop("exact"), "gates must declare exactly"),
        (lambda d: d["gates"]["truth-relative"].update(c=1), "unknown key(s) ['c']"),
        (lambda d: d["gates"]["truth-relative"].pop("b"), "missing key(s) ['b']"),
        (lambda d: d["gates"]["truth-relative"]["why"].pop("a"), "no reason given for ['a']"),
        (lambda d: d["gates"]["truth-relative"]["why"].update(a="two\nlines"), "must be one line"),
        (lambda d: d["gates"]["truth-relative"]["why"].update(a="  "), "must be a non-empty one-line string"),
        (lambda d: d["gates"]["truth-relative"].update(a=-1), "must not be negative"),
        (lambda d: d["gates"]["truth-relative"].update(a="2"), "must be a number"),
        (lambda d: d["gates"]["truth-relative"].update(a=True), "must be a number"),
        (lambda d: d["gates"]["truth-relative"].update(b=2.0), "exceeds 1"),
        (lambda d: d["gates"]["exact"].update(max_abs_dp=1.5), "exceeds 1"),
        (lambda d: d["gates"]["truth-relative"].update(min_questions=2.5), "whole number"),
        (lambda d: d["checks"].update(answer_formula_max_abs=0), "one bound per device"),
        (lambda d: d["checks"].pop("rotary_max_abs"), "missing key(s) ['rotary_max_abs']"),
        (lambda d: d["entries"][0].update(max_abs_dp=0.1), "unknown key(s) ['max_abs_dp']"),
        (lambda d: d["entries"][0].pop("why"), "missing key(s) ['why']"),
        (lambda d: d["entries"][0].update(why="two\nlines"), "must be one line"),
        (lambda d: d["entries"][0].update(device="tpu"), "'tpu' is not one of ['cpu', 'cuda']"),
        (lambda d: d["entries"][0].update(gate="loose"), "is not one of ['exact', 'fp32-rounding', 'truth-relative']"),
        (lambda d: d["entries"][0].update(dual="reference"), "only a shared-prefix entry"),
        (lambda d: d["entries"][1].update(dual="somewhere"), "is not null or one of"),
        (lambda d: d["entries"][0].update(roundings=2), "only a truth-relative entry counts roundings"),
        (lambda d: next(e for e in d["entries"] if e["gate"] == "truth-relative").update(roundings=0), "whole number >= 1"),
        (lambda d: d["entries"][0].update(measured=[1]), "measured: must be an object"),
        (lambda d: d["entries"].append(copy.deepcopy(d["entries"][0])), "duplicates entries[0]"),
    ],
)
def test_validation_refuses(tmp_path, mutate, message):
    path = _write(tmp_path, _mutate(mutate))
    with pytest.raises(ToleranceError) as e:
        tolerances.load(path)
    assert message in str(e.value)
    assert str(path) in str(e.value)


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_numbers_refused(tmp_path, literal):
    text = json.dumps(shipped()).replace('"b": 0.01', f'"b": {literal}', 1)
    assert literal in text
    with pytest.raises(ToleranceError, match="not a finite number"):
        tolerances.load(_write(tmp_path, text))


def test_huge_number_refused_as_non_finite(tmp_path):
    text = json.dumps(shipped()).replace('"b": 0.01', '"b": 1e999', 1)
    with pytest.raises(ToleranceError, match="must be finite"):
        tolerances.load(_write(tmp_path, text))


def test_unreadable_and_invalid_json(tmp_path):
    with pytest.raises(ToleranceError, match="cannot read"):
        tolerances.load(tmp_path / "missing.json")
    with pytest.raises(ToleranceError, match="not valid JSON"):
        tolerances.load(_write(tmp_path, "{"))
    with pytest.raises(ToleranceError, match="duplicate key"):
        tolerances.load(_write(tmp_path, '{"schema": 1, "schema": 2}'))


def test_select_names_the_missing_combination():
    entries = [g for g in tolerances.load() if g.device == "cpu"]
    with pytest.raises(ToleranceError, match="no tolerance declared for lora=separate dtype=bf16 device=cuda mode=per-branch"):
        tolerances.select(entries, "separate", "bf16", "cuda", "per-branch")
