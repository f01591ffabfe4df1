"""benchmarks/reference_video.py: what the video benchmark's reference process decodes and reads
(its fallback `read_video` against PyAV's own frames; video data URLs become files the reference
prompt builder opens)."""

from __future__ import annotations

import base64
import sys
from pathlib import Path

import pytest
import torch

av = pytest.importorskip("av")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from reference_video import read_video_tv021, with_video_files  # noqa: E402

from valen_export.clips import encode_clip  # noqa: E402


@pytest.fixture(scope="module")
def clip() -> bytes:
    return encode_clip("mp4", "libx264", 10, 12, 64, 48, preset="ultrafast")


def test_the_fallback_read_video_returns_every_frame_in_rgb_at_the_stream_rate(clip, tmp_path):
    path = tmp_path / "clip.mp4"
    path.write_bytes(clip)
    video, audio, info = read_video_tv021(str(path), start_pts=0.0, end_pts=None, pts_unit="sec", output_format="TCHW")
    with av.open(str(path)) as container:
        want = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    assert video.dtype == torch.uint8 and tuple(video.shape) == (12, 3, 48, 64) and info == {"video_fps": 10.0}
    assert all(torch.equal(video[i].permute(1, 2, 0), torch.from_numpy(frame)) for i, frame in enumerate(want))
    assert audio.numel() == 0
    thwc, _, _ = read_video_tv021(str(path))
    assert torch.equal(thwc, video.permute(0, 2, 3, 1))
    with pytest.raises(ValueError, match="whole files"):
        read_video_tv021(str(path), start_pts=1.0)


@pytest.mark.parametrize("form", ["video", "messages"])
def test_video_states_reach_the_reference_builder_as_files(clip, tmp_path, form):
    from parity.prompt import wire_to_state

    url = "data:video/mp4;base64," + base64.b64encode(clip).decode("ascii")
    if form == "video":
        state = {"video": url}
    else:
        state = {"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                                           {"type": "text", "text": "what happens?"}]}]}
    request = {"model": "valen-preview-0923", "state": state, "questions": {}}
    translated = wire_to_state(with_video_files(request, tmp_path)["state"], tmp_path)
    items = [item for message in translated["messages"] for item in message["content"] if item["type"] == "video_url"]
    assert len(items) == 1 and Path(items[0]["video_url"]["url"]).read_bytes() == clip
    assert request["state"] == state  # the request itself is left alone
