"""valen_runtime.request: state prefix vs transformers 5.4.0, suffix segments per docs/valen-model.md,
request validation (docs/wire-contract.md) and a property test that nothing but RequestError escapes."""

import base64
import hashlib
import io
import json
import os
import struct
import subprocess
import sys
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from PIL import Image

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from valen_runtime.request import (  # noqa: E402
    MAX_BODY,
    NOUL_CANDIDATES,
    CompiledRequest,
    Compiler,
    parse_request_bytes,
)
from valen_runtime.errors import RequestError  # noqa: E402
from valen_runtime.image import ImageLimits  # noqa: E402
from valen_runtime.wire import MAX_VIDEO_BODY  # noqa: E402

MODEL = "valen-preview-0923"
NOUL_TRUE = "True / 是：满足问题中的条件。"
NOUL_FALSE = "False / 否：不满足问题中的条件。"


@pytest.fixture(scope="module")
def folder(text_assets):
    return text_assets[0]


@pytest.fixture(scope="module")
def compiler(folder):
    return Compiler.from_dir(folder)


@pytest.fixture(scope="module")
def processor(folder):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(folder))


@pytest.fixture(scope="module")
def hf_encode(processor):
    def encode(text):
        return processor.tokenizer.encode(text, add_special_tokens=False)

    return encode


def png(width, height, mode="RGB", seed=0) -> bytes:
    rng = np.random.default_rng(seed)
    channels = 4 if mode == "RGBA" else 3
    image = Image.fromarray(rng.integers(0, 256, (height, width, channels), dtype=np.uint8), mode)
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def jpeg_rotated(width, height) -> bytes:
    rng = np.random.default_rng(3)
    image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    exif = image.getexif()
    exif[0x0112] = 8
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", exif=exif, quality=90)
    return buffer.getvalue()


def data_url(data: bytes, fmt="png") -> str:
    return f"data:image/{fmt};base64," + base64.b64encode(data).decode("ascii")


def choice(criteria=None, instructions="Should we refund the customer?"):
    return {"type": "choice", "instructions": instructions, "criteria": criteria or {"refund": "Refund now", "wait": None}}


def request(state="The card was charged twice for one order.", questions=None):
    return {"model": MODEL, "state": state, "questions": questions or {"q1": choice()}}


def reference_state(processor, messages):
    """What Valen's compiler gets from transformers for the state messages."""
    return processor.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=False, return_dict=True, return_tensors="pt",
        processor_kwargs={"return_metadata": True},
    )


def assert_state_equal(state, expected):
    assert state.input_ids == expected["input_ids"][0].tolist()
    assert state.mm_token_type_ids == expected["mm_token_type_ids"][0].tolist()
    if "pixel_values" in expected:
        assert state.pixel_values.dtype == torch.float32 and state.image_grid_thw.dtype == torch.int64
        assert torch.equal(state.image_grid_thw, expected["image_grid_thw"])
        assert torch.equal(state.pixel_values, expected["pixel_values"])  # bitwise
    else:
        assert state.pixel_values is None and state.image_grid_thw is None


# ------------------------------------------------------------------ state vs transformers 5.4.0

TEXT_STATES = [
    "The card was charged twice for one order.",
    "  leading and trailing whitespace is trimmed by the template \n\t",
    "白色棋子在左上角。黑色呢？",
    "हिन्दी में पाठ। क्या यह सही है? मैंने किताब पढ़ी।",
    "ภาษาไทย น้ำ",
    "emoji 😀 👍🏽 👨‍👩‍👧 and <think> tags",
    "line one\nline two\r\n\ttabbed",
]


@pytest.mark.parametrize("text", TEXT_STATES)
def test_text_state_matches_transformers(compiler, processor, text):
    compiled = compiler.compile(request(state=text))
    expected = reference_state(processor, [{"role": "user", "content": [{"type": "text", "text": text}]}])
    assert_state_equal(compiled.state, expected)


@pytest.mark.parametrize("value", [{"b": [1, 2.5, None, True], "a": "é 白", "nested": {"x": []}}, ["x", {"y": 1}], {}])
def test_json_state_is_serialised_with_ensure_ascii_false(compiler, processor, value):
    compiled = compiler.compile(request(state=value))
    text = json.dumps(value, ensure_ascii=False)
    expected = reference_state(processor, [{"role": "user", "content": [{"type": "text", "text": text}]}])
    assert_state_equal(compiled.state, expected)


IMAGE_CASES = {
    "png-rgb": lambda: (png(64, 48), "png"),
    "png-rgba": lambda: (png(97, 33, "RGBA"), "png"),
    "jpeg-exif-rotated": lambda: (jpeg_rotated(150, 90), "jpeg"),
    "png-1024x768": lambda: (png(1024, 768), "png"),
    "png-tiny": lambda: (png(2, 3), "png"),
}


@pytest.mark.parametrize("case", sorted(IMAGE_CASES))
def test_image_state_matches_transformers(compiler, processor, case):
    data, fmt = IMAGE_CASES[case]()
    url = data_url(data, fmt)
    compiled = compiler.compile(request(state={"image": url}))
    expected = reference_state(processor, [{"role": "user", "content": [{"type": "image", "url": url}]}])
    assert_state_equal(compiled.state, expected)
    grid = compiled.state.image_grid_thw
    assert sum(compiled.state.mm_token_type_ids) == int(grid.prod(-1).sum()) // 4


@pytest.mark.parametrize("decode_in_thread", [True, False], ids=["threaded", "serial"])
def test_on_images_gets_the_compiled_images_once_on_the_calling_thread(folder, monkeypatch, decode_in_thread):
    # The engine starts the vision tower from this hook: it must run once, on the caller's thread
    # (the CUDA stream is per thread), with exactly what the compiled state ends up with. With the
    # decode pool the state is tokenized while the images decode, so the hook comes after the
    # tokenizer; without it the images are ready first and the hook comes before it.
    compiler = Compiler.from_dir(folder, decode_in_thread=decode_in_thread)
    events, seen, threads = [], [], []
    real_encode = compiler.tokenizer.encode_prompt
    monkeypatch.setattr(compiler.tokenizer, "encode_prompt", lambda text: events.append("tokenize") or real_encode(text))

    def on_images(images):
        events.append("images")
        seen.append(images)
        threads.append(threading.get_ident())

    urls = [data_url(png(70, 50, seed=3)), data_url(png(40, 90, seed=4))]
    state = {"messages": [{"role": "user", "content": [{"type": "image", "image": u} for u in urls]}]}
    compiled = compiler.compile(request(state=state), on_images)
    assert events == (["tokenize", "images"] if decode_in_thread else ["images", "tokenize"])
    assert threads == [threading.get_ident()]
    (images,) = seen
    assert torch.equal(images.grid_thw, compiled.state.image_grid_thw)
    assert torch.equal(images.pixel_values_on("cpu"), compiled.state.pixel_values)
    events.clear()
    compiler.compile(request(state="text only"), on_images)
    assert events == ["tokenize"]


def test_messages_with_two_images_match_transformers(compiler, processor):
    first, second = data_url(png(70, 50, seed=1)), data_url(jpeg_rotated(40, 90), "jpeg")
    state = {
        "messages": [
            {"role": "system", "content": "You judge boards."},
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": first}},
                    {"type": "text", "text": " Which is white? "},
                    {"type": "image", "image": second},
                ],
            },
            {"role": "assistant", "content": [{"type": "text", "text": "left"}]},
            {"role": "user", "content": "and now?"},
        ]
    }
    compiled = compiler.compile(request(state=state))
    expected = reference_state(
        processor,
        [
            {"role": "system", "content": [{"type": "text", "text": "You judge boards."}]},
            {
                "role": "user",
                "content": [
                    {"type": "image", "url": first},
                    {"type": "text", "text": " Which is white? "},
                    {"type": "image", "url": second},
                ],
            },
            {"role": "assistant", "content": [{"type": "text", "text": "left"}]},
            {"role": "user", "content": [{"type": "text", "text": "and now?"}]},
        ],
    )
    assert_state_equal(compiled.state, expected)
    assert compiled.state.image_grid_thw.shape == (2, 3)


# ------------------------------------------------------------------ suffix golden tests (§8.5)


def expected_branch(hf_encode, base, kind, instructions, items):
    """Segments of docs/valen-model.md (prompt format), each encoded on its own by transformers' tokenizer."""
    suffix = hf_encode("<|im_start|>user\n")
    suffix += hf_encode(f"Task: {kind}\nQuestion: {instructions}\nCandidates:\n")
    positions = []
    for text in items:
        suffix += hf_encode(text)
        positions.append(base + len(suffix) - 1)
        suffix += hf_encode("\n")
    suffix += hf_encode("Decision:")
    return suffix, positions, base + len(suffix) - 1


def test_choice_branch_segments_and_positions(compiler, hf_encode):
    criteria = {"refund": "Refund the order?", "wait": None, "ask": "Ask for details:"}
    compiled = compiler.compile(request(questions={"q1": choice(criteria, "Refund or wait?")}))
    base = len(compiled.state.input_ids)
    (question,) = compiled.questions
    assert question.kind == "choice" and question.keys == ["refund", "wait", "ask"]
    assert question.descriptions == ["Refund the order?", "wait", "Ask for details:"]  # null -> key
    (branch,) = question.branches
    suffix, positions, decision = expected_branch(
        hf_encode, base, "choice", "Refund or wait?", ["refund: Refund the order?", "wait: wait", "ask: Ask for details:"]
    )
    assert branch.suffix_ids == suffix
    assert branch.candidate_positions == positions
    assert branch.decision_position == decision == base + len(branch.suffix_ids) - 1
    assert branch.suffix_ids[:3] == hf_encode("<|im_start|>user\n") and len(hf_encode("<|im_start|>user\n")) == 3
    # Segment boundaries matter: "?" + "\n" encoded together merge into one token here.
    whole = hf_encode(
        "<|im_start|>user\nTask: choice\nQuestion: Refund or wait?\nCandidates:\n"
        "refund: Refund the order?\nwait: wait\nask: Ask for details:\nDecision:"
    )
    assert whole != branch.suffix_ids


def test_noul_uses_fixed_bilingual_candidates(compiler, hf_encode):
    assert NOUL_CANDIDATES == (("true", NOUL_TRUE), ("false", NOUL_FALSE))
    for (_, text), digest, size, points in (
        (NOUL_CANDIDATES[0], "6013d06fe04f22ce6913bd38a63e0b8f0a8e5f4b67b9bbe788633b5ebdad32dc", 40, 18),
        (NOUL_CANDIDATES[1], "8682831f01e2c5676edeff84b87f29faee29b26872a9fc034082cdb9b8c9912c", 44, 20),
    ):
        assert hashlib.sha256(text.encode("utf-8")).hexdigest() == digest
        assert len(text.encode("utf-8")) == size and len(text) == points
    assert NOUL_TRUE.encode("utf-8").hex(" ").upper() == (
        "54 72 75 65 20 2F 20 E6 98 AF EF BC 9A E6 BB A1 E8 B6 B3 E9 97 AE E9 A2 98 E4 B8 AD E7 9A 84 E6 9D A1 E4 BB B6 E3 80 82"
    )
    question = {"type": "noul", "instructions": "Is the light on?"}
    compiled = compiler.compile(request(questions={"n": question}))
    base = len(compiled.state.input_ids)
    (q,) = compiled.questions
    assert q.keys == ["true", "false"]
    assert [d.encode("utf-8") for d in q.descriptions] == [NOUL_TRUE.encode("utf-8"), NOUL_FALSE.encode("utf-8")]
    (branch,) = q.branches
    suffix, positions, decision = expected_branch(
        hf_encode, base, "noul", "Is the light on?", [f"true: {NOUL_TRUE}", f"false: {NOUL_FALSE}"]
    )
    assert (branch.suffix_ids, branch.candidate_positions, branch.decision_position) == (suffix, positions, decision)
    # The candidate position is the last token of "。", not a merged "。\n".
    ids = compiled.state.input_ids + branch.suffix_ids
    assert ids[positions[0]] == hf_encode("。")[-1] and ids[positions[0] + 1] == hf_encode("\n")[0]


def test_noul_criteria_may_be_absent(compiler):
    compiled = compiler.compile(request(questions={"n": {"type": "noul", "instructions": "Lit?"}}))
    assert compiled.questions[0].keys == ["true", "false"]


def test_score_has_one_branch_per_grade_and_hides_grade_ids(compiler, hf_encode, processor):
    levels = ["Not severe at all", "Somewhat severe", "Very severe?"]
    question = {"type": "score", "instructions": "How severe is it?", "criteria": levels}
    compiled = compiler.compile(request(questions={"s": question}))
    base = len(compiled.state.input_ids)
    (q,) = compiled.questions
    assert q.kind == "score" and q.keys == ["0", "1", "2"] and q.descriptions == levels
    assert len(q.branches) == 3
    for grade, branch in enumerate(q.branches):
        suffix, positions, decision = expected_branch(hf_encode, base, "score", "How severe is it?", [levels[grade]])
        assert (branch.suffix_ids, branch.candidate_positions, branch.decision_position) == (suffix, positions, decision)
        text = processor.tokenizer.decode(branch.suffix_ids)
        assert levels[grade] in text
        assert all(other not in text for i, other in enumerate(levels) if i != grade)
        assert f"{grade}:" not in text and f"{grade}: " not in text
    suffix_total = sum(len(b.suffix_ids) for b in q.branches)
    assert compiled.logical_tokens == base + suffix_total
    assert compiled.compute_tokens == 3 * base + suffix_total


def test_unicode_questions_follow_segments(compiler, hf_encode):
    criteria = {"白": "白色先走。", "काला": "काला मोहरा 👍🏽", "e\u0301": "combining accent"}
    compiled = compiler.compile(request(state="棋盘", questions={"ü": choice(criteria, "हिन्दी में सवाल? 😀")}))
    base = len(compiled.state.input_ids)
    (branch,) = compiled.questions[0].branches
    items = [f"{k}: {v}" for k, v in criteria.items()]
    suffix, positions, decision = expected_branch(hf_encode, base, "choice", "हिन्दी में सवाल? 😀", items)
    assert (branch.suffix_ids, branch.candidate_positions, branch.decision_position) == (suffix, positions, decision)


def test_instructions_are_inserted_verbatim(compiler, hf_encode):
    compiled = compiler.compile(request(questions={"q": choice(instructions="  spaced out  ")}))
    (branch,) = compiled.questions[0].branches
    segment = hf_encode("Task: choice\nQuestion:   spaced out  \nCandidates:\n")
    assert branch.suffix_ids[3 : 3 + len(segment)] == segment


def test_questions_keep_request_order_and_accounting(compiler):
    questions = {
        "zeta": choice(),
        "alpha": {"type": "score", "instructions": "Rate", "criteria": ["low", "mid", "high"]},
        "mid": {"type": "noul", "instructions": "Ok?"},
    }
    compiled = compiler.compile(request(questions=questions))
    assert isinstance(compiled, CompiledRequest) and compiled.model == MODEL
    assert [q.qid for q in compiled.questions] == ["zeta", "alpha", "mid"]
    base = len(compiled.state.input_ids)
    branches = [b for q in compiled.questions for b in q.branches]
    assert len(branches) == 1 + 3 + 1
    assert compiled.logical_tokens == base + sum(len(b.suffix_ids) for b in branches)
    assert compiled.compute_tokens == sum(base + len(b.suffix_ids) for b in branches)


def test_max_length_refusal_uses_reference_message(folder):
    probe = Compiler.from_dir(folder).compile(request())
    length = len(probe.state.input_ids) + len(probe.questions[0].branches[0].suffix_ids)
    assert Compiler.from_dir(folder, max_length=length).compile(request()).questions  # exactly at the limit
    with pytest.raises(RequestError) as info:
        Compiler.from_dir(folder, max_length=length - 1).compile(request())
    assert info.value.field == "questions.q1"
    # The field path once, then the reference's wording (not "questions.q1: q1: ...").
    assert str(info.value) == f"questions.q1: {length} tokens exceed max_length={length - 1}; no truncation"


def test_compile_bytes_round_trip(compiler):
    body = json.dumps(request(), ensure_ascii=False).encode("utf-8")
    assert compiler.compile_bytes(body).state.input_ids == compiler.compile(request()).state.input_ids


# ------------------------------------------------------------------ validation: one test per rule

LONG = "x" * 257
SMALL_PNG = data_url(png(4, 4))


def q_with(**changes):
    question = choice()
    question.update(changes)
    return {"q": question}


REFUSALS = [
    # (request, field, phrase)
    (["not", "an", "object"], "body", "JSON object"),
    ({**request(), "extra": 1}, "extra", "unknown field"),
    ({"state": "s", "questions": {"q": choice()}}, "model", "required"),
    ({"model": MODEL, "questions": {"q": choice()}}, "state", "required"),
    ({"model": MODEL, "state": "s"}, "questions", "required"),
    ({**request(), "model": "Valen"}, "model", "valen-preview-0923"),
    (request(questions=[choice()]), "questions", "object"),
    ({"model": MODEL, "state": "s", "questions": {}}, "questions", "1-8"),
    (request(questions={f"q{i}": choice() for i in range(9)}), "questions", "1-8"),
    (request(questions={"": choice()}), "questions.", "1-256"),
    (request(questions={LONG: choice()}), f"questions.{LONG}", "1-256"),
    (request(questions={"q": "choice"}), "questions.q", "object"),
    (request(questions=q_with(extra=1)), "questions.q.extra", "unknown field"),
    (request(questions=q_with(type="rank")), "questions.q.type", "choice, noul, score"),
    (request(questions={"q": {"instructions": "x", "criteria": {"a": "b"}}}), "questions.q.type", "choice"),
    (request(questions=q_with(instructions=None)), "questions.q.instructions", "string"),
    (request(questions=q_with(instructions=" \n\t")), "questions.q.instructions", "non-empty"),
    (request(questions=q_with(instructions="a <|im_end|> b")), "questions.q.instructions", "<|im_end|>"),
    (request(questions=q_with(criteria=["a", "b"])), "questions.q.criteria", "object"),
    (request(questions=q_with(criteria={})), "questions.q.criteria", "1-255"),
    (request(questions=q_with(criteria={f"k{i}": "d" for i in range(256)})), "questions.q.criteria", "1-255"),
    (request(questions=q_with(criteria={"": "d"})), "questions.q.criteria.", "1-256"),
    (request(questions=q_with(criteria={LONG: "d"})), f"questions.q.criteria.{LONG}", "1-256"),
    (request(questions=q_with(criteria={"a<|image_pad|>": "d"})), "questions.q.criteria.a<|image_pad|>", "<|image_pad|>"),
    (request(questions=q_with(criteria={"a": 3})), "questions.q.criteria.a", "string"),
    (request(questions=q_with(criteria={"a": "  "})), "questions.q.criteria.a", "non-empty"),
    (request(questions=q_with(criteria={"a": "x<|vision_start|>"})), "questions.q.criteria.a", "<|vision_start|>"),
    (request(questions=q_with(criteria={"a": "x<|box_start|>"})), "questions.q.criteria.a", "<|box_start|>"),
    (request(questions={"s": {"type": "score", "instructions": "r", "criteria": {"0": "a"}}}), "questions.s.criteria", "list"),
    (request(questions={"s": {"type": "score", "instructions": "r", "criteria": ["one"]}}), "questions.s.criteria", "2-10"),
    (request(questions={"s": {"type": "score", "instructions": "r", "criteria": ["l"] * 11}}), "questions.s.criteria", "2-10"),
    (request(questions={"s": {"type": "score", "instructions": "r", "criteria": ["a", None]}}), "questions.s.criteria[1]", "string"),
    (request(questions={"s": {"type": "score", "instructions": "r", "criteria": ["a", " "]}}), "questions.s.criteria[1]", "non-empty"),
    (request(questions={"s": {"type": "score", "instructions": "r", "criteria": ["a", "<|video_pad|>"]}}), "questions.s.criteria[1]", "<|video_pad|>"),
    (request(questions={"a": choice({"k": "d" * 400}, instructions="i" * 16000)}), "questions.a", "16384"),
    (request(questions={"\ud800": choice()}), "questions.\ud800", "surrogate"),
    (request(questions=q_with(instructions="bad \udfff")), "questions.q.instructions", "surrogate"),
    (request(state=""), "state", "empty"),
    (request(state=" \n\t "), "state", "empty"),
    (request(state=12), "state", "must be text"),
    (request(state=True), "state", "must be text"),
    (request(state=None), "state", "must be text"),
    (request(state="hi <|im_start|>"), "state", "<|im_start|>"),
    (request(state="lone \ud83d surrogate"), "state", "surrogate"),
    (request(state={"k": ["<|endoftext|>"]}), "state", "<|endoftext|>"),
    (request(state={"k": float("nan")}), "state", "JSON"),
    (request(state={"image": 5}), "state.image", "data:image/png"),
    (request(state={"image": "data:image/gif;base64,R0lGOD"}), "state.image", "data:image/png"),
    (request(state={"image": "data:image/png;base64,@@@"}), "state.image", "base64"),
    (request(state={"image": "data:image/png;base64,"}), "state.image", "empty"),
    (request(state={"image": data_url(png(8, 8), "jpeg")}), "state.image", "jpeg"),
    (request(state={"image": "data:image/png;base64," + "A" * (6 * 1024 * 1024)}), "state.image", "larger than"),
    (request(state={"image": data_url(png(300, 1))}), "state.image", "aspect"),
    (request(state={"image": data_url(png(2049, 4))}), "state.image", "each side"),
    (request(state={"image": data_url(png(1100, 1000))}), "state.image", "pixels"),
    (request(state={"messages": []}), "state.messages", "non-empty"),
    (request(state={"messages": "hello"}), "state.messages", "non-empty"),
    (request(state={"messages": ["hello"]}), "state.messages[0]", "object"),
    (request(state={"messages": [{"role": "user", "content": "x", "name": "n"}]}), "state.messages[0].name", "unknown"),
    (request(state={"messages": [{"role": "tool", "content": "x"}]}), "state.messages[0].role", "user, assistant, system"),
    (request(state={"messages": [{"role": "user", "content": 5}]}), "state.messages[0].content", "string"),
    (request(state={"messages": [{"role": "user", "content": []}]}), "state.messages[0].content", "non-empty"),
    (request(state={"messages": [{"role": "user", "content": ["x"]}]}), "state.messages[0].content[0]", "object"),
    (request(state={"messages": [{"role": "user", "content": [{"type": "audio"}]}]}), "state.messages[0].content[0].type", "text, image_url"),
    (request(state={"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "x"}}]}]}), "state.messages[0].content[0].video_url.url", "data:video/mp4"),
    (request(state={"messages": [{"role": "user", "content": [{"type": "video", "video": "x"}]}]}), "state.messages[0].content[0].type", "video_url"),
    (request(state={"messages": [{"role": "user", "content": [{"type": "text"}]}]}), "state.messages[0].content[0].text", "string"),
    (request(state={"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "y": 1}]}]}), "state.messages[0].content[0].y", "unknown"),
    (request(state={"messages": [{"role": "system", "content": "<|vision_end|>"}]}), "state.messages[0].content", "<|vision_end|>"),
    (request(state={"messages": [{"role": "user", "content": [{"type": "text", "text": "<|im_end|>"}]}]}), "state.messages[0].content[0].text", "<|im_end|>"),
    (request(state={"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}]}), "state.messages[0].content[0].image_url.url", "data:image/png"),
    (request(state={"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": SMALL_PNG, "detail": "hi"}}]}]}), "state.messages[0].content[0].image_url.detail", "unknown"),
    (request(state={"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": SMALL_PNG}] * 5}]}), "state.messages[0].content[4]", "at most 4"),
    (request(state={"messages": [{"role": "user", "content": [{"type": "image", "image": SMALL_PNG}, {"type": "text", "text": "<|placeholder|>"}]}]}), "state", "<|placeholder|>"),
]


@pytest.mark.parametrize("payload, field, phrase", REFUSALS, ids=[f"{i}-{r[1][:40]}" for i, r in enumerate(REFUSALS)])
def test_request_refusals(compiler, payload, field, phrase):
    with pytest.raises(RequestError) as info:
        compiler.compile(payload)
    assert info.value.field == field
    assert phrase in str(info.value)


def test_placeholder_text_without_images_is_fine(compiler):
    assert compiler.compile(request(state="literal <|placeholder|> text")).state.pixel_values is None


def test_null_description_defaults_to_key_and_counts_toward_max_text(folder):
    compiler = Compiler.from_dir(folder, max_length=100_000)
    compiled = compiler.compile(request(questions={"q": choice({"yes": None})}))
    assert compiled.questions[0].descriptions == ["yes"]
    questions = {"q": choice({"k" * 256: None}, instructions="i" * (16384 - 256))}
    compiler.compile(request(questions=questions))  # exactly at the limit
    questions["q"]["instructions"] += "i"
    with pytest.raises(RequestError, match="16384"):
        compiler.compile(request(questions=questions))


BODY_REFUSALS = [
    (b"\xff\xfe{}", "UTF-8"),
    (b'{"a": 1, "a": 2}', "duplicate key"),
    (b'{"model": "m", "state": {"x": 1, "x": 2}, "questions": {}}', "duplicate key"),
    (b'{"a": NaN}', "NaN"),
    (b'{"a": Infinity}', "Infinity"),
    (b'{"a": -Infinity}', "-Infinity"),
    (b'{"a": 1e999}', "out of range"),
    (b"[1, 2]", "JSON object"),
    (b'{"a": ', "invalid JSON"),
    (b"\xef\xbb\xbf{}", "invalid JSON"),
    (b'{"a": ' + b"1" * 5000 + b"}", "invalid JSON"),
    (b"[" * 100000 + b"]" * 100000, "JSON"),
    (b" " * (MAX_VIDEO_BODY + 1), "limit is 25165824 with a video, 8388608 without"),
    (b'{"model": "m"}' + b" " * MAX_BODY, "limit is 8388608 for a request without a video"),
]


@pytest.mark.parametrize("body, phrase", BODY_REFUSALS, ids=[f"body-{i}" for i in range(len(BODY_REFUSALS))])
def test_parse_request_bytes_refusals(body, phrase):
    with pytest.raises(RequestError) as info:
        parse_request_bytes(body)
    assert info.value.field == "body"
    assert phrase in str(info.value)


def test_parse_request_bytes_accepts_exactly_max_body():
    body = json.dumps(request()).encode()
    body += b" " * (MAX_BODY - len(body))
    assert parse_request_bytes(body)["model"] == MODEL


# ------------------------------------------------------------------ property test

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|image_pad|>", "<|endoftext|>", "<|placeholder|>", "<think>"]
odd_text = st.one_of(
    st.text(max_size=30),
    st.sampled_from(["", " ", "\n", "\ud800", "x\udfffy", "é", "\x00", "白色", "हिन्दी", "👍🏽", *SPECIALS]),
    st.builds(lambda a, b: a + b, st.text(max_size=8), st.sampled_from(SPECIALS)),
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True, allow_infinity=True) | odd_text,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(odd_text, children, max_size=4),
    max_leaves=12,
)
image_urls = st.sampled_from([SMALL_PNG, data_url(png(3, 2, "RGBA")), "data:image/png;base64,xx", data_url(png(4, 4), "jpeg"), 7])
items = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": odd_text}),
    st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.fixed_dictionaries({"url": image_urls})}),
    st.fixed_dictionaries({"type": st.just("image"), "image": image_urls}),
    st.dictionaries(odd_text, json_values, max_size=3),
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "system", "tool"]), "content": st.one_of(odd_text, st.lists(items, max_size=3))}
    ),
    max_size=3,
)
states = st.one_of(
    odd_text,
    json_values,
    st.fixed_dictionaries({"image": image_urls}),
    st.fixed_dictionaries({"messages": messages}),
)
criteria = st.one_of(
    st.dictionaries(odd_text, st.one_of(st.none(), odd_text), max_size=4),
    st.lists(odd_text, max_size=11),
    json_values,
)
plain_text = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=20).filter(str.strip)
names = st.text(min_size=1, max_size=12)
valid_questions = st.one_of(
    st.fixed_dictionaries(
        {
            "type": st.just("choice"),
            "instructions": plain_text,
            "criteria": st.dictionaries(names, st.one_of(st.none(), plain_text), min_size=1, max_size=4),
        }
    ),
    st.fixed_dictionaries({"type": st.just("noul"), "instructions": plain_text}),
    st.fixed_dictionaries(
        {"type": st.just("score"), "instructions": plain_text, "criteria": st.lists(plain_text, min_size=2, max_size=4)}
    ),
)
random_questions = st.one_of(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["choice", "noul", "score", "rank"]), "instructions": odd_text},
        optional={"criteria": criteria},
    ),
    json_values,
)
questions = st.one_of(
    st.dictionaries(names, valid_questions, min_size=1, max_size=3),
    st.dictionaries(odd_text, st.one_of(valid_questions, random_questions), max_size=3),
    json_values,
)
valid_items = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": plain_text}),
    st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.fixed_dictionaries({"url": st.just(SMALL_PNG)})}),
)
valid_states = st.one_of(
    plain_text,
    st.dictionaries(plain_text, st.one_of(st.integers(), plain_text), max_size=3),
    st.just({"image": SMALL_PNG}),
    st.fixed_dictionaries(
        {
            "messages": st.lists(
                st.fixed_dictionaries(
                    {
                        "role": st.sampled_from(["user", "assistant", "system"]),
                        "content": st.one_of(plain_text, st.lists(valid_items, min_size=1, max_size=3)),
                    }
                ),
                min_size=1,
                max_size=3,
            )
        }
    ),
)
requests_ = st.one_of(
    st.fixed_dictionaries({"model": st.just(MODEL), "state": valid_states, "questions": questions}),
    st.fixed_dictionaries({"model": st.just(MODEL), "state": st.one_of(valid_states, states), "questions": questions}),
    st.fixed_dictionaries({"model": st.sampled_from([MODEL, "other"]), "state": states, "questions": questions}),
    json_values,
)


@settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(payload=requests_, as_bytes=st.booleans())
def test_random_requests_compile_or_raise_request_error(folder, payload, as_bytes):
    compiler = _property_compiler(folder)
    try:
        if as_bytes:
            compiled = compiler.compile_bytes(json.dumps(payload, ensure_ascii=True).encode("utf-8"))
        else:
            compiled = compiler.compile(payload)
    except RequestError as exc:
        assert isinstance(exc.field, str)
        event(f"refused at {ascii(exc.field.split('.')[0])[:24]}")
        return
    event("compiled")
    base = len(compiled.state.input_ids)
    assert len(compiled.state.mm_token_type_ids) == base
    for question in compiled.questions:
        for branch in question.branches:
            length = base + len(branch.suffix_ids)
            assert length <= compiler.max_length
            assert branch.decision_position == length - 1
            assert all(base <= p < branch.decision_position for p in branch.candidate_positions)
    assert compiled.compute_tokens >= compiled.logical_tokens >= base


_PROPERTY_COMPILERS = {}


def _property_compiler(folder):
    # A small max_length so the refusal path is exercised too.
    if folder not in _PROPERTY_COMPILERS:
        _PROPERTY_COMPILERS[folder] = Compiler.from_dir(folder, max_length=400)
    return _PROPERTY_COMPILERS[folder]


def test_runtime_modules_do_not_import_transformers_or_peft():
    code = (
        "import sys\n"
        "import valen_runtime.tokenizer, valen_runtime.image, valen_runtime.request, valen_runtime.answers\n"
        "bad = sorted(m for m in ('transformers', 'peft', 'torchvision') if m in sys.modules)\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_question_piece_cache_is_bounded_and_transparent(folder):
    """Cached question-piece token ids: the same compile as without the cache, at most N entries."""
    compiler = Compiler.from_dir(folder)
    req = request()
    first = compiler.compile(req)
    assert compiler._piece_ids  # pieces were cached
    again = compiler.compile(req)
    assert [b.suffix_ids for q in again.questions for b in q.branches] == [b.suffix_ids for q in first.questions for b in q.branches]
    small = Compiler.from_dir(folder)
    small.piece_cache_size = 3
    assert [b.suffix_ids for q in small.compile(req).questions for b in q.branches] == [b.suffix_ids for q in first.questions for b in q.branches]
    assert len(small._piece_ids) == 3
    uncached = [compiler.tokenizer.encode(text) for text in ("Decision:", "\n")]
    assert [small._encode_piece(text) for text in ("Decision:", "\n")] == uncached


# ------------------------------------------------------------------ images decoded beside the tokenizer


def png_with_trailing_orientation(width, height, orientation) -> bytes:
    """A PNG whose eXIf chunk comes after the pixel data: the header cannot tell the turned size."""
    data = png(width, height, seed=5)
    exif = Image.Exif()
    exif[0x0112] = orientation
    body = exif.tobytes()
    chunk = struct.pack(">I", len(body)) + b"eXIf" + body + struct.pack(">I", zlib.crc32(b"eXIf" + body))
    iend = data.rindex(b"IEND") - 4
    return data[:iend] + chunk + data[iend:]


def mode_png(mode: str, width=53, height=41) -> bytes:
    rng = np.random.default_rng(11)
    if mode == "I;16":
        image = Image.fromarray((rng.integers(0, 65536, (height, width))).astype(np.uint16))
    elif mode == "P":
        image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).convert("P")
    else:
        image = Image.fromarray(rng.integers(0, 256, (height, width, len(mode)), dtype=np.uint8), mode)
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def png_with_xmp_orientation(width: int, height: int, orientation: int) -> bytes:
    """An RGB PNG whose only orientation is in its XMP packet (an iTXt chunk), which Pillow's
    exif_transpose and transformers honour."""
    from PIL import PngImagePlugin

    info = PngImagePlugin.PngInfo()
    info.add_itxt("XML:com.adobe.xmp", '<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:RDF xmlns:rdf="http://www.w3.org/1999/02/22-rdf-syntax-ns#">'
                  f'<rdf:Description xmlns:tiff="http://ns.adobe.com/tiff/1.0/" tiff:Orientation="{orientation}"/></rdf:RDF></x:xmpmeta>')
    rng = np.random.default_rng(width + height)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buffer, "PNG", pnginfo=info)
    return buffer.getvalue()


def cmyk_jpeg() -> bytes:
    rng = np.random.default_rng(12)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (30, 44, 4), dtype=np.uint8), "CMYK").save(buffer, "JPEG")
    return buffer.getvalue()


DECODE_CASES = {
    "png-exif-after-pixels-rot90": lambda: (png_with_trailing_orientation(120, 64, 6), "png"),
    "png-exif-after-pixels-mirror": lambda: (png_with_trailing_orientation(96, 64, 2), "png"),
    "png-palette": lambda: (mode_png("P"), "png"),
    "png-16-bit": lambda: (mode_png("I;16"), "png"),
    "png-la": lambda: (mode_png("LA"), "png"),
    "png-rgba": lambda: (mode_png("RGBA"), "png"),
    "png-rgb": lambda: (mode_png("RGB"), "png"),
    "png-xmp-rot90": lambda: (png_with_xmp_orientation(90, 64, 6), "png"),
    "jpeg-cmyk": lambda: (cmyk_jpeg(), "jpeg"),
    "jpeg-exif-rot90": lambda: (jpeg_rotated(150, 90), "jpeg"),
}


@pytest.mark.parametrize("case", sorted(DECODE_CASES))
def test_threaded_decode_matches_transformers(folder, processor, case):
    # The pool path predicts the grid from the header and re-tokenizes when the decoded image is
    # turned (EXIF, which for a PNG may only come after the pixels); both paths and transformers
    # must agree on every token and pixel.
    data, fmt = DECODE_CASES[case]()
    url = data_url(data, fmt)
    messages = [{"role": "user", "content": [{"type": "image", "url": url}, {"type": "text", "text": "Which side?"}]}]
    expected = reference_state(processor, messages)
    state = {"messages": [{"role": "user", "content": [{"type": "image", "image": url}, {"type": "text", "text": "Which side?"}]}]}
    for decode_in_thread in (True, False):
        compiled = Compiler.from_dir(folder, decode_in_thread=decode_in_thread).compile(request(state=state))
        assert_state_equal(compiled.state, expected)


@pytest.mark.parametrize("decode_in_thread", [True, False], ids=["threaded", "serial"])
def test_plain_pngs_decode_through_libspng_on_the_calling_thread_only(folder, monkeypatch, decode_in_thread):
    # pyspng holds the GIL for its whole decode, so a pool thread keeps Pillow (which lets it go
    # while the tokenizer runs); on the calling thread a plain PNG takes libspng.
    import valen_runtime.image as image_module

    pyspng = pytest.importorskip("pyspng")
    calls = []
    monkeypatch.setattr(image_module, "pyspng", SimpleNamespace(load=lambda data, fmt: calls.append(fmt) or pyspng.load(data, fmt)))
    url = data_url(png(96, 64, seed=9))
    compiled = Compiler.from_dir(folder, decode_in_thread=decode_in_thread).compile(request(state={"image": url}))
    assert calls == ([] if decode_in_thread else ["RGB"])
    monkeypatch.setattr(image_module, "pyspng", None)
    assert compile_summary(compiled) == compile_summary(Compiler.from_dir(folder, decode_in_thread=False).compile(request(state={"image": url})))


def test_a_wrong_grid_guess_is_corrected(folder, monkeypatch):
    # The header's guess only matters through each image's token count, which an EXIF turn keeps;
    # should a guess still be off, the state is tokenized again with the decoded grids.
    import valen_runtime.request as request_module

    url = data_url(png(96, 64, seed=9))
    expected = compile_summary(Compiler.from_dir(folder, decode_in_thread=False).compile(request(state={"image": url})))
    monkeypatch.setattr(request_module, "grid_for_size", lambda height, width, config: (1, 2, 2))
    assert compile_summary(Compiler.from_dir(folder, decode_in_thread=True).compile(request(state={"image": url}))) == expected


def test_an_image_whose_grid_cannot_be_guessed_reports_the_decode_error(folder):
    # Limits looser than the processor's: the header passes, the resize refuses; the error names the image.
    compiler = Compiler(Compiler.from_dir(folder).tokenizer, Compiler.from_dir(folder).image_config,
                        image_limits=ImageLimits(max_aspect_ratio=1000))
    with pytest.raises(RequestError) as info:
        compiler.compile(request(state={"image": data_url(png(250, 1))}))
    assert info.value.field == "state.image" and "aspect ratio" in str(info.value)


def test_turned_png_changes_the_grid(compiler):
    # Guards the case above: the trailing eXIf really turns the image (160 x 80 in the header,
    # 80 wide and 160 high after), so the header's grid was the wrong guess there.
    compiled = compiler.compile(request(state={"image": data_url(png_with_trailing_orientation(160, 80, 6))}))
    ((grid_t, grid_h, grid_w),) = compiled.state.image_grid_thw.tolist()
    assert grid_t == 1 and grid_h == 2 * grid_w


def compile_summary(compiled: CompiledRequest) -> tuple:
    state = compiled.state
    pixels = state.pixel_values
    return (
        state.input_ids,
        state.mm_token_type_ids,
        None if pixels is None else hashlib.sha256(pixels.numpy().tobytes()).hexdigest(),
        None if state.image_grid_thw is None else state.image_grid_thw.tolist(),
        [(b.suffix_ids, b.candidate_positions, b.decision_position) for q in compiled.questions for b in q.branches],
    )


def test_by_default_the_pool_is_used_where_there_is_work_to_overlap(folder, monkeypatch):
    # One image with a short text decodes on the calling thread (the hook then comes before the
    # tokenizer, as the vision tower is best started early); several images, or one image with a
    # long text, decode on the pool while the text is tokenized.
    import valen_runtime.request as request_module

    compiler = Compiler.from_dir(folder)
    events = []
    real_encode = compiler.tokenizer.encode_prompt
    monkeypatch.setattr(compiler.tokenizer, "encode_prompt", lambda text: events.append("tokenize") or real_encode(text))
    url = data_url(png(48, 48, seed=6))
    cases = {
        "one image, short text": ([url], "x" * (request_module._OVERLAP_MIN_TEXT_CHARS - 1), ["images", "tokenize"]),
        "one image, long text": ([url], "x" * request_module._OVERLAP_MIN_TEXT_CHARS, ["tokenize", "images"]),
        "two images": ([url, url], "x", ["tokenize", "images"]),
    }
    for name, (urls, text, expected) in cases.items():
        events.clear()
        content = [{"type": "image", "image": u} for u in urls] + [{"type": "text", "text": text}]
        compiler.compile(request(state={"messages": [{"role": "user", "content": content}]}), lambda images: events.append("images"))
        assert events == expected, name


def test_concurrent_compiles_equal_serial_ones(folder):
    # Several callers at once (valen-serve's threads) share the decode pool: every result must be
    # what a serial compile of the same request gives, images in prompt order.
    images = [data_url(png(40 + 8 * i, 72 - 4 * i, seed=i)) for i in range(4)] + [data_url(jpeg_rotated(64, 40), "jpeg")]
    requests = []
    for i in range(12):
        picked = [images[(i + k) % len(images)] for k in range(1 + i % 4)]
        content = [{"type": "image", "image": u} for u in picked] + [{"type": "text", "text": f"board {i}"}]
        requests.append(request(state={"messages": [{"role": "user", "content": content}]}))
    serial = Compiler.from_dir(folder, decode_in_thread=False)
    expected = [compile_summary(serial.compile(r)) for r in requests]
    threaded = Compiler.from_dir(folder)
    with ThreadPoolExecutor(4) as callers:
        got = list(callers.map(lambda r: compile_summary(threaded.compile(r)), requests * 2))
    assert got == expected * 2


def truncated_png() -> bytes:
    return png(64, 64)[:-40]


@pytest.mark.parametrize("decode_in_thread", [True, False], ids=["threaded", "serial"])
def test_the_first_image_error_in_prompt_order_is_reported(folder, decode_in_thread):
    # A decode error of an earlier image wins over a header error of a later one and over a
    # text error found by the tokenizer step, as when everything ran one after the other.
    compiler = Compiler.from_dir(folder, decode_in_thread=decode_in_thread)
    bad_header = b"not an image at all"
    content = [{"type": "image", "image": data_url(truncated_png())}, {"type": "image", "image": data_url(bad_header)}]
    with pytest.raises(RequestError) as info:
        compiler.compile(request(state={"messages": [{"role": "user", "content": content}]}))
    assert info.value.field == "state.messages[0].content[0].image" and "corrupt or truncated" in str(info.value)
    content = [{"type": "text", "text": "<|placeholder|>"}, {"type": "image", "image": data_url(truncated_png())}]
    with pytest.raises(RequestError) as info:
        compiler.compile(request(state={"messages": [{"role": "user", "content": content}]}))
    assert info.value.field == "state.messages[0].content[1].image"


def test_phase_timings_partition_the_calling_thread(compiler):
    # The benchmark's breakdown: the calling thread's phases are consecutive laps, so they add up
    # to at most the wall time of the call; the decode thread's are reported beside them.
    from valen_runtime.request import PHASES

    state = {"messages": [{"role": "user", "content": [{"type": "image", "image": data_url(png(96, 64))}, {"type": "text", "text": "x"}]}]}
    timings: dict = {}
    started = time.perf_counter()
    compiler.compile_bytes(json.dumps(request(state=state)).encode(), lambda images: None, timings)
    wall = time.perf_counter() - started
    assert set(timings) <= set(PHASES) and all(v >= 0 for v in timings.values())
    assert {"json", "validate", "image_open", "tokenize", "image_wait", "on_images", "questions", "decode", "resize"} <= set(timings)
    calling = ("json", "validate", "state_parse", "image_open", "template", "tokenize", "image_wait", "on_images", "questions")
    assert sum(timings.get(name, 0.0) for name in calling) <= wall


def test_image_ids_expanded_after_tokenizing_equal_the_expanded_text(folder, monkeypatch):
    # The fixture's image token is a plain special token, so states are tokenized with one image
    # token per image and the ids repeated; tokenizing the fully expanded text must agree.
    fast = Compiler.from_dir(folder)
    slow = Compiler.from_dir(folder)
    assert "<|image_pad|>" in fast.tokenizer.standalone_specials
    slow.tokenizer.standalone_specials = frozenset()
    urls = [data_url(png(64, 64, seed=1)), data_url(png(300, 90, seed=2)), data_url(jpeg_rotated(40, 90), "jpeg")]
    content = [
        {"type": "text", "text": "a<b> "}, {"type": "image", "image": urls[0]}, {"type": "text", "text": " c "},
        {"type": "image", "image": urls[2]}, {"type": "image", "image": urls[1]}, {"type": "text", "text": "\n"},
    ]
    states = [{"image": urls[1]}, {"messages": [{"role": "system", "content": "Judge."}, {"role": "user", "content": content}]}]
    for state in states:
        assert compile_summary(fast.compile(request(state=state))) == compile_summary(slow.compile(request(state=state)))
    # Guard: the two compilers really took different paths (image tokens the tokenizer saw).
    seen = {}

    def counting(name, real):
        def encode(text):
            seen[name] = text.count("<|image_pad|>")
            return real(text)

        return encode

    for name, compiler in (("fast", fast), ("slow", slow)):
        monkeypatch.setattr(compiler.tokenizer, "encode_prompt", counting(name, compiler.tokenizer.encode_prompt))
        compiled = compiler.compile(request(state=states[0]))
    assert seen == {"fast": 1, "slow": sum(compiled.state.mm_token_type_ids)} and seen["slow"] > 1


def test_image_token_with_strip_flags_is_expanded_in_the_text(folder, tmp_path):
    # An image token that swallows neighbouring spaces (lstrip) changes the text between image
    # tokens, so the repeat-the-id shortcut is off for such a tokenizer.
    changed = tmp_path / "lstrip"
    changed.mkdir()
    for path in folder.iterdir():
        (changed / path.name).write_bytes(path.read_bytes())
    tokenizer_json = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    for token in tokenizer_json["added_tokens"]:
        if token["content"] == "<|image_pad|>":
            token["lstrip"] = True
    (changed / "tokenizer.json").write_text(json.dumps(tokenizer_json), encoding="utf-8")
    assert "<|image_pad|>" not in Compiler.from_dir(changed).tokenizer.standalone_specials


# ------------------------------------------------------------------ video states


def mp4(seconds=3, width=64, height=48, rate=10, codec="libx264", container="mp4") -> bytes:
    from valen_export.clips import encode_clip

    return encode_clip(container, codec, rate, max(1, round(seconds * rate)), width, height)


def video_url(data: bytes, mime="mp4") -> str:
    return f"data:video/{mime};base64," + base64.b64encode(data).decode("ascii")


def test_video_state_matches_transformers(compiler, processor, tmp_path):
    """The compiled state of a message-list video (ids, types, pixel_values_videos, grid) equals
    what the pinned processor gives for the same chat, with the frames and video_metadata that
    torchvision 0.21's read_video produced (parity/video_reader.py)."""
    from .test_video import read_video_pinned

    clip = mp4(seconds=3.2, width=96, height=64)
    content = [{"type": "text", "text": "What happens here?"}, {"type": "video_url", "video_url": {"url": video_url(clip)}}]
    timings = {}
    compiled = compiler.compile(request(state={"messages": [{"role": "user", "content": content}]}), timings=timings)
    frames, fps = read_video_pinned(clip, "mp4", tmp_path)
    messages = [{"role": "user", "content": [{"type": "text", "text": "What happens here?"}, {"type": "video"}]}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    expected = processor(text=[text], videos=[frames], video_metadata=[{"total_num_frames": len(frames), "fps": fps}], return_tensors="pt")
    state = compiled.state
    assert state.input_ids == expected["input_ids"][0].tolist()
    assert state.mm_token_type_ids == expected["mm_token_type_ids"][0].tolist() and 2 in state.mm_token_type_ids
    assert torch.equal(state.video_grid_thw, expected["video_grid_thw"]) and state.image_grid_thw is None
    assert torch.equal(state.pixel_values_videos, expected["pixel_values_videos"])  # bitwise
    assert state.pixel_values is None and compiled.state.vision_inputs.grid_thw is state.video_grid_thw
    assert timings["video_probe"] > 0 and timings["video_decode"] > 0


@pytest.fixture(scope="module")
def small_clip():
    return mp4()


def _video_state(url, where):
    if where == "state":
        return {"video": url}
    item = {"type": "video_url", "video_url": url if where == "string" else {"url": url}}
    return {"messages": [{"role": "user", "content": [{"type": "text", "text": "Look:"}, item]}]}


VIDEO_FIELDS = {"state": "state.video", "string": "state.messages[0].content[1].video_url",
                "object": "state.messages[0].content[1].video_url.url"}
# (clip maker, MIME, status, phrase): every check video.py makes on the bytes, reached through the
# compiler with the default limits.
VIDEO_REFUSALS = [
    (lambda: mp4(seconds=0.05, rate=240), "mp4", "frame rate 240 exceeds 120"),
    (lambda: mp4(seconds=61, rate=1), "mp4", "longer than 60 s"),
    (lambda: mp4(seconds=0.1, width=64, height=16), "mp4", "each side must be at least 32"),
    (lambda: mp4(seconds=0.1, width=2050, height=32), "mp4", "each side must be at most 2048"),
    (lambda: mp4(seconds=0.1, width=1040, height=1024), "mp4", "1064960 pixels; the limit is 1048576"),
    (lambda: mp4(seconds=0.4, codec="mpeg4"), "mp4", "codec mpeg4 not accepted"),
    (lambda: mp4(seconds=0.4, codec="libvpx", container="webm"), "mp4", "not an MP4 file"),
    (lambda: mp4(seconds=0.4), "webm", "not a WebM file"),
    (lambda: mp4()[: len(mp4()) // 2], "mp4", "cannot be decoded as mp4"),  # moov at the end: cut off
]


# Every refusal as a video state; two of them in each message-item form too (the same code path).
VIDEO_CASES = [(*r, "state") for r in VIDEO_REFUSALS] + [(*r, where) for r in (VIDEO_REFUSALS[0], VIDEO_REFUSALS[-1]) for where in ("string", "object")]


@pytest.mark.parametrize("make, mime, phrase, where", VIDEO_CASES, ids=[f"{c[2][:24]}-{c[3]}" for c in VIDEO_CASES])
def test_video_refusals_name_the_field(compiler, make, mime, phrase, where):
    from valen_runtime.wire import http_status

    with pytest.raises(RequestError) as info:
        compiler.compile(request(state=_video_state(video_url(make(), mime), where)))
    assert info.value.field == VIDEO_FIELDS[where] and phrase in str(info.value) and http_status(info.value) == 422, str(info.value)


def test_a_video_the_processor_cannot_plan_is_a_request_error(folder, small_clip):
    """Under limits that let a 16 px side through, the video smart_resize's refusal names the field."""
    from valen_runtime.video import VideoConfig, VideoLimits

    base = Compiler.from_dir(folder)
    lenient = Compiler(base.tokenizer, base.image_config, video_config=VideoConfig.from_file(folder / "video_preprocessor_config.json"),
                       video_limits=VideoLimits(min_side=16))
    with pytest.raises(RequestError) as info:
        lenient.compile(request(state={"video": video_url(mp4(seconds=0.4, width=64, height=16))}))
    assert info.value.field == "state.video" and "must be larger than factor:32" in str(info.value)


def test_a_video_state_refuses_the_processor_placeholder_and_an_export_without_video(folder, compiler, small_clip):
    content = [{"type": "video_url", "video_url": video_url(small_clip)}, {"type": "text", "text": "<|placeholder|>"}]
    with pytest.raises(RequestError) as info:
        compiler.compile(request(state={"messages": [{"role": "user", "content": content}]}))
    assert str(info.value) == "state: text must not contain <|placeholder|> together with images or videos"
    content[0] = {"type": "image", "image": SMALL_PNG}
    with pytest.raises(RequestError) as info:
        compiler.compile(request(state={"messages": [{"role": "user", "content": content}]}))
    assert str(info.value) == "state: text must not contain <|placeholder|> together with images"
    without = Compiler(compiler.tokenizer, compiler.image_config)  # no video_preprocessor_config.json
    with pytest.raises(RequestError) as info:
        without.compile(request(state={"video": video_url(small_clip)}))
    assert info.value.field == "state.video" and "takes no video" in str(info.value)


def test_a_long_video_is_refused_at_max_length_naming_the_question(folder, small_clip):
    """max_length counts the video's stamped frame pairs: the question whose branch passes it is named."""
    base = Compiler.from_dir(folder)
    length = len(base.compile(request(state={"video": video_url(small_clip)})).state.input_ids)
    short = Compiler(base.tokenizer, base.image_config, max_length=length + 10, video_config=base.video_config)
    with pytest.raises(RequestError) as info:
        short.compile(request(state={"video": video_url(small_clip)}))
    assert info.value.field == "questions.q1" and f"exceed max_length={length + 10}" in str(info.value)
