"""manifests/tolerances.json and its validator."""

from __future__ import annotations

import copy
import json

import pytest

from parity import tolerances
from parity.tolerances import ToleranceError


def shipped() -> dict:
    return json.loads(tolerances.DEFAULT_PATH.read_text(encoding="utf-8"))


def test_shipped_file_covers_every_combination():
    entries = tolerances.load()
    keys = {t.key for t in entries}
    assert len(keys) == 16
    for lora in ("separate", "merged"):
        for dtype in ("fp32", "bf16"):
            for device in ("cpu", "cuda"):
                for mode in ("per-branch", "shared-prefix"):
                    t = tolerances.select(entries, lora, dtype, device, mode)
                    assert t.why
                    assert t.decision_margin == pytest.approx(2 * t.max_abs_dp)
                    # Every shipped entry was set from a measurement (CPU here, one H200 run for CUDA).
                    assert not t.provisional
    # The reference's own shape (separate LoRA, per-branch) is held to the ecosystem's 1e-6 gate.
    for dtype in ("fp32", "bf16"):
        assert tolerances.select(entries, "separate", dtype, "cpu", "per-branch").max_abs_dp <= 1e-6
    assert tolerances.select(entries, "merged", "bf16", "cuda:0", "per-branch").device == "cuda"


def _write(tmp_path, data) -> str:
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
        (lambda d: d["entries"][0].update(max_abs_dlogit=0.1), "unknown key(s) ['max_abs_dlogit']"),
        (lambda d: d["entries"][0].pop("why"), "missing key(s) ['why']"),
        (lambda d: d["entries"][0].update(why="   "), "why must be a non-empty one-line string"),
        (lambda d: d["entries"][0].update(why="two\nlines"), "why must be one line"),
        (lambda d: d["entries"][0].update(max_abs_dp=-1e-6), "must not be negative"),
        (lambda d: d["entries"][0].update(max_abs_dp="1e-6"), "must be a number"),
        (lambda d: d["entries"][0].update(max_abs_dscore=True), "must be a number"),
        (lambda d: d["entries"][0].update(max_abs_dp=2.0), "exceeds 1"),
        (lambda d: d["entries"][0].update(device="tpu"), "'tpu' is not one of ['cpu', 'cuda']"),
        (lambda d: d["entries"][0].update(token_ids="approx"), 'token_ids: must be "exact"'),
        (lambda d: d["entries"][0].update(status="guessed"), "status must be 'measured' or start with 'provisional'"),
        (lambda d: d["entries"].append(copy.deepcopy(d["entries"][0])), "duplicates entries[0]"),
        (lambda d: d.update(schema="other/1"), "schema must be"),
        (lambda d: d.update(entries=[]), "entries must be a non-empty list"),
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
    text = json.dumps(shipped()).replace('"max_abs_dp": 1e-06', f'"max_abs_dp": {literal}', 1)
    assert literal in text
    with pytest.raises(ToleranceError, match="not a finite number"):
        tolerances.load(_write(tmp_path, text))


def test_huge_number_refused_as_non_finite(tmp_path):
    text = json.dumps(shipped()).replace('"max_abs_dp": 1e-06', '"max_abs_dp": 1e999', 1)
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
    entries = [t for t in tolerances.load() if t.device == "cpu"]
    with pytest.raises(ToleranceError, match="no tolerance declared for lora=separate dtype=bf16 device=cuda mode=per-branch"):
        tolerances.select(entries, "separate", "bf16", "cuda", "per-branch")
