"""The pinned Valen environment's video decoder, for the reference process: torchvision 0.21's PyAV
`torchvision.io.read_video`, which torchvision 0.29 no longer has.

transformers 5.4.0 decodes a video path with torchcodec when it is importable, else with
`torchvision.io.read_video(path, start_pts=0.0, end_pts=None, pts_unit="sec",
output_format="TCHW")` (`video_utils.read_video_torchvision`). The reference process blocks
torchcodec (parity/isolation.py), as the pinned environment had none, and `install()` puts
`read_video` below in torchvision's place, so the processor's own `load_video` path runs unchanged
on what the pinned decoder returned:

- the file opened with PyAV (`metadata_errors="ignore"`), its first video stream sought to 0
  (backward, key frames) and decoded from there; every frame keyed by its pts, so a repeated pts
  keeps the later frame; the frames with pts >= 0 in pts order. For a stream that starts at pts
  >= 0 the seek is a no-op; for a WebM whose first key frame lies before 0, FFmpeg's seek lands
  after it (frames at and after 0 are lost) or fails (no frames at all);
- each frame `frame.to_rgb().to_ndarray()` (FFmpeg's swscale, PyAV's defaults), stacked uint8
  [T, H, W, 3], permuted to [T, 3, H, W] for "TCHW";
- an FFmpeg error while seeking gives no frames; one while decoding ends decoding and keeps the
  frames decoded so far; one while opening (also a missing file) gives no frames
  (torchvision swallowed every `FFmpegError`);
- `info["video_fps"] = float(stream.average_rate)`, absent when the stream has no average rate.

Only the call transformers makes is reproduced (start 0, no end); audio is not decoded (the
processor drops it; torchvision decoded it after the video frames, which leaves them unchanged),
so the audio tensor is torchvision's empty one. Checked against torchvision 0.21.0's
`torchvision/io/video.py` (`read_video`, `_read_from_stream`).
"""

from __future__ import annotations

import numpy as np

OUTPUT_FORMATS = ("THWC", "TCHW")


def _decode_error_types() -> tuple:
    import av

    # torchvision 0.21 caught av.FFmpegError (av.AVError before PyAV 14).
    return tuple(t for t in (getattr(av, "FFmpegError", None), getattr(av, "AVError", None)) if t is not None)


def _stream_frames(container, stream, errors) -> list:
    """torchvision 0.21's `_read_from_stream` from pts 0 to the end: frames keyed by pts, pts >= 0, in pts order."""
    try:
        container.seek(0, any_frame=False, backward=True, stream=stream)
    except errors:
        return []
    frames = {}
    try:
        for frame in container.decode(video=0):
            frames[frame.pts] = frame
    except errors:
        pass  # what was decoded before the error is kept
    return [frames[pts] for pts in sorted(frames) if pts >= 0]


def decode_rgb(path) -> tuple[np.ndarray, float | None]:
    """(uint8 [T, H, W, 3], float(average_rate) or None), as torchvision 0.21 decoded `path`."""
    import av

    errors = _decode_error_types()
    frames, fps = [], None
    try:
        with av.open(str(path), metadata_errors="ignore") as container:
            if container.streams.video:
                stream = container.streams.video[0]
                frames = _stream_frames(container, stream, errors)
                if stream.average_rate is not None:
                    fps = float(stream.average_rate)
    except errors:
        pass
    rgb = [frame.to_rgb().to_ndarray() for frame in frames]
    return (np.stack(rgb) if rgb else np.empty((0, 1, 1, 3), np.uint8)), fps


def read_video(filename, start_pts=0, end_pts=None, pts_unit: str = "pts", output_format: str = "THWC"):
    """torchvision 0.21's `read_video` for start 0 and no end: (video uint8 tensor, empty audio
    [1, 0] float32, info)."""
    import torch

    output_format = output_format.upper()
    if output_format not in OUTPUT_FORMATS:
        raise ValueError(f"output_format: expected one of {', '.join(OUTPUT_FORMATS)}, got {output_format!r}")
    if start_pts != 0 or end_pts is not None or pts_unit not in ("pts", "sec"):
        raise ValueError("parity.video_reader.read_video reproduces only start_pts=0, end_pts=None (the call transformers makes)")
    rgb, fps = decode_rgb(filename)
    video = torch.as_tensor(rgb)
    if output_format == "TCHW":
        video = video.permute(0, 3, 1, 2)
    info = {} if fps is None else {"video_fps": fps}
    return video, torch.empty((1, 0), dtype=torch.float32), info


def install() -> None:
    """Make `read_video` torchvision's in this process (the reference process only)."""
    import torchvision.io

    torchvision.io.read_video = read_video


def decoder_environment() -> dict:
    """The decoder every report records: this reader, PyAV's version and the FFmpeg it links."""
    import av
    import torchvision.io

    return {
        "read_video": f"{torchvision.io.read_video.__module__}.{torchvision.io.read_video.__name__}",
        "av": av.__version__,
        "ffmpeg": getattr(av, "ffmpeg_version_info", None),
        "libraries": {name: ".".join(map(str, version)) for name, version in av.library_versions.items()},
    }
