"""docs/runtime.md's video worked example is what valen_runtime.video computes.

The block between `<!-- video-worked-example -->` and `<!-- /video-worked-example -->` is
regenerated here from a real clip (valen_export.clips), `probe_video`, `plan_video`,
`decode_frames`, `patchify_video`, `encode_prompt` with the repository's synthetic tokenizer and
`rope_index`, and must equal the page's text; on a difference the assertion shows the block to paste.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "runtime.md"
BLOCK = re.compile(r"<!-- video-worked-example -->\n(.*?)<!-- /video-worked-example -->", re.S)
MESSAGES = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "state"}]}]


def worked_example(folder: Path) -> str:
    """The worked example's text: a 3.0 s, 30 fps, 320x240 H.264 clip, step by step."""
    from valen_export.clips import encode_clip
    from valen_runtime.positions import rope_index
    from valen_runtime.tokenizer import Tokenizer
    from valen_runtime.video import VideoConfig, decode_frames, encode_prompt, patchify_video, plan_video, probe_video

    config = VideoConfig.from_file(folder / "video_preprocessor_config.json")
    tokenizer = Tokenizer.from_dir(folder)
    data = encode_clip("mp4", "libx264", 30, 90, 320, 240, noise=8, preset="ultrafast")
    probe = probe_video(data, "mp4", "state.video")
    n, r = probe.frame_count, probe.fps
    plan = plan_video(n, r, probe.height, probe.width, config)
    pixel_values, grid = patchify_video(decode_frames(data, probe, plan, "state.video"), config)
    count = int(n / r * config.fps)
    spread = np.linspace(0, n - 1, len(plan.indices))
    h_bar, w_bar = round(probe.height / config.factor) * config.factor, round(probe.width / config.factor) * config.factor
    t_bar = math.ceil(len(plan.indices) / config.temporal_patch_size) * config.temporal_patch_size
    budget = t_bar * h_bar * w_bar
    within = config.min_pixels <= budget <= config.max_pixels
    pairs = [plan.indices[i:i + 2] if i + 1 < len(plan.indices) else (plan.indices[i], plan.indices[i])
             for i in range(0, len(plan.indices), 2)]
    text = tokenizer.render_chat(MESSAGES)
    ids, types = encode_prompt(tokenizer, text, [plan])
    positions, next_position = rope_index(ids, types, None, config.merge_size, video_grid_thw=[plan.grid_thw])
    specials = {tokenizer.token_id(t): t for t in ("<|vision_start|>", "<|vision_end|>", "<|video_pad|>", "<|im_start|>", "<|im_end|>")}
    start = tokenizer.token_id("<|vision_start|>")
    first_stamp = ids.index(start) - 1
    while first_stamp > 0 and types[first_stamp - 1] == 0 and tokenizer.backend.id_to_token(ids[first_stamp - 1]) not in ("\n", "Ċ"):
        first_stamp -= 1
    pads = [i for i, kind in enumerate(types) if kind == 2]
    per_pair = plan.tokens_per_pair
    end_1 = pads[per_pair - 1] + 1
    merged_w = plan.grid_thw[2] // config.merge_size
    shown = list(range(first_stamp, pads[0] + 2)) + [pads[merged_w - 1], pads[merged_w], pads[per_pair - 1], end_1, end_1 + 1]

    def piece(i: int) -> str:
        token = specials.get(ids[i]) or tokenizer.backend.id_to_token(ids[i])
        return token.replace("Ċ", "\\n").replace("Ġ", " ")

    lines = [
        f"clip      3.0 s of {probe.width}x{probe.height} (W x H) at 30 fps, H.264 in MP4: N = {n} frames, r = {r}",
        f"sampling  int({n} / {r:g} * {config.fps:g}) = {count}; min(max({count}, {config.min_frames}), {config.max_frames}, {n}) = {len(plan.indices)}",
        f"          linspace(0, {n - 1}, {len(plan.indices)}) = {', '.join(f'{v:.1f}' for v in spread)}",
        f"          rounded half to even: {', '.join(map(str, plan.indices))}",
        f"resize    round({probe.height} / {config.factor}) * {config.factor} = {h_bar}, round({probe.width} / {config.factor}) * {config.factor} = {w_bar};"
        f" {t_bar} * {h_bar} * {w_bar} = {budget:,} {'within' if within else 'outside'} [{config.min_pixels:,}, {config.max_pixels:,}]",
        f"          every frame -> {plan.width}x{plan.height} (W x H)",
        f"patches   grid_thw [{', '.join(map(str, grid))}], pixel_values_videos [{pixel_values.shape[0]}, {pixel_values.shape[1]}];"
        f" {per_pair} <|video_pad|> per pair ({plan.grid_thw[1] // 2} x {plan.grid_thw[2] // 2}), {plan.video_tokens} in all",
        "stamps    " + "; ".join(f"({a} + {b}) / 2 / {r:g} = {s:.4g} -> {t}" for (a, b), s, t in zip(pairs, plan.timestamps, plan.stamp_texts())),
        f"prompt    {text!r} -> {len(ids)} tokens: {types.count(2)} pads, "
        f"{len(plan.timestamps)} x (stamp + <|vision_start|> + <|vision_end|>) and the text around them;"
        f" next position {next_position}",
        "",
        "index  token               id  type  position (t, h, w)",
    ]
    previous = None
    for i in shown:
        if previous is not None and i > previous + 1:
            lines.append("  ...")
        lines.append(f"{i:5d}  {piece(i)!r:<18} {ids[i]:3d}  {types[i]:4d}  ({', '.join(str(int(v)) for v in positions[:, i])})")
        previous = i
    return "\n".join(["```text", *lines, "```", ""])


@pytest.fixture(scope="module")
def computed(text_assets) -> str:
    pytest.importorskip("av")
    return worked_example(text_assets[0])


def test_the_runtime_docs_video_worked_example_is_what_the_code_computes(computed):
    found = BLOCK.search(PAGE.read_text(encoding="utf-8"))
    assert found, f"{PAGE.relative_to(ROOT)}: no <!-- video-worked-example --> block"
    assert found.group(1) == computed, f"paste this between the markers:\n{computed}"


def test_the_worked_example_is_the_documented_clip(computed):
    """The numbers the prose around the block quotes (docs/runtime.md, docs/valen-model.md §8.4)."""
    assert "0, 18, 36, 53, 71, 89" in computed and "grid_thw [3, 16, 20]" in computed
    assert "<0.3 seconds>; " in computed and "-> <1.5 seconds>" in computed and "-> <2.7 seconds>" in computed
    assert "80 <|video_pad|> per pair (8 x 10), 240 in all" in computed
