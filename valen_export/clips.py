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
ENCODER_OPTIONS = {"libaom-av1": {"cpu-used": "8"}, "libx265": {"x265-params": "log-level=none"},
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


def encode_clip(container: str, codec: str, rate: int | Fraction, count: int, width: int, height: int,
                seed: int = 0, noise: int = 64, first_pts: int = 0, **options: str) -> bytes:
    """An encoded clip of `count` frames_array frames at `rate` fps. container: a PyAV muxer
    ("mp4", "webm"); codec: a PyAV encoder ("libx264", "libvpx-vp9", ...); yuv420p, so even sides.
    first_pts < 0 (in frames; WebM) writes the first frames before time 0 unshifted, as some
    recorders do. The same arguments give the same bytes (on one PyAV build)."""
    import av

    options = {**ENCODER_OPTIONS.get(codec, {}), **options}
    buffer = io.BytesIO()
    # bitexact: no random Matroska SegmentUID and no muxer version tag, so equal arguments give equal bytes.
    muxer_options = {"fflags": "+bitexact"} | ({"avoid_negative_ts": "disabled"} if first_pts < 0 else {})
    with av.open(buffer, mode="w", format=container, options=muxer_options) as out:
        stream = out.add_stream(codec, rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = options
        for index, rgb in enumerate(frames_array(count, height, width, seed=seed, noise=noise)):
            frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
            if first_pts:
                frame.pts, frame.time_base = first_pts + index, Fraction(1) / Fraction(rate)
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buffer.getvalue()
