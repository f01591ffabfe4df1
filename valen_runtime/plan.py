"""Shared-prefix plans: what a request's device work needs from the host, as int64 tensors.

The state's shared part ends on a chunk boundary of the delta rule (64 tokens), so every branch
sees the reference's chunking; each branch then runs the state tail (< 64 tokens) plus its own
suffix. A state under 64 tokens has nothing to share: its branches run as whole rows of state +
suffix in one batched forward ("rows"). Otherwise two layouts compute the same function:

- "batch": the prefix in one forward (its per-layer state cached), then the branches as a
  right-padded batch continuing from it. Runs on the reference modules and on the fast model.
- "one-pass" (the fast model's, `FastText.one_pass`): the prefix's rows followed by every
  branch's continuation packed back to back in one row, so the layers are swept once. Several
  requests can share one sweep (`plan_one_pass`): their prefixes lead, then all their
  continuations, each continuing its own request's prefix. Alone, a request runs it when its
  prefix holds at least K-1 rows (a whole conv history); a state under 64 tokens has none, and its
  branches run as rows (measured faster there than packing them); beside other requests it joins
  their sweep, its branches starting from a zero state.

Nothing here touches the device or the model; `Plan.sizes` is also the CUDA-graph key. Sizes that
vary with the questions' lengths are rounded up to rungs of `bucket` (pads read by no real row),
so requests that differ a little share one key, and so one CUDA graph.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from .config import ModelConfig
from .positions import rope_index
from .request import Branch, CompiledRequest

CHUNK = 64  # the chunk size of the reference's gated delta rule


@dataclass
class Plan:
    """One or more requests' shared-prefix inputs on the host.

    rows:     (a state under one chunk) parts = row ids [N, L] (state, suffix, pads), row
              positions [3, N, L], image token indices into the flattened rows [N * n_img],
              head rows [C + N + C]; sizes = (N, L, C, n_img), N, L and C on rungs (pad
              branches and head rows, see `_rows`).
    batch:    parts = state ids [1, P], prefix positions [3, 1, cut], suffix ids [N, L - tail],
              row positions [3, N, L], image token indices [n_img], head rows [C + N + C];
              sizes = (P, cut, N, L, C, n_img).
    one-pass: parts = all state ids [1, P], all suffix ids [S], row sources [cut + T] (into
              [states | suffixes]), row positions [3, 1, cut + T], image token indices (into the
              states), head rows [C + N + C], then the `fast.model.OnePass` fields; sizes = (P,
              cut, T, C, n_img, N, n sequences, NT chunks, L attention rows, S, prefix lengths),
              P and cut summed over the requests; cut + T, P, C, N, n, NT, S and (with several
              requests) L on rungs of `bucket`; C and N count pad head rows (the real
              candidates are sum(candidates_per_branch)).
    """

    kind: str  # "rows", "batch" or "one-pass": the layout this request runs
    parts: list[torch.Tensor]
    sizes: tuple
    candidates_per_branch: list[int]  # every branch of every request, in request order
    branches_per_request: list[int]

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
    else rows for a state under one chunk, the batch layout otherwise."""
    st = compiled.state
    cut = (len(st.input_ids) // CHUNK) * CHUNK
    if one_pass and cut >= config.text_config.linear_conv_kernel_dim - 1:
        return plan_one_pass([compiled], config)
    positions, next_pos = _rope(compiled, config)
    branches = [br for q in compiled.questions for br in q.branches]
    if cut == 0:
        return _rows(compiled, branches, positions, next_pos)
    return _batch(compiled, branches, positions, next_pos, cut, _image_index(compiled))


def _rope(compiled: CompiledRequest, config: ModelConfig) -> tuple[torch.Tensor, int]:
    st = compiled.state
    return rope_index(st.input_ids, st.mm_token_type_ids, st.image_grid_thw, config.vision_config.spatial_merge_size)  # [3, P]


def _image_index(compiled: CompiledRequest) -> torch.Tensor:
    return torch.from_numpy(np.flatnonzero(np.array(compiled.state.mm_token_type_ids, dtype=np.int64) == 1))


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
    head_index, C = head_rows(branches, [k * L for k in range(N)], [cut] * N)  # rows of the flattened [N * L, H]
    parts = [torch.tensor([st.input_ids]), positions[:, None, :cut], suffix_ids, rows_pos, image_index, head_index]
    sizes = (P, cut, N, L, C, len(image_index))
    return Plan("batch", parts, sizes, [len(br.candidate_positions) for br in branches], [N])


def _rows(compiled: CompiledRequest, branches: list[Branch], positions: torch.Tensor, next_pos: int) -> Plan:
    """A state under one chunk: nothing to share, every branch one row of state + suffix, built
    on the host so the state's length is no shape. Rows: N on a rung of `bucket` (pad branches
    are the state and pad tokens), L on multiples of 32 on its rungs, candidates and decisions
    padded as `pad_head_rows`."""
    st = compiled.state
    P = len(st.input_ids)
    N = bucket(len(branches))
    L = 32 * bucket(-(-(P + max(len(br.suffix_ids) for br in branches)) // 32))
    pad_id = branches[0].suffix_ids[-1]
    suffixes = [br.suffix_ids for br in branches] + [[]] * (N - len(branches))
    # Right padding is exact for the real tokens: every layer is causal, so a pad token never
    # influences an earlier position.
    row_ids = torch.tensor([st.input_ids + s + [pad_id] * (L - P - len(s)) for s in suffixes])  # [N, L]
    rows_pos = torch.cat([positions[:, None, :].expand(3, N, -1), torch.arange(next_pos, next_pos + L - P).view(1, 1, -1).expand(3, N, -1)],
                         dim=2)  # [3, N, L]
    image_index = (_image_index(compiled)[None, :] + L * torch.arange(N)[:, None]).reshape(-1)  # every row's copy [N * n_img]
    head_index, C = head_rows(branches, [k * L for k in range(len(branches))], [0] * len(branches))
    head_index, C, N_head = pad_head_rows(head_index, C, len(branches))
    assert N_head == N
    return Plan("rows", [row_ids, rows_pos, image_index, head_index], (N, L, C, len(image_index) // N), [len(br.candidate_positions) for br in branches],
                [len(branches)])


def plan_one_pass(requests: list[CompiledRequest], config: ModelConfig, buckets: bool = True) -> Plan:
    """The one-pass layout for one or several requests, swept through the layers together:
    [each request's prefix, back to back | every branch's continuation of every request, packed |
    pad sequences].

    A request's prefix is its state's chunk-aligned part (cut, a multiple of 64); its branches
    continue from it with the state tail and their suffix. A request whose state is under 64
    tokens has no prefix: its branches run state + suffix from a zero state (as the rows layout
    with cut 0 does). Rows take their embedding from [all states | all suffixes].

    buckets: round every size but the prefixes and image tokens up to a rung of `bucket`, so
    requests whose questions differ a little share one shape (one CUDA graph, see `Plan.sizes`):
    pad sequences (`pad_sequences`) continue the last request and are read by no real row, pad
    head rows (`pad_head_rows`) answer logits the engine drops. Off, one pad sequence rounds the
    packed rows up to a multiple of 8."""
    K = config.text_config.linear_conv_kernel_dim
    state_ids, suffix_ids, image_index = [], [], []
    prefix_sources, prefix_pos, cont_sources, cont_pos = [], [], [], []
    groups, branch_lists, cand_counts, branch_counts = [], [], [], []
    state_offset = 0
    for compiled in requests:
        st = compiled.state
        P = len(st.input_ids)
        cut = (P // CHUNK) * CHUNK
        cut = cut if cut >= K - 1 else 0
        positions, next_pos = _rope(compiled, config)
        branches = [br for q in compiled.questions for br in q.branches]
        prefix_sources.append(torch.arange(state_offset, state_offset + cut))
        prefix_pos.append(positions[:, :cut])
        lengths = []
        for br in branches:
            n = len(br.suffix_ids)
            lengths.append(P - cut + n)
            # suffix tokens are numbered from 0 here and shifted past all states below
            cont_sources += [torch.arange(state_offset + cut, state_offset + P), -1 - torch.arange(len(suffix_ids), len(suffix_ids) + n)]
            cont_pos += [positions[:, cut:], torch.arange(next_pos, next_pos + n).view(1, -1).expand(3, -1)]
            suffix_ids += br.suffix_ids
        groups.append((cut, lengths))
        branch_lists.append(branches)
        cand_counts += [len(br.candidate_positions) for br in branches]
        branch_counts.append(len(branches))
        state_ids += st.input_ids
        image_index.append(_image_index(compiled) + state_offset)
        state_offset += P
    pad_id = requests[-1].questions[0].branches[0].suffix_ids[-1]
    real_lengths = [n for _, lengths in groups for n in lengths]
    if buckets:
        pads = pad_sequences(real_lengths, prefix_rows=sum(cut for cut, _ in groups))
    else:
        pads = [-sum(real_lengths) % 8] if sum(real_lengths) % 8 else []
    # The pad sequences continue the last request (its attention rows, its prefix's state); their
    # rows read pad tokens placed after the suffixes, at positions from 0 (any valid ones).
    groups[-1] = (groups[-1][0], groups[-1][1] + pads)
    for pad in pads:
        cont_sources.append(-1 - torch.arange(len(suffix_ids), len(suffix_ids) + pad))
        cont_pos.append(torch.arange(0, pad).view(1, -1).expand(3, -1))
        suffix_ids += [pad_id] * pad
    if buckets:  # token tables on rungs too: the extra entries are read by no row
        state_ids += [pad_id] * (bucket(len(state_ids)) - len(state_ids))
        suffix_ids += [pad_id] * (bucket(len(suffix_ids)) - len(suffix_ids))
    # Suffix token i sits at n_state + i of [states | suffixes]; it was written as -1 - i above.
    n_state, total_cut = len(state_ids), sum(cut for cut, _ in groups)
    cont = torch.cat(cont_sources)
    source = torch.cat(prefix_sources + [torch.where(cont < 0, n_state - 1 - cont, cont)])  # [total_cut + T]
    rows_pos = torch.cat(prefix_pos + cont_pos, dim=1)[:, None, :]  # [3, 1, total_cut + T]
    # Head rows: each branch's first row (absolute position = its request's cut) in the packed part.
    starts, firsts, k = [], [], total_cut
    for (cut, lengths), branches in zip(groups, branch_lists):
        for n in lengths[: len(branches)]:
            starts.append(k)
            firsts.append(cut)
            k += n
    all_branches = [br for branches in branch_lists for br in branches]
    head_index, C = head_rows(all_branches, starts, firsts)
    N = len(all_branches)
    if buckets:
        head_index, C, N = pad_head_rows(head_index, C, N)
    image_index = torch.cat(image_index)
    cont_lengths = [n for _, lengths in groups for n in lengths]
    # Attention runs per request over L rows when there are several (fast.layers); alone, over the row.
    L = max(cut + sum(lengths) for cut, lengths in groups)
    attention_length = bucket(L) if buckets and len(groups) > 1 else L
    layout = packed_indices(groups, K, attention_length=attention_length)
    # The graph key: every tensor's shape, and each launch grid (FLA's varlen kernels' grids depend
    # on the sequence and chunk counts), follows from these; no per-sequence length is in it.
    sizes = (n_state, total_cut, sum(cont_lengths), C, len(image_index), N, len(cont_lengths), len(layout[4]), attention_length,
             len(suffix_ids), tuple(cut for cut, _ in groups))
    parts = [torch.tensor([state_ids]), torch.tensor(suffix_ids, dtype=torch.int64), source, rows_pos, image_index, head_index, *layout]
    return Plan("one-pass", parts, sizes, cand_counts, branch_counts)


def bucket(n: int) -> int:
    """The smallest rung >= n of a ladder with 8 rungs per doubling: every count up to 16, then
    multiples of 2 up to 32, of 4 up to 64, and so on (at most 12.5 % above n)."""
    if n <= 16:
        return n
    step = 1 << ((n - 1).bit_length() - 4)
    return -(-n // step) * step


def _chunks(length: int) -> int:
    return -(-length // CHUNK)


def pad_sequences(lengths: list[int], prefix_rows: int = 0) -> list[int]:
    """Lengths of pad sequences (at least one) that bring the packed continuations `lengths` to
    rungs of `bucket` at once in sequences, in 64-token chunks and in rows counted with the
    `prefix_rows` before them (the whole sweep's rows, which its cost follows). Always at least
    one, even for a plan on its rungs already: that plan then shares its key with its neighbours
    (measured: 8 keys instead of 6 over the 899 variants of (a) when such plans went unpadded).

    k sequences of c chunks in all hold between 64 (c - k) + k and 64 c rows, so the search takes
    the lowest row rung, then the lowest chunk and sequence rungs that fit it. Each chunk the
    chunk rung adds beyond the pad sequences' own costs 64 rows, so many continuations shorter
    than a chunk can grow by more than the row rung's 12.5 % (up to ≈ 35 % seen for 40
    continuations of 20 rows and one of 70). Should nothing fit within the rungs searched, one
    pad sequence rounds the rows up to a multiple of 8 (a shape of its own, still correct)."""
    rows, sequences, chunks = sum(lengths), len(lengths), sum(_chunks(n) for n in lengths)
    T = bucket(prefix_rows + rows + 1)
    for _ in range(64):
        r = T - prefix_rows - rows
        NT = bucket(chunks + _chunks(r))
        for _ in range(8):
            c = NT - chunks
            n = bucket(sequences + 1)
            while n - sequences <= min(r, c):
                k = n - sequences
                if c <= k + (r - k) // CHUNK:
                    return _pad_lengths(r, k, c)
                n = bucket(n + 1)
            NT = bucket(NT + 1)
        T = bucket(T + 1)
    return [8 - rows % 8]


def _pad_lengths(rows: int, k: int, chunks: int) -> list[int]:
    """k lengths summing to `rows` whose 64-token chunks sum to `chunks` (k <= chunks,
    64 (chunks - k) + k <= rows <= 64 chunks): the first takes the extra chunks."""
    capacity = [CHUNK * (chunks - k + 1)] + [CHUNK] * (k - 1)
    lengths = [CHUNK * (chunks - k) + 1] + [1] * (k - 1)
    left = rows - sum(lengths)
    for i in range(k):
        more = min(left, capacity[i] - lengths[i])
        lengths[i] += more
        left -= more
    assert left == 0 and sum(_chunks(n) for n in lengths) == chunks, (rows, k, chunks)
    return lengths


def pad_head_rows(head_index: torch.Tensor, C: int, N: int) -> tuple[torch.Tensor, int, int]:
    """`head_rows`' [candidates (C) | decisions (N) | branch of each candidate (C)] with C and N
    brought to rungs of `bucket`: pad candidates read row 0 against branch 0 and pad decisions row 0;
    their logits follow the real C and are dropped. -> (head index, C', N')."""
    Cb, Nb = bucket(C), bucket(N)
    zeros = head_index.new_zeros
    padded = torch.cat([head_index[:C], zeros(Cb - C), head_index[C : C + N], zeros(Nb - N), head_index[C + N :], zeros(Cb - C)])
    return padded, Cb, Nb


def packed_indices(groups: list[tuple[int, list[int]]], K: int, attention_length: int | None = None) -> list[torch.Tensor]:
    """The one-pass rows' indices (`fast.model.OnePass`'s fields, int64) for groups (prefix rows,
    continuation lengths): the prefixes lead back to back, then every group's continuations in
    group order; a prefix of 0 rows means its continuations start from zero history. K: conv taps;
    attention_length: L of `attention_rows` [m, L], at least the longest group's rows (the default)."""
    assert all(cut == 0 or cut >= K - 1 for cut, _ in groups), "a prefix must hold a whole conv history"
    # Every sequence once, in row order: (length, sequence id, owner, where its history ends).
    # Prefix g is sequence -1 - g and reads zeros before its start; continuation n is sequence n
    # and reads the last rows of its group's prefix (zeros without one: a history end of 0).
    sequences, prefix_ends, row = [], [], 0
    for g, (cut, _) in enumerate(groups):
        sequences.append((cut, -1 - g, g, 0))
        row += cut
        prefix_ends.append(row)
    total_cut, n = row, 0
    initial_state_index, prefix_number = [], 0
    for g, (cut, lengths) in enumerate(groups):
        prefix_number += bool(cut)
        for length in lengths:
            sequences.append((length, n, g, prefix_ends[g] if cut else 0))
            initial_state_index.append(prefix_number if cut else 0)
            n += 1
    # Per row, each sequence's fields repeated over its rows (numpy: a few microseconds where
    # Python lists or torch.repeat_interleave take a millisecond at these sizes).
    table = np.array(sequences, dtype=np.int64).reshape(-1, 4)  # [sequences, (length, id, owner, history end)]
    lengths = table[:, 0]
    R = int(lengths.sum())
    offsets = torch.from_numpy(np.arange(R) - np.repeat(np.cumsum(lengths) - lengths, lengths))  # [R]
    seq_ids, owners, history = (torch.from_numpy(np.repeat(table[:, i], lengths)) for i in (1, 2, 3))
    # Tap j of row t reads [zeros (K-1) | rows] at t + j: its own rows, or before its start the
    # history's last rows (offset + j < K - 1 lands below the history's end, or in the zeros).
    rows = torch.arange(R)
    taps = torch.stack([torch.where(offsets + j >= K - 1, rows + j, history + offsets + j) for j in range(K)])  # [K, R]
    cont_lengths = [length for _, lengths in groups for length in lengths]
    prefix_lengths = [cut for cut, _ in groups if cut]
    # Attention per request: its rows in order (prefix, then continuations), padded with -1 to the
    # longest request's count L; slots: where each row lands in the flattened [m, L].
    per_group = [torch.nonzero(owners == g).view(-1) for g in range(len(groups))]
    L = max(len(r) for r in per_group)
    assert attention_length is None or attention_length >= L, (attention_length, L)
    L = attention_length or L
    attention_rows = torch.stack([torch.cat([r, torch.full((L - len(r),), -1)]) for r in per_group])  # [m, L]
    slots = torch.empty(R, dtype=torch.int64)
    for g, r in enumerate(per_group):
        slots[r] = g * L + torch.arange(len(r))
    return [
        seq_ids, offsets, taps, _cu_seqlens(cont_lengths), _chunk_indices(cont_lengths),
        torch.arange(total_cut), owners, _cu_seqlens(prefix_lengths), _chunk_indices(prefix_lengths),
        torch.tensor(initial_state_index, dtype=torch.int64), attention_rows, slots,
    ]


def _cu_seqlens(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int64)


def _chunk_indices(lengths: list[int]) -> torch.Tensor:
    """(sequence, chunk) of every 64-token delta-rule chunk, as FLA's varlen kernels take them: [NT, 2]."""
    chunks = -(-np.array(lengths, dtype=np.int64) // CHUNK)
    first = np.repeat(np.cumsum(chunks) - chunks, chunks)
    return torch.from_numpy(np.stack([np.repeat(np.arange(len(chunks)), chunks), np.arange(int(chunks.sum())) - first], axis=1))


def head_rows(branches: list[Branch], starts: list[int], firsts: list[int]) -> tuple[torch.Tensor, int]:
    """Head rows for branches whose first token (absolute position firsts[k]) sits at row starts[k]:
    [candidate rows (C) | decision rows (N) | branch of each candidate (C)] int64, and C."""
    cand_rows, cand_branch, dec_rows = [], [], []
    for k, (br, start, first) in enumerate(zip(branches, starts, firsts)):
        cand_rows += [start + p - first for p in br.candidate_positions]
        cand_branch += [k] * len(br.candidate_positions)
        dec_rows.append(start + br.decision_position - first)
    return torch.tensor(cand_rows + dec_rows + cand_branch, dtype=torch.int64), len(cand_rows)
