"""Video states for Qwen3.5's vision tower: decode, sample, resize, patchify, timestamps, prompt ids.

Reproduces, bit for bit, what transformers 5.4.0's `Qwen3VLVideoProcessor` and `Qwen3VLProcessor`
return for a video whose frames and `video_metadata` (frame count, fps) come from torchvision
0.21's PyAV `read_video` (the decoder the pinned Valen environment ran): frames sampled at 2 fps
(4 to 768 of them), the video `smart_resize` whose pixel budget is summed over all sampled frames,
uint8 bicubic antialiased resize, fused rescale + normalise in FP32, two consecutive frames folded
into one patch row, and before each frame pair a text timestamp `<x.y seconds>`.

Decoding reads untrusted bytes with PyAV (FFmpeg inside the wheel) in two passes: the first
decodes without converting anything, to count the frames (a WebM header holds no count) and check
every limit; the second decodes again and converts and resizes only the sampled frames, so memory
stays bounded by the sampled, resized clip. docs/runtime.md ("Video states") has the numbers.

Typical use (`load_video` does the first four steps):

    probe = probe_video(data, "mp4", "state.video")         # pass 1: counts, fps, size, limits
    plan = plan_video(probe.frame_count, probe.fps, probe.height, probe.width, config)
    # plan.grid_thw, plan.timestamps and plan.tokens_per_pair fix the prompt before any pixel
    frames = decode_frames(data, probe, plan, "state.video")  # pass 2: uint8 [T, 3, H', W']
    pixel_values, grid_thw = patchify_video(frames, config)
    ids, types = encode_prompt(tokenizer, rendered_chat, videos=[plan])
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .config import read_config_json
from .errors import ConfigError, RequestError
from .image import _BICUBIC, _rescale_and_normalize, pixel_fields
from .tokenizer import Tokenizer

from .limits import (  # noqa: F401  (the wire's, re-exported)
    MAX_ASPECT_RATIO, MAX_FRAME_PIXELS, MAX_FRAME_SIDE, MAX_VIDEO_BYTES, MAX_VIDEO_FPS, MAX_VIDEO_FRAMES, MAX_VIDEO_SECONDS,
    MIN_FRAME_SIDE,
)

# MIME subtype (data:video/<subtype>) -> the one libavformat demuxer allowed to read it. Never
# let FFmpeg probe: its hls, concat and image2 demuxers open other files or URLs named inside.
VIDEO_CONTAINERS = {"mp4": "mp4", "webm": "matroska"}
ALLOWED_CODECS = frozenset({"h264", "hevc", "vp8", "vp9", "av1"})
_NAMES = {"mp4": "an MP4", "webm": "a WebM"}
_DEMUXER_OPTIONS = {"mp4": {"enable_drefs": "0", "use_absolute_path": "0"}, "webm": {}}

DECODE_THREADS = 2  # FFmpeg decoder threads per video (frame and slice threading)

PLACEHOLDER = "<|placeholder|>"  # the processor's temporary marker; refused in prompt text


@dataclass(frozen=True)
class VideoConfig:
    """The video-processor settings that change frames, pixels or the grid
    (video_preprocessor_config.json names; defaults are Qwen3VLVideoProcessor's class defaults)."""

    fps: float = 2
    min_frames: int = 4
    max_frames: int = 768
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 131072  # size.shortest_edge, summed over the sampled frames
    max_pixels: int = 786432  # size.longest_edge, summed over the sampled frames
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    resample: int = _BICUBIC

    def __post_init__(self):
        for name in ("min_frames", "max_frames", "patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"video_preprocessor_config.json: {name} must be a positive integer, got {value!r}")
        if isinstance(self.fps, bool) or not isinstance(self.fps, (int, float)) or not self.fps > 0 or math.isinf(self.fps):
            raise ConfigError(f"video_preprocessor_config.json: fps must be a positive number, got {self.fps!r}")
        if self.resample != _BICUBIC:
            raise ConfigError(f"video_preprocessor_config.json: resample={self.resample!r} unsupported (only 3, bicubic)")
        if len(self.image_mean) != 3 or len(self.image_std) != 3:
            raise ConfigError("video_preprocessor_config.json: image_mean and image_std need 3 values")
        if any(s == 0 for s in self.image_std):
            raise ConfigError("video_preprocessor_config.json: image_std must not contain 0")

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @classmethod
    def from_dict(cls, config: dict, media_kwargs: dict | None = None) -> "VideoConfig":
        """Build from a parsed video_preprocessor_config.json, then apply Valen's `media_kwargs`."""
        if config.get("do_sample_frames", True) is not True:
            raise ConfigError("video_preprocessor_config.json: do_sample_frames must be true")
        if config.get("do_convert_rgb", True) is not True:
            raise ConfigError("video_preprocessor_config.json: do_convert_rgb=false is unsupported")
        if config.get("num_frames") is not None:
            raise ConfigError("video_preprocessor_config.json: num_frames is unsupported (5.4.0 refuses it beside fps)")
        size = config.get("size") or {}
        values = dict(
            pixel_fields(config, cls),
            fps=config.get("fps", cls.fps),
            min_frames=config.get("min_frames", cls.min_frames),
            max_frames=config.get("max_frames", cls.max_frames),
            min_pixels=size.get("shortest_edge", cls.min_pixels),
            max_pixels=size.get("longest_edge", cls.max_pixels),
        )
        return cls(**values).with_media_kwargs(media_kwargs or {})

    @classmethod
    def from_file(cls, path: Path, media_kwargs: dict | None = None) -> "VideoConfig":
        return cls.from_dict(read_config_json(path), media_kwargs)

    def with_media_kwargs(self, media_kwargs: dict) -> "VideoConfig":
        """Apply processor call kwargs the way 5.4.0's video processor would; refuse what it refuses.

        `fps` and `size` change the result. `min_frames` / `max_frames` are accepted and change
        nothing: 5.4.0's `sample_frames` reads the instance's values, not the call's. `min_pixels`
        / `max_pixels` reach only the image processor. `num_frames` is refused (5.4.0 raises when
        it meets the default fps), and so is turning frame sampling off.
        """
        unknown = sorted(set(media_kwargs) - {"fps", "size", "min_frames", "max_frames", "min_pixels", "max_pixels",
                                               "do_sample_frames", "return_metadata", "num_frames", "video_metadata"})
        if unknown:
            raise ConfigError(f"media_kwargs: unsupported keys {unknown}")
        if media_kwargs.get("num_frames") is not None:
            raise ConfigError("media_kwargs: num_frames and fps are mutually exclusive (5.4.0 refuses num_frames)")
        if media_kwargs.get("do_sample_frames", True) is not True:
            raise ConfigError("media_kwargs: do_sample_frames must be true for video states")
        if media_kwargs.get("video_metadata") is not None:
            raise ConfigError("media_kwargs: video_metadata is the decoder's to set")
        changes = {}
        if media_kwargs.get("fps") is not None:
            changes["fps"] = media_kwargs["fps"]
        size = media_kwargs.get("size")
        if size is not None:
            if not isinstance(size, dict) or not size.get("shortest_edge") or not size.get("longest_edge"):
                raise ConfigError("media_kwargs: size must contain 'shortest_edge' and 'longest_edge' keys")
            changes.update(min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"])
        return replace(self, **changes) if changes else self


@dataclass(frozen=True)
class VideoLimits:
    """Input limits, checked on the header where it states them and on every decoded frame."""

    max_bytes: int = MAX_VIDEO_BYTES
    max_seconds: float = MAX_VIDEO_SECONDS
    max_frames: int = MAX_VIDEO_FRAMES
    max_fps: float = MAX_VIDEO_FPS
    min_side: int = MIN_FRAME_SIDE
    max_side: int = MAX_FRAME_SIDE
    max_pixels: int = MAX_FRAME_PIXELS
    max_aspect_ratio: float = MAX_ASPECT_RATIO
    codecs: frozenset[str] = ALLOWED_CODECS


@dataclass(frozen=True)
class VideoProbe:
    """What the counting pass learned: everything the plan and the token count need."""

    frame_count: int  # frames read_video would return (distinct pts >= 0)
    fps: float  # float(stream.average_rate), the reference's video_fps
    height: int
    width: int
    codec: str
    container: str  # "mp4" or "webm"
    # Decode-order ordinal of each returned frame, in presentation order (pass 2 finds them by it).
    decode_ordinals: tuple[int, ...] = field(repr=False, default=())

    @property
    def seconds(self) -> float:
        return self.frame_count / self.fps


@dataclass(frozen=True)
class VideoPlan:
    """Sampled frames, resized size, grid and timestamps of one video: all known before any pixel."""

    indices: tuple[int, ...]  # sampled frame indices (before the odd-count padding)
    fps: float
    height: int  # resized frame size
    width: int
    grid_thw: tuple[int, int, int]  # (frame pairs, height / patch, width / patch)
    timestamps: tuple[float, ...]  # seconds, one per frame pair
    tokens_per_pair: int  # <|video_pad|> tokens of one frame pair

    @property
    def video_tokens(self) -> int:
        """<|video_pad|> tokens of the whole video (the vision tower's output rows)."""
        return self.grid_thw[0] * self.tokens_per_pair

    def stamp_texts(self) -> list[str]:
        return [timestamp_text(seconds) for seconds in self.timestamps]


# ---------------------------------------------------------------- sampling, resize, timestamps


def sample_indices(frame_count: int, video_fps: float, config: VideoConfig) -> list[int]:
    """Indices of the frames the processor keeps (`Qwen3VLVideoProcessor.sample_frames`).

    int(N / video_fps * fps) frames, at least min_frames and at most max_frames and N, spread
    evenly with numpy's linspace rounded half to even.
    """
    if frame_count < 1:
        raise ValueError(f"a video needs at least one frame, got {frame_count}")
    if not video_fps > 0:
        raise ValueError(f"video fps must be positive, got {video_fps!r}")
    count = int(frame_count / video_fps * config.fps)
    count = min(max(count, config.min_frames), config.max_frames, frame_count)
    return np.linspace(0, frame_count - 1, count).round().astype(int).tolist()


def smart_resize_video(num_frames: int, height: int, width: int, config: VideoConfig) -> tuple[int, int]:
    """Target (height, width) of every frame: multiples of patch * merge, the pixel budget counted
    over all `num_frames` frames (rounded up to the temporal patch). Same arithmetic as 5.4.0's
    video `smart_resize` (Python `round` is half to even); ValueError where it raises."""
    factor, temporal = config.factor, config.temporal_patch_size
    if height < factor or width < factor:
        raise ValueError(f"height:{height} or width:{width} must be larger than factor:{factor}")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = math.ceil(num_frames / temporal) * temporal
    if t_bar * h_bar * w_bar > config.max_pixels:
        beta = math.sqrt((num_frames * height * width) / config.max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < config.min_pixels:
        beta = math.sqrt(config.min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def pair_timestamps(indices: Sequence[int], video_fps: float, temporal_patch_size: int = 2) -> list[float]:
    """Seconds of each frame pair: the mean of its first and last frame's index / fps, the odd
    count padded with the last index (`Qwen3VLProcessor._calculate_timestamps`, same float steps)."""
    indices = list(indices)
    if len(indices) % temporal_patch_size:
        indices += [indices[-1]] * (temporal_patch_size - len(indices) % temporal_patch_size)
    seconds = [index / video_fps for index in indices]
    return [(seconds[i] + seconds[i + temporal_patch_size - 1]) / 2 for i in range(0, len(seconds), temporal_patch_size)]


def timestamp_text(seconds: float) -> str:
    """The prompt text before a frame pair: one decimal of the binary float ("<1.4 seconds>" for 1.45)."""
    return f"<{seconds:.1f} seconds>"


def plan_video(frame_count: int, video_fps: float, height: int, width: int, config: VideoConfig) -> VideoPlan:
    """Sampling, resized size, grid and timestamps of a decoded video of this shape; ValueError
    where the processor raises (no frame, a side under patch * merge, aspect ratio over 200)."""
    indices = sample_indices(frame_count, video_fps, config)
    if config.do_resize:
        height, width = smart_resize_video(len(indices), height, width, config)
    if height % config.factor or width % config.factor:
        raise ValueError(f"frame size {height}x{width} is not a multiple of {config.factor}; enable do_resize")
    tp, p, m = config.temporal_patch_size, config.patch_size, config.merge_size
    grid = (-(-len(indices) // tp), height // p, width // p)
    return VideoPlan(
        indices=tuple(indices),
        fps=float(video_fps),
        height=height,
        width=width,
        grid_thw=grid,
        timestamps=tuple(pair_timestamps(indices, video_fps, tp)),
        tokens_per_pair=grid[1] * grid[2] // (m * m),
    )


def resize_batch(frames: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """uint8 [k, 3, H, W] -> contiguous uint8 [k, 3, height, width]: torchvision's uint8 bicubic
    antialiased resize on the CPU, skipped (as there) when the size already matches. Each frame
    comes out the same whatever the batch; one call per batch is many times faster than per frame."""
    if frames.dtype != torch.uint8 or frames.ndim != 4 or frames.shape[1] != 3:
        raise ValueError(f"expected uint8 frames [k, 3, H, W], got {frames.dtype} {tuple(frames.shape)}")
    frames = frames.contiguous()  # the processor permutes [T, H, W, C] to a contiguous [T, C, H, W]
    if tuple(frames.shape[-2:]) == (height, width):
        return frames
    return F.interpolate(frames, size=[height, width], mode="bicubic", align_corners=False, antialias=True)


def resize_frames(frames: torch.Tensor, plan: VideoPlan) -> torch.Tensor:
    """Sampled frames uint8 [T, 3, H, W] (or [T, H, W, 3]) -> uint8 [T, 3, plan.height, plan.width]."""
    if frames.ndim == 4 and frames.shape[-1] == 3 and frames.shape[1] != 3:
        frames = frames.permute(0, 3, 1, 2)
    if frames.shape[0] != len(plan.indices):
        raise ValueError(f"{frames.shape[0]} frames for a plan of {len(plan.indices)}")
    return resize_batch(frames, plan.height, plan.width)


def patchify_video(frames: torch.Tensor, config: VideoConfig) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Resized frames uint8 [T, C, H, W] -> fp32 pixel_values_videos [t * h * w, C * tp * p * p] and
    the grid (t, h, w): an odd T repeats its last frame, each two consecutive frames share a patch
    row. Only IEEE-exact operations and a permutation, so any device gives the same bits."""
    p, tp, m = config.patch_size, config.temporal_patch_size, config.merge_size
    if frames.ndim != 4 or frames.shape[0] < 1:
        raise ValueError(f"expected frames [T, C, H, W], got {tuple(frames.shape)}")
    count, channels, height, width = frames.shape
    if height % (p * m) or width % (p * m):
        raise ValueError(f"frame size {height}x{width} is not a multiple of {p * m}")
    if count % tp:
        frames = torch.cat([frames, frames[-1:].expand(tp - count % tp, -1, -1, -1)], dim=0)
    grid_t, grid_h, grid_w = frames.shape[0] // tp, height // p, width // p
    patches = frames.reshape(1, grid_t, tp, channels, grid_h // m, m, p, grid_w // m, m, p)
    # -> [1, t, h/m, w/m, m, m, C, tp, p, p]: merge-window order, then channel, time, row, column.
    patches = patches.permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9).reshape(grid_t * grid_h * grid_w, channels, tp, p * p)
    values = _rescale_and_normalize(patches, config)  # per element, so the same bits as normalising first
    return values.reshape(grid_t * grid_h * grid_w, channels * tp * p * p), (grid_t, grid_h, grid_w)


@dataclass
class ProcessedVideo:
    pixel_values: torch.Tensor  # pixel_values_videos [t * h * w, C * tp * p * p] fp32
    plan: VideoPlan

    @property
    def grid_thw(self) -> tuple[int, int, int]:
        return self.plan.grid_thw


def preprocess_frames(frames: torch.Tensor, video_fps: float, config: VideoConfig) -> ProcessedVideo:
    """All decoded frames uint8 [N, H, W, 3] (or [N, 3, H, W]) of a video at `video_fps` -> what the
    processor returns for them with video_metadata={"total_num_frames": N, "fps": video_fps}."""
    if frames.dtype != torch.uint8 or frames.ndim != 4:
        raise ValueError(f"expected uint8 frames [N, H, W, 3], got {frames.dtype} {tuple(frames.shape)}")
    if frames.shape[-1] == 3 and frames.shape[1] != 3:
        frames = frames.permute(0, 3, 1, 2)
    plan = plan_video(frames.shape[0], video_fps, frames.shape[2], frames.shape[3], config)
    resized = resize_frames(frames[list(plan.indices)], plan)
    pixel_values, _ = patchify_video(resized, config)
    return ProcessedVideo(pixel_values, plan)


# ---------------------------------------------------------------- decoding (PyAV)


def _av():
    try:
        import av
    except ImportError as exc:  # a deployment without the decoder refuses videos, nothing else
        raise ConfigError("video input needs PyAV (pip install av); it is not installed") from exc
    return av


def _open(data: bytes, mime_format: str, field_name: str, limits: VideoLimits):
    """Container and its first video stream, opened with the MIME type's demuxer only."""
    if mime_format not in VIDEO_CONTAINERS:
        raise RequestError(field_name, f"video type {mime_format!r} not accepted; expected mp4 or webm")
    if len(data) > limits.max_bytes:
        raise RequestError(field_name, f"video is {len(data)} bytes; the limit is {limits.max_bytes}")
    magic_ok = data[4:8] == b"ftyp" if mime_format == "mp4" else data[:4] == b"\x1a\x45\xdf\xa3"
    if not magic_ok:
        raise RequestError(field_name, f"not {_NAMES[mime_format]} file (its first bytes are no {mime_format} header)")
    av = _av()
    try:
        container = av.open(io.BytesIO(data), mode="r", format=VIDEO_CONTAINERS[mime_format],
                            options=_DEMUXER_OPTIONS[mime_format], metadata_errors="ignore")
    except Exception as exc:  # FFmpeg reports damage through many error types
        raise RequestError(field_name, f"video cannot be decoded as {mime_format} ({type(exc).__name__})") from exc
    try:
        if not container.streams.video:
            raise RequestError(field_name, "video has no video stream")
        stream = container.streams.video[0]
        codec = stream.codec_context.codec.canonical_name
        if codec not in limits.codecs:
            raise RequestError(field_name, f"codec {codec} not accepted; expected one of {', '.join(sorted(limits.codecs))}")
        # A fixed thread count: AUTO alone starts one decoder thread per core for every request.
        stream.thread_type = "AUTO"
        stream.codec_context.thread_count = DECODE_THREADS
        # As the pinned decoder (torchvision 0.21's read_video) did: seek to 0, back to a key frame,
        # and decode from there. A no-op for a stream that starts at pts >= 0; for a WebM whose first
        # key frame lies before 0 it decides which frames exist, and where FFmpeg refuses it the
        # reference got no frames at all.
        try:
            container.seek(0, any_frame=False, backward=True, stream=stream)
        except av.FFmpegError as exc:
            raise RequestError(field_name, f"video cannot be read from its start (the seek to 0 failed: {type(exc).__name__})") from exc
        return container, stream, codec
    except BaseException:
        container.close()
        raise


def _check_frame_size(width: int, height: int, field_name: str, limits: VideoLimits) -> None:
    if min(width, height) < limits.min_side:
        raise RequestError(field_name, f"video frames are {width}x{height}; each side must be at least {limits.min_side}")
    if max(width, height) > limits.max_side:
        raise RequestError(field_name, f"video frames are {width}x{height}; each side must be at most {limits.max_side}")
    if width * height > limits.max_pixels:
        raise RequestError(field_name, f"video frames have {width * height} pixels; the limit is {limits.max_pixels}")
    if max(width, height) / min(width, height) > limits.max_aspect_ratio:
        raise RequestError(field_name, f"video aspect ratio {width}x{height} exceeds {limits.max_aspect_ratio}")


def _stream_fps(stream, field_name: str, limits: VideoLimits) -> float:
    rate = stream.average_rate
    fps = float(rate) if rate is not None else 0.0
    if not fps > 0 or math.isinf(fps):
        raise RequestError(field_name, "video stream states no frame rate")
    if fps > limits.max_fps:
        raise RequestError(field_name, f"video frame rate {fps:g} exceeds {limits.max_fps:g}")
    return fps


def probe_video(data: bytes, mime_format: str, field_name: str, limits: VideoLimits = VideoLimits()) -> VideoProbe:
    """Pass 1: open untrusted MP4 / WebM bytes, decode every frame without converting it, count.

    The count follows torchvision 0.21's `read_video` (what the reference ran): frames keyed by
    pts (a repeated pts keeps the later frame), those with pts >= 0, in pts order. The header's
    frame count is never used (WebM has none). Every limit is checked, on the header where it
    states a value and on the frames as they come, so a long or large video is refused early.

    Args:
        data: the encoded file.
        mime_format: "mp4" or "webm" (the data URL's type): the only demuxer used.
        field_name: JSON path named in every RequestError.
        limits: size, duration, frame-rate and codec limits.
    """
    container, stream, codec = _open(data, mime_format, field_name, limits)
    try:
        fps = _stream_fps(stream, field_name, limits)
        context = stream.codec_context
        if context.width and context.height:
            _check_frame_size(context.width, context.height, field_name, limits)
        if stream.frames and stream.frames > limits.max_frames:
            raise RequestError(field_name, f"video has {stream.frames} frames; the limit is {limits.max_frames}")
        max_count = min(limits.max_frames, math.floor(limits.max_seconds * fps + 1e-9))
        by_pts: dict[int, int] = {}
        size = None
        av = _av()
        try:
            for ordinal, frame in enumerate(container.decode(stream)):
                if size is None:
                    size = (frame.width, frame.height)
                    _check_frame_size(frame.width, frame.height, field_name, limits)
                elif (frame.width, frame.height) != size:
                    raise RequestError(field_name, f"video frame size changes from {size[0]}x{size[1]} to {frame.width}x{frame.height}")
                if frame.pts is None:
                    raise RequestError(field_name, "video frame without a timestamp")
                if frame.pts >= 0:
                    by_pts[frame.pts] = ordinal
                # Frames that do not count (repeated or negative pts) still cost decoding: bounded too.
                if len(by_pts) > max_count or ordinal >= limits.max_frames:
                    raise RequestError(field_name, _too_long(max(len(by_pts), ordinal + 1), fps, limits))
        except av.FFmpegError as exc:
            raise RequestError(field_name, f"video data is corrupt or truncated ({type(exc).__name__})") from exc
        if not by_pts:
            raise RequestError(field_name, "video has no decodable frame")
        return VideoProbe(
            frame_count=len(by_pts), fps=fps, width=size[0], height=size[1], codec=codec, container=mime_format,
            decode_ordinals=tuple(by_pts[pts] for pts in sorted(by_pts)),
        )
    finally:
        container.close()


def _too_long(count: int, fps: float, limits: VideoLimits) -> str:
    if count > limits.max_frames:
        return f"video has more than {limits.max_frames} frames"
    return f"video is longer than {limits.max_seconds:g} s ({count} frames at {fps:g} fps)"


def decode_frames(data: bytes, probe: VideoProbe, plan: VideoPlan, field_name: str,
                  limits: VideoLimits = VideoLimits(), chunk_bytes: int = 64 * 1024 * 1024) -> torch.Tensor:
    """Pass 2: decode again; convert to RGB (rgb24, as read_video's `to_rgb()`) only the planned
    frames and resize them in batches of at most `chunk_bytes` of full-size RGB, so memory holds
    one batch plus the resized clip. uint8 [T, 3, H', W'] in `plan.indices` order."""
    wanted: dict[int, list[int]] = {}  # decode ordinal -> positions in plan.indices
    for position, index in enumerate(plan.indices):
        wanted.setdefault(probe.decode_ordinals[index], []).append(position)
    out = torch.empty(len(plan.indices), 3, plan.height, plan.width, dtype=torch.uint8)
    filled = [False] * len(plan.indices)
    pending: list[tuple[list[int], torch.Tensor]] = []

    def flush():
        resized = resize_batch(torch.stack([rgb for _, rgb in pending]), plan.height, plan.width)
        for (positions, _), frame in zip(pending, resized):
            for position in positions:
                out[position] = frame
                filled[position] = True
        pending.clear()

    container, stream, _ = _open(data, probe.container, field_name, limits)
    av = _av()
    last = max(wanted)
    try:
        for ordinal, frame in enumerate(container.decode(stream)):
            if ordinal in wanted:
                rgb = torch.from_numpy(frame.to_ndarray(format="rgb24")).permute(2, 0, 1)  # [3, H, W]
                if tuple(rgb.shape) != (3, probe.height, probe.width):
                    raise RequestError(field_name, "video decoded differently the second time")
                pending.append((wanted[ordinal], rgb))
                if len(pending) * rgb.numel() >= chunk_bytes:
                    flush()
            if ordinal >= last:
                break
    except av.FFmpegError as exc:
        raise RequestError(field_name, f"video data is corrupt or truncated ({type(exc).__name__})") from exc
    finally:
        container.close()
    if pending:
        flush()
    if not all(filled):
        raise RequestError(field_name, "video decoded differently the second time")
    return out


def load_video(data: bytes, mime_format: str, field_name: str, config: VideoConfig,
               limits: VideoLimits = VideoLimits()) -> ProcessedVideo:
    """Untrusted MP4 / WebM bytes -> pixel_values_videos and the plan (grid, timestamps, indices)."""
    probe = probe_video(data, mime_format, field_name, limits)
    try:
        plan = plan_video(probe.frame_count, probe.fps, probe.height, probe.width, config)
    except ValueError as exc:
        raise RequestError(field_name, str(exc)) from exc
    frames = decode_frames(data, probe, plan, field_name, limits)
    pixel_values, _ = patchify_video(frames, config)
    return ProcessedVideo(pixel_values, plan)


# ---------------------------------------------------------------- prompt


def video_placeholder(plan: VideoPlan, video_token: str = "<|video_pad|>", vision_start: str = "<|vision_start|>",
                      vision_end: str = "<|vision_end|>", pads_per_pair: int | None = None) -> str:
    """The text that stands for one video in the prompt: per frame pair its timestamp, then
    vision_start, the pair's pad tokens (`pads_per_pair`, default all of them), vision_end."""
    pads = video_token * (plan.tokens_per_pair if pads_per_pair is None else pads_per_pair)
    return "".join(f"{stamp}{vision_start}{pads}{vision_end}" for stamp in plan.stamp_texts())


def expand_videos(text: str, videos: Sequence[VideoPlan], video_token: str = "<|video_pad|>",
                  vision_start: str = "<|vision_start|>", vision_end: str = "<|vision_end|>",
                  pads_per_pair: int | None = None) -> str:
    """Qwen3VLProcessor.__call__'s video substitution: for each video in order, the first
    `vision_start video_token vision_end` left anywhere in the text (or, if there is none, the
    first bare video_token) becomes `video_placeholder`. ValueError when the text has not one
    video token per video or holds the processor's temporary `<|placeholder|>` marker."""
    if text.count(video_token) != len(videos):
        raise ValueError(f"the prompt holds {text.count(video_token)} {video_token} for {len(videos)} videos")
    if videos and PLACEHOLDER in text:
        raise ValueError(f"text must not contain {PLACEHOLDER} together with videos")
    triple = f"{vision_start}{video_token}{vision_end}"
    for plan in videos:
        # Pads are written as the marker first, so that no expanded pad is matched again.
        placeholder = video_placeholder(plan, PLACEHOLDER, vision_start, vision_end, pads_per_pair)
        text = text.replace(triple if triple in text else video_token, placeholder, 1)
    return text.replace(PLACEHOLDER, video_token) if videos else text  # the processor leaves a prompt without videos as it is


def encode_prompt(tokenizer: Tokenizer, text: str, videos: Sequence[VideoPlan] = (),
                  image_token_counts: Sequence[int] = ()) -> tuple[list[int], list[int]]:
    """(input_ids, mm_token_type_ids) of a rendered chat with one image token per image and one
    `vision_start video_pad vision_end` per video, as Qwen3VLProcessor.__call__ gives them: each
    image token becomes its count of image tokens, each video its stamped frame pairs, and the
    whole text is tokenized once (so the first stamp is tokenized in context with the text before
    it). Types: 1 on image tokens, 2 on video tokens, 0 elsewhere. Image and video states of the
    compiler both come through here.

    Tokenizes the text with one pad per image and per frame pair and repeats those ids, which is
    exact when the pad tokens in play stand alone (`_stands_alone`, as in every Qwen folder);
    otherwise the fully expanded text is tokenized. ValueError when the counts of image or video
    tokens do not match, or the text holds the processor's `<|placeholder|>` marker.
    """
    specials = tokenizer.special_tokens_map
    image_token = specials.get("image_token", "<|image_pad|>")
    video_token = specials.get("video_token", "<|video_pad|>")
    vision_start = specials.get("vision_start_token", "<|vision_start|>")
    vision_end = specials.get("vision_end_token", "<|vision_end|>")
    image_id, video_id = tokenizer.token_id(image_token), tokenizer.token_id(video_token)
    # The processor expands through that temporary marker, which would turn user text holding it
    # into pad tokens: such a prompt is refused rather than tokenized differently.
    if (videos or image_token_counts) and PLACEHOLDER in text:
        raise ValueError(f"text must not contain {PLACEHOLDER} together with {'images or videos' if videos else 'images'}")
    if text.count(image_token) != len(image_token_counts):
        raise ValueError(f"the prompt holds {text.count(image_token)} {image_token} for {len(image_token_counts)} images")
    input_ids = None
    pads = ([image_token] if image_token_counts else []) + ([video_token] if videos else [])
    if all(_stands_alone(tokenizer, pad) for pad in pads):  # a 1024-token image costs one token to tokenize
        compact = expand_videos(text, videos, video_token, vision_start, vision_end, pads_per_pair=1)
        # ids: one pad per image and per frame pair -> each repeated to its image's or pair's count
        input_ids = _repeat_pads(tokenizer.encode_prompt(compact), image_id, list(image_token_counts), video_id,
                                 [plan.tokens_per_pair for plan in videos for _ in range(plan.grid_thw[0])])
    if input_ids is None:
        pieces = text.split(image_token)  # len(image_token_counts) + 1 pieces
        text = pieces[0] + "".join(image_token * count + piece for count, piece in zip(image_token_counts, pieces[1:]))
        input_ids = tokenizer.encode_prompt(expand_videos(text, videos, video_token, vision_start, vision_end))
    types = [1 if token == image_id else 2 if token == video_id else 0 for token in input_ids]
    return input_ids, types


def _repeat_pads(ids: list[int], image_id: int, image_counts: list[int], video_id: int,
                 pair_counts: list[int]) -> list[int] | None:
    """`ids` with the n-th image token repeated image_counts[n] times and the n-th video token
    pair_counts[n] times; None when the ids hold another number of either."""
    images = [i for i, token in enumerate(ids) if token == image_id]
    pairs = [i for i, token in enumerate(ids) if token == video_id]
    if len(images) != len(image_counts) or len(pairs) != len(pair_counts):
        return None
    repeat = dict(zip(images, image_counts)) | dict(zip(pairs, pair_counts))
    out: list[int] = []
    for i, token in enumerate(ids):
        out += [token] * repeat.get(i, 1)
    return out


def _stands_alone(tokenizer: Tokenizer, token: str) -> bool:
    """Whether N copies of `token` in a text are N ids with the text between tokenized alone (a
    special added token matched exactly as written; worked out once, when the tokenizer loads)."""
    return token in tokenizer.standalone_specials
