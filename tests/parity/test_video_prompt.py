"""Video states on the reference side: the wire translation, the `video` case group, and the
reference prompt builder through the pinned processor against valen_runtime.video (an independent
implementation of the same processor: ids, token types, grid and pixels must be identical)."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
import torch

from parity import cases, generator, prompt, video_reader
from valen_runtime.tokenizer import Tokenizer
from valen_runtime.video import VideoConfig, encode_prompt, load_video, sample_indices, timestamp_text

MP4 = cases.video_data_url("mp4_short")
WEBM = cases.video_data_url("webm_vp9_odd")


def _bytes(url: str) -> bytes:
    return base64.b64decode(url.split(",", 1)[1])


# ---------------------------------------------------------------- wire -> record


@pytest.mark.parametrize("url, suffix", [(MP4, ".mp4"), (WEBM, ".webm")])
def test_a_video_state_becomes_one_video_url_item_with_its_file(tmp_path, url, suffix):
    rec = prompt.wire_to_state({"video": url}, tmp_path)
    assert rec == {"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": str(tmp_path / f"input{suffix}")}}]}]}
    assert (tmp_path / f"input{suffix}").read_bytes() == _bytes(url)


@pytest.mark.parametrize("item", [{"type": "video_url", "video_url": WEBM}, {"type": "video_url", "video_url": {"url": WEBM}}])
def test_message_video_items_are_written_and_the_text_around_them_kept(tmp_path, item):
    state = {"messages": [{"role": "user", "content": [{"type": "text", "text": "before"}, item, {"type": "text", "text": "after"}]}]}
    content = prompt.wire_to_state(state, tmp_path)["messages"][0]["content"]
    assert content == [{"type": "text", "text": "before"}, {"type": "video_url", "video_url": {"url": str(tmp_path / "input.webm")}},
                       {"type": "text", "text": "after"}]
    assert (tmp_path / "input.webm").read_bytes() == _bytes(WEBM)


@pytest.mark.parametrize("state, message", [
    ({"video": "data:video/avi;base64,AAAA"}, "video: expected a data:video/mp4;base64,... or data:video/webm;base64,... URL"),
    ({"video": 3}, "video: expected"),
    ({"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": MP4}, {"type": "video_url", "video_url": WEBM}]}]},
     "at most one video per request"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": cases.images()["small_png"]}, {"type": "video_url", "video_url": MP4}]}]},
     "no image beside the video"),
])
def test_video_refusals(tmp_path, state, message):
    with pytest.raises(prompt.PromptError, match=message.replace("(", r"\(").replace(".", r"\.").replace("+", r"\+")):
        prompt.wire_to_state(state, tmp_path)


# ---------------------------------------------------------------- the case group


def test_the_video_group_covers_the_brief(text_assets):
    group = cases.cases("video")
    assert len(group) == 3 and {c for c, _, _ in group} == {"video"}
    kinds = {q["type"] for _, _, r in group for q in r["questions"].values()}
    assert kinds == {"choice", "noul", "score"}
    assert {spec[:2] for spec in cases.CLIPS.values()} == {("mp4", "libx264"), ("webm", "libvpx-vp9")}
    config = VideoConfig.from_file(text_assets[0] / "video_preprocessor_config.json")
    sampled = {name: sample_indices(count, float(rate), config) for name, (_, _, rate, count, *_) in cases.CLIPS.items()}
    assert len(sampled["webm_vp9_odd"]) % 2 == 1
    long = sampled["mp4_long"]
    assert len(long) < cases.CLIPS["mp4_long"][3] and long[-1] / cases.CLIPS["mp4_long"][2] > 10  # frames skipped, stamps past 10 s
    assert any(isinstance(r["state"], dict) and list(r["state"]) == ["video"] for _, _, r in group)
    items = [r["state"]["messages"][-1]["content"] for _, n, r in group if "messages" in r["state"]]
    assert any([i["type"] for i in c] == ["text", "video_url", "text"] for c in items)  # text before and after
    assert {type(i["video_url"]).__name__ for c in items for i in c if i["type"] == "video_url"} == {"str", "dict"}
    # branches: one per choice / noul question, one per score grade; few, for the CPU gate's time
    assert sum(len(q["criteria"]) if q["type"] == "score" else 1 for _, _, r in group for q in r["questions"].values()) == 4


def test_clips_are_the_same_bytes_when_encoded_again():
    first = [cases.video_data_url(name) for name in cases.CLIPS]
    cases.video_data_url.cache_clear()
    assert [cases.video_data_url(name) for name in cases.CLIPS] == first


CLIPS_BEFORE_AND_AFTER_A_REQUEST = """
import json, sys
from parity import cases
from valen_runtime.cli import main
def clips():
    cases.video_data_url.cache_clear()
    return [cases.video_data_url(name) for name in reversed(cases.CLIPS)]  # mp4_long first: it showed the fault
before = clips()
try:
    main.main(["--export", sys.argv[1], "--device", "cpu", sys.argv[2]], standalone_mode=False)
except SystemExit as exit:
    assert not exit.code, exit.code
print(json.dumps([clips() == before for _ in range(3)]))
"""


def test_clips_are_the_same_bytes_before_and_after_the_runtime_ran(tiny_export, tmp_path):
    # x264's mbtree gave other bytes once a torch CPU request had run in the process (clips.py):
    # in a child process, whose first encoding comes before any torch work.
    import json
    import subprocess
    import sys

    request = {"model": "valen-preview-0923", "state": "The parcel came late.",
               "questions": {"q": {"type": "choice", "instructions": "What next?", "criteria": {"a": "Refund", "b": "Wait"}}}}
    (tmp_path / "request.json").write_text(json.dumps(request))
    child = subprocess.run([sys.executable, "-c", CLIPS_BEFORE_AND_AFTER_A_REQUEST, str(tiny_export["separate"]), str(tmp_path / "request.json")],
                           capture_output=True, text=True, cwd=Path(__file__).parents[2])
    assert child.returncode == 0, child.stderr[-2000:]
    assert json.loads(child.stdout.splitlines()[-1]) == [True] * 3


def test_every_generated_set_ends_with_the_video_group():
    group = cases.cases("video")
    for make in generator.SETS.values():
        requests = make()
        assert requests[-len(group):] == group
        assert not any("data:video/" in repr(r["state"]) for _, _, r in requests[:-len(group)])


# ---------------------------------------------------------------- the reference builder vs valen_runtime.video


@pytest.fixture(scope="module")
def builder(text_assets):
    from transformers import AutoProcessor

    return prompt.ReferencePromptBuilder(AutoProcessor.from_pretrained(str(text_assets[0]), local_files_only=True))


@pytest.fixture()
def reader_calls(monkeypatch):
    """parity.video_reader installed as torchvision's read_video, as in the reference process; records its calls."""
    import torchvision.io

    calls = []

    def counting(filename, *args, **kwargs):
        calls.append((filename, args, kwargs))
        return video_reader.read_video(filename, *args, **kwargs)

    monkeypatch.setattr(torchvision.io, "read_video", counting, raising=False)
    return calls


@pytest.mark.parametrize("name", [n for n, _ in cases.video_case()])
def test_reference_prompt_equals_valen_runtime_video(name, builder, reader_calls, text_assets, tmp_path):
    request = dict(cases.video_case())[name]
    ref = builder.build(request, tmp_path)
    (path,) = [m["path"] for m in ref.media if "path" in m]
    assert reader_calls == [(path, (), {"start_pts": 0.0, "end_pts": None, "pts_unit": "sec", "output_format": "TCHW"})]

    folder = text_assets[0]
    config = VideoConfig.from_file(folder / "video_preprocessor_config.json")
    tokenizer = Tokenizer.from_dir(folder)
    processed = load_video(Path(path).read_bytes(), Path(path).suffix[1:], "state.video", config)
    (tmp_path / "again").mkdir()
    messages, _ = builder.messages(prompt.wire_to_state(request["state"], tmp_path / "again"))
    ids, types = encode_prompt(tokenizer, tokenizer.render_chat(messages), [processed.plan])

    base = ref.base
    assert base["input_ids"][0].tolist() == ids
    assert base["mm_token_type_ids"][0].tolist() == types
    assert base["video_grid_thw"].tolist() == [list(processed.grid_thw)]
    assert torch.equal(base["pixel_values_videos"], processed.pixel_values)
    assert "pixel_values" not in base and "image_grid_thw" not in base
    assert ref.media[-1] == {"video_grid_thw": [list(processed.grid_thw)], "visual_tokens": processed.plan.video_tokens}
    record = ref.to_json()
    assert record["video_grid_thw"] == [list(processed.grid_thw)] and record["image_grid_thw"] is None
    inputs = builder.branch_inputs(ref, ref.questions[0].branches[0])
    assert torch.equal(inputs["pixel_values_videos"], base["pixel_values_videos"]) and torch.equal(inputs["video_grid_thw"], base["video_grid_thw"])
    assert inputs["mm_token_type_ids"][0].tolist() == types + [0] * len(ref.questions[0].branches[0].suffix_ids)
    if name == "mp4_long_text_around":
        stamps = [timestamp_text(s) for s in processed.plan.timestamps]
        assert len(stamps) == 12 and stamps[0] == "<0.3 seconds>" and stamps[-1] == "<11.5 seconds>"  # one digit, then two


# ---------------------------------------------------------------- the harness's video checks


def _video_request_measured(ref_grid, rt_grid, ref_pixels, rt_pixels):
    """measure_request on one video request without questions: only the exact checks speak."""
    from types import SimpleNamespace

    from parity import compare
    from parity import tolerances

    gate = tolerances.select(tolerances.load(), "separate", "bf16", "cpu", "per-branch")
    ids, types = [1, 2, 2, 3], [0, 2, 2, 0]
    state = SimpleNamespace(input_ids=ids, mm_token_type_ids=types, image_grid_thw=None, pixel_values=None,
                            video_grid_thw=torch.tensor(rt_grid), pixel_values_videos=rt_pixels)
    compiled = SimpleNamespace(state=state, questions=[], logical_tokens=4, compute_tokens=0)
    response = {"answers": {}, "usage": {"input_tokens": 4, "output_tokens": 0}, "internal_usage": {"compute_tokens": 0}}
    outcome = SimpleNamespace(result=SimpleNamespace(compiled=compiled, response=response, logits=[], timings={}), rejected=None, crashed=None,
                              rotary={"positions": torch.zeros(3, 4, dtype=torch.long), "tables": torch.zeros(2, 4, 2)})
    record = {"ok": True, "prompt": {"input_ids": ids, "mm_token_type_ids": types, "image_grid_thw": None, "video_grid_thw": ref_grid,
                                     "questions": [], "logical_tokens": 4, "compute_tokens": 0, "media": []}}
    rotary = {"positions": torch.zeros(3, 4, dtype=torch.long), "tables": torch.zeros(2, 4, 2)}
    return compare.measure_request("video", "x", {"bf16": record}, "bf16", outcome, gate, ref_rotary=rotary, ref_pixels_videos=ref_pixels)


def test_video_grid_and_pixels_are_compared_exactly():
    pixels = torch.rand(8, 6)
    same = _video_request_measured([[1, 2, 4]], [[1, 2, 4]], pixels, pixels.clone())
    assert same["problems"] == [] and same["checks"]["pixel_values_videos"]["max_abs"] == 0
    grid = _video_request_measured([[1, 2, 4]], [[1, 4, 2]], pixels, pixels.clone())
    assert grid["problems"] == ["token_ids: state.video_grid_thw: reference [[1, 2, 4]], runtime [[1, 4, 2]]"]
    moved = pixels.clone()
    moved[3, 1] = torch.nextafter(moved[3, 1], torch.tensor(2.0))  # one ulp
    off = _video_request_measured([[1, 2, 4]], [[1, 2, 4]], pixels, moved)
    assert len(off["problems"]) == 1 and off["problems"][0].startswith("pixel_values_videos: pixel_values_videos max |Δ|")
