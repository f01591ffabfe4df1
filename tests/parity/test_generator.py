"""The seeded request generator: deterministic, and covering every kind the gate's statistics need."""

from __future__ import annotations

import base64
import collections
import io
import json
import math

import pytest
from PIL import Image

from parity import generator


def _images(request) -> list[tuple[str, Image.Image]]:
    """(mime, decoded image) of every data URL in the request's state."""
    out = []
    text = json.dumps(request["state"])
    for part in text.split('"')[1:]:
        if part.startswith("data:image/"):
            head, data = part.split(",", 1)
            out.append((head[len("data:"):].split(";")[0], Image.open(io.BytesIO(base64.b64decode(data)))))
    return out


def test_the_video_set_is_the_video_group_that_ends_every_set():
    videos = generator.SETS["video"]()
    assert videos and {case for case, _, _ in videos} == {"video"}
    assert generator.ci_set()[-len(videos):] == videos == generator.gpu_set()[-len(videos):]


def test_same_seed_same_bytes_other_seed_other_requests():
    assert generator.gpu_set(0) == generator.gpu_set(0)
    assert generator.ci_set(0) == generator.ci_set(0)
    assert generator.ci_set(1) != generator.ci_set(0)


@pytest.mark.parametrize("name, minimum", [("ci", generator.CI_QUESTIONS), ("gpu", 200)])
def test_sets_have_enough_questions_of_every_kind(name, minimum):
    requests = generator.SETS[name]()
    questions = [q for _, _, r in requests for q in r["questions"].values()]
    assert len(questions) >= minimum
    kinds = collections.Counter(q["type"] for q in questions)
    assert set(kinds) == {"choice", "noul", "score"}
    assert {n.split("-", 1)[1] for c, n, _ in requests if c != "video"} == set(generator.STATE_KINDS)
    assert any(len(r["questions"]) >= 3 and len({q["type"] for q in r["questions"].values()}) >= 2 for _, _, r in requests)  # mixed
    assert any(None in q["criteria"].values() for q in questions if q["type"] == "choice")
    assert {len(q["criteria"]) for q in questions if q["type"] == "choice"} >= {1, 2, 3}
    ids = [f"{c}/{n}" for c, n, _ in requests]
    assert len(ids) == len(set(ids))


def test_gpu_set_covers_every_score_grade_count():
    grades = {len(q["criteria"]) for _, _, r in generator.gpu_set() for q in r["questions"].values() if q["type"] == "score"}
    assert grades == set(range(2, 11))


def test_images_cover_formats_sizes_orientation_and_alpha():
    seen = collections.defaultdict(list)
    for _, name, request in generator.gpu_set():
        for mime, image in _images(request):
            seen[name.split("-", 1)[1]].append((mime, image))
    mimes = {m for items in seen.values() for m, _ in items}
    assert mimes == {"image/png", "image/jpeg"}
    assert all(img.width != img.height for _, img in seen["png"] + seen["jpeg"])  # non-square
    assert any(img.width % 2 and img.height % 2 for _, img in seen["png"])  # odd sizes
    assert all(img.mode == "RGBA" for _, img in seen["rgba"])
    orientations = {img.getexif().get(0x0112) for _, img in seen["exif"]}
    assert orientations <= set(range(2, 9)) and len(orientations) >= 3
    assert all(img.width * img.height < 65536 for _, img in seen["small"])
    for _, name, request in generator.gpu_set():
        if name.endswith("two_images"):
            assert len(_images(request)) == 2


def test_half_sizes_are_where_round_half_even_and_half_up_differ():
    from valen_runtime.image import smart_resize

    for _, name, request in generator.ci_set():
        if not name.endswith("-half"):
            continue
        (_, img), = _images(request)
        for side in (img.width, img.height):
            assert (side / 32) % 1 == 0.5 and math.floor(side / 32) % 2 == 0  # .5 above an even multiple
        h, w = smart_resize(img.height, img.width, 32, 65536, 16777216)
        assert (h, w) == (round(img.height / 32) * 32, round(img.width / 32) * 32)  # the rounding decides the grid
        assert (h, w) != (math.floor(img.height / 32 + 0.5) * 32, math.floor(img.width / 32 + 0.5) * 32)


def test_long_states_span_more_than_two_delta_rule_chunks(tiny_export):
    from valen_runtime.request import Compiler

    compiler = Compiler.from_dir(tiny_export["separate"])
    lengths = [len(compiler.compile(r).state.input_ids) for _, n, r in generator.ci_set() if n.endswith("-long")]
    assert lengths and min(lengths) > 2 * 64
    every = [compiler.compile(r) for _, _, r in generator.ci_set()]  # every generated request is valid for the runtime
    assert len(every) == len(generator.ci_set())


def test_unicode_reaches_states_keys_and_descriptions():
    text = json.dumps([r for _, _, r in generator.gpu_set()], ensure_ascii=False)
    for needle in ("白色", "\u0301", "👍🏽", "नमस्ते", "مرحبا", "🤷"):
        assert needle in text
