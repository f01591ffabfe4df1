"""Video in the reference process (benchmarks/reference_latency.py): the decoder and the media files.

transformers 5.4.0's video processor decodes a video file with torchcodec where it is importable
(it is blocked in the reference process) and otherwise with `torchvision.io.read_video`, the
decoder the pinned Valen environment ran (torchvision 0.21, on PyAV). Later torchvision releases
dropped `read_video`, so `install_read_video` puts one back: the parity harness's
(parity/video_reader.py, which also keeps 0.21's seek and its handling of decoder errors) where
the checkout has it, else `read_video_tv021` below, which follows 0.21 on clean files: every frame
keyed by its pts (a repeated pts keeps the later frame), those with pts >= 0 in pts order,
`to_rgb()`, and `info["video_fps"] = float(stream.average_rate)`.
"""

from __future__ import annotations

import base64
import copy
import json
from pathlib import Path

# data:video/<subtype>;base64, -> the file suffix the processor's decoder gets
VIDEO_DATA_URLS = {"data:video/mp4;base64,": ".mp4", "data:video/webm;base64,": ".webm"}


def read_video_tv021(filename, start_pts=0, end_pts=None, pts_unit="pts", output_format="THWC"):
    """torchvision 0.21's `read_video` for a whole file: (frames uint8 [T, H, W, 3] or [T, 3, H, W],
    an empty audio tensor, {"video_fps": ...}). Only the whole-file call transformers makes."""
    import av
    import numpy as np
    import torch

    if start_pts not in (0, 0.0) or end_pts is not None:
        raise ValueError("read_video_tv021 reads whole files only (start_pts=0, end_pts=None)")
    if output_format not in ("THWC", "TCHW"):
        raise ValueError(f"output_format must be THWC or TCHW, got {output_format!r}")
    with av.open(str(filename)) as container:
        stream = container.streams.video[0]
        by_pts = {frame.pts: frame for frame in container.decode(stream)}
        fps = float(stream.average_rate)
        frames = [by_pts[pts].to_rgb().to_ndarray() for pts in sorted(by_pts) if pts is not None and pts >= 0]
    video = torch.as_tensor(np.stack(frames)) if frames else torch.empty((0, 1, 1, 3), dtype=torch.uint8)
    if output_format == "TCHW":
        video = video.permute(0, 3, 1, 2)
    return video, torch.empty((1, 0), dtype=torch.float32), {"video_fps": fps}


def install_read_video():
    """Set `torchvision.io.read_video` (what transformers' torchvision video backend calls) to the
    parity harness's reader where there is one, else `read_video_tv021`; returns the reader."""
    try:
        from parity.video_reader import read_video  # the harness's reader, shared with the parity cases
    except ImportError:
        read_video = read_video_tv021
    import torchvision.io

    torchvision.io.read_video = read_video
    return read_video


def _write_video(url: str, media_dir: Path, stem: str) -> str | None:
    """The data URL written to a file in media_dir (its path), or None for anything else."""
    for prefix, suffix in VIDEO_DATA_URLS.items():
        if isinstance(url, str) and url.startswith(prefix):
            path = Path(media_dir) / f"{stem}{suffix}"
            path.write_bytes(base64.b64decode(url[len(prefix):], validate=True))
            return str(path.resolve())
    return None


def with_video_files(request: dict, media_dir: Path) -> dict:
    """`request` with its video data URLs written to files and named by path, which the reference
    prompt builder hands to the processor (as it does a Valen record's media), unless the parity
    harness's wire translation already turns video states into files itself."""
    from parity.prompt import wire_to_state

    state = request.get("state")
    if "data:video/" not in json.dumps(state):
        return request
    translated = wire_to_state(copy.deepcopy(state), Path(media_dir))
    if "data:video/" not in json.dumps(translated) and not isinstance(translated, str):
        return request  # the harness reads video states itself
    if isinstance(state, dict) and list(state) == ["video"]:
        path = _write_video(state["video"], media_dir, "video")
        content = [{"type": "video_url", "video_url": {"url": path}}]
        return {**request, "state": {"messages": [{"role": "user", "content": content}]}}
    messages = copy.deepcopy(state["messages"])
    count = 0
    for message in messages:
        for item in message.get("content") if isinstance(message.get("content"), list) else []:
            if isinstance(item, dict) and item.get("type") == "video_url":
                url = item["video_url"]["url"] if isinstance(item["video_url"], dict) else item["video_url"]
                path = _write_video(url, media_dir, f"video-{count}")
                if path is not None:
                    item["video_url"] = {"url": path}
                    count += 1
    return {**request, "state": {"messages": messages}}
