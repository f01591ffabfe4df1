"""What every shared-prefix layout shares: the plan it hands the engine, the state's positions and
visual (image or video) tokens on the host, and the head rows (built on the host, read on the device)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np
import torch

from ..config import ModelConfig
from ..positions import rope_index
from ..request import Branch, CompiledRequest

CHUNK = 64  # the chunk size of the reference's gated delta rule


@dataclass(frozen=True)
class Plan:
    """One or more requests' shared-prefix work as built on the host: which layout runs it
    (`layouts.LAYOUTS[kind]`), its named inputs (int64 tensors; `features`, the vision tower's
    output, joins them on the device) and its shape, from which every tensor shape and kernel
    grid of the layout's forward follows. The inputs are built on first use: a plan that the graph
    policy pads into a captured shape (`layouts.graph_plan`) needs only its shape."""

    kind: str  # "rows", "batch" or "one-pass"
    build_inputs: Callable[[], NamedTuple]  # -> the layout's Inputs, features None
    shape: NamedTuple  # the layout's Shape
    candidates_per_branch: list[int]  # every branch of every request, in request order
    branches_per_request: list[int]

    @functools.cached_property
    def inputs(self) -> NamedTuple:
        return self.build_inputs()

    @property
    def key(self) -> tuple:
        """The CUDA-graph key: the layout and its shape."""
        return (self.kind, *self.shape)

    def upload(self, device: torch.device) -> NamedTuple:
        """The inputs on `device` in one copy (pinned, asynchronous on CUDA), as views."""
        return upload(self.inputs, device)


def upload(inputs: NamedTuple, device: torch.device) -> NamedTuple:
    """A named tuple of tensors (possibly nested, None fields kept) copied in one transfer, as views."""
    parts = list(leaves(inputs))
    flat = torch.cat([p.reshape(-1) for p in parts])
    if device.type == "cuda":
        flat = flat.pin_memory().to(device, non_blocking=True)
    views, offset = [], 0
    for p in parts:
        views.append(flat[offset : offset + p.numel()].view(p.shape))
        offset += p.numel()
    return rebuild(inputs, iter(views))


def leaves(tree):
    """The tensors of a tensor, or of a (named) tuple or list of them, nested, in field order; None skipped."""
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (tuple, list)):
        for item in tree:
            yield from leaves(item)


def skeleton(tree):
    """`tree` with every tensor replaced by a placeholder (...): its structure, holding no tensor."""
    if isinstance(tree, torch.Tensor):
        return ...
    if isinstance(tree, list):
        return [skeleton(item) for item in tree]
    if isinstance(tree, tuple):
        items = [skeleton(item) for item in tree]
        return type(tree)(*items) if hasattr(tree, "_fields") else tuple(items)
    return tree


def rebuild(tree, tensors):
    """`tree` (or its `skeleton`) with its tensors replaced, in order, by the next ones from the
    iterator `tensors`."""
    if tree is ... or isinstance(tree, torch.Tensor):
        return next(tensors)
    if isinstance(tree, list):
        return [rebuild(item, tensors) for item in tree]
    if isinstance(tree, tuple):
        items = [rebuild(item, tensors) for item in tree]
        return type(tree)(*items) if hasattr(tree, "_fields") else tuple(items)
    return tree


def state_positions(compiled: CompiledRequest, config: ModelConfig) -> tuple[torch.Tensor, int]:
    """The state's M-RoPE positions [3, P] and the first position after it."""
    st = compiled.state
    return rope_index(st.input_ids, st.mm_token_type_ids, st.image_grid_thw, config.vision_config.spatial_merge_size,
                      video_grid_thw=st.video_grid_thw)


def visual_index(compiled: CompiledRequest) -> torch.Tensor:
    """The state's image or video tokens (where the vision tower's features go), in order. A
    state holds images or one video, never both (wire.py), so the features are in this order."""
    return torch.from_numpy(np.flatnonzero(np.array(compiled.state.mm_token_type_ids, dtype=np.int64) != 0))


def branches_of(compiled: CompiledRequest) -> list[Branch]:
    return [br for q in compiled.questions for br in q.branches]


def head_rows(branches: list[Branch], starts: list[int], firsts: list[int]) -> tuple[torch.Tensor, int]:
    """Head rows for branches whose first token (absolute position firsts[k]) sits at row starts[k]:
    [candidate rows (C) | decision rows (N) | branch of each candidate (C)] int64, and C."""
    cand_rows, cand_branch, dec_rows = [], [], []
    for k, (br, start, first) in enumerate(zip(branches, starts, firsts)):
        cand_rows += [start + p - first for p in br.candidate_positions]
        cand_branch += [k] * len(br.candidate_positions)
        dec_rows.append(start + br.decision_position - first)
    return torch.tensor(cand_rows + dec_rows + cand_branch, dtype=torch.int64), len(cand_rows)


# ---- on the device (capturable: no host work)


def head_logits(head, flat: torch.Tensor, head_index: torch.Tensor, C: int, N: int) -> tuple[torch.Tensor]:
    """The head for every branch at once from hidden rows [R, H] and `head_rows`' index: logits [C] fp32."""
    c = head.candidate(flat[head_index[:C]].float())  # [C, P]
    d = head.decision(flat[head_index[C : C + N]].float())  # [N, P]
    return ((c * d[head_index[C + N :]]).sum(-1) / head.scale,)


def state_embeds(text, state_ids: torch.Tensor, visual_index: torch.Tensor, features: torch.Tensor | None) -> torch.Tensor:
    """[1, P, H]; as HF's masked_scatter, the vision tower's features replace the <|image_pad|>
    (<|video_pad|>) embeddings in order."""
    embeds = text.embed(state_ids)
    if features is not None:
        embeds = embeds.index_copy(1, visual_index, features[None].to(embeds.dtype))
    return embeds
