"""valen_export.clips: the synthetic clips the video tests and the parity gate encode."""

from __future__ import annotations

from valen_export.clips import encode_clip


def test_a_one_frame_hevc_clip_is_the_same_bytes_every_time():
    # x265's B-frames left a one-frame clip's decode timestamp unset: other bytes, or a muxer refusal.
    clips = {encode_clip("mp4", "libx265", 30, 1, 64, 64) for _ in range(20)}
    assert len(clips) == 1
