"""The rows layout: a state under one chunk (64 tokens) has no chunk-aligned prefix to share, so
every branch is one row of state + suffix, built on the host, and all rows run as one batch from
position 0. The state's length is therefore no shape. Runs on the reference modules and on the
fast model.

Padding: right padding is exact for the real tokens (every layer is causal, so a pad token never
influences an earlier position). The branch count N is on a rung of the ladder (pad branches are
the state and pad tokens), the row length L on multiples of 32 on its rungs, candidates and
decisions padded as `ladder.pad_head_rows`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..config import ModelConfig
from ..request import CompiledRequest
from .common import Plan, branches_of, head_logits, head_rows, visual_index, state_positions
from .ladder import bucket, pad_head_rows

name = "rows"


class Inputs(NamedTuple):
    row_ids: torch.Tensor  # [N, L]: state, suffix, pads
    rows_pos: torch.Tensor  # [3, N, L]: M-RoPE positions of every row
    visual_index: torch.Tensor  # [N * n_visual]: the image or video tokens of every row, into the flattened [N * L]
    head_index: torch.Tensor  # [C + N + C]: `common.head_rows`, padded
    features: torch.Tensor | None = None  # [n_visual, H]: the vision tower's output (on the device)


class Shape(NamedTuple):
    N: int  # rows (branches, with pad branches)
    L: int  # row length
    C: int  # candidates, with pad candidates
    n_visual: int  # image or video tokens of one row


def build(compiled: CompiledRequest, config: ModelConfig, into: Shape | None = None) -> Plan | None:
    """The rows plan, its sizes on the ladder; into: padded to this shape instead (a captured
    graph's), or None when the request does not fit it (other image tokens, or more of any size)."""
    st = compiled.state
    branches = branches_of(compiled)
    P = len(st.input_ids)
    N = bucket(len(branches))
    L = 32 * bucket(-(-(P + max(len(br.suffix_ids) for br in branches)) // 32))
    if into is not None:
        C = sum(len(br.candidate_positions) for br in branches)
        if into.N < N or into.L < L or into.C < C or into.n_visual != sum(t != 0 for t in st.mm_token_type_ids):
            return None
        N, L = into.N, into.L
    positions, next_pos = state_positions(compiled, config)
    pad_id = branches[0].suffix_ids[-1]
    suffixes = [br.suffix_ids for br in branches] + [[]] * (N - len(branches))
    row_ids = torch.tensor([st.input_ids + s + [pad_id] * (L - P - len(s)) for s in suffixes])  # [N, L]
    rows_pos = torch.cat([positions[:, None, :].expand(3, N, -1), torch.arange(next_pos, next_pos + L - P).view(1, 1, -1).expand(3, N, -1)],
                         dim=2)  # [3, N, L]
    images = (visual_index(compiled)[None, :] + L * torch.arange(N)[:, None]).reshape(-1)  # every row's copy [N * n_visual]
    head_index, C = head_rows(branches, [k * L for k in range(len(branches))], [0] * len(branches))
    head_index, C, N_head = pad_head_rows(head_index, C, len(branches), into=(into.C, N) if into is not None else None)
    assert N_head == N
    shape = Shape(N, L, C, len(images) // N)
    assert into is None or shape == into, (shape, into)
    inputs = Inputs(row_ids, rows_pos, images, head_index)
    return Plan(name, lambda: inputs, shape, [len(br.candidate_positions) for br in branches], [len(branches)])


def _two_rungs_up(L: int) -> int:
    """The row length two rungs above L (in 32-token units): 64 -> 128, 128 -> 192, 512 -> 640."""
    for _ in range(2):
        L = 32 * bucket(L // 32 + 1)
    return L


def rows_swept(shape: Shape) -> int:
    """The rows a plan of this shape sweeps through the layers (what it costs)."""
    return shape.N * shape.L

def pad_into(requests: list[CompiledRequest], config: ModelConfig, plan: Plan, shape: Shape) -> Plan | None:
    """`plan`'s request padded into a captured graph's `shape`: the same branches and candidates
    and rows at most two rungs longer (a short state's rows are launch-bound: longer rows cost
    little next to a capture), else None."""
    own = plan.shape
    if (shape.N, shape.C) != (own.N, own.C) or not own.L <= shape.L <= _two_rungs_up(own.L):
        return None
    return build(requests[0], config, into=shape)


def with_headroom(requests: list[CompiledRequest], config: ModelConfig, plan: Plan) -> Plan:
    """`plan` with rows two rungs longer, so the graph captured for it serves requests whose
    questions are a little longer too (`pad_into`)."""
    return build(requests[0], config, into=plan.shape._replace(L=_two_rungs_up(plan.shape.L)))


def forward(text, head, shape: Shape, inputs: Inputs) -> tuple[torch.Tensor]:
    """Every row in one batched forward of `text` (the reference `TextModel` or the fast model's)
    -> (logits [C] fp32,)."""
    N, L, C = shape.N, shape.L, shape.C
    embeds = text.embed(inputs.row_ids)  # [N, L, H]
    if inputs.features is not None:  # each row's copy of the vision features, in order
        flat = embeds.reshape(N * L, -1).index_copy(0, inputs.visual_index, inputs.features.to(embeds.dtype).repeat(N, 1))
        embeds = flat.view(N, L, -1)
    return head_logits(head, text(embeds, inputs.rows_pos).reshape(N * L, -1), inputs.head_index, C, N)

