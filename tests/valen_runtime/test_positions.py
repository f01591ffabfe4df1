"""valen_runtime.positions.rope_index against transformers 5.4.0's Qwen3_5Model.get_rope_index."""

import json
from types import SimpleNamespace

import pytest
import torch

from valen_runtime.positions import rope_index

IMG, VID = 12, 13  # image and video token ids in these tests (only mm_token_type_ids matters)
STAMP = 9  # text tokens before each frame pair: a timestamp, vision_start (vision_end comes after)


def sequence(parts, merge=2, with_videos=False):
    """parts: ints (a run of text tokens), (t, h, w) image grids or ("video", t, h, w) video grids
    (each frame pair a run of pads between STAMP text tokens and one more) -> ids, types, image
    grids (and video grids when with_videos)."""
    ids, types, grids, video_grids = [], [], [], []
    for part in parts:
        if isinstance(part, int):
            ids += [100 + i for i in range(part)]
            types += [0] * part
        elif part[0] == "video":
            t, h, w = part[1:]
            for _ in range(t):
                n = (h // merge) * (w // merge)
                ids += [200 + i for i in range(STAMP)] + [VID] * n + [201]
                types += [0] * STAMP + [2] * n + [0]
            video_grids.append([t, h, w])
        else:
            t, h, w = part
            n = t * (h // merge) * (w // merge)
            ids += [IMG] * n
            types += [1] * n
            grids.append(list(part))
    grids_t = torch.tensor(grids, dtype=torch.long) if grids else None
    if with_videos:
        return torch.tensor(ids), torch.tensor(types), grids_t, torch.tensor(video_grids, dtype=torch.long) if video_grids else None
    return torch.tensor(ids), torch.tensor(types), grids_t


CASES = {
    "text only": [37],
    "image at start": [(1, 4, 4), 9],
    "image in the middle": [5, (1, 6, 10), 12],
    "two images": [3, (1, 8, 4), 2, (1, 2, 14), 6],
    "odd merged grids": [1, (1, 10, 6), 1, (1, 6, 6), 1, (1, 2, 2), 4],
    "image at the end": [7, (1, 14, 2)],
}


def hf_rope_index(ids, types, grids, merge, video_grids=None):
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf
    # get_rope_index reads only config.vision_config.spatial_merge_size and get_vision_position_ids.
    fake = SimpleNamespace(
        config=SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=merge)),
        get_vision_position_ids=lambda *a, **k: hf.Qwen3_5Model.get_vision_position_ids(None, *a, **k),
    )
    return hf.Qwen3_5Model.get_rope_index(fake, ids[None], types[None], image_grid_thw=grids, video_grid_thw=video_grids)


@pytest.mark.parametrize("name", list(CASES))
def test_matches_transformers_get_rope_index(name):
    ids, types, grids = sequence(CASES[name])
    ref_pos, ref_delta = hf_rope_index(ids, types, grids, merge=2)
    pos, next_position = rope_index(ids, types, grids, spatial_merge_size=2)
    assert pos.dtype == torch.int64 and pos.shape == (3, len(ids))
    assert torch.equal(pos, ref_pos[:, 0])
    assert next_position - len(ids) == int(ref_delta)


VIDEO_CASES = {
    "one pair": [5, ("video", 1, 4, 4), 3],
    "three pairs (a 3 s 64x48 clip)": [3, ("video", 3, 4, 4), 6],
    "ten pairs, non-square": [4, ("video", 10, 16, 20), 2],
    "video at the start, taller than wide": [("video", 2, 12, 4), 7],
    "image then two videos": [2, (1, 6, 10), 3, ("video", 3, 4, 6), 1, ("video", 2, 8, 2), 5],
    "video then image": [1, ("video", 4, 2, 2), (1, 4, 4), 2],
}


@pytest.mark.parametrize("name", list(VIDEO_CASES))
def test_video_runs_match_transformers_get_rope_index(name):
    ids, types, grids, video_grids = sequence(VIDEO_CASES[name], with_videos=True)
    ref_pos, ref_delta = hf_rope_index(ids, types, grids, 2, video_grids.clone())
    pos, next_position = rope_index(ids, types, grids, 2, video_grid_thw=video_grids)
    assert pos.shape == (3, len(ids))
    assert torch.equal(pos, ref_pos[:, 0])
    assert next_position - len(ids) == int(ref_delta)


def test_video_worked_example():
    """docs/runtime.md: 3 text tokens, then the 3 s 64x48 clip (3 pairs of 2 x 2 merged tokens):
    pair 1 starts at 3 + STAMP = 12, its pads hold (12, 12..13, 12..13), vision_end is 14."""
    ids, types, _, video_grids = sequence([3, ("video", 3, 4, 4), 2], with_videos=True)
    pos, next_position = rope_index(ids, types, None, 2, video_grid_thw=video_grids)
    first_pad = 3 + STAMP
    assert pos[:, first_pad:first_pad + 4].tolist() == [[12] * 4, [12, 12, 13, 13], [12, 13, 12, 13]]
    assert pos[:, first_pad + 4].tolist() == [14] * 3  # vision_end: 12 + max(2, 2)
    assert next_position == len(ids) - 3 * 2  # each pair's 4 pads take 2 positions


def test_video_suffix_continues_from_start():
    ids, types, _, video_grids = sequence([3, ("video", 3, 4, 6), 20], with_videos=True)
    full, end = rope_index(ids, types, None, 2, video_grid_thw=video_grids)
    cut = len(ids) - 20
    prefix, start = rope_index(ids[:cut], types[:cut], None, 2, video_grid_thw=video_grids)
    suffix, end2 = rope_index(ids[cut:], types[cut:], None, 2, start=start)
    assert torch.equal(torch.cat([prefix, suffix], dim=1), full) and end2 == end


def test_accepts_lists_and_merge_size_4():
    ids, types, grids = sequence([2, (1, 8, 12), 3], merge=4)
    ref_pos, _ = hf_rope_index(ids, types, grids, merge=4)
    pos, _ = rope_index(ids.tolist(), types.tolist(), grids.tolist(), spatial_merge_size=4)
    assert torch.equal(pos, ref_pos[:, 0])


def test_worked_example_from_spec():
    """docs/numerics.md: 4 text, a 28 x 28 patch grid (196 tokens), vision_end, 42 text -> last position 60."""
    ids, types, grids = sequence([4, (1, 28, 28), 43])
    pos, next_position = rope_index(ids, types, grids, spatial_merge_size=2)
    assert len(ids) == 243 and next_position == 61 and next_position - len(ids) == -182
    assert pos[:, 4].tolist() == [4, 4, 4] and pos[:, 199].tolist() == [4, 17, 17] and pos[:, 200].tolist() == [18] * 3


def test_suffix_continues_from_start():
    ids, types, grids = sequence([3, (1, 6, 10), 5, 20])
    full, end = rope_index(ids, types, grids, 2)
    cut = 3 + 15 + 5
    prefix, start = rope_index(ids[:cut], types[:cut], grids, 2)
    suffix, end2 = rope_index(ids[cut:], types[cut:], None, 2, start=start)
    assert torch.equal(torch.cat([prefix, suffix], dim=1), full) and end2 == end


def test_empty_sequence():
    pos, nxt = rope_index([], [], None, 2, start=5)
    assert pos.shape == (3, 0) and nxt == 5


@pytest.mark.parametrize(
    "types, grids, phrase",
    [
        ([0, 2, 2, 0], None, "video run at token 1 has no video_grid_thw row"),
        ([0, 1, 1, 1, 0], [[1, 4, 4]], "gives 4"),
        ([0, 1, 1, 1, 1], None, "no image_grid_thw row"),
        ([0, 0], [[1, 4, 4]], "fewer image runs"),
        ([0, 3], None, "expected 0, 1 or 2"),
    ],
)
def test_refusals(types, grids, phrase):
    with pytest.raises(ValueError, match=phrase):
        rope_index(list(range(len(types))), types, grids, 2)


@pytest.mark.parametrize(
    "types, video_grids, phrase",
    [
        # A video's frame pair has h/2 * w/2 tokens: a run of 3 for a 4 x 4 grid is refused.
        ([0, 2, 2, 2, 0], [[1, 4, 4]], "video run at token 1 has 3 tokens"),
        # Two pairs in the grid, one run in the sequence.
        ([0, 2, 2, 2, 2, 0], [[2, 4, 4]], "2 frame pairs but the sequence has fewer video runs"),
        # One pair in the grid, two runs in the sequence.
        ([2, 2, 2, 2, 0, 2, 2, 2, 2], [[1, 4, 4]], "video run at token 5 has no video_grid_thw row left"),
        # Video rows never serve image runs.
        ([0, 1, 1, 1, 1], [[1, 4, 4]], "image run at token 1 has no image_grid_thw row"),
    ],
)
def test_video_refusals(types, video_grids, phrase):
    with pytest.raises(ValueError, match=phrase):
        rope_index(list(range(len(types))), types, None, 2, video_grid_thw=video_grids)


def test_length_mismatch_is_refused():
    with pytest.raises(ValueError, match="entries for"):
        rope_index([1, 2, 3], [0, 0], None, 2)


# ---------------------------------------------------------------- the rotary tables these positions drive


def _rotary_pair(text: dict):
    """(runtime TextRotaryEmbedding, transformers' Qwen3_5TextRotaryEmbedding) for one text config."""
    hf = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    from valen_runtime.config import TextConfig
    from valen_runtime.qwen35 import TextRotaryEmbedding

    cfg, _, _ = TextConfig.from_dict(dict(text, model_type="qwen3_5_text"))
    return TextRotaryEmbedding(cfg), hf.Qwen3_5TextRotaryEmbedding(Qwen3_5TextConfig(**text))


def _config_2b() -> dict:
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    return json.loads((root / "manifests" / "qwen3.5-2b.config.json").read_text())["text_config"]


def _config_tiny() -> dict:
    from valen_export.fixture import TINY_TEXT

    return dict(TINY_TEXT, vocab_size=1000)


@pytest.mark.parametrize("config", [_config_2b, _config_tiny], ids=["2b", "tiny fixture"])
def test_rotary_tables_match_transformers_bitwise_and_see_swapped_sections(config):
    text = config()
    t, h, w = text["rope_parameters"]["mrope_section"]
    assert h != w  # unequal height / width sections, or a swap of the two could not show
    runtime, reference = _rotary_pair(text)
    # Two images of merged grids 10 x 6 and 3 x 14 among text: height and width positions part from
    # the temporal one by up to 13 rows / columns, at offsets up to ~1000 (a long state).
    ids, types, grids = sequence([900, (1, 20, 12), 7, (1, 6, 28), 40])
    pos, _ = rope_index(ids, types, grids, spatial_merge_size=2)
    pos = pos[:, None, :]  # [3, 1, T]
    probe = torch.zeros(1, dtype=torch.float32)
    cos, sin = runtime(probe, pos)
    ref_cos, ref_sin = reference(probe, pos)
    assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)
    # The same tables with the height and width sections swapped are not the same tables.
    runtime.mrope_section = (t, w, h)
    swapped_cos, swapped_sin = runtime(probe, pos)
    assert not (torch.equal(swapped_cos, ref_cos) and torch.equal(swapped_sin, ref_sin))
