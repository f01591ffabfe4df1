"""valen_runtime.plan: the shared-prefix layouts' host-side indices, checked against the compiled
request they come from (which token and which M-RoPE position each row holds, which rows the head
reads), without running a model."""

from __future__ import annotations

import pytest
import torch

from valen_runtime.config import ModelConfig
from valen_runtime.plan import CHUNK, plan_shared_prefix
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
    P, cut = plan.sizes[:2]
    head = plan.parts[5]
    branches = branch_sequences(compiled, config)
    C, N = sum(plan.candidates_per_branch), len(branches)
    cand, dec, owner = head[:C], head[C : C + N], head[C + N :]
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
    plan = plan_shared_prefix(compiled, config, one_pass=False)
    state_ids, prefix_pos, suffix_ids, rows_pos, image_index, _ = plan.parts
    P, cut, N, L, C, n_img = plan.sizes
    assert plan.kind == "batch" and cut == (P // CHUNK) * CHUNK > 0 and L % 8 == 0
    assert n_img == sum(compiled.state.mm_token_type_ids) == len(image_index)
    full_pos, _ = rope_index(compiled.state.input_ids, compiled.state.mm_token_type_ids, compiled.state.image_grid_thw,
                             config.vision_config.spatial_merge_size)
    assert torch.equal(prefix_pos[:, 0], full_pos[:, :cut])
    rows = torch.cat([state_ids[:, cut:].expand(N, -1), suffix_ids], dim=1)  # [N, L]: state tail | suffix | padding
    assert_head_rows_read_the_readout_tokens(plan, compiled, config, rows.reshape(-1).tolist(), rows_pos.reshape(3, -1))


def test_one_pass_layout_rows(setup, long_image_request):
    compiler, config = setup
    compiled = compiler.compile(long_image_request)
    plan = plan_shared_prefix(compiled, config, one_pass=True)
    state_ids, suffix_ids, source, rows_pos, _, _, seq_ids, offsets, taps, cu_seqlens, chunk_indices, prefix_rows = plan.parts
    P, cut, T, C, n_img, N, seq_lengths = plan.sizes
    assert plan.kind == "one-pass" and cut > 0 and T % 8 == 0 and sum(seq_lengths) == T
    assert len(prefix_rows) == cut and rows_pos.shape == (3, 1, cut + T) and taps.shape[1] == cut + T
    assert cu_seqlens.tolist()[-1] == T and len(seq_lengths) in (N, N + 1)  # one pad sequence at most
    row_ids = torch.cat([state_ids[0], suffix_ids])[source].tolist()  # the token of every row
    assert row_ids[:cut] == compiled.state.input_ids[:cut] and (seq_ids[:cut] == -1).all()
    assert_head_rows_read_the_readout_tokens(plan, compiled, config, row_ids, rows_pos[:, 0])
    # Every 64-token chunk of every continuation, in order.
    assert chunk_indices.tolist() == [[i, c] for i, n in enumerate(seq_lengths) for c in range(-(-n // CHUNK))]
    assert offsets[cut:].tolist() == [o for n in seq_lengths for o in range(n)]


def test_a_state_without_a_chunk_aligned_prefix_runs_the_batch_layout(setup, short_request):
    compiler, config = setup
    compiled = compiler.compile(short_request)
    assert len(compiled.state.input_ids) < CHUNK
    plan = plan_shared_prefix(compiled, config, one_pass=True)
    assert plan.kind == "batch" and plan.sizes[1] == 0  # no prefix to share: the branches from position 0
    _, _, suffix_ids, rows_pos, _, _ = plan.parts
    state_ids = plan.parts[0]
    N = plan.sizes[2]
    rows = torch.cat([state_ids.expand(N, -1), suffix_ids], dim=1)
    assert_head_rows_read_the_readout_tokens(plan, compiled, config, rows.reshape(-1).tolist(), rows_pos.reshape(3, -1))


def test_upload_returns_the_parts_in_order(setup, long_image_request):
    compiler, config = setup
    plan = plan_shared_prefix(compiler.compile(long_image_request), config, one_pass=True)
    for got, want in zip(plan.upload(torch.device("cpu")), plan.parts):
        assert torch.equal(got, want) and got.shape == want.shape
