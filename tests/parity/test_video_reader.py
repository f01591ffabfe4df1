"""parity.video_reader: torchvision 0.21's PyAV `read_video`, the reference process's video decoder."""

from __future__ import annotations

import io
from fractions import Fraction

import av
import numpy as np
import pytest
import torch

from parity import video_reader
from valen_export.clips import encode_clip, frames_array


def plain_decode(path) -> tuple[list[int], np.ndarray]:
    """Every frame of the first video stream, in decoding order, as rgb24 (no seek, no pts filter)."""
    with av.open(str(path)) as container:
        frames = list(container.decode(video=0))
        return [f.pts for f in frames], np.stack([f.to_ndarray(format="rgb24") for f in frames])


def write(tmp_path, name: str, data: bytes):
    path = tmp_path / name
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("container, codec, rate, count", [
    ("mp4", "libx264", 10, 30),
    ("webm", "libvpx-vp9", Fraction(15, 2), 22),
    ("webm", "libvpx", Fraction(24000, 1001), 12),
])
def test_frames_equal_a_plain_pyav_decode_and_fps_is_the_average_rate(tmp_path, container, codec, rate, count):
    path = write(tmp_path, f"clip.{container}", encode_clip(container, codec, rate, count, 64, 48))
    video, audio, info = video_reader.read_video(str(path), start_pts=0.0, end_pts=None, pts_unit="sec", output_format="THWC")
    _, expected = plain_decode(path)
    assert video.dtype == torch.uint8 and tuple(video.shape) == (count, 48, 64, 3)
    assert np.array_equal(video.numpy(), expected)
    assert info == {"video_fps": float(rate)}
    assert audio.dtype == torch.float32 and tuple(audio.shape) == (1, 0)


def test_tchw_is_thwc_with_channels_first(tmp_path):
    path = write(tmp_path, "clip.mp4", encode_clip("mp4", "libx264", 10, 6, 64, 48))
    thwc, _, _ = video_reader.read_video(str(path), pts_unit="sec", output_format="THWC")
    tchw, _, _ = video_reader.read_video(str(path), start_pts=0.0, pts_unit="sec", output_format="tchw")
    assert tuple(tchw.shape) == (6, 3, 48, 64)
    assert torch.equal(tchw, thwc.permute(0, 3, 1, 2))


def _negative_pts_webm(first_pts: int, key_interval: int, count: int = 8) -> bytes:
    """A VP9 WebM whose first frames carry negative pts (the muxer told not to shift them)."""
    return encode_clip("webm", "libvpx-vp9", 10, count, 64, 48, first_pts=first_pts, g=str(key_interval))


@pytest.mark.parametrize("first_pts, key_interval, first_kept_ms", [
    (-2, 1, 0),  # every frame a key frame: the seek lands on pts 0, the negative frames are never decoded
    (-1, 2, 100),  # key frames at -100, 100, ...: the seek lands on 100, so the frame at 0 is lost too
])
def test_a_clip_starting_before_zero_decodes_from_where_the_seek_to_zero_lands(tmp_path, first_pts, key_interval, first_kept_ms):
    """torchvision 0.21 seeks to 0 before decoding; FFmpeg's Matroska seek decides what is left."""
    path = write(tmp_path, "clip.webm", _negative_pts_webm(first_pts, key_interval))
    pts, every = plain_decode(path)
    assert pts == [(first_pts + i) * 100 for i in range(8)]  # milliseconds: it really starts before 0
    video, _, info = video_reader.read_video(str(path), pts_unit="sec", output_format="THWC")
    assert np.array_equal(video.numpy(), every[pts.index(first_kept_ms):])
    assert info == {"video_fps": 10.0}


def test_a_failed_seek_gives_no_frames_but_keeps_the_fps(tmp_path):
    """One key frame at -200 ms: FFmpeg refuses the seek to 0 (EPERM) and torchvision returned nothing."""
    path = write(tmp_path, "clip.webm", _negative_pts_webm(-2, 100))
    assert len(plain_decode(path)[0]) == 8
    video, _, info = video_reader.read_video(str(path), pts_unit="sec", output_format="TCHW")
    assert tuple(video.shape) == (0, 3, 1, 1) and info == {"video_fps": 10.0}


class _Frame:
    def __init__(self, pts: int, value: int):
        self.pts, self.value = pts, value

    def to_rgb(self):
        return self

    def to_ndarray(self):
        return np.full((2, 2, 3), self.value, np.uint8)


class _Container:
    """Frames in decoding order, as a demuxer with out-of-order and repeated pts would give them."""

    def __init__(self, frames):
        self.frames = frames
        self.seeks = []

    def seek(self, offset, **kwargs):
        self.seeks.append((offset, kwargs))

    def decode(self, **streams):
        assert streams == {"video": 0}
        yield from self.frames


def test_pts_order_and_a_repeated_pts_keeps_the_later_frame():
    container = _Container([_Frame(2, 20), _Frame(0, 1), _Frame(-1, 99), _Frame(1, 10), _Frame(0, 2)])
    stream = object()
    frames = video_reader._stream_frames(container, stream, video_reader._decode_error_types())
    assert [(f.pts, f.value) for f in frames] == [(0, 2), (1, 10), (2, 20)]
    assert container.seeks == [(0, {"any_frame": False, "backward": True, "stream": stream})]


def test_a_decoder_error_keeps_the_frames_decoded_before_it():
    class Failing(_Container):
        def decode(self, **streams):
            yield _Frame(0, 1)
            yield _Frame(1, 2)
            raise av.InvalidDataError(1094995529, "damaged")

    frames = video_reader._stream_frames(Failing([]), object(), video_reader._decode_error_types())
    assert [f.pts for f in frames] == [0, 1]


def test_unreadable_bytes_give_an_empty_video_without_fps(tmp_path):
    path = write(tmp_path, "clip.mp4", b"\x00\x00\x00\x18ftypmp42" + bytes(64))
    video, _, info = video_reader.read_video(str(path), pts_unit="sec", output_format="TCHW")
    assert tuple(video.shape) == (0, 3, 1, 1) and info == {}


def test_refusals(tmp_path):
    path = write(tmp_path, "clip.mp4", encode_clip("mp4", "libx264", 10, 2, 64, 48))
    with pytest.raises(ValueError, match="output_format"):
        video_reader.read_video(str(path), output_format="CHWT")
    with pytest.raises(ValueError, match="start_pts=0"):
        video_reader.read_video(str(path), start_pts=1.0, pts_unit="sec")
    video, _, info = video_reader.read_video(str(tmp_path / "missing.mp4"))  # av.open's error is an FFmpegError
    assert tuple(video.shape) == (0, 1, 1, 3) and info == {}


def test_install_makes_it_torchvisions_read_video(monkeypatch):
    import torchvision.io

    monkeypatch.setattr(torchvision.io, "read_video", None, raising=False)
    video_reader.install()
    assert torchvision.io.read_video is video_reader.read_video
    assert video_reader.decoder_environment()["read_video"] == "parity.video_reader.read_video"
    assert video_reader.decoder_environment()["av"] == av.__version__
