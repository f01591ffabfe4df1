"""valen_runtime.video: bitwise against transformers 5.4.0's Qwen3VLVideoProcessor / Qwen3VLProcessor.

The reference gets what the pinned Valen environment gave it: the frames torchvision 0.21's PyAV
`read_video` decodes (the parity reference's decoder, parity/video_reader.py) and `video_metadata`
with the frame count and `float(stream.average_rate)`. Clips are encoded here with PyAV's own
encoders.
"""

import dataclasses
import io
import os
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

av = pytest.importorskip("av")  # pinned in requirements.txt; a deployment without it refuses videos

from parity.video_reader import read_video  # noqa: E402
from valen_export.clips import encode_clip, frames_array  # noqa: E402
from valen_runtime import video as video_module  # noqa: E402
from valen_runtime.errors import ConfigError, RequestError  # noqa: E402
from valen_runtime.tokenizer import Tokenizer  # noqa: E402
from valen_runtime.video import (  # noqa: E402
    VideoConfig,
    VideoLimits,
    decode_frames,
    encode_prompt,
    expand_videos,
    load_video,
    plan_video,
    preprocess_frames,
    probe_video,
    sample_indices,
    smart_resize_video,
    timestamp_text,
)

FIELD = "state.video"


@pytest.fixture(scope="module")
def folder(text_assets):
    return text_assets[0]


@pytest.fixture(scope="module")
def processor(folder):
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(str(folder))
    assert type(proc).__name__ == "Qwen3VLProcessor" and type(proc.video_processor).__name__ == "Qwen3VLVideoProcessor"
    return proc


@pytest.fixture(scope="module")
def config(folder):
    return VideoConfig.from_file(folder / "video_preprocessor_config.json")


@pytest.fixture(scope="module")
def tokenizer(folder):
    return Tokenizer.from_dir(folder)


# ---------------------------------------------------------------- clips and the reference decoder


def read_video_pinned(data: bytes, suffix: str, directory) -> tuple[np.ndarray, float]:
    """(uint8 [T, H, W, 3], fps) as the pinned environment's decoder gave them to the processor."""
    path = directory / f"clip.{suffix}"
    path.write_bytes(data)
    video, _, info = read_video(str(path), start_pts=0.0, end_pts=None, pts_unit="sec", output_format="THWC")
    return video.numpy(), info["video_fps"]


CLIPS = {  # name: (MIME subtype, demuxer, encoder, frame rate, frames, width, height)
    "h264 mp4 3 s 64x48 10 fps": ("mp4", "mp4", "libx264", 10, 30, 64, 48),
    "vp9 webm 23.976 fps 48x64": ("webm", "webm", "libvpx-vp9", Fraction(24000, 1001), 25, 48, 64),
    "vp8 webm 25 fps": ("webm", "webm", "libvpx", 25, 20, 64, 48),
    "h264 7.5 fps, odd sample count": ("mp4", "mp4", "libx264", Fraction(15, 2), 22, 64, 48),
    "h264 29.97 fps 96x64": ("mp4", "mp4", "libx264", Fraction(30000, 1001), 40, 96, 64),
    "hevc mp4 one frame": ("mp4", "mp4", "libx265", 30, 1, 64, 64),
    "av1 mp4 60 fps": ("mp4", "mp4", "libaom-av1", 60, 10, 64, 48),
}


@pytest.fixture(scope="module")
def clips():
    return {name: encode_clip(demuxer, encoder, rate, count, width, height)
            for name, (_, demuxer, encoder, rate, count, width, height) in CLIPS.items()}


def reference(processor, text: str, frames: np.ndarray, video_fps: float, **kwargs):
    return processor(text=[text], videos=[frames], video_metadata=[{"total_num_frames": len(frames), "fps": video_fps}],
                     return_tensors="pt", **kwargs)


VIDEO_MESSAGES = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "state"}]}]


# ---------------------------------------------------------------- end to end: bytes -> tensors and ids


@pytest.mark.parametrize("name", list(CLIPS))
def test_load_video_equals_the_processor_on_read_video_frames(name, clips, processor, config, tokenizer, tmp_path):
    mime = CLIPS[name][0]
    data = clips[name]
    got = load_video(data, mime, FIELD, config)
    frames, fps = read_video_pinned(data, CLIPS[name][1], tmp_path)
    text = tokenizer.render_chat(VIDEO_MESSAGES)
    ref = reference(processor, text, frames, fps)
    assert torch.equal(got.pixel_values, ref["pixel_values_videos"])
    assert list(got.grid_thw) == ref["video_grid_thw"][0].tolist()
    ids, types = encode_prompt(tokenizer, text, [got.plan])
    assert ids == ref["input_ids"][0].tolist() and types == ref["mm_token_type_ids"][0].tolist()
    probe = probe_video(data, mime, FIELD)
    assert (probe.frame_count, probe.fps, probe.width, probe.height) == (len(frames), fps, frames.shape[2], frames.shape[1])


def test_measured_shapes(clips, config):
    """The shapes measured with the pinned processor for these clips (and the 1-frame grid_t 1)."""
    plan = load_video(clips["h264 mp4 3 s 64x48 10 fps"], "mp4", FIELD, config).plan
    assert plan.indices == (0, 6, 12, 17, 23, 29) and plan.grid_thw == (3, 4, 4) and plan.video_tokens == 12
    assert [timestamp_text(s) for s in plan.timestamps] == ["<0.3 seconds>", "<1.4 seconds>", "<2.6 seconds>"]
    odd = load_video(clips["h264 7.5 fps, odd sample count"], "mp4", FIELD, config).plan
    assert odd.indices == (0, 5, 10, 16, 21) and odd.grid_thw == (3, 4, 4)
    one = load_video(clips["hevc mp4 one frame"], "mp4", FIELD, config)
    assert one.plan.indices == (0,) and one.grid_thw == (1, 4, 4) and one.pixel_values.shape == (16, 1536)


def test_webm_header_has_no_frame_count_and_the_probe_counts(clips):
    data = clips["vp9 webm 23.976 fps 48x64"]
    with av.open(io.BytesIO(data), format="webm") as c:
        assert c.streams.video[0].frames == 0  # what transformers' own PyAV reader trusts
    probe = probe_video(data, "webm", FIELD)
    assert probe.frame_count == 25 and probe.codec == "vp9" and probe.fps == 24000 / 1001


def test_worked_example_from_the_docs(config):
    """docs/runtime.md: 3.0 s of 30 fps 320x240."""
    data = encode_clip("mp4", "libx264", 30, 90, 320, 240, noise=8, preset="ultrafast")
    probe = probe_video(data, "mp4", FIELD)
    assert (probe.frame_count, probe.fps, probe.width, probe.height) == (90, 30.0, 320, 240)
    plan = plan_video(probe.frame_count, probe.fps, probe.height, probe.width, config)
    assert plan.indices == (0, 18, 36, 53, 71, 89)
    assert (plan.height, plan.width) == (256, 320) and plan.grid_thw == (3, 16, 20)
    assert plan.tokens_per_pair == 80 and plan.video_tokens == 240
    assert plan.stamp_texts() == ["<0.3 seconds>", "<1.5 seconds>", "<2.7 seconds>"]
    frames = decode_frames(data, probe, plan, FIELD)
    assert frames.shape == (6, 3, 256, 320) and frames.dtype == torch.uint8
    # Resized in batches of any size (here one frame each), the frames are the same.
    assert torch.equal(decode_frames(data, probe, plan, FIELD, chunk_bytes=1), frames)


# ---------------------------------------------------------------- sampling, resize, patchify on a grid of shapes

FPS = [7.5, 24000 / 1001, 25.0, 30000 / 1001, 30.0, 60.0, 10.0, 2.0]
SIDES = [32, 33, 47, 48, 49, 63, 80, 81, 111, 112, 144, 240]  # 48 -> 64 and 80 -> 64: half to even


def video_processor(folder, config: VideoConfig):
    """A Qwen3VLVideoProcessor with the fixture's file settings and `config`'s pixel budget."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    return Qwen3VLVideoProcessor.from_pretrained(str(folder), size={"shortest_edge": config.min_pixels, "longest_edge": config.max_pixels})


BUDGETS = {  # (min_pixels, max_pixels): the file's, one that shrinks the frames, one that enlarges them
    "file": None,
    "tight": (4096, 64 * 64 * 6),
    "enlarging": (96 * 96 * 8, 25165824),
}


@pytest.fixture(scope="module")
def budget_processors(folder, config):
    out = {}
    for name, budget in BUDGETS.items():
        cfg = config if budget is None else dataclasses.replace(config, min_pixels=budget[0], max_pixels=budget[1])
        out[name] = (cfg, video_processor(folder, cfg))
    return out


@given(
    count=st.integers(1, 200),
    fps=st.sampled_from(FPS),
    height=st.sampled_from(SIDES),
    width=st.sampled_from(SIDES),
    budget=st.sampled_from(list(BUDGETS)),
    seed=st.integers(0, 2**16),
)
def test_frames_equal_the_video_processor_over_a_grid(count, fps, height, width, budget, seed, budget_processors, processor):
    cfg, reference_processor = budget_processors[budget]
    frames = frames_array(count, height, width, seed)
    got = preprocess_frames(torch.from_numpy(frames), fps, cfg)
    ref = reference_processor(videos=[frames], video_metadata=[{"total_num_frames": count, "fps": fps}],
                              return_metadata=True, return_tensors="pt")
    indices = ref["video_metadata"][0].frames_indices
    assert list(got.plan.indices) == list(indices)
    assert list(got.grid_thw) == ref["video_grid_thw"][0].tolist()
    assert torch.equal(got.pixel_values, ref["pixel_values_videos"])
    assert list(got.plan.timestamps) == processor._calculate_timestamps(indices, fps, 2)


@pytest.mark.parametrize(
    "count, fps, indices",
    [
        (1, 30.0, [0]),  # fewer frames than min_frames: all of them
        (2, 30.0, [0, 1]),
        (3, 30.0, [0, 1, 2]),
        (30, 10.0, [0, 6, 12, 17, 23, 29]),  # linspace 5.8, 11.6, 17.4 ...: numpy rounding
        (300, 30.0, [0, 16, 31, 47, 63, 79, 94, 110, 126, 142, 157, 173, 189, 205, 220, 236, 252, 268, 283, 299]),
        (100000, 1.0, None),  # capped at max_frames
    ],
)
def test_sample_indices(count, fps, indices, config):
    got = sample_indices(count, fps, config)
    if indices is None:
        assert len(got) == config.max_frames and got[0] == 0 and got[-1] == count - 1
    else:
        assert got == indices


def test_smart_resize_equals_transformers_and_sums_the_budget_over_frames(config):
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

    for frames in (1, 2, 3, 7, 200, 768):
        for height, width in ((32, 32), (48, 80), (240, 320), (480, 640), (1080, 1920), (33, 6000), (2048, 2048)):
            assert smart_resize_video(frames, height, width, config) == smart_resize(
                frames, height, width, 2, 32, config.min_pixels, config.max_pixels)
    # One 640x480 frame pair keeps its size; 200 sampled frames of it share the budget and shrink.
    assert smart_resize_video(2, 480, 640, config) == (480, 640)
    height, width = smart_resize_video(200, 480, 640, config)
    assert height < 480 and 200 * height * width <= config.max_pixels
    with pytest.raises(ValueError, match="must be larger than factor"):
        smart_resize_video(4, 31, 64, config)
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize_video(4, 32, 32 * 201, config)


def test_timestamps_cross_ten_seconds(processor, config, tokenizer):
    frames = frames_array(300, 32, 48)
    got = preprocess_frames(torch.from_numpy(frames), 25.0, config)
    stamps = got.plan.stamp_texts()
    assert len(stamps) == 12 and stamps[0] == "<0.3 seconds>" and stamps[-2:] == ["<10.7 seconds>", "<11.7 seconds>"]
    text = tokenizer.render_chat(VIDEO_MESSAGES)
    ref = reference(processor, text, frames, 25.0)
    ids, types = encode_prompt(tokenizer, text, [got.plan])
    assert ids == ref["input_ids"][0].tolist() and types == ref["mm_token_type_ids"][0].tolist()


def test_fps_media_kwarg_matches_the_processor(processor, config, tokenizer):
    frames = frames_array(40, 48, 64)
    cfg = config.with_media_kwargs({"fps": 1, "min_frames": 2, "max_frames": 3})  # the frame bounds change nothing in 5.4.0
    got = preprocess_frames(torch.from_numpy(frames), 10.0, cfg)
    text = tokenizer.render_chat(VIDEO_MESSAGES)
    ref = reference(processor, text, frames, 10.0, fps=1, min_frames=2, max_frames=3)
    assert got.plan.indices == (0, 13, 26, 39)
    assert torch.equal(got.pixel_values, ref["pixel_values_videos"])
    assert encode_prompt(tokenizer, text, [got.plan])[0] == ref["input_ids"][0].tolist()


# ---------------------------------------------------------------- prompt ids


def _image_png(width, height) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(frames_array(1, height, width)[0]).save(buffer, "PNG")
    return buffer.getvalue()


PROMPTS = {
    "video first": [{"type": "video"}, {"type": "text", "text": "state"}],
    "text ending in punctuation before the video": [{"type": "text", "text": "Look:"}, {"type": "video"}],
    "two videos around text": [{"type": "video"}, {"type": "text", "text": "then 12.5 later"}, {"type": "video"}],
    "image and video": [{"type": "text", "text": "a"}, {"type": "image"}, {"type": "video"}, {"type": "text", "text": "b."}],
}


@pytest.mark.parametrize("name", list(PROMPTS))
@pytest.mark.parametrize("expand_text", [False, True], ids=["pad ids repeated", "text expanded"])
def test_prompt_ids_equal_the_processor(name, expand_text, processor, config, tokenizer, monkeypatch):
    if expand_text:  # the path taken when a pad token is not a plain special token
        monkeypatch.setattr(video_module, "_stands_alone", lambda *_: False)
    content = PROMPTS[name]
    n_videos = sum(item["type"] == "video" for item in content)
    clips = [frames_array(count, 48, 64, seed=count) for count in (30, 17)[:n_videos]]
    fps = [10.0, 7.5][:n_videos]
    plans = [preprocess_frames(torch.from_numpy(c), f, config).plan for c, f in zip(clips, fps)]
    text = tokenizer.render_chat([{"role": "user", "content": content}])
    kwargs = {}
    image_counts = []
    if any(item["type"] == "image" for item in content):
        from PIL import Image

        kwargs["images"] = [Image.open(io.BytesIO(_image_png(96, 64)))]
        image_counts = [processor.image_processor(images=kwargs["images"], return_tensors="pt")["image_grid_thw"].prod().item() // 4]
    ref = processor(text=[text], videos=clips, video_metadata=[{"total_num_frames": len(c), "fps": f} for c, f in zip(clips, fps)],
                    return_tensors="pt", **kwargs)
    ids, types = encode_prompt(tokenizer, text, plans, image_counts)
    assert ids == ref["input_ids"][0].tolist()
    assert types == ref["mm_token_type_ids"][0].tolist()


@pytest.mark.parametrize("expand_text", [False, True], ids=["pad ids repeated", "text expanded"])
def test_a_prompt_without_media_keeps_the_processor_marker_as_text(expand_text, processor, tokenizer, monkeypatch):
    """The marker is refused only beside images or videos; without them the processor substitutes
    nothing, so the text is tokenized as it stands."""
    if expand_text:
        monkeypatch.setattr(video_module, "_stands_alone", lambda *_: False)
    text = tokenizer.render_chat([{"role": "user", "content": "literal <|placeholder|> text"}])
    ids, types = encode_prompt(tokenizer, text)
    assert ids == processor(text=[text], return_tensors="pt")["input_ids"][0].tolist() and not any(types)


def test_expand_videos_takes_the_first_triple_anywhere_then_bare_tokens(processor, config, tokenizer):
    """5.4.0 gives the first video to the first vision_start/video_pad/vision_end left anywhere in
    the text, even one after a bare video token; the bare one gets the next video."""
    clips = [(frames_array(4, 32, 32), 2.0), (frames_array(6, 32, 32), 1.0)]
    plans = [preprocess_frames(torch.from_numpy(c), f, config).plan for c, f in clips]
    assert plans[0].stamp_texts() == ["<0.2 seconds>", "<1.2 seconds>"]
    assert plans[1].stamp_texts() == ["<0.5 seconds>", "<2.5 seconds>", "<4.5 seconds>"]
    text = "<|im_start|>a <|video_pad|> b <|vision_start|><|video_pad|><|vision_end|> c<|im_end|>"
    expanded = expand_videos(text, plans)
    assert expanded.index("<0.5 seconds>") < expanded.index("<0.2 seconds>")
    ref = processor(text=[text], videos=[c for c, _ in clips], return_tensors="pt",
                    video_metadata=[{"total_num_frames": len(c), "fps": f} for c, f in clips])
    assert encode_prompt(tokenizer, text, plans)[0] == ref["input_ids"][0].tolist()


@pytest.mark.parametrize(
    "text, videos, message",
    [
        ("<|vision_start|><|video_pad|><|vision_end|>", 0, "holds 1 <\\|video_pad\\|> for 0 videos"),
        ("no video here", 1, "holds 0"),
        ("<|placeholder|> <|video_pad|>", 1, "must not contain <\\|placeholder\\|>"),
    ],
)
def test_prompt_refusals(text, videos, message, config, tokenizer):
    plan = plan_video(4, 2.0, 32, 32, config)
    with pytest.raises(ValueError, match=message):
        encode_prompt(tokenizer, text, [plan] * videos)


# ---------------------------------------------------------------- refusals: one RequestError naming the field


def test_every_limit_is_a_request_error(clips):
    mp4 = clips["h264 mp4 3 s 64x48 10 fps"]
    cases = [
        (mp4, "mp4", VideoLimits(max_bytes=1000), "bytes; the limit is 1000"),
        (mp4, "mp4", VideoLimits(max_seconds=2.5), "longer than 2.5 s"),
        (mp4, "mp4", VideoLimits(max_frames=29), "has 30 frames; the limit is 29"),  # the mp4 header states it
        (clips["vp9 webm 23.976 fps 48x64"], "webm", VideoLimits(max_frames=24), "more than 24 frames"),  # counted
        (mp4, "mp4", VideoLimits(max_fps=9), "frame rate 10 exceeds 9"),
        (mp4, "mp4", VideoLimits(max_side=63), "each side must be at most 63"),
        (mp4, "mp4", VideoLimits(min_side=49), "each side must be at least 49"),
        (mp4, "mp4", VideoLimits(max_pixels=3000), "3072 pixels; the limit is 3000"),
        (mp4, "mp4", VideoLimits(codecs=frozenset({"vp9"})), "codec h264 not accepted"),
        (mp4, "webm", VideoLimits(), "not a WebM file"),
        (clips["vp8 webm 25 fps"], "mp4", VideoLimits(), "not an MP4 file"),
        (mp4, "quicktime", VideoLimits(), "video type 'quicktime' not accepted"),
        (mp4[: len(mp4) // 2], "mp4", VideoLimits(), "cannot be decoded as mp4"),  # moov at the end: cut off
        (b"\x00\x00\x00\x18ftypisom" + bytes(64), "mp4", VideoLimits(), "cannot be decoded as mp4"),
    ]
    for data, mime, limits, message in cases:
        with pytest.raises(RequestError) as info:
            probe_video(data, mime, FIELD, limits)
        assert str(info.value).startswith(f"{FIELD}: ") and message in str(info.value), (message, str(info.value))


def test_codec_outside_the_allow_list_is_refused():
    data = encode_clip("mp4", "mpeg4", 10, 4, 64, 48)
    with pytest.raises(RequestError, match="codec mpeg4 not accepted; expected one of av1, h264, hevc, vp8, vp9"):
        probe_video(data, "mp4", FIELD)


def test_audio_only_file_is_refused():
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as out:
        stream = out.add_stream("aac", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
        frame.sample_rate = 8000
        for packet in [*stream.encode(frame), *stream.encode()]:
            out.mux(packet)
    with pytest.raises(RequestError, match="state.video: video has no video stream"):
        probe_video(buffer.getvalue(), "mp4", FIELD)


def test_frames_under_32_pixels_are_refused_before_the_processor_would():
    data = encode_clip("webm", "libvpx", 10, 4, 64, 16)
    with pytest.raises(RequestError, match="64x16; each side must be at least 32"):
        load_video(data, "webm", FIELD, VideoConfig())


@given(clip=st.sampled_from([("h264 mp4 3 s 64x48 10 fps", "mp4"), ("vp9 webm 23.976 fps 48x64", "webm")]),
       position=st.integers(0, 10**6), value=st.integers(0, 255), cut=st.booleans())
def test_damaged_bytes_decode_or_raise_a_request_error(clip, position, value, cut, clips, config):
    """No FFmpeg or Python exception but RequestError leaves the decoder, whatever the damage."""
    name, mime = clip
    data = bytearray(clips[name])
    index = position % len(data)
    if cut:
        data = data[:index]
    else:
        data[index] = value
    try:
        out = load_video(bytes(data), mime, FIELD, config)
    except RequestError as exc:
        assert str(exc).startswith(FIELD)
    else:
        assert out.pixel_values.shape[0] == out.plan.grid_thw[0] * out.plan.grid_thw[1] * out.plan.grid_thw[2]


# ---------------------------------------------------------------- configuration


def test_config_reads_the_base_values(config):
    assert (config.fps, config.min_frames, config.max_frames) == (2, 4, 768)
    assert (config.min_pixels, config.max_pixels) == (4096, 25165824)
    assert (config.patch_size, config.temporal_patch_size, config.merge_size) == (16, 2, 2)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_frames": 8}, "mutually exclusive"),
        ({"do_sample_frames": False}, "do_sample_frames must be true"),
        ({"video_metadata": {"fps": 3}}, "decoder's to set"),
        ({"crop_size": 3}, "unsupported keys \\['crop_size'\\]"),
        ({"size": {"shortest_edge": 4}}, "size must contain"),
        ({"fps": 0}, "fps must be a positive number"),
    ],
)
def test_media_kwargs_refusals(kwargs, message, config):
    with pytest.raises(ConfigError, match=message):
        config.with_media_kwargs(kwargs)


def test_size_media_kwarg_and_image_only_keys(config):
    cfg = config.with_media_kwargs({"size": {"shortest_edge": 1, "longest_edge": 2048}, "min_pixels": 5, "max_pixels": 6})
    assert (cfg.min_pixels, cfg.max_pixels) == (1, 2048)


@pytest.mark.parametrize("first_pts, key_interval", [(-2, 1), (-1, 2)], ids=["key frames only", "key frame every second"])
def test_a_webm_starting_before_zero_keeps_the_frames_the_pinned_decoder_keeps(first_pts, key_interval, config, tmp_path):
    """The pinned decoder seeks to 0 before decoding: frames before 0, and on a clip whose key
    frames straddle 0 also those up to the next key frame, never exist for it; the runtime's
    count and pixels follow it."""
    from parity.video_reader import read_video

    data = encode_clip("webm", "libvpx-vp9", 10, 8, 64, 48, first_pts=first_pts, g=str(key_interval))
    (tmp_path / "clip.webm").write_bytes(data)
    frames, _, info = read_video(str(tmp_path / "clip.webm"), pts_unit="sec", output_format="THWC")
    probe = probe_video(data, "webm", FIELD)
    assert (probe.frame_count, probe.fps) == (len(frames), info["video_fps"])
    expected = preprocess_frames(frames, info["video_fps"], config)
    got = load_video(data, "webm", FIELD, config)
    assert got.plan == expected.plan and torch.equal(got.pixel_values, expected.pixel_values)


def test_a_webm_whose_seek_to_zero_fails_is_refused():
    """One key frame before 0: FFmpeg refuses the seek, and the pinned decoder returned no frames."""
    data = encode_clip("webm", "libvpx-vp9", 10, 8, 64, 48, first_pts=-2, g="100")
    with pytest.raises(RequestError, match=r"^state.video: video cannot be read from its start"):
        probe_video(data, "webm", FIELD)
