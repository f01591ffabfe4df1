"""Synthetic video clips for fixtures, tests, the parity cases and the demo (PyAV's own encoders).

Real Valen traffic carries camera or screen recordings; these clips stand in for them with content
that exercises what matters to the pipeline: a colour ramp that moves every frame (so resizing,
sampling and chroma subsampling change the pixels) plus noise (so an encoder cannot collapse frames).
"""

from __future__ import annotations

import io
from fractions import Fraction

import numpy as np

# Encoder options that keep the slow software encoders fast on a 2-core machine. VP8 takes a
# negative cpu-used: a positive one in realtime mode adapts its speed to the measured encoding
# time, so the bytes would depend on the machine's load.
# x264's macroblock-tree rate control (mbtree) on these small frames gives other bytes once the
# process has run torch CPU work (not with asm=0: an assembly routine reads memory it did not
# write). It is off, with B-frames placed without the lookahead (b-adapt=0).
# x265 with B-frames gives a one-frame clip an unset decode timestamp (the MP4 muxer then refused
# it now and then), so it runs without them.
ENCODER_OPTIONS = {"libaom-av1": {"cpu-used": "8"}, "libx265": {"x265-params": "log-level=none:bframes=0"},
                   "libx264": {"x264-params": "b-adapt=0:mbtree=0"},
                   "libvpx": {"deadline": "realtime", "cpu-used": "-8"}, "libvpx-vp9": {"deadline": "realtime", "cpu-used": "8"}}
# MIME subtype (data:video/<subtype>) -> PyAV's muxer name.
MUXERS = {"mp4": "mp4", "webm": "webm"}


def frames_array(count: int, height: int, width: int, seed: int = 0, noise: int = 64) -> np.ndarray:
    """uint8 [count, H, W, 3]: a moving colour ramp (wrapping at 256) plus noise; the noise repeats
    every 8 frames, which keeps long clips cheap to make."""
    y, x, c = np.ogrid[0:height, 0:width, 0:3]
    ramp = ((x * 3 + y * 2 + c * 85 + seed * 37) % 256).astype(np.uint8)
    shift = (np.arange(count) * 11 % 256).astype(np.uint8)[:, None, None, None]
    pool = np.random.default_rng(seed).integers(0, noise, (min(count, 8), height, width, 3), dtype=np.uint8)
    return ramp[None] + shift + pool[np.arange(count) % len(pool)]  # uint8 arithmetic wraps


def yuv420p(rgb: np.ndarray) -> np.ndarray:
    """uint8 [H, W, 3] RGB -> the planar yuv420p layout PyAV takes ([H * 3 / 2, W]: Y, then U, then
    V at half size), BT.601 limited range in integer arithmetic. Done here rather than by FFmpeg's
    swscale, whose SIMD paths can round differently with the input buffer's alignment: the same
    arguments must give the same bytes in any process."""
    r, g, b = (rgb[..., i].astype(np.int32) for i in range(3))
    y = ((66 * r + 129 * g + 25 * b + 128) >> 8) + 16
    u = ((-38 * r - 74 * g + 112 * b + 128) >> 8) + 128
    v = ((112 * r - 94 * g - 18 * b + 128) >> 8) + 128
    height, width = y.shape

    def half(plane):  # 2 x 2 means, rounded half up
        return (plane.reshape(height // 2, 2, width // 2, 2).sum(axis=(1, 3)) + 2) >> 2

    return np.concatenate([y.ravel(), half(u).ravel(), half(v).ravel()]).astype(np.uint8).reshape(height * 3 // 2, width)


def encode_clip(container: str, codec: str, rate: int | Fraction, count: int, width: int, height: int,
                seed: int = 0, noise: int = 64, first_pts: int = 0, **options: str) -> bytes:
    """An encoded clip of `count` frames_array frames at `rate` fps. container: a PyAV muxer
    ("mp4", "webm"); codec: a PyAV encoder ("libx264", "libvpx-vp9", ...); yuv420p, so even sides.
    first_pts < 0 (in frames; WebM) writes the first frames before time 0 unshifted, as some
    recorders do. The same arguments give the same bytes (on one PyAV build), except for HEVC clips
    of more than one frame, whose bytes x265 varies from run to run."""
    import av

    options = {**ENCODER_OPTIONS.get(codec, {}), **options}
    buffer = io.BytesIO()
    # bitexact: no random Matroska SegmentUID and no muxer version tag, so equal arguments give equal bytes.
    muxer_options = {"fflags": "+bitexact"} | ({"avoid_negative_ts": "disabled"} if first_pts < 0 else {})
    with av.open(buffer, mode="w", format=container, options=muxer_options) as out:
        stream = out.add_stream(codec, rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = options
        # One encoder thread: threaded x264 and libvpx may choose differently with the machine and
        # its load, and the same arguments must give the same bytes everywhere.
        stream.codec_context.thread_count = 1
        for index, rgb in enumerate(frames_array(count, height, width, seed=seed, noise=noise)):
            frame = av.VideoFrame.from_ndarray(yuv420p(rgb), format="yuv420p")
            if first_pts:
                frame.pts, frame.time_base = first_pts + index, Fraction(1) / Fraction(rate)
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buffer.getvalue()
