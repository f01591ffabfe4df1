"""Shared-prefix layouts: how a request's device work is laid out, as host-built int64 tensors.

The state's shared part ends on a chunk boundary of the delta rule (64 tokens), so every branch
sees the reference's chunking; each branch then runs the state tail (< 64 tokens) plus its own
suffix. Three layouts compute the same function, one module each, and each module holds the
layout's whole story: its named `Inputs`, its `Shape` (with the layout's name, the CUDA-graph
key), `build` (the host side, with its own padding) and `forward` (the device side):

- `rows`: a state under 64 tokens has nothing to share: every branch a whole row of state + suffix.
- `batch`: the prefix in one forward (its per-layer state cached), then the branches as a
  right-padded batch continuing from it.
- `one_pass`: the prefixes' rows followed by every branch's continuation packed back to back in
  one row, one sweep of the layers (the fast model's); several requests can share it.

`ladder` holds the bucketing ladder and its padding rules, `common` the plan and the head rows.
`choose` decides a request's layout from the engine's resolved layout policy
(`EngineOptions.layout`); nothing here touches the device or the model.
"""

from __future__ import annotations

from typing import Iterable, NamedTuple, Protocol

import torch

from ..config import ModelConfig
from ..request import CompiledRequest
from . import batch, one_pass, rows
from .common import CHUNK, Plan
from .ladder import bucket, pad_head_rows, pad_sequences
from .one_pass import OnePass, packed_indices

__all__ = ["CHUNK", "LAYOUTS", "Layout", "OnePass", "Plan", "batch", "bucket", "choose", "graph_plan", "one_pass", "packed_indices",
           "pad_head_rows", "pad_sequences", "rows"]


class Layout(Protocol):
    """What each layout module provides (`build` takes the request or, for one_pass, the requests)."""

    name: str
    Inputs: type[NamedTuple]
    Shape: type[NamedTuple]

    def forward(self, text, head, shape: NamedTuple, inputs: NamedTuple) -> tuple[torch.Tensor]: ...

    def rows_swept(self, shape: NamedTuple) -> int: ...

    def pad_into(self, requests: list[CompiledRequest], config: ModelConfig, plan: Plan, shape: NamedTuple) -> Plan | None: ...

    def with_headroom(self, requests: list[CompiledRequest], config: ModelConfig, plan: Plan) -> Plan: ...


LAYOUTS: dict[str, Layout] = {rows.name: rows, batch.name: batch, one_pass.name: one_pass}


def choose(compiled: CompiledRequest, config: ModelConfig, prefix_layout: str) -> Plan:
    """The plan for one request: `prefix_layout` ("one-pass" or "batch", `EngineOptions.layout`) for
    a state whose chunk-aligned prefix holds a whole conv history, else rows for a state under one
    chunk, the batch layout otherwise."""
    cut = (len(compiled.state.input_ids) // CHUNK) * CHUNK
    if prefix_layout == one_pass.name and cut >= config.text_config.linear_conv_kernel_dim - 1:
        return one_pass.build([compiled], config)
    if cut == 0:
        return rows.build(compiled, config)
    return batch.build(compiled, config)


def graph_plan(requests: list[CompiledRequest], config: ModelConfig, plan: Plan, captured: Iterable[tuple]) -> Plan:
    """The plan a CUDA graph runs, given the keys of the graphs `captured` so far: `plan` itself when
    its key is among them; else `plan` padded into the captured shape of its layout that sweeps the
    fewest rows and holds it within the layout's bound (`pad_into`: served by a replay); else `plan`
    with the layout's headroom (`with_headroom`), whose graph, captured on this first use, then
    serves its neighbours on the ladder. A request's real rows compute the same function in any of
    them (pads are read by no real row); kernels sized for more rows may round differently."""
    captured = list(captured)
    if plan.key in captured:
        return plan
    layout = LAYOUTS[plan.kind]
    shapes = [layout.Shape(*key[1:]) for key in captured if key[0] == plan.kind]
    for shape in sorted(shapes, key=layout.rows_swept):
        padded = layout.pad_into(requests, config, plan, shape)
        if padded is not None:
            return padded
    return layout.with_headroom(requests, config, plan)

