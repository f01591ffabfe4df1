"""The batch layout: the state's chunk-aligned prefix in one forward (its per-layer state cached),
then the branches as a right-padded batch continuing from it, each row the state tail (< 64
tokens) and one branch's suffix. Runs on the reference modules and on the fast model; the layout
of `kernels="torch"` and of fp32 on CUDA for states of 64 tokens or more.

Padding: right padding is exact for the real tokens (every layer is causal, so a pad token never
influences an earlier position); the row length rounds up to a multiple of 8 so graphs are
reused. No ladder.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..config import ModelConfig
from ..request import CompiledRequest
from .common import CHUNK, Plan, branches_of, head_logits, head_rows, visual_index, state_embeds, state_positions

name = "batch"


class Inputs(NamedTuple):
    state_ids: torch.Tensor  # [1, P]
    prefix_pos: torch.Tensor  # [3, 1, cut]: the prefix's M-RoPE positions
    suffix_ids: torch.Tensor  # [N, L - tail]: each branch's suffix and pads
    rows_pos: torch.Tensor  # [3, N, L]: positions of every row (state tail, suffix, pads)
    visual_index: torch.Tensor  # [n_visual]: the image or video tokens of the state
    head_index: torch.Tensor  # [C + N + C]: `common.head_rows` into the flattened [N * L]
    features: torch.Tensor | None = None  # [n_visual, H]: the vision tower's output (on the device)


class Shape(NamedTuple):
    P: int  # state tokens
    cut: int  # prefix tokens (a multiple of 64)
    N: int  # branches
    L: int  # row length: state tail + longest suffix, a multiple of 8
    C: int  # candidates
    n_visual: int  # image or video tokens


def build(compiled: CompiledRequest, config: ModelConfig) -> Plan:
    st = compiled.state
    positions, next_pos = state_positions(compiled, config)
    branches = branches_of(compiled)
    images = visual_index(compiled)
    P = len(st.input_ids)
    cut = (P // CHUNK) * CHUNK
    N, tail = len(branches), P - cut
    L = -(-(tail + max(len(br.suffix_ids) for br in branches)) // 8) * 8
    pad_id = branches[0].suffix_ids[-1]
    suffix_ids = torch.tensor([br.suffix_ids + [pad_id] * (L - tail - len(br.suffix_ids)) for br in branches])  # [N, L - tail]
    suffix_pos = torch.arange(next_pos, next_pos + L - tail).view(1, 1, -1).expand(3, N, -1)
    rows_pos = torch.cat([positions[:, None, cut:].expand(3, N, -1), suffix_pos], dim=2)  # [3, N, L]
    head_index, C = head_rows(branches, [k * L for k in range(N)], [cut] * N)  # rows of the flattened [N * L, H]
    inputs = Inputs(torch.tensor([st.input_ids]), positions[:, None, :cut], suffix_ids, rows_pos, images, head_index)
    return Plan(name, lambda: inputs, Shape(P, cut, N, L, C, len(images)), [len(br.candidate_positions) for br in branches], [N])


def rows_swept(shape: Shape) -> int:
    """The rows a plan of this shape sweeps through the layers (what it costs)."""
    return shape.cut + shape.N * shape.L

def pad_into(requests: list[CompiledRequest], config: ModelConfig, plan: Plan, shape: Shape) -> None:
    """No ladder: a batch plan runs on a graph of its own shape only."""
    return None


def with_headroom(requests: list[CompiledRequest], config: ModelConfig, plan: Plan) -> Plan:
    return plan


def forward(text, head, shape: Shape, inputs: Inputs) -> tuple[torch.Tensor]:
    """The prefix once into a cache, then the branches as one batch from it -> (logits [C] fp32,)."""
    cut, N, L, C = shape.cut, shape.N, shape.L, shape.C
    embeds = state_embeds(text, inputs.state_ids, inputs.visual_index, inputs.features)  # [1, P, H]
    rows = torch.cat([embeds[:, cut:].expand(N, -1, -1), text.embed(inputs.suffix_ids)], dim=1)  # [N, L, H]
    hidden = text(rows, inputs.rows_pos, cache=prefix_cache(text, embeds[:, :cut], inputs.prefix_pos).expand(N))
    return head_logits(head, hidden.reshape(N * L, -1), inputs.head_index, C, N)


def prefix_cache(text, embeds: torch.Tensor, positions: torch.Tensor):
    """Run the shared prefix [1, cut, H] once; its per-layer state is what every branch continues."""
    cache = text.new_cache()
    text(embeds, positions, cache=cache)
    return cache
