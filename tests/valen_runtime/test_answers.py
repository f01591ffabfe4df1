"""valen_runtime.answers: the answer formulas, the worked examples and the response JSON of docs/valen-model.md."""

import json
from dataclasses import dataclass, field

import pytest
import torch

from valen_runtime.answers import (answer, answer_from_probabilities, batch_probabilities, load_temperature, probabilities, queue_probabilities,
                                   read_probabilities, response)
from valen_runtime.errors import ConfigError


def test_score_worked_example():
    result = answer_from_probabilities("score", ["0", "1", "2"], ["low", "mid", "high"], [0.1, 0.3, 0.6])
    assert result["score"] == 1.5
    assert result["confidence"] == pytest.approx(0.25, abs=1e-15)
    assert list(result) == ["type", "probabilities", "score", "legend", "confidence"]
    assert result["type"] == "score"
    assert result["probabilities"] == {"0": 0.1, "1": 0.3, "2": 0.6}
    assert result["legend"] == {"0": "low", "1": "mid", "2": "high"}


def test_equal_logits_give_zero_confidence():
    result = answer("choice", ["a", "b", "c"], ["A", "B", "C"], torch.zeros(3))
    assert result["probabilities"] == {"a": 1 / 3, "b": 1 / 3, "c": 1 / 3}
    assert result["confidence"] == 0.0
    assert result["choice"] == "a"  # ties -> earliest candidate


def test_two_way_choice_confidence_is_exact():
    result = answer_from_probabilities("choice", ["white", "black"], ["W", "B"], [0.4459854086288687, 0.5540145913711313])
    assert result == {
        "type": "choice",
        "probabilities": {"white": 0.4459854086288687, "black": 0.5540145913711313},
        "choice": "black",
        "confidence": 0.10802918274226259,
    }
    assert list(result) == ["type", "probabilities", "choice", "confidence"]


def test_refund_example():
    result = answer_from_probabilities("choice", ["refund", "wait"], ["R", "W"], [0.5159631044115068, 0.4840368955884932])
    assert result["choice"] == "refund"
    assert result["confidence"] == pytest.approx(0.0319262088230137, abs=1e-15)


@pytest.mark.parametrize("top, expected", [(0.937, 0.916), (0.394, 0.192)])
def test_four_way_readme_examples(top, expected):
    rest = (1 - top) / 3
    result = answer_from_probabilities("choice", list("abcd"), list("ABCD"), [top, rest, rest, rest])
    assert result["confidence"] == pytest.approx(expected, abs=1e-12)


def test_single_candidate_choice_has_full_confidence():
    result = answer("choice", ["only"], ["The only one"], torch.tensor([-3.0]))
    assert result == {"type": "choice", "probabilities": {"only": 1.0}, "choice": "only", "confidence": 1.0}


def test_noul_reports_probability_of_true_only():
    logits = torch.tensor([0.25, -0.5])
    result = answer("noul", ["true", "false"], ["T", "F"], logits)
    assert list(result) == ["type", "noul"]
    p = torch.softmax(logits.float(), -1).tolist()
    assert result["noul"] == p[0] / sum(p)


@pytest.mark.parametrize("k, mad", [(2, 0.5), (3, 2 / 3), (4, 1.0), (5, 1.2), (6, 1.5), (7, 12 / 7), (8, 2.0), (9, 20 / 9), (10, 2.5)])
def test_score_confidence_uses_uniform_mad(k, mad):
    # All mass one step from the mode's neighbour: distance = 0.5 -> confidence = 1 - 0.5 / mad.
    probs = [0.0] * k
    probs[0], probs[1] = 0.5, 0.5
    result = answer_from_probabilities("score", [str(i) for i in range(k)], ["d"] * k, probs)
    assert result["confidence"] == pytest.approx(max(0.0, 1 - 0.5 / mad), abs=1e-12)
    uniform = answer_from_probabilities("score", [str(i) for i in range(k)], ["d"] * k, [1 / k] * k)
    assert uniform["confidence"] == 0.0  # mean distance from the first grade >= uniform MAD


def test_probabilities_follow_reference_arithmetic():
    logits = torch.tensor([1.5, -0.25, 3.0, 0.0], dtype=torch.bfloat16)
    temperature = 0.7
    fp32 = (logits.float() / temperature).softmax(-1).tolist()
    total = 0.0
    for value in fp32:
        total += value
    assert probabilities(logits, 4, temperature) == [value / total for value in fp32]


def test_first_maximum_wins_on_ties():
    result = answer_from_probabilities("score", ["0", "1", "2"], ["a", "b", "c"], [0.4, 0.2, 0.4])
    # mode = 0 -> distance = 0.2 * 1 + 0.4 * 2
    assert result["confidence"] == max(0.0, 1.0 - (0.2 * 1 + 0.4 * 2) / (2 / 3))
    tie = answer_from_probabilities("choice", ["x", "y"], ["X", "Y"], [0.5, 0.5])
    assert tie["choice"] == "x" and tie["confidence"] == 0.0


@pytest.mark.parametrize("temperature", [0.0, -1.0, float("nan"), float("inf"), True, "1.0", None])
def test_bad_temperature_is_refused(temperature):
    with pytest.raises(ValueError, match="temperature"):
        answer("choice", ["a", "b"], ["A", "B"], torch.zeros(2), temperature)


@pytest.mark.parametrize(
    "logits",
    [torch.zeros(3), torch.zeros(1, 2), torch.tensor(0.0), torch.tensor([0.0, float("nan")]), torch.tensor([float("inf"), 0.0]), [0.0, 1.0]],
    ids=["wrong-length", "2-d", "0-d", "nan", "inf", "not-a-tensor"],
)
def test_bad_logits_are_refused(logits):
    with pytest.raises(ValueError):
        answer("choice", ["a", "b"], ["A", "B"], logits)


def test_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="rank"):
        answer("rank", ["a", "b"], ["A", "B"], torch.zeros(2))


@dataclass
class _Q:
    qid: str


@dataclass
class _Compiled:
    questions: list = field(default_factory=list)
    logical_tokens: int = 48
    compute_tokens: int = 96


def test_response_shape_and_order():
    compiled = _Compiled([_Q("second"), _Q("first")])
    answers = {"first": {"type": "noul", "noul": 0.25}, "second": {"type": "noul", "noul": 0.75}}
    body = response(compiled, answers)
    assert list(body) == ["model", "answers", "usage", "internal_usage"]
    assert body["model"] == "valen-preview-0923"
    assert list(body["answers"]) == ["second", "first"]  # compiled (request) order
    assert body["usage"] == {"input_tokens": 48, "output_tokens": 0}
    assert body["internal_usage"] == {"compute_tokens": 96}
    assert response(compiled, [answers["second"], answers["first"]], model_id="Valen")["model"] == "Valen"
    text = json.dumps(body, ensure_ascii=False)
    assert text.startswith('{"model": "valen-preview-0923", "answers": {"second"')
    with pytest.raises(ValueError):
        response(compiled, {"first": {}})
    with pytest.raises(ValueError):
        response(compiled, [{}])


def test_load_temperature(tmp_path):
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({"temperature": 1.25, "note": "fit on dev"}))
    assert load_temperature(path) == 1.25
    path.write_text(json.dumps({"temperature": 2}))
    assert load_temperature(path) == 2.0 and isinstance(load_temperature(path), float)


@pytest.mark.parametrize(
    "content, phrase",
    [
        ({"temperature": {"choice": 1.1, "score": 0.9}}, "later Valen format"),
        ({"temp": 1.0}, "'temperature'"),
        ({"temperature": 0}, "finite and > 0"),
        ({"temperature": -2.0}, "finite and > 0"),
        ({"temperature": "1.0"}, "number"),
        ({"temperature": True}, "number"),
        ([1.0], "'temperature'"),
    ],
)
def test_load_temperature_refusals(tmp_path, content, phrase):
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ConfigError, match=phrase):
        load_temperature(path)


def test_load_temperature_rejects_non_finite_and_missing_files(tmp_path):
    path = tmp_path / "calibration.json"
    path.write_text('{"temperature": Infinity}')
    with pytest.raises(ConfigError, match="finite"):
        load_temperature(path)
    with pytest.raises(ConfigError, match="cannot read"):
        load_temperature(tmp_path / "missing.json")


def test_batch_probabilities_equal_per_question_probabilities():
    gen = torch.Generator().manual_seed(9)
    logits = [torch.randn(n, generator=gen) * 3 for n in (2, 5, 1, 4)]
    probs, host = batch_probabilities(logits, [2, 5, 1, 4], temperature=0.7)
    assert probs == [probabilities(lg, len(lg), 0.7) for lg in logits]  # bit for bit
    assert all(torch.equal(a, b) for a, b in zip(host, logits))
    with pytest.raises(ValueError, match="finite"):
        batch_probabilities([torch.tensor([0.0, float("nan")])], [2])
    with pytest.raises(ValueError, match="one logit per candidate"):
        batch_probabilities([torch.zeros(3)], [2])
    assert batch_probabilities([], []) == ([], [])


def test_the_device_and_host_halves_compose_to_batch_probabilities():
    """queue_probabilities (device: logits then softmaxes, one tensor) and read_probabilities (host)
    are batch_probabilities split at the copy; the host half refuses a tensor of the wrong size."""
    gen = torch.Generator().manual_seed(11)
    logits = [torch.randn(n, generator=gen) for n in (3, 1, 6)]
    queued = queue_probabilities(logits, [3, 1, 6], temperature=1.3)
    assert queued.shape == (20,) and torch.equal(queued[:10], torch.cat(logits))
    assert torch.equal(queued[10:], torch.cat([(lg / 1.3).softmax(-1) for lg in logits]))
    probs, host = read_probabilities(queued, [3, 1, 6])
    for p, softmax in zip(probs, queued[10:].split([3, 1, 6])):  # float64 renormalised, summed left to right
        values = softmax.tolist()
        assert p == [v / sum(values) for v in values]
    assert all(torch.equal(a, b) for a, b in zip(host, logits))
    with pytest.raises(ValueError, match="expected 20 values"):
        read_probabilities(queued[:-1], [3, 1, 6])


def test_probabilities_that_overflow_at_a_tiny_temperature_are_refused():
    """Finite logits over a temperature of 1e-39 overflow fp32 and the softmax is NaN: refused with a
    line that names the temperature, never answered (a response holds no NaN)."""
    logits = [torch.tensor([2.0, -1.0, 0.5])]
    with pytest.raises(ValueError, match="temperature"):
        batch_probabilities(logits, [3], temperature=1e-39)
