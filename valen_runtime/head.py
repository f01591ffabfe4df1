"""Valen's bilinear decision head (FP32), as `valen.modeling.qwen.model.DecisionHead`.

Scores candidate rows against the decision row of one branch's last hidden state. Picking the
rows (candidate / decision positions) and turning logits into answers are left to the engine and
`answers`.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class DecisionHead(nn.Module):
    """`decision.weight`, `candidate.weight`: [projection_dim, hidden] FP32, no bias."""

    def __init__(self, hidden_size: int, projection_dim: int):
        super().__init__()
        self.projection_dim = projection_dim
        self.decision = nn.Linear(hidden_size, projection_dim, bias=False, dtype=torch.float32)
        self.candidate = nn.Linear(hidden_size, projection_dim, bias=False, dtype=torch.float32)
        self.scale = math.sqrt(projection_dim)

    def logits(self, candidate_rows: torch.Tensor, decision_row: torch.Tensor) -> torch.Tensor:
        """candidate_rows [K, H], decision_row [H] (any dtype) -> logits [K] fp32.

        Rows are cast to fp32 before projecting; the decision row is projected as a vector and
        the dot product is an elementwise product summed over the projection, as Valen does.
        """
        d = self.decision(decision_row.float())  # [P]
        c = self.candidate(candidate_rows.float())  # [K, P]
        return (c * d).sum(-1) / self.scale  # [K]
