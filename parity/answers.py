"""Valen's answer formulas (docs/valen-model.md), applied by the harness to every side's logits.

The same code turns the reference's, the truth's and the runtime's logits into probabilities,
confidence, score and decision, so only the logits can make them differ.
"""

from __future__ import annotations

import torch


def probabilities(logits: list[float] | torch.Tensor, temperature: float = 1.0) -> list[float]:
    """softmax(logits / T) in FP32, to Python floats, renormalised in float64 with a left-to-right sum."""
    t = logits if isinstance(logits, torch.Tensor) else torch.tensor(logits, dtype=torch.float32)
    values = (t.float().cpu() / temperature).softmax(-1).tolist()
    total = 0.0
    for v in values:
        total += v
    return [v / total for v in values]


def first_max(p: list[float]) -> int:
    """Index of the largest probability; ties keep the earliest (Valen's decision)."""
    best = 0
    for i in range(1, len(p)):
        if p[i] > p[best]:
            best = i
    return best


def answer_numbers(kind: str, p: list[float]) -> dict:
    """mode, confidence (choice/score), score (score) from probabilities."""
    k = len(p)
    mode = first_max(p)
    out = {"mode": mode, "confidence": None, "score": None}
    if kind == "choice":
        out["confidence"] = 1.0 if k == 1 else max(0.0, (max(p) - 1 / k) / (1 - 1 / k))
    elif kind == "score":
        out["score"] = sum(i * pi for i, pi in enumerate(p))
        distance = sum(pi * abs(i - mode) for i, pi in enumerate(p))
        uniform_mad = sum(abs(i - (k - 1) / 2) for i in range(k)) / k
        out["confidence"] = max(0.0, 1 - distance / uniform_mad)
    return out


def top_two_margin(p: list[float]) -> float | None:
    """Largest minus second-largest probability; None for a one-candidate question."""
    if len(p) < 2:
        return None
    s = sorted(p, reverse=True)
    return s[0] - s[1]


def abs_errors(p: list[float], q: list[float]) -> list[float]:
    """|p_i - q_i| per option."""
    return [abs(a - b) for a, b in zip(p, q)]
