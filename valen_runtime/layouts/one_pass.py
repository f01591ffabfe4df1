"""The one-pass layout (the fast model's, `FastText.one_pass`): the prefixes' rows followed by
every branch's continuation packed back to back in one row, so the layers are swept once.

Several requests can share one sweep: their prefixes lead, then all their continuations, each
continuing its own request's prefix. A request's prefix is its state's chunk-aligned part (cut, a
multiple of 64); its branches continue from it with the state tail and their suffix. Alone, a
request runs this layout when its prefix holds at least K-1 rows (a whole conv history; `choose`);
a state under 64 tokens has none and runs as rows alone, but beside other requests it joins their
sweep, its branches running state + suffix from a zero state. Rows take their embedding from
[all states | all suffixes]. The rows come in one order whatever the requests' order (the longest
prefix first, then the most rows; the requests without one last, sharing attention groups of up
to `MERGED_ROWS` rows, since such rows only see their own sequence), so a batch of the same
requests has the same shape in any order;
the head rows and the image features follow the requests' own order.

Padding (`ladder`): every size but the prefixes and image tokens on a rung of `bucket`, so
requests whose questions differ a little share one shape (one CUDA graph): pad sequences
(`pad_sequences`) continue the last attention group and are read by no real row, pad head rows
(`pad_head_rows`) answer logits the engine drops, the token tables grow by entries no row reads,
and with several requests each attention group's block is on a rung. Without buckets, one pad
sequence rounds the packed rows up to a multiple of 8.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import numpy as np
import torch

from ..config import ModelConfig
from ..request import CompiledRequest
from .common import CHUNK, Plan, branches_of, head_logits, head_rows, visual_index, state_embeds, state_positions
from .ladder import bucket, chunks, fit_sequences, pad_head_rows, pad_sequences

name = "one-pass"


class OnePass(NamedTuple):
    """Where the rows of a one-pass forward come from: the prefixes' P rows lead (one per request
    that has one, back to back), then every branch's continuation (its state tail and suffix) of
    every request, packed back to back (R = P + T rows). Attention runs per group: a request with a
    prefix, or requests without one together. `packed_indices` builds them."""

    seq_ids: torch.Tensor  # [R] int64: the sequence of each row: continuation n >= 0, prefix of group g -1 - g
    offsets: torch.Tensor  # [R] int64: its position within that sequence
    conv_taps: torch.Tensor  # [K, R] int64: each row's causal-conv inputs, indices into [zeros (K-1) | row]
    cu_seqlens: torch.Tensor  # [n + 1] int64: the continuations' boundaries, counted from the first one
    chunk_indices: torch.Tensor  # [NT, 2] int64: (continuation, chunk) of every 64-token delta-rule chunk
    prefix_rows: torch.Tensor  # [P]: its length is the prefixes' total
    owners: torch.Tensor  # [R] int64: the attention group of each row
    prefix_cu_seqlens: torch.Tensor  # [m + 1] int64: the m non-empty prefixes' boundaries
    prefix_chunk_indices: torch.Tensor  # [NTp, 2] int64: (prefix, chunk) of every 64-token chunk of the prefixes
    initial_state_index: torch.Tensor  # [n] int64: each continuation's start: 0 the zero state, i prefix i-1's final state
    attention_rows: torch.Tensor  # [m, L] int64: each group's rows (prefix, then continuations), -1 pads to L
    attention_slots: torch.Tensor  # [R] int64: each row's place in the flattened [m, L]


class Inputs(NamedTuple):
    state_ids: torch.Tensor  # [1, P]: every request's state, back to back, then pads
    suffix_ids: torch.Tensor  # [S]: every branch's suffix, then the pad sequences' tokens and pads
    source: torch.Tensor  # [cut + T]: each row's token, an index into [state_ids | suffix_ids]
    rows_pos: torch.Tensor  # [3, 1, cut + T]: M-RoPE positions of every row
    visual_index: torch.Tensor  # [n_visual]: the image or video tokens, into the states
    head_index: torch.Tensor  # [C + N + C]: `common.head_rows` into the rows, padded
    layout: OnePass  # the rows' sequences, conv taps, delta-rule chunks and attention blocks
    features: torch.Tensor | None = None  # [n_visual, H]: the vision tower's output (on the device)


class Shape(NamedTuple):
    """The graph key: every tensor's shape, and each launch grid (FLA's varlen kernels' grids depend
    on the sequence and chunk counts), follows from these; no per-sequence length is in it."""

    P: int  # state tokens, all requests (the state table's length)
    cut: int  # prefix rows, all requests
    T: int  # continuation rows (pad sequences included)
    C: int  # candidates, with pad candidates (the real ones: sum(candidates_per_branch))
    n_visual: int  # image or video tokens
    N: int  # branches, with pad branches
    n: int  # continuation sequences (pad sequences included)
    NT: int  # 64-token chunks of the continuations
    L: int  # attention rows per group
    S: int  # the suffix table's length
    prefixes: tuple  # each attention group's prefix rows (0: requests without a prefix), longest first


# Prefix-less requests share an attention group up to this many rows: every group's attention runs
# over the largest group's length L (m groups cost m L^2), so a group of many short texts must not
# grow far past what one request's group would be.
MERGED_ROWS = 1024


def build(requests: list[CompiledRequest], config: ModelConfig, buckets: bool = True, into: Shape | None = None) -> Plan | None:
    """The one-pass plan for one or several requests, swept through the layers together:
    [each request's prefix, back to back | every branch's continuation of every request, packed |
    pad sequences]. buckets: pad to the ladder (the module's docstring); off, no rung padding.
    into: pad to this shape instead (a captured graph's, at least the ladder's), or return None
    when the requests do not fit it (other prefixes or image tokens, or more of any size)."""
    K = config.text_config.linear_conv_kernel_dim
    branches = [branches_of(c) for c in requests]
    cuts = []
    for compiled in requests:
        cut = (len(compiled.state.input_ids) // CHUNK) * CHUNK
        cuts.append(cut if cut >= K - 1 else 0)
    # The sizes first (cheap), so a shape the requests do not fit is refused before any tensor work.
    request_lengths = [[len(c.state.input_ids) - cut + len(br.suffix_ids) for br in bs] for c, cut, bs in zip(requests, cuts, branches)]
    # Rows in one order whatever the requests' order, so that batches of the same requests share a
    # shape: the longest prefixes first, then the most continuation rows; requests without a
    # prefix last, sharing attention groups of up to MERGED_ROWS rows.
    order = sorted(range(len(requests)), key=lambda i: (-cuts[i], -sum(request_lengths[i])))
    groups = []  # (prefix rows, continuation lengths) per attention group, in row order
    starts = {}  # per request (its index in `requests`): its group and its first sequence in it
    for i in order:
        # Branches without a prefix start from the zero state and attend to their own rows only, so
        # prefix-less requests can share an attention group (one prefix entry in the key).
        if cuts[i] == 0 and groups and groups[-1][0] == 0 and sum(groups[-1][1]) + sum(request_lengths[i]) <= MERGED_ROWS:
            starts[i] = (len(groups) - 1, len(groups[-1][1]))
            groups[-1][1].extend(request_lengths[i])
        else:
            starts[i] = (len(groups), 0)
            groups.append((cuts[i], list(request_lengths[i])))
    real_lengths = [n for _, lengths in groups for n in lengths]
    total_cut, prefixes = sum(cut for cut, _ in groups), tuple(cut for cut, _ in groups)
    state_tokens = sum(len(c.state.input_ids) for c in requests)
    n_suffix = sum(len(br.suffix_ids) for bs in branches for br in bs)
    cand_counts = [len(br.candidate_positions) for bs in branches for br in bs]  # per branch, in request order
    n_visual = sum(1 for c in requests for t in c.state.mm_token_type_ids if t != 0)
    if into is not None:
        if (into.cut, into.prefixes, into.n_visual) != (total_cut, prefixes, n_visual) \
                or into.P < state_tokens or into.C < sum(cand_counts) or into.N < len(cand_counts):
            return None
        pads = fit_sequences(real_lengths, into.T, into.n, into.NT)
        if pads is None or into.S < n_suffix + sum(pads):
            return None
    elif buckets:
        pads = pad_sequences(real_lengths, prefix_rows=total_cut)
    else:
        pads = [-sum(real_lengths) % 8] if sum(real_lengths) % 8 else []
    # The pad sequences continue the last group (its attention rows, its prefix's state); their
    # rows read pad tokens placed after the suffixes, at positions from 0 (any valid ones).
    groups[-1] = (groups[-1][0], groups[-1][1] + pads)
    L = max(cut + sum(lengths) for cut, lengths in groups)  # attention rows of the largest group
    if into is not None and into.L < L:
        return None
    # The shape, from the sizes alone: the graph policy may pad this plan into a captured shape
    # (`graph_plan`), and then its tensors are never built.
    if into is not None:
        shape = into
    else:
        fit = bucket if buckets else (lambda size: size)
        cont_lengths = real_lengths + pads
        shape = Shape(fit(state_tokens), total_cut, sum(cont_lengths), fit(sum(cand_counts)), n_visual, fit(len(cand_counts)),
                      len(cont_lengths), sum(chunks(n) for n in cont_lengths), bucket(L) if buckets and len(groups) > 1 else L,
                      fit(n_suffix + sum(pads)), prefixes)
    return Plan(name, lambda: _inputs(requests, config, shape, order, cuts, branches, groups, starts, pads), shape, cand_counts,
                [len(bs) for bs in branches])


def _inputs(requests: list[CompiledRequest], config: ModelConfig, shape: Shape, order: list[int], cuts: list[int], branches: list,
            groups: list, starts: dict, pads: list[int]) -> Inputs:
    """`build`'s tensors for its sizes: the requests' rows in `order`, `groups` (pads included) and
    `starts` as `build` laid them out, padded to `shape`."""
    K = config.text_config.linear_conv_kernel_dim
    total_cut = shape.cut

    # The rows' tokens and positions, in row order.
    state_ids, suffix_ids = [], []
    prefix_sources, prefix_pos, cont_sources, cont_pos = [], [], [], []
    images = {}  # per request: its visual tokens in [all states]
    state_offset = 0
    for i in order:
        compiled, cut = requests[i], cuts[i]
        st = compiled.state
        P = len(st.input_ids)
        positions, next_pos = state_positions(compiled, config)
        prefix_sources.append(torch.arange(state_offset, state_offset + cut))
        prefix_pos.append(positions[:, :cut])
        for br in branches[i]:
            n = len(br.suffix_ids)
            # suffix tokens are numbered from 0 here and shifted past all states below
            cont_sources += [torch.arange(state_offset + cut, state_offset + P), -1 - torch.arange(len(suffix_ids), len(suffix_ids) + n)]
            cont_pos += [positions[:, cut:], torch.arange(next_pos, next_pos + n).view(1, -1).expand(3, -1)]
            suffix_ids += br.suffix_ids
        state_ids += st.input_ids
        images[i] = visual_index(compiled) + state_offset
        state_offset += P
    pad_id = requests[-1].questions[0].branches[0].suffix_ids[-1]
    for pad in pads:
        cont_sources.append(-1 - torch.arange(len(suffix_ids), len(suffix_ids) + pad))
        cont_pos.append(torch.arange(0, pad).view(1, -1).expand(3, -1))
        suffix_ids += [pad_id] * pad
    # the token tables at the shape's lengths (rungs, or a captured shape's): the extra entries are read by no row
    state_ids += [pad_id] * (shape.P - len(state_ids))
    suffix_ids += [pad_id] * (shape.S - len(suffix_ids))
    # Suffix token i sits at n_state + i of [states | suffixes]; it was written as -1 - i above.
    n_state = len(state_ids)
    cont = torch.cat(cont_sources)
    source = torch.cat(prefix_sources + [torch.where(cont < 0, n_state - 1 - cont, cont)])  # [total_cut + T]
    rows_pos = torch.cat(prefix_pos + cont_pos, dim=1)[:, None, :]  # [3, 1, total_cut + T]
    # Head rows, in the requests' own order: each branch's first row (absolute position = its
    # request's cut) in the packed part.
    group_rows = list(itertools.accumulate((sum(lengths) for _, lengths in groups), initial=total_cut))  # each group's first row
    all_branches, head_starts, firsts = [], [], []
    for i in range(len(requests)):
        g, first_sequence = starts[i]
        k = group_rows[g] + sum(groups[g][1][:first_sequence])
        for br, n in zip(branches[i], groups[g][1][first_sequence:]):
            all_branches.append(br)
            head_starts.append(k)
            firsts.append(cuts[i])
            k += n
    head_index, C = head_rows(all_branches, head_starts, firsts)
    head_index, C, N = pad_head_rows(head_index, C, len(all_branches), into=(shape.C, shape.N))
    images = torch.cat([images[i] for i in range(len(requests))])  # the vision features come in request order
    layout = packed_indices(groups, K, attention_length=shape.L)
    assert (len(state_ids), total_cut, int(layout.cu_seqlens[-1]), C, len(images), N, len(layout.cu_seqlens) - 1, len(layout.chunk_indices),
            len(suffix_ids)) == (shape.P, shape.cut, shape.T, shape.C, shape.n_visual, shape.N, shape.n, shape.NT, shape.S), shape
    return Inputs(torch.tensor([state_ids]), torch.tensor(suffix_ids, dtype=torch.int64), source, rows_pos, images, head_index, layout)


def rows_swept(shape: Shape) -> int:
    """The rows a plan of this shape sweeps through the layers (what it costs)."""
    return shape.cut + shape.T


# A combined plan (several requests) may run in a captured shape up to this many rungs of rows above
# its own (about 40 % more rows): its batch-mates vary its sizes more than one request's questions
# do, and a direct run of it (launch-bound, tens of ms) costs more than sweeping those rows.
BATCH_RUNGS = 3


def pad_into(requests: list[CompiledRequest], config: ModelConfig, plan: Plan, shape: Shape) -> Plan | None:
    """`plan`'s requests padded into a captured graph's `shape` when it sweeps at most one rung more
    rows (at most an eighth more rows; docs/runtime.md says what that bounds), or `BATCH_RUNGS`
    rungs for several requests, else None."""
    own = plan.shape
    most = bucket(own.cut + own.T + 1)
    for _ in range(BATCH_RUNGS - 1 if len(requests) > 1 else 0):
        most = bucket(most + 1)
    if not own.cut + own.T <= shape.cut + shape.T <= most \
            or (shape.cut, shape.prefixes, shape.n_visual) != (own.cut, own.prefixes, own.n_visual) \
            or shape.C < sum(plan.candidates_per_branch) or shape.N < len(plan.candidates_per_branch) \
            or shape.n <= len(plan.candidates_per_branch):  # a continuation per branch, and a pad
        return None  # checked before `build`'s host work: most captured shapes fail here
    return build(requests, config, into=shape)


def with_headroom(requests: list[CompiledRequest], config: ModelConfig, plan: Plan) -> Plan:
    """`plan` one rung of rows larger, with one more pad sequence and the fewest chunks that fit,
    so the graph captured for it serves requests whose questions are a little longer (more rows,
    and branches crossing into another chunk: `pad_into`). `plan` itself when nothing fits."""
    own = plan.shape
    grown = grow(requests, config, own, T=bucket(own.cut + own.T + 1) - own.cut, n=bucket(own.n + 1))
    return grown if grown is not None else plan


def grow(requests: list[CompiledRequest], config: ModelConfig, shape: Shape, T: int, n: int) -> Plan | None:
    """`requests` built into `shape` grown to T rows and n sequences (the attention block and the
    sequence table grown with the rows, the fewest chunks that fit), or None when none fits."""
    S = bucket(shape.S + T - shape.T)
    for NT in range(shape.NT, shape.NT + n + -(-(T - shape.T) // CHUNK) + 1):
        if bucket(NT) == NT:
            grown = build(requests, config, into=shape._replace(T=T, n=n, NT=NT, S=S, L=shape.L + T - shape.T))
            if grown is not None:
                return grown
    return None


def packed_indices(groups: list[tuple[int, list[int]]], K: int, attention_length: int | None = None) -> OnePass:
    """The one-pass rows' indices (int64) for groups (prefix rows, continuation lengths): the
    prefixes lead back to back, then every group's continuations in group order; a prefix of 0 rows
    means its continuations start from zero history. K: conv taps; attention_length: L of
    `attention_rows` [m, L], at least the longest group's rows (the default)."""
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
    # Attention per group: its rows in order (prefix, then continuations), padded with -1 to the
    # longest group's count L; slots: where each row lands in the flattened [m, L].
    per_group = [torch.nonzero(owners == g).view(-1) for g in range(len(groups))]
    L = max(len(r) for r in per_group)
    assert attention_length is None or attention_length >= L, (attention_length, L)
    L = attention_length or L
    attention_rows = torch.stack([torch.cat([r, torch.full((L - len(r),), -1)]) for r in per_group])  # [m, L]
    slots = torch.empty(R, dtype=torch.int64)
    for g, r in enumerate(per_group):
        slots[r] = g * L + torch.arange(len(r))
    return OnePass(
        seq_ids=seq_ids, offsets=offsets, conv_taps=taps, cu_seqlens=_cu_seqlens(cont_lengths), chunk_indices=_chunk_indices(cont_lengths),
        prefix_rows=torch.arange(total_cut), owners=owners, prefix_cu_seqlens=_cu_seqlens(prefix_lengths),
        prefix_chunk_indices=_chunk_indices(prefix_lengths), initial_state_index=torch.tensor(initial_state_index, dtype=torch.int64),
        attention_rows=attention_rows, attention_slots=slots,
    )


def _cu_seqlens(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int64)


def _chunk_indices(lengths: list[int]) -> torch.Tensor:
    """(sequence, chunk) of every 64-token delta-rule chunk, as FLA's varlen kernels take them: [NT, 2]."""
    chunks = -(-np.array(lengths, dtype=np.int64) // CHUNK)
    first = np.repeat(np.cumsum(chunks) - chunks, chunks)
    return torch.from_numpy(np.stack([np.repeat(np.arange(len(chunks)), chunks), np.arange(int(chunks.sum())) - first], axis=1))


# ---- on the device (capturable: no host work)


def forward(text, head, shape: Shape, inputs: Inputs) -> tuple[torch.Tensor]:
    """[prefixes | packed continuations] in one row through the fast model's `one_pass` sweep ->
    (logits [C] fp32,)."""
    embeds = state_embeds(text, inputs.state_ids, inputs.visual_index, inputs.features)  # [1, P, H]
    rows = torch.cat([embeds[0], text.embed(inputs.suffix_ids)])[inputs.source][None]  # [1, cut + T, H]
    hidden = text.one_pass(rows, inputs.rows_pos, inputs.layout)
    return head_logits(head, hidden[0], inputs.head_index, shape.C, shape.N)


def one_pass_mask(layout: OnePass, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive mask [m, 1, L, L] over each group's rows (`attention_rows`): a prefix row sees its
    prefix's earlier rows; a continuation row sees its request's whole prefix and its own sequence
    causally; a pad slot is seen by none and sees itself only (so no row is empty)."""
    rows = layout.attention_rows
    valid = rows >= 0
    index = rows.clamp(min=0)
    seq, offsets, owners = layout.seq_ids[index], layout.offsets[index], layout.owners[index]  # [m, L] each
    same = seq[:, :, None] == seq[:, None, :]
    causal = offsets[:, None, :] <= offsets[:, :, None]
    in_prefix = seq < 0
    same_request = owners[:, :, None] == owners[:, None, :]
    seen = ((same & causal) | (same_request & in_prefix[:, None, :] & ~in_prefix[:, :, None])) & valid[:, None, :]
    seen = seen | (torch.eye(rows.shape[1], dtype=torch.bool, device=device) & ~valid[:, :, None])
    return torch.where(seen, torch.zeros((), dtype=dtype, device=device), torch.finfo(dtype).min)[:, None]
