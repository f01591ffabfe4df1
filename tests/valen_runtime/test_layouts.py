"""valen_runtime.layouts: the shared-prefix layouts' host-side inputs, checked against the compiled
request they come from (which token and which M-RoPE position each row holds, which rows the head
reads), without running a model; `choose`; the shape ladder and its padding rules."""

from __future__ import annotations

import functools

import pytest
import torch

from valen_runtime.config import ModelConfig
from valen_runtime.layouts import CHUNK, bucket, choose, one_pass, packed_indices
from valen_runtime.positions import rope_index
from valen_runtime.request import Compiler


@pytest.fixture(scope="module")
def setup(tiny_export):
    import json

    export = tiny_export["separate"]
    config = ModelConfig.from_dict(json.loads((export / "config.json").read_text()))
    return Compiler.from_dir(export), config


def branch_sequences(compiled, config):
    """Per branch: the full token ids and M-RoPE positions [3, T] of state + suffix (the per-branch forward)."""
    st = compiled.state
    out = []
    for q in compiled.questions:
        for br in q.branches:
            ids = st.input_ids + br.suffix_ids
            types = st.mm_token_type_ids + [0] * len(br.suffix_ids)
            pos, _ = rope_index(ids, types, st.image_grid_thw, config.vision_config.spatial_merge_size)
            out.append((br, ids, pos))
    return out


def assert_head_rows_read_the_readout_tokens(plan, compiled, config, row_ids, row_pos):
    """row_ids [R] / row_pos [3, R]: what each row of the flattened hidden states holds."""
    assert plan.candidates_per_branch == [len(br.candidate_positions) for br, _, _ in branch_sequences(compiled, config)]
    assert_head_reads(plan.inputs.head_index, plan.shape.C, plan.shape.N, compiled, config, row_ids, row_pos)


def assert_head_reads(head, Cb, Nb, compiled, config, row_ids, row_pos):
    """`common.head_rows` index `head` with Cb candidates and Nb branches (pads counted) reads the
    request's candidate and decision tokens first, each with its own branch."""
    branches = branch_sequences(compiled, config)
    C, N = sum(len(br.candidate_positions) for br, _, _ in branches), len(branches)
    assert len(head) == 2 * Cb + Nb
    cand, dec, owner = head[:C], head[Cb : Cb + N], head[Cb + Nb : Cb + Nb + C]
    k = 0
    for b, (br, ids, pos) in enumerate(branches):
        wanted = list(br.candidate_positions) + [br.decision_position]
        rows = cand[k : k + len(br.candidate_positions)].tolist() + [dec[b].item()]
        for p, r in zip(wanted, rows):
            assert row_ids[r] == ids[p] and torch.equal(row_pos[:, r], pos[:, p]), (b, p, r)
        assert owner[k : k + len(br.candidate_positions)].tolist() == [b] * len(br.candidate_positions)
        k += len(br.candidate_positions)


def test_batch_layout_rows(setup, long_image_request):
    compiler, config = setup
    compiled = compiler.compile(long_image_request)
    plan = choose(compiled, config, "batch")
    inputs, (P, cut, N, L, C, n_visual) = plan.inputs, plan.shape
    state_ids, prefix_pos, suffix_ids, rows_pos = inputs.state_ids, inputs.prefix_pos, inputs.suffix_ids, inputs.rows_pos
    assert plan.kind == "batch" and plan.key == ("batch", P, cut, N, L, C, n_visual) and cut == (P // CHUNK) * CHUNK > 0 and L % 8 == 0
    assert n_visual == sum(compiled.state.mm_token_type_ids) == len(inputs.visual_index) and inputs.features is None
    full_pos, _ = rope_index(compiled.state.input_ids, compiled.state.mm_token_type_ids, compiled.state.image_grid_thw,
                             config.vision_config.spatial_merge_size)
    assert torch.equal(prefix_pos[:, 0], full_pos[:, :cut])
    rows = torch.cat([state_ids[:, cut:].expand(N, -1), suffix_ids], dim=1)  # [N, L]: state tail | suffix | padding
    assert_head_rows_read_the_readout_tokens(plan, compiled, config, rows.reshape(-1).tolist(), rows_pos.reshape(3, -1))


def test_one_pass_layout_rows(setup, long_image_request):
    compiler, config = setup
    compiled = compiler.compile(long_image_request)
    plan = choose(compiled, config, "one-pass")
    inputs, layout = plan.inputs, plan.inputs.layout
    state_ids, suffix_ids, source, rows_pos = inputs.state_ids, inputs.suffix_ids, inputs.source, inputs.rows_pos
    seq_ids, offsets, taps, cu_seqlens, chunk_indices, prefix_rows = (layout.seq_ids, layout.offsets, layout.conv_taps, layout.cu_seqlens,
                                                                      layout.chunk_indices, layout.prefix_rows)
    P, cut, T, C, n_visual, N, n, NT, L, S, prefix_lengths = plan.shape
    assert plan.key == ("one-pass", *plan.shape)
    seq_lengths = cu_seqlens.diff().tolist()
    branches = sum(len(q.branches) for q in compiled.questions)
    assert plan.kind == "one-pass" and cut > 0 and sum(seq_lengths) == T and prefix_lengths == (cut,)
    assert len(prefix_rows) == cut and rows_pos.shape == (3, 1, cut + T) and taps.shape[1] == cut + T and L == cut + T
    assert len(seq_lengths) == n > branches and len(chunk_indices) == NT and len(suffix_ids) == S and state_ids.shape == (1, P)
    assert all(bucket(x) == x for x in (P, cut + T, C, N, n, NT, S))  # every size on a rung (ladder.bucket)
    row_ids = torch.cat([state_ids[0], suffix_ids])[source].tolist()  # the token of every row
    assert row_ids[:cut] == compiled.state.input_ids[:cut] and (seq_ids[:cut] == -1).all()
    assert_head_rows_read_the_readout_tokens(plan, compiled, config, row_ids, rows_pos[:, 0])
    # Every 64-token chunk of every continuation, in order.
    assert chunk_indices.tolist() == [[i, c] for i, n in enumerate(seq_lengths) for c in range(-(-n // CHUNK))]
    assert offsets[cut:].tolist() == [o for n in seq_lengths for o in range(n)]
    # One request: every row its own, one prefix, every continuation from that prefix's state.
    owners, prefix_cu, prefix_chunks, initial, attention_rows, slots = (layout.owners, layout.prefix_cu_seqlens, layout.prefix_chunk_indices,
                                                                        layout.initial_state_index, layout.attention_rows, layout.attention_slots)
    assert (owners == 0).all() and prefix_cu.tolist() == [0, cut] and initial.tolist() == [1] * len(seq_lengths)
    assert attention_rows.tolist() == [list(range(cut + T))] and slots.tolist() == list(range(cut + T))  # attention over the whole row
    assert prefix_chunks.tolist() == [[0, c] for c in range(cut // CHUNK)]


def expected_conv_taps(groups, K: int) -> torch.Tensor:
    """[K, R] written row by row: tap j of a row at offset o of its sequence reads input o - (K-1) + j
    of that sequence; before its start, a continuation reads its prefix's last rows (zeros without
    one) and a prefix reads zeros. Index i of [zeros (K-1) | rows] is row i - (K-1)."""
    rows_of_prefix, row = [], 0
    for cut, _ in groups:
        rows_of_prefix.append(list(range(row, row + cut)))
        row += cut
    columns = []
    for prefix in rows_of_prefix:
        for o in range(len(prefix)):
            columns.append([K - 1 + prefix[o - (K - 1) + j] if o - (K - 1) + j >= 0 else "zero" for j in range(K)])
    for g, (cut, lengths) in enumerate(groups):
        for n in lengths:
            own = list(range(row, row + n))
            history = rows_of_prefix[g]
            for o in range(n):
                col = []
                for j in range(K):
                    i = o - (K - 1) + j
                    col.append(K - 1 + own[i] if i >= 0 else (K - 1 + history[i] if history else "zero"))
                columns.append(col)
            row += n
    return columns


def test_packed_indices_for_several_requests():
    """Three requests (prefix 64 / none / 128) and their continuations: sequences, owners, conv taps,
    the prefixes' and continuations' boundaries and chunks, each continuation's initial state."""
    K = 4
    groups = [(64, [5, 70]), (0, [3, 1]), (128, [2])]
    layout = packed_indices(groups, K)
    seq_ids, offsets, taps, cu, chunks, prefix_rows = layout.seq_ids, layout.offsets, layout.conv_taps, layout.cu_seqlens, layout.chunk_indices, layout.prefix_rows
    owners, prefix_cu, prefix_chunks, initial = layout.owners, layout.prefix_cu_seqlens, layout.prefix_chunk_indices, layout.initial_state_index
    attention_rows, slots = layout.attention_rows, layout.attention_slots
    R = 64 + 128 + 5 + 70 + 3 + 1 + 2
    assert taps.shape == (K, R) and len(prefix_rows) == 192
    assert seq_ids.tolist() == [-1] * 64 + [-3] * 128 + [0] * 5 + [1] * 70 + [2] * 3 + [3] + [4] * 2
    assert owners.tolist() == [0] * 64 + [2] * 128 + [0] * 75 + [1] * 4 + [2] * 2
    assert offsets.tolist() == list(range(64)) + list(range(128)) + [o for n in (5, 70, 3, 1, 2) for o in range(n)]
    assert cu.tolist() == [0, 5, 75, 78, 79, 81] and prefix_cu.tolist() == [0, 64, 192]
    assert chunks.tolist() == [[0, 0], [1, 0], [1, 1], [2, 0], [3, 0], [4, 0]]
    assert prefix_chunks.tolist() == [[0, 0], [1, 0], [1, 1]]
    assert initial.tolist() == [1, 1, 0, 0, 2]  # prefix 1 (request 0), zero state (request 1), prefix 2 (request 2)
    # Attention per request: its prefix rows, then its continuations' rows, padded with -1 to the longest (139 rows).
    own = [list(range(0, 64)) + list(range(192, 267)), list(range(267, 271)), list(range(64, 192)) + list(range(271, 273))]
    assert attention_rows.tolist() == [rows + [-1] * (139 - len(rows)) for rows in own]
    assert all(slots[r].item() == g * 139 + i for g, rows in enumerate(own) for i, r in enumerate(rows)) and len(slots) == R
    for r, col in enumerate(expected_conv_taps(groups, K)):
        for j, want in enumerate(col):
            got = taps[j, r].item()
            assert (got < K - 1) if want == "zero" else got == want, (r, j, got, want)


def test_several_requests_in_one_plan(setup, long_image_request, short_request):
    """Each request's rows (tokens and M-RoPE positions) and head rows in a combined plan, as in its
    own plan; the rows in one order (longest prefix first; short states, with no prefix, last and in
    one attention group), the head rows and image features in the requests' own order."""
    compiler, config = setup
    text_long = dict(short_request, state=" ".join(["a second and much longer account of the same order"] * 9))
    requests = [compiler.compile(r) for r in (short_request, long_image_request, short_request, text_long)]
    plan = one_pass.build(requests, config)
    inputs = plan.inputs
    state_ids, suffix_ids, source, rows_pos, visual_index, head = (inputs.state_ids, inputs.suffix_ids, inputs.source, inputs.rows_pos,
                                                                  inputs.visual_index, inputs.head_index)
    P, cut, T, C, n_visual, N, n, NT, L, S, prefix_lengths = plan.shape
    cuts = [(len(c.state.input_ids) // CHUNK) * CHUNK for c in requests]
    assert cuts[0] == cuts[2] == 0 and 0 < cuts[1] < cuts[3]  # so the row order differs from the requests'
    row_order = [3, 1, 0, 2]
    assert prefix_lengths == (cuts[3], cuts[1], 0) and cut == cuts[1] + cuts[3]
    assert P == bucket(sum(len(c.state.input_ids) for c in requests)) and inputs.layout.cu_seqlens.tolist()[-1] == T and bucket(cut + T) == cut + T
    assert inputs.layout.attention_rows.shape == (3, L) and L == bucket(L)  # attention rows per group: two prefixes, the short states
    assert plan.branches_per_request == [sum(len(q.branches) for q in c.questions) for c in requests]
    types = [t for i in row_order for t in requests[i].state.mm_token_type_ids]  # image features land on the image tokens of [all states]
    assert n_visual == len(visual_index) > 0 and visual_index.tolist() == [i for i, t in enumerate(types) if t == 1]
    row_ids = torch.cat([state_ids[0], suffix_ids])[source].tolist()
    # The combined head rows, request by request in the requests' order, as each request's own plan would read them.
    k_cand, k_branch = 0, 0
    for compiled, n_branches in zip(requests, plan.branches_per_request):
        n_cand = sum(len(br.candidate_positions) for q in compiled.questions for br in q.branches)
        own = torch.cat([head[k_cand : k_cand + n_cand], head[C + k_branch : C + k_branch + n_branches],
                         head[C + N + k_cand : C + N + k_cand + n_cand] - k_branch])
        assert_head_reads(own, n_cand, n_branches, compiled, config, row_ids, rows_pos[:, 0])
        k_cand, k_branch = k_cand + n_cand, k_branch + n_branches
    # The prefixes lead, each its own request's first `cut` tokens and positions.
    row = 0
    for compiled in (requests[3], requests[1]):
        c = (len(compiled.state.input_ids) // CHUNK) * CHUNK
        full_pos, _ = rope_index(compiled.state.input_ids, compiled.state.mm_token_type_ids, compiled.state.image_grid_thw,
                                 config.vision_config.spatial_merge_size)
        assert row_ids[row : row + c] == compiled.state.input_ids[:c] and torch.equal(rows_pos[:, 0, row : row + c], full_pos[:, :c])
        row += c
    # The same requests in another order: the same shape (one CUDA graph), the same rows.
    shuffled = one_pass.build([requests[i] for i in (2, 3, 0, 1)], config)
    assert shuffled.shape == plan.shape and torch.equal(shuffled.inputs.source, source) and torch.equal(shuffled.inputs.layout.attention_rows,
                                                                                                      inputs.layout.attention_rows)



def test_a_batch_pads_into_a_shape_up_to_its_own_rung_bound(setup, long_image_request, short_request):
    """A combined plan may run in a captured shape up to `BATCH_RUNGS` rungs of rows above its own
    (its batch-mates vary its sizes), one request in one rung only; beyond that, or with other
    prefixes, neither. Padded, every real row reads as in the unbucketed plan."""
    compiler, config = setup
    batch = [compiler.compile(r) for r in (short_request, long_image_request, variant(short_request, 3, True))]
    plan = one_pass.build(batch, config)
    own = plan.shape
    rungs = [own.cut + own.T]
    for _ in range(one_pass.BATCH_RUNGS + 1):
        rungs.append(bucket(rungs[-1] + 1))
    for k, rows in enumerate(rungs[2:], start=2):
        grown = one_pass.grow(batch, config, own, T=rows - own.cut, n=bucket(own.n + k))
        assert grown is not None
        padded = one_pass.pad_into(batch, config, plan, grown.shape)
        assert (padded is not None) == (k <= one_pass.BATCH_RUNGS), k
        if padded is not None:
            assert padded.shape == grown.shape
            assert_real_rows_as_plain(padded, one_pass.build(batch, config, buckets=False))
    alone = [batch[1]]
    alone_plan = one_pass.build(alone, config)
    alone_own = alone_plan.shape
    two_rungs = one_pass.grow(alone, config, alone_own, T=bucket(bucket(alone_own.cut + alone_own.T + 1) + 1) - alone_own.cut, n=bucket(alone_own.n + 2))
    assert two_rungs is not None and one_pass.pad_into(alone, config, alone_plan, two_rungs.shape) is None  # two rungs: too far alone
    other_prefixes = one_pass.build([batch[0], batch[2]], config).shape
    assert one_pass.pad_into(batch, config, plan, other_prefixes) is None


def test_short_states_share_attention_groups_of_bounded_rows(setup, short_request, monkeypatch):
    """Requests without a prefix share attention groups, each at most MERGED_ROWS rows unless one
    request alone is longer; the groups, and so the shape, are the same in any order."""
    compiler, config = setup
    monkeypatch.setattr(one_pass, "MERGED_ROWS", 700)
    compiled = [compiler.compile(variant(short_request, words, extra)) for words, extra in ((0, False), (9, True), (3, False), (20, True), (1, False))]
    plan = one_pass.build(compiled, config)
    rows = one_pass.build(compiled, config, buckets=False).inputs.layout.attention_rows
    per_group = (rows >= 0).sum(1).tolist()
    assert set(plan.shape.prefixes) == {0} and 1 < len(plan.shape.prefixes) < len(compiled)
    own = sorted(sum(len(c.state.input_ids) + len(br.suffix_ids) for q in c.questions for br in q.branches) for c in compiled)
    assert all(n <= 700 or n == own[-1] for n in per_group) and sum(own) <= sum(per_group) < sum(own) + 8  # one pad sequence rounds to 8
    for order in ([4, 3, 2, 1, 0], [2, 0, 4, 1, 3]):
        assert one_pass.build([compiled[i] for i in order], config).shape == plan.shape

@pytest.mark.parametrize("prefix_layout", ["one-pass", "batch"])
def test_a_state_under_one_chunk_runs_as_rows(setup, short_request, prefix_layout):
    """Nothing to share: every branch one row of state + suffix (pads after), rows, length and
    candidates on rungs, pad branches the state again; an image's tokens indexed in every row."""
    from .conftest import png_data_url

    compiler, config = setup
    # The fixture's processor resizes images to at least 64 tokens; a lower minimum (a media
    # setting) gives an image state under one chunk.
    small = Compiler(compiler.tokenizer, compiler.image_config, media_kwargs={"min_pixels": 1024, "max_pixels": 4096})
    for image, (by, request) in enumerate(((compiler, short_request), (small, dict(short_request, state={"image": png_data_url(40, 24)})))):
        compiled = by.compile(request)
        P = len(compiled.state.input_ids)
        assert P < CHUNK and (sum(compiled.state.mm_token_type_ids) > 0) == bool(image)
        plan = choose(compiled, config, prefix_layout)
        row_ids, rows_pos, visual_index = plan.inputs.row_ids, plan.inputs.rows_pos, plan.inputs.visual_index
        N, L, C, n_visual = plan.shape
        branches = sum(len(q.branches) for q in compiled.questions)
        assert plan.kind == "rows" and plan.key == ("rows", N, L, C, n_visual) and L % 32 == 0 and bucket(L // 32) == L // 32 and N == bucket(branches) and C == bucket(C)
        assert row_ids.shape == (N, L) and rows_pos.shape == (3, N, L) and n_visual == sum(compiled.state.mm_token_type_ids)
        assert (row_ids[:, :P] == torch.tensor(compiled.state.input_ids)).all()  # pad branches hold the state too
        assert visual_index.tolist() == [k * L + i for k in range(N) for i, t in enumerate(compiled.state.mm_token_type_ids) if t == 1]
        assert_head_rows_read_the_readout_tokens(plan, compiled, config, row_ids.reshape(-1).tolist(), rows_pos.reshape(3, -1))


@pytest.mark.parametrize("prefix_layout", ["one-pass", "batch"])
def test_upload_returns_the_named_inputs(setup, long_image_request, short_request, prefix_layout):
    from valen_runtime.layouts.common import leaves

    compiler, config = setup
    for request in (long_image_request, short_request):
        plan = choose(compiler.compile(request), config, prefix_layout)
        got = plan.upload(torch.device("cpu"))
        assert type(got) is type(plan.inputs) and got.features is None
        if plan.kind == "one-pass":
            assert type(got.layout) is type(plan.inputs.layout)
        pairs = list(zip(leaves(got), leaves(plan.inputs)))
        assert len(pairs) == len(list(leaves(plan.inputs))) > 0
        for g, w in pairs:
            assert torch.equal(g, w) and g.shape == w.shape


# ---- shape buckets ---------------------------------------------------------------------------

from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from valen_runtime.layouts import pad_head_rows, pad_sequences  # noqa: E402


def test_the_ladder_has_eight_rungs_per_doubling():
    assert [bucket(n) for n in range(1, 18)] == list(range(1, 17)) + [18]
    for e in range(4, 14):
        rungs = {bucket(n) for n in range(2**e + 1, 2 ** (e + 1) + 1)}
        assert len(rungs) == 8 and max(rungs) == 2 ** (e + 1), e


@given(st.integers(min_value=0, max_value=10**6))
def test_a_rung_is_the_least_at_most_an_eighth_above(n):
    b = bucket(n)
    assert n <= b <= max(16, n * 9 // 8 + 1) and bucket(b) == b
    assert all(bucket(m) != m for m in range(n, b))  # no rung skipped


def chunks(length: int) -> int:
    return -(-length // CHUNK)


@given(st.lists(st.integers(min_value=1, max_value=400), min_size=1, max_size=80), st.integers(0, 40).map(lambda c: 64 * c))
def test_pad_sequences_bring_rows_sequences_and_chunks_onto_rungs(lengths, prefix_rows):
    pads = pad_sequences(lengths, prefix_rows)
    every = lengths + pads
    assert pads and all(n >= 1 for n in pads)
    for total in (prefix_rows + sum(every), len(every), sum(chunks(n) for n in every)):
        assert bucket(total) == total, (lengths, prefix_rows, pads)
    # Bounded growth: a rung is at most 1/8 above its value, and every chunk the chunk rung adds
    # beyond one per pad sequence costs 64 rows; twice that envelope, with a sequence rung's worth,
    # holds with room to spare (its worst ratio over 100k random and extreme inputs was 0.58).
    R, NT, n = prefix_rows + sum(lengths), sum(chunks(x) for x in lengths), len(lengths)
    assert sum(pads) <= R // 4 + 64 * (NT // 4 + 1) + n // 4 + 64, (lengths, prefix_rows, pads)


def test_pad_sequences_cost_where_the_chunk_rung_sets_it():
    # Many continuations under a chunk with one over it: the chunk rung, not the row rung, sets the cost.
    pads = pad_sequences([20] * 40 + [70])
    assert 870 * 9 // 8 < 870 + sum(pads) <= 870 * 4 // 3


def test_pad_sequences_for_many_short_continuations_and_one_long():
    # A case an earlier, narrower search could not fit (59 one-row sequences and one of 66 rows).
    for lengths in ([1] * 59 + [66], [1] * 127, [64] * 33, [65] * 15, [1] * 1925 + [65]):
        every = lengths + pad_sequences(lengths)
        assert all(bucket(t) == t for t in (sum(every), len(every), sum(chunks(n) for n in every))), lengths


def test_pad_head_rows_keep_the_real_rows_first():
    head = torch.tensor([5, 6, 7, 100, 101, 0, 0, 1])  # C = 3 candidates, N = 2 branches
    padded, C, N = pad_head_rows(head, 3, 2)
    assert (C, N) == (3, 2) and torch.equal(padded, head)  # already on rungs
    head = torch.arange(1, 36)  # C = 17, N = 1
    padded, C, N = pad_head_rows(head, 17, 1)
    assert (C, N) == (18, 1) and padded[:17].tolist() == head[:17].tolist() and padded[18] == head[17]
    assert padded[19:36].tolist() == head[18:].tolist() and padded[17] == 0 and padded[36] == 0


def variant(request: dict, words: int, extra_question: bool) -> dict:
    """`request` with its first question's instructions `words` words longer, and maybe a second question."""
    questions = {k: dict(v) for k, v in request["questions"].items()}
    first = next(iter(questions))
    questions[first]["instructions"] = questions[first]["instructions"] + " please" * words
    if extra_question:
        questions["extra"] = dict(questions[first], instructions="Is this " + "really " * words + "so?")
    return dict(request, questions=questions)


@given(st.lists(st.tuples(st.sampled_from(["image", "text", "short"]), st.integers(0, 40), st.booleans()), min_size=1, max_size=4))
def test_bucketed_plans_read_every_real_row_as_the_unbucketed_plan(setup, long_image_request, short_request, shapes):
    """Random requests, alone or several in one plan: every size on a rung, and each real row holds
    the token and position the plan without buckets gives it; pad rows are read by no real row; the
    requests in the reverse order have the same shape (one graph)."""
    compiler, config = setup
    compiled = [compiler.compile(variant(base_requests(long_image_request, short_request)[kind], words, extra)) for kind, words, extra in shapes]
    padded, plain = one_pass.build(compiled, config), one_pass.build(compiled, config, buckets=False)
    assert one_pass.build(compiled[::-1], config).shape == padded.shape
    P, cut, T, C, n_visual, N, n, NT, L, S, prefixes = padded.shape
    assert all(bucket(x) == x for x in (P, cut + T, C, N, n, NT, S)) and (cut, n_visual, prefixes) == (plain.shape.cut, plain.shape.n_visual, plain.shape.prefixes)
    assert L == (bucket(L) if len(compiled) > 1 else cut + T)  # alone, attention runs over the whole row
    assert_real_rows_as_plain(padded, plain)


def base_requests(long_image_request, short_request) -> dict:
    return {"image": long_image_request, "short": short_request,
            "text": dict(short_request, state=" ".join(["an account of the order and its two charges"] * 7))}


def assert_real_rows_as_plain(padded, plain) -> None:
    """Each real row of the one-pass plan `padded` holds the token, position, sequence and offset
    of the unpadded `plain` plan's; the head reads the same rows; no real row attends to a pad."""
    P, cut, T, C, n_visual, N, n, NT, L, S, prefixes = padded.shape

    def rows(plan):  # per row: (token, positions, sequence, offset)
        x = plan.inputs
        return torch.cat([x.state_ids[0], x.suffix_ids])[x.source], x.rows_pos[:, 0], x.layout.seq_ids, x.layout.offsets

    tokens, positions, seqs, offsets = rows(padded)
    want_tokens, want_positions, want_seqs, want_offsets = rows(plain)
    n_real = sum(padded.branches_per_request)  # real continuations come first, pads after them
    is_real = (seqs < n_real)  # prefixes (negative ids) and real continuations
    real_rows = torch.nonzero(is_real).view(-1)
    plain_real = torch.nonzero(want_seqs < n_real).view(-1)
    assert torch.equal(tokens[real_rows], want_tokens[plain_real]) and torch.equal(positions[:, real_rows], want_positions[:, plain_real])
    assert torch.equal(seqs[real_rows], want_seqs[plain_real]) and torch.equal(offsets[real_rows], want_offsets[plain_real])
    assert torch.equal(real_rows, plain_real)  # pads only after every real row
    # The head reads the same rows; its pad entries follow the real ones.
    C_real, N_real = sum(plain.candidates_per_branch), n_real
    head, want = padded.inputs.head_index, plain.inputs.head_index
    assert torch.equal(head[:C_real], want[:C_real]) and torch.equal(head[C : C + N_real], want[C_real : C_real + N_real])
    assert torch.equal(head[C + N : C + N + C_real], want[C_real + N_real :])
    # Attention: no real row sees a pad row (its mask row is -inf at every pad column).
    from valen_runtime.layouts.one_pass import one_pass_mask

    layout = padded.inputs.layout
    mask = one_pass_mask(layout, torch.float32, torch.device("cpu"))[:, 0]  # [m, L, L]
    attention_rows = layout.attention_rows
    pad_slot = (attention_rows < 0) | ~is_real[attention_rows.clamp(min=0)]
    real_slot = ~pad_slot
    seen = mask == 0
    assert not (seen & real_slot[:, :, None] & pad_slot[:, None, :]).any()


# ---- graph shapes: padding into a captured shape, and headroom -----------------------------

from valen_runtime.layouts import graph_plan, rows  # noqa: E402
from valen_runtime.layouts.ladder import fit_sequences  # noqa: E402


@functools.lru_cache(maxsize=None)
def pads_exist(k: int, rows_left: int, chunks_left: int) -> bool:
    """Brute force: can k sequences of at least one row each hold exactly these rows and chunks?"""
    if k == 0:
        return rows_left == 0 and chunks_left == 0
    return any(pads_exist(k - 1, rows_left - n, chunks_left - chunks(n)) for n in range(1, rows_left + 1) if chunks(n) <= chunks_left)


@given(st.lists(st.integers(1, 200), min_size=1, max_size=6), st.integers(0, 140), st.integers(0, 4), st.integers(0, 5))
def test_fit_sequences_hits_the_sizes_exactly_or_says_none(lengths, extra_rows, extra_sequences, extra_chunks):
    """Pads bringing continuations to exactly (rows, sequences, chunks), each pad at least one row;
    None exactly when no such pads exist (brute force)."""
    rows_, seqs, n_chunks = sum(lengths) + extra_rows, len(lengths) + extra_sequences, sum(chunks(x) for x in lengths) + extra_chunks
    pads = fit_sequences(lengths, rows_, seqs, n_chunks)
    exists = extra_sequences >= 1 and pads_exist(extra_sequences, extra_rows, extra_chunks)
    assert (pads is not None) == exists, (lengths, extra_rows, extra_sequences, extra_chunks, pads)
    if pads is not None:
        assert len(pads) == extra_sequences and min(pads) >= 1 and sum(pads) == extra_rows and sum(chunks(x) for x in pads) == extra_chunks


@given(st.sampled_from(["image", "text"]), st.integers(0, 40), st.integers(1, 30), st.booleans())
def test_a_headroom_plan_holds_its_request_and_longer_neighbours_as_the_unbucketed_plan(setup, long_image_request, short_request,
                                                                                        kind, words, more, extra):
    """One-pass: the headroom plan of a request, and a request a few words longer padded into that
    plan's shape when it fits (`pad_into`), read every real row as their unbucketed plans; the
    headroom is one rung of rows and one more sequence, and a plan padded into a shape has it exactly."""
    compiler, config = setup
    base = base_requests(long_image_request, short_request)[kind]
    compiled = [compiler.compile(variant(base, words, extra))]
    plan = one_pass.build(compiled, config)
    grown = one_pass.with_headroom(compiled, config, plan)
    own, big = plan.shape, grown.shape
    assert big.cut + big.T == bucket(own.cut + own.T + 1) and big.n == bucket(own.n + 1) and big.NT >= own.NT
    assert_real_rows_as_plain(grown, one_pass.build(compiled, config, buckets=False))
    assert one_pass.pad_into(compiled, config, plan, big).shape == big  # it holds itself
    longer = [compiler.compile(variant(base, words + more, extra))]
    longer_plan = one_pass.build(longer, config)
    padded = one_pass.pad_into(longer, config, longer_plan, big)
    if padded is not None:
        assert padded.shape == big and longer_plan.shape.cut + longer_plan.shape.T <= big.cut + big.T
        assert_real_rows_as_plain(padded, one_pass.build(longer, config, buckets=False))
    # Never into a shape more than one rung of rows above its own (two rungs: one that holds it), nor
    # into one with other prefixes or images
    two_rungs = one_pass.grow(compiled, config, big, T=bucket(big.cut + big.T + 1) - big.cut, n=big.n)
    assert two_rungs is not None and one_pass.pad_into(compiled, config, plan, two_rungs.shape) is None
    assert one_pass.pad_into(compiled, config, plan, big._replace(T=bucket(bucket(big.cut + big.T + 1) + 1) - big.cut)) is None
    assert one_pass.build(compiled, config, into=big._replace(n_visual=big.n_visual + 1)) is None


def test_rows_pad_into_longer_rows_within_two_rungs(setup, short_request):
    """Rows: a short state's request runs in a captured shape with the same branches and candidates
    and rows up to two rungs longer; real tokens and positions are the unpadded ones, head rows
    follow them."""
    compiler, config = setup
    compiled = compiler.compile(short_request)
    plan = rows.build(compiled, config)
    grown = rows.with_headroom([compiled], config, plan)
    assert grown.shape._replace(L=plan.shape.L) == plan.shape and grown.shape.L > plan.shape.L
    N, L = plan.shape.N, plan.shape.L
    x, y = plan.inputs, grown.inputs
    assert torch.equal(y.row_ids[:, :L], x.row_ids) and torch.equal(y.rows_pos[:, :, :L], x.rows_pos)
    # head rows index the flattened [N * L]: the same (row, column) in the longer rows
    C = plan.shape.C
    assert torch.equal(y.head_index[: C + N] // grown.shape.L, x.head_index[: C + N] // L)
    assert torch.equal(y.head_index[: C + N] % grown.shape.L, x.head_index[: C + N] % L)
    assert rows.pad_into([compiled], config, plan, grown.shape).shape == grown.shape
    too_long = grown.shape._replace(L=32 * bucket(grown.shape.L // 32 + 1))
    assert rows.pad_into([compiled], config, plan, too_long) is None
    assert rows.pad_into([compiled], config, plan, grown.shape._replace(C=plan.shape.C + 1)) is None


def test_graph_plan_takes_the_own_key_then_the_cheapest_captured_holder_then_headroom(setup, long_image_request):
    compiler, config = setup
    compiled = [compiler.compile(long_image_request)]
    plan = one_pass.build(compiled, config)
    grown = one_pass.with_headroom(compiled, config, plan)
    assert graph_plan(compiled, config, plan, []).key == grown.key  # nothing captured: headroom
    assert graph_plan(compiled, config, plan, [plan.key, grown.key]) is plan  # its own key
    assert graph_plan(compiled, config, plan, [("rows", 1, 64, 2, 0), grown.key]).key == grown.key  # a holder of its layout
    longer = [compiler.compile(variant(long_image_request, 30, True))]
    far = one_pass.with_headroom(longer, config, one_pass.build(longer, config))
    assert graph_plan(compiled, config, plan, [far.key, grown.key]).key == grown.key  # one that does not hold it is passed over


def test_graph_plan_tries_the_captured_holders_cheapest_first(setup, long_image_request, monkeypatch):
    """Of several captured shapes of the request's layout, the one sweeping the fewest rows is
    tried first, whatever the order of capture (pad_into replaced by one that takes any shape)."""
    compiler, config = setup
    compiled = [compiler.compile(long_image_request)]
    plan = one_pass.build(compiled, config)
    tried = []

    def takes_any(requests, config_, plan_, shape):
        tried.append(shape)
        return ("padded into", shape)

    monkeypatch.setattr(one_pass, "pad_into", takes_any)
    own = plan.shape
    cheap, costly = own._replace(T=own.T + 32), own._replace(T=own.T + 64)
    assert graph_plan(compiled, config, plan, [("one-pass", *costly), ("rows", 1, 64, 2, 0), ("one-pass", *cheap)]) == ("padded into", cheap)
    assert tried == [cheap]
