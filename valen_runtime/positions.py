"""3-D M-RoPE position ids for one sequence, as transformers 5.4.0's `Qwen3_5Model.get_rope_index`.

Text tokens advance all three axes together; an image run of merged grid (t, h, w) sits at the
running offset s with temporal = s, height = s + row, width = s + col, and the next text token
resumes at s + max(h, w). A video of grid (t, h, w) is t runs, one per frame pair, each placed like
an image of grid (1, h, w): its timestamp text between the runs is what carries time (5.4.0 splits
`video_grid_thw` this way). Batch 1, no padding. Building token ids and `mm_token_type_ids` is the
prompt builder's job.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

TEXT, IMAGE, VIDEO = 0, 1, 2


def rope_index(
    input_ids: torch.Tensor | Sequence[int],
    mm_token_type_ids: torch.Tensor | Sequence[int],
    image_grid_thw: torch.Tensor | Sequence[Sequence[int]] | None,
    spatial_merge_size: int,
    start: int = 0,
    video_grid_thw: torch.Tensor | Sequence[Sequence[int]] | None = None,
) -> tuple[torch.Tensor, int]:
    """Position ids of one sequence.

    Args:
        input_ids: [T] token ids (only the length is used, as in HF).
        mm_token_type_ids: [T] 0 text, 1 image, 2 video.
        image_grid_thw: [n_images, 3] patch grids (before merging), one per image run in order.
        spatial_merge_size: vision `spatial_merge_size`.
        start: position of the first token (a suffix continues at the prefix's `next_position`).
        video_grid_thw: [n_videos, 3] patch grids; a grid (t, h, w) stands for t video runs of
            grid (1, h, w), one per frame pair, in order.
    Returns:
        position_ids [3, T] int64 (temporal, height, width) and next_position = max + 1
        (`start` for an empty sequence); HF's rope_delta is next_position - start - T.
    """
    if isinstance(mm_token_type_ids, torch.Tensor):
        types = mm_token_type_ids.reshape(-1).tolist()
    else:  # a list already (the compiler's form): no round trip through a tensor
        types = list(mm_token_type_ids)
    n_tokens = len(input_ids) if not isinstance(input_ids, torch.Tensor) else input_ids.reshape(-1).shape[0]
    if len(types) != n_tokens:
        raise ValueError(f"mm_token_type_ids has {len(types)} entries for {n_tokens} tokens")
    grids = {
        IMAGE: _rows(image_grid_thw),
        VIDEO: [[1, h, w] for t, h, w in _rows(video_grid_thw) for _ in range(t)],
    }
    next_grid = {kind: iter(rows) for kind, rows in grids.items()}
    names = {IMAGE: "image", VIDEO: "video"}

    pieces = []
    pos = start
    # Runs of equal type, as HF's itertools.groupby: two images with no token between them form one run.
    offset = 0
    for kind, run in itertools.groupby(types):
        length = len(list(run))
        if kind == TEXT:
            pieces.append(torch.arange(pos, pos + length).view(1, -1).expand(3, -1))
            pos += length
        elif kind in (IMAGE, VIDEO):
            name = names[kind]
            grid = next(next_grid[kind], None)
            if grid is None:
                raise ValueError(f"{name} run at token {offset} has no {name}_grid_thw row left")
            t, h, w = grid[0], grid[1] // spatial_merge_size, grid[2] // spatial_merge_size
            if t * h * w != length:
                raise ValueError(
                    f"{name} run at token {offset} has {length} tokens; grid {grid} with merge "
                    f"{spatial_merge_size} gives {t * h * w}"
                )
            pieces.append(_image_positions(pos, t, h, w))
            pos += max(h, w)
        else:
            raise ValueError(f"mm_token_type_ids value {kind!r} at token {offset}: expected 0, 1 or 2")
        offset += length
    if next(next_grid[IMAGE], None) is not None:
        raise ValueError(f"image_grid_thw has {len(grids[IMAGE])} rows but the sequence has fewer image runs")
    if next(next_grid[VIDEO], None) is not None:
        raise ValueError(
            f"video_grid_thw has {len(grids[VIDEO])} frame pairs but the sequence has fewer video runs"
        )

    if not pieces:
        return torch.zeros(3, 0, dtype=torch.int64), start
    positions = torch.cat(pieces, dim=1).to(torch.int64)  # [3, T]
    return positions, int(positions.max()) + 1


def _rows(grid_thw) -> list[list[int]]:
    return [] if grid_thw is None else torch.as_tensor(grid_thw).reshape(-1, 3).tolist()


def _image_positions(s: int, t: int, h: int, w: int) -> torch.Tensor:
    """[3, t*h*w]: temporal s, height s + row, width s + col, rows major (get_vision_position_ids)."""
    width = torch.arange(s, s + w).repeat(h * t)
    height = torch.arange(s, s + h).repeat_interleave(w * t)
    temporal = torch.full((t * h * w,), s, dtype=torch.long)
    return torch.stack([temporal, height, width], dim=0)
