"""Head logits -> Valen answers and the response JSON (docs/valen-model.md).

Arithmetic follows the reference `answer()`: FP32 softmax on the logits' device, Python floats,
float64 renormalisation with a left-to-right sum, first maximum wins. Dict key order matches the
reference output so the JSON text compares equal, not only the parsed values.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from .errors import ConfigError

MODEL_ID = "valen-preview-0923"


def _validate_temperature(temperature) -> float:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise ValueError(f"temperature must be a number, got {temperature!r}")
    if not math.isfinite(temperature) or temperature <= 0:
        raise ValueError(f"temperature must be finite and > 0, got {temperature!r}")
    return float(temperature)


def probabilities(logits: torch.Tensor, count: int, temperature: float = 1.0) -> list[float]:
    """softmax(logits / T) in FP32 on the logits' device, then float64 renormalised on the host."""
    return batch_probabilities([logits], [count], temperature)[0][0]


def _renormalise(values: list[float]) -> list[float]:
    total = sum(values)
    return [value / total for value in values]


def batch_probabilities(logits: Sequence[torch.Tensor], counts: Sequence[int], temperature: float = 1.0) -> tuple[list[list[float]], list[torch.Tensor]]:
    """`probabilities` for several questions with one device-to-host transfer: the softmaxes run on
    the logits' device, as the reference's; the logits and probabilities of all questions then come
    back in one copy. Returns the probabilities and the logits on the CPU."""
    return read_probabilities(queue_probabilities(logits, counts, temperature).cpu(), counts)


def queue_probabilities(logits: Sequence[torch.Tensor], counts: Sequence[int], temperature: float = 1.0) -> torch.Tensor:
    """The device half of `batch_probabilities`: every question's logits, then every question's
    softmax(logits / T), fp32 in one tensor [2 * sum(counts)] on the logits' device (queued on
    CUDA, not awaited). `read_probabilities` turns its host copy into answers."""
    temperature = _validate_temperature(temperature)
    if len(logits) != len(counts):
        raise ValueError(f"{len(logits)} logit tensors for {len(counts)} questions")
    for lg, count in zip(logits, counts):
        if not isinstance(lg, torch.Tensor):
            raise ValueError(f"logits must be a torch.Tensor, got {type(lg).__name__}")
        if lg.ndim != 1 or lg.shape[0] != count:
            raise ValueError(f"expected one logit per candidate: shape ({count},), got {tuple(lg.shape)}")
    if not logits:
        return torch.zeros(0)
    probs = [(lg.float() / temperature).softmax(-1) for lg in logits]
    return torch.cat([lg.float() for lg in logits] + probs)


def read_probabilities(host: torch.Tensor, counts: Sequence[int]) -> tuple[list[list[float]], list[torch.Tensor]]:
    """The host half of `batch_probabilities`: `queue_probabilities`' tensor, copied to the CPU, as
    float64-renormalised probabilities per question and the logits per question ([K] fp32)."""
    n = sum(counts)
    if host.shape != (2 * n,):
        raise ValueError(f"expected {2 * n} values (logits then probabilities of {len(counts)} questions), got {tuple(host.shape)}")
    if n == 0:
        return [], []
    host_logits, host_probs = host[:n].split(list(counts)), host[n:].split(list(counts))
    if not bool(torch.isfinite(host[:n]).all()):
        raise ValueError("logits must be finite")
    if not bool(torch.isfinite(host[n:]).all()):  # finite logits over a tiny temperature overflow fp32
        raise ValueError("the probabilities are not finite: the logits divided by the temperature overflow fp32 (use a larger temperature)")
    return [_renormalise(p.tolist()) for p in host_probs], list(host_logits)


def answer_from_probabilities(kind: str, keys: Sequence[str], descriptions: Sequence[str], probs: Sequence[float]) -> dict:
    """The answer dict for already-normalised probabilities (in compiled candidate order)."""
    keys = list(keys)
    probs = list(probs)
    if len(probs) != len(keys) or len(descriptions) != len(keys):
        raise ValueError(f"{len(keys)} keys, {len(descriptions)} descriptions, {len(probs)} probabilities")
    if kind == "noul":
        return {"type": "noul", "noul": probs[keys.index("true")]}
    if kind not in ("choice", "score"):
        raise ValueError(f"unknown question type {kind!r}")
    count = len(probs)
    mode = 0
    for index in range(1, count):
        if probs[index] > probs[mode]:  # strict: ties keep the earliest candidate
            mode = index
    result = {"type": kind, "probabilities": dict(zip(keys, probs))}
    if kind == "choice":
        result["choice"] = keys[mode]
        if count == 1:
            result["confidence"] = 1.0
        else:
            result["confidence"] = max(0.0, (max(probs) - 1 / count) / (1 - 1 / count))
        return result
    result["score"] = sum(index * p for index, p in enumerate(probs))
    result["legend"] = dict(zip(keys, descriptions))
    distance = sum(p * abs(index - mode) for index, p in enumerate(probs))
    uniform_mad = sum(abs(index - (count - 1) / 2) for index in range(count)) / count
    result["confidence"] = max(0.0, 1.0 - distance / uniform_mad)
    return result


def answer(kind: str, keys: Sequence[str], descriptions: Sequence[str], logits: torch.Tensor, temperature: float = 1.0) -> dict:
    """One question's answer from its head logits (all branches concatenated in candidate order).

    Raises:
        ValueError: temperature not finite and > 0; logits not 1-D, wrong length or not finite.
    """
    return answer_from_probabilities(kind, keys, descriptions, probabilities(logits, len(keys), temperature))


def response(compiled, answers, model_id: str = MODEL_ID) -> dict:
    """The /v1/systemone response body for a CompiledRequest and its answers.

    Args:
        compiled: the CompiledRequest the answers belong to.
        answers: {qid: answer dict} or a sequence aligned with `compiled.questions`.
        model_id: the `model` field ("valen-preview-0923" for the worker; the Valen CLI says "Valen").
    """
    qids = [question.qid for question in compiled.questions]
    if isinstance(answers, Mapping):
        if set(answers) != set(qids):
            raise ValueError(f"answers for {sorted(answers)} do not match questions {sorted(qids)}")
        ordered = {qid: answers[qid] for qid in qids}
    else:
        answers = list(answers)
        if len(answers) != len(qids):
            raise ValueError(f"{len(answers)} answers for {len(qids)} questions")
        ordered = dict(zip(qids, answers))
    return {
        "model": model_id,
        "answers": ordered,
        "usage": {"input_tokens": compiled.logical_tokens, "output_tokens": 0},
        "internal_usage": {"compute_tokens": compiled.compute_tokens},
    }


def load_temperature(path: Path) -> float:
    """Read a calibration file's scalar `temperature` (the Preview format)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot read calibration file ({exc})") from exc
    if not isinstance(data, dict) or "temperature" not in data:
        raise ConfigError(f"{path}: expected an object with a 'temperature' field")
    value = data["temperature"]
    if isinstance(value, dict):
        raise ConfigError(
            f"{path}: 'temperature' is a per-kind dict, a later Valen format; the Preview uses one scalar"
        )
    try:
        return _validate_temperature(value)
    except ValueError as exc:
        raise ConfigError(f"{path}: {exc}") from exc
