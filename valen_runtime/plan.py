"""Shared-prefix plans: what a request's device work needs from the host, as int64 tensors.

The state's shared part ends on a chunk boundary of the delta rule (64 tokens), so every branch
sees the reference's chunking; each branch then runs the state tail (< 64 tokens) plus its own
suffix. Two layouts compute the same function:

- "batch": the prefix in one forward (its per-layer state cached), then the branches as a
  right-padded batch continuing from it. Runs on the reference modules and on the fast model.
- "one-pass" (the fast model's, `FastText.one_pass`): the prefix's rows followed by every
  branch's continuation packed back to back in one row, so the layers are swept once. It needs a
  prefix of at least K-1 rows (a whole conv history); a state under 64 tokens has none, and its
  branches run as the batch layout from position 0 (measured faster there than packing them).

Nothing here touches the device or the model; `Plan.sizes` is also the CUDA-graph key.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from .config import ModelConfig
from .positions import rope_index
from .request import Branch, CompiledRequest

CHUNK = 64  # the chunk size of the reference's gated delta rule


@dataclass
class Plan:
    """A request's shared-prefix inputs on the host.

    batch:    parts = state ids [1, P], prefix positions [3, 1, cut], suffix ids [N, L - tail],
              row positions [3, N, L], image token indices [n_img], head rows [C + N + C];
              sizes = (P, cut, N, L, C, n_img).
    one-pass: parts = state ids [1, P], suffix ids [S], row sources [cut + T], row positions
              [3, 1, cut + T], image token indices, head rows, then the `fast.model.OnePass`
              fields (seq_ids, offsets, conv_taps, cu_seqlens, chunk_indices, prefix_rows);
              sizes = (P, cut, T, C, n_img, N, sequence lengths).
    """

    kind: str  # "batch" or "one-pass": the layout this request runs
    parts: list[torch.Tensor]
    sizes: tuple
    candidates_per_branch: list[int]

    def upload(self, device: torch.device) -> list[torch.Tensor]:
        """One copy (pinned, asynchronous on CUDA) of all parts, returned as views in order."""
        flat = torch.cat([p.reshape(-1) for p in self.parts])
        if device.type == "cuda":
            flat = flat.pin_memory().to(device, non_blocking=True)
        out, offset = [], 0
        for p in self.parts:
            out.append(flat[offset : offset + p.numel()].view(p.shape))
            offset += p.numel()
        return out


def plan_shared_prefix(compiled: CompiledRequest, config: ModelConfig, one_pass: bool) -> Plan:
    """The plan for `compiled`: one-pass when asked for and the prefix holds a whole conv history,
    else the batch layout."""
    st = compiled.state
    P = len(st.input_ids)
    positions, next_pos = rope_index(st.input_ids, st.mm_token_type_ids, st.image_grid_thw,
                                     config.vision_config.spatial_merge_size)  # [3, P]
    cut = (P // CHUNK) * CHUNK
    branches = [br for q in compiled.questions for br in q.branches]
    image_index = torch.tensor([i for i, t in enumerate(st.mm_token_type_ids) if t == 1], dtype=torch.int64)
    K = config.text_config.linear_conv_kernel_dim
    if one_pass and cut >= K - 1:
        return _one_pass(compiled, branches, positions, next_pos, cut, image_index, K)
    return _batch(compiled, branches, positions, next_pos, cut, image_index)


def _batch(compiled: CompiledRequest, branches: list[Branch], positions: torch.Tensor, next_pos: int, cut: int,
           image_index: torch.Tensor) -> Plan:
    st = compiled.state
    P = len(st.input_ids)
    N, tail = len(branches), P - cut
    # Right padding is exact for the real tokens: every layer is causal, so a pad token never
    # influences an earlier position. Lengths round up to a multiple of 8 so graphs are reused.
    L = -(-(tail + max(len(br.suffix_ids) for br in branches)) // 8) * 8
    pad_id = branches[0].suffix_ids[-1]
    suffix_ids = torch.tensor([br.suffix_ids + [pad_id] * (L - tail - len(br.suffix_ids)) for br in branches])  # [N, L - tail]
    suffix_pos = torch.arange(next_pos, next_pos + L - tail).view(1, 1, -1).expand(3, N, -1)
    rows_pos = torch.cat([positions[:, None, cut:].expand(3, N, -1), suffix_pos], dim=2)  # [3, N, L]
    head_index, C = head_rows(branches, [k * L for k in range(N)], cut)  # rows of the flattened [N * L, H]
    parts = [torch.tensor([st.input_ids]), positions[:, None, :cut], suffix_ids, rows_pos, image_index, head_index]
    sizes = (P, cut, N, L, C, len(image_index))
    return Plan("batch", parts, sizes, [len(br.candidate_positions) for br in branches])


def _one_pass(compiled: CompiledRequest, branches: list[Branch], positions: torch.Tensor, next_pos: int, cut: int,
              image_index: torch.Tensor, K: int) -> Plan:
    """[prefix rows 0..cut | each branch's state tail + suffix, back to back | one pad sequence
    rounding the packed part T up to a multiple of 8]."""
    st = compiled.state
    P = len(st.input_ids)
    tail = P - cut
    lengths = [tail + len(br.suffix_ids) for br in branches]
    T = -(-sum(lengths) // 8) * 8
    pad = T - sum(lengths)
    pad_id = branches[0].suffix_ids[-1]
    suffix_ids = [t for br in branches for t in br.suffix_ids] + [pad_id] * pad  # [S]
    seq_lengths = lengths + ([pad] if pad else [])
    # Row t takes its embedding from [state rows (P) | suffix tokens (S)].
    source, pos_parts, starts, s_offset = list(range(cut)), [positions[:, :cut]], [], P
    for br in branches:
        starts.append(len(source))
        source += list(range(cut, P)) + list(range(s_offset, s_offset + len(br.suffix_ids)))
        s_offset += len(br.suffix_ids)
        pos_parts += [positions[:, cut:], torch.arange(next_pos, next_pos + len(br.suffix_ids)).view(1, -1).expand(3, -1)]
    source += list(range(s_offset, s_offset + pad))
    pos_parts.append(torch.arange(next_pos, next_pos + pad).view(1, -1).expand(3, -1))
    rows_pos = torch.cat(pos_parts, dim=1)[:, None, :]  # [3, 1, cut + T]
    head_index, C = head_rows(branches, starts, cut)
    # Every sequence length is part of the key: the varlen kernels' launch grids depend on them.
    sizes = (P, cut, T, C, len(image_index), len(branches), tuple(seq_lengths))
    parts = [torch.tensor([st.input_ids]), torch.tensor(suffix_ids, dtype=torch.int64), torch.tensor(source), rows_pos,
             image_index, head_index, *one_pass_indices(cut, seq_lengths, K)]
    return Plan("one-pass", parts, sizes, [len(br.candidate_positions) for br in branches])


def one_pass_indices(cut: int, seq_lengths: list[int], K: int) -> list[torch.Tensor]:
    """The one-pass row's indices (`fast.model.OnePass`'s fields, int64) for a prefix of `cut` rows
    followed by continuations of the given lengths, with a causal conv of K taps."""
    T = sum(seq_lengths)
    seq_ids = torch.cat([torch.full((cut,), -1)] + [torch.full((n,), i) for i, n in enumerate(seq_lengths)])  # [cut + T]
    offsets = torch.cat([torch.arange(cut)] + [torch.arange(n) for n in seq_lengths])
    # Conv tap j of row t reads [zeros (K-1) | row] at t + j: the prefix rows read zeros before
    # their start; a continuation reads its own rows, or before its start the prefix's last rows
    # (offset + j < K - 1 lands in the prefix, which ends at row cut).
    cont_offsets, cont_rows = offsets[cut:], torch.arange(T)
    cont_taps = torch.stack([torch.where(cont_offsets + j >= K - 1, cont_rows + j, cont_offsets + j) for j in range(K)])
    taps = torch.cat([torch.stack([torch.arange(cut) + j for j in range(K)]), cont_taps + cut], dim=1)  # [K, cut + T]
    cu_seqlens = torch.tensor([0] + list(itertools.accumulate(seq_lengths)))
    chunk_indices = torch.tensor([[i, c] for i, n in enumerate(seq_lengths) for c in range(-(-n // CHUNK))]).view(-1, 2)
    return [seq_ids, offsets, taps, cu_seqlens, chunk_indices, torch.arange(cut)]


def head_rows(branches: list[Branch], starts: list[int], cut: int) -> tuple[torch.Tensor, int]:
    """Head rows for branches whose first token (absolute position `cut`) sits at row starts[k]:
    [candidate rows (C) | decision rows (N) | branch of each candidate (C)] int64, and C."""
    cand_rows, cand_branch, dec_rows = [], [], []
    for k, (br, start) in enumerate(zip(branches, starts)):
        cand_rows += [start + p - cut for p in br.candidate_positions]
        cand_branch += [k] * len(br.candidate_positions)
        dec_rows.append(start + br.decision_position - cut)
    return torch.tensor(cand_rows + dec_rows + cand_branch, dtype=torch.int64), len(cand_rows)
