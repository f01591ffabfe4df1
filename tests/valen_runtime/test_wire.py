"""valen_runtime.wire: bounded reading, strict JSON, the request's shape and limits at and past
each boundary, the response body; and valen-run reading through it (docs/wire-contract.md)."""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from valen_runtime.cli import main as valen_run
from valen_runtime.request import Compiler
from valen_runtime.errors import RequestError
from valen_runtime.wire import (
    MAX_BODY,
    MAX_DEPTH,
    MAX_IMAGE_BYTES,
    MAX_MESSAGE_IMAGES,
    MAX_OPTIONS,
    MAX_QUESTIONS,
    MAX_TEXT,
    MAX_VIDEO_BODY,
    BodyError,
    Candidate,
    ImagePart,
    Message,
    TextPart,
    TooLarge,
    check_request,
    decode_request,
    http_status,
    parse_request_bytes,
    read_limited,
    response_body,
    validate_request,
)

MODEL = "valen-preview-0923"


def choice(criteria=None, instructions="Refund or wait?"):
    return {"type": "choice", "instructions": instructions, "criteria": criteria or {"refund": "Refund it", "wait": "Wait"}}


def request(state="The card was charged twice.", questions=None) -> dict:
    return {"model": MODEL, "state": state, "questions": questions or {"q": choice()}}


def refused(req, field: str, phrase: str, kind=RequestError) -> RequestError:
    with pytest.raises(kind) as info:
        validate_request(req)
    assert info.value.field == field, str(info.value)
    assert phrase in str(info.value), str(info.value)
    return info.value


def png_bytes(width: int = 2, height: int = 2) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (width, height), "white").save(buffer, "PNG")
    return buffer.getvalue()


def data_url(data: bytes, fmt: str = "png") -> str:
    return f"data:image/{fmt};base64," + base64.b64encode(data).decode("ascii")


# ---------------------------------------------------------------- bounded reading


class Endless(io.RawIOBase):
    """A stream of zeros that never ends and counts what was taken from it (like /dev/zero)."""

    def __init__(self):
        self.taken = 0

    def readable(self):
        return True

    def readinto(self, buffer):
        buffer[:] = bytes(len(buffer))
        self.taken += len(buffer)
        return len(buffer)


def test_read_limited_takes_at_most_limit_plus_one_byte():
    stream = Endless()
    with pytest.raises(TooLarge) as info:
        read_limited(io.BufferedReader(stream, buffer_size=1), 1000, "stdin")
    assert info.value.field == "stdin" and "1000" in str(info.value) and http_status(info.value) == 413
    assert stream.taken == 1001
    assert read_limited(io.BytesIO(b"x" * 1000), 1000) == b"x" * 1000  # exactly the limit


def _valen_run_peak(tmp_path, export, stdin) -> tuple[int, str, int]:
    """(exit code, stderr, peak RSS in KiB) of one valen-run process (its own rusage, not the tests')."""
    proc = subprocess.Popen([sys.executable, "-m", "valen_runtime", "--export", str(export), "--device", "cpu", "-"],
                            stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    err = proc.stderr.read().decode()
    proc.stdout.close(), proc.stderr.close()
    return os.waitstatus_to_exitcode(status), err, usage.ru_maxrss


def test_valen_run_refuses_an_endless_stdin_after_24_mib(tiny_export, tmp_path):
    small = tmp_path / "small.json"
    small.write_text("{")
    with open(small, "rb") as handle:
        base_code, base_err, base_peak = _valen_run_peak(tmp_path, tiny_export["separate"], handle)
    assert base_code == 2 and "invalid JSON" in base_err
    with open("/dev/zero", "rb") as zero:
        code, err, peak = _valen_run_peak(tmp_path, tiny_export["separate"], zero)
    assert code == 2 and err.count("\n") == 1 and err.startswith(f"error: stdin: more than {MAX_VIDEO_BODY} bytes"), err
    # Same process, same imports; what reading adds is at most the 24 MiB + 1 bytes read (the
    # video body limit) and one transient copy, plus allocator slack.
    assert (peak - base_peak) * 1024 < 3 * MAX_VIDEO_BODY, (peak, base_peak)


def test_valen_run_refuses_a_200_mib_file_without_reading_it(tiny_export, tmp_path):
    big = tmp_path / "big.json"
    with open(big, "wb") as handle:
        handle.truncate(200 * 1024 * 1024)  # sparse: reading it would still return 200 MiB of zeros
    result = CliRunner().invoke(valen_run, ["--export", str(tiny_export["separate"]), "--device", "cpu", str(big)])
    assert result.exit_code == 2 and result.output.count("\n") == 1
    assert f"{big}: more than {MAX_VIDEO_BODY} bytes" in result.output


def test_valen_run_prints_the_wire_body(tiny_export, tmp_path):
    from valen_runtime.engine import Engine
    from valen_runtime.options import EngineOptions

    req = request(questions={"q": choice(), "n": {"type": "noul", "instructions": "Twice?"},
                             "s": {"type": "score", "instructions": "How bad?", "criteria": ["fine", "bad"]}})
    path = tmp_path / "req.json"
    path.write_text(json.dumps(req))
    result = CliRunner().invoke(valen_run, ["--export", str(tiny_export["separate"]), "--device", "cpu", str(path)])
    assert result.exit_code == 0, result.output
    body = json.loads(result.output)
    assert list(body) == ["model", "answers", "usage", "internal_usage"]
    assert list(body["answers"]["q"]) == ["type", "choice", "probabilities", "confidence"]  # the upstream worker's order
    assert list(body["answers"]["n"]) == ["type", "noul"]
    assert list(body["answers"]["s"]) == ["type", "probabilities", "score", "legend", "confidence"]
    engine = Engine.load(tiny_export["separate"], EngineOptions(device="cpu"))
    assert body == json.loads(json.dumps(engine.run(req).response))  # the same values, only reordered


# ---------------------------------------------------------------- strict JSON (400) and the body limit (413)

BODY_ERRORS = [
    (b'{"a": NaN}', "NaN"),
    (b'{"a": Infinity}', "Infinity"),
    (b'{"a": -Infinity}', "-Infinity"),
    (b'{"a": 1e400}', "out of range"),
    (b'{"model": "x", "state": {"k": 1, "k": 2}}', "duplicate key 'k'"),
    (b'{"a": "\\ud800"}', "lone surrogate"),
    (b'{"a": ["\\udfff x"]}', "lone surrogate"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b"\xc3\x28", "invalid UTF-8"),
    (b'"just a string"', "JSON object"),
    (b"{", "invalid JSON"),
]


@pytest.mark.parametrize("body, phrase", BODY_ERRORS, ids=[f"body-{i}" for i in range(len(BODY_ERRORS))])
def test_malformed_bodies_are_400(body, phrase):
    with pytest.raises(BodyError) as info:
        decode_request(body)
    assert info.value.field == "body" and phrase in str(info.value) and http_status(info.value) == 400


def test_body_limit_at_and_past_8_mib():
    body = json.dumps(request()).encode()
    at_limit = body + b" " * (MAX_BODY - len(body))
    assert decode_request(at_limit)["model"] == MODEL
    with pytest.raises(TooLarge) as info:
        decode_request(at_limit + b" ")
    assert http_status(info.value) == 413 and str(MAX_BODY) in str(info.value)


def test_deep_but_parseable_nesting_is_a_text_state():
    state = {"k": 1}
    for _ in range(50):
        state = {"k": state}
    assert decode_request(json.dumps(request(state=state)).encode())["state"] == state


def nested_state_body(levels: int) -> bytes:
    """A request whose state is `levels` arrays inside each other: levels + 1 in all, the request included."""
    head = json.dumps(request())[:-1].replace('"state": "The card was charged twice.", ', "")
    return (head + ', "state": ' + "[" * levels + "]" * levels + "}").encode()


def test_one_nesting_limit_with_one_status():
    """MAX_DEPTH levels are read; every depth past it is the same 400, whether Python's parser would
    have read it (it used to be a 422 from serialising the state just under the parser's limit of
    about 1,000) or not; a dict handed to validate_request is held to the same limit."""
    assert decode_request(nested_state_body(MAX_DEPTH - 1))["state"] == json.loads("[" * (MAX_DEPTH - 1) + "]" * (MAX_DEPTH - 1))
    messages = set()
    for levels in (MAX_DEPTH, 900, 985, 986, 987, 988, 989, 1200, 100_000):
        with pytest.raises(BodyError) as info:
            decode_request(nested_state_body(levels))
        assert http_status(info.value) == 400, (levels, str(info.value))
        messages.add(str(info.value))
    assert messages == {f"body: JSON nested too deeply; at most {MAX_DEPTH} levels of objects and arrays"}
    state: list = []
    for _ in range(MAX_DEPTH):
        state = [state]
    refused(request(state=state), "body", "nested too deeply", BodyError)


# ---------------------------------------------------------------- shape and limits (422 unless noted)


def test_text_state_limit_names_the_state():
    assert check_request(request(state="a" * MAX_TEXT))["state"] == "a" * MAX_TEXT
    error = refused(request(state="a" * (MAX_TEXT + 1)), "state", f"{MAX_TEXT + 1} characters")
    assert str(MAX_TEXT) in str(error) and "question" not in str(error)
    refused(request(state="x" * 20_000), "state", "20000 characters")


def test_json_state_counts_its_json_text():
    def state_of(length: int) -> dict:
        state = {"note": ""}
        state["note"] = "n" * (length - len(json.dumps(state, ensure_ascii=False)))
        assert len(json.dumps(state, ensure_ascii=False)) == length
        return state

    validate_request(request(state=state_of(MAX_TEXT)))
    refused(request(state=state_of(MAX_TEXT + 1)), "state", f"{MAX_TEXT + 1} characters")
    # Non-ASCII stays one character each (ensure_ascii=False), as the upstream worker serialises:
    # '{"语": "白…"}' is 9 + n characters.
    validate_request(request(state={"语": "白" * (MAX_TEXT - 9)}))
    refused(request(state={"语": "白" * (MAX_TEXT - 8)}), "state", f"{MAX_TEXT + 1} characters")


def test_message_list_text_is_limited_like_a_text_state():
    half = MAX_TEXT // 2
    ok = {"messages": [{"role": "system", "content": "s" * half}, {"role": "user", "content": [{"type": "text", "text": "u" * (MAX_TEXT - half)}]}]}
    validate_request(request(state=ok))
    ok["messages"][0]["content"] += "s"
    refused(request(state=ok), "state.messages", f"{MAX_TEXT + 1} characters")


def test_question_text_limit_is_per_question():
    at = choice({"k": "d" * 384}, instructions="i" * (MAX_TEXT - 384))
    validate_request(request(questions={"a": at, "b": at}))  # 2 x 16384: each question within its limit
    over = choice({"k": "d" * 385}, instructions="i" * (MAX_TEXT - 384))
    refused(request(questions={"a": at, "b": over}), "questions.b", f"{MAX_TEXT + 1} characters")
    # A null description is the key, and counts as the key.
    null_at = choice({"k" * 256: None}, instructions="i" * (MAX_TEXT - 256))
    validate_request(request(questions={"q": null_at}))
    null_at["instructions"] += "i"
    refused(request(questions={"q": null_at}), "questions.q", f"{MAX_TEXT + 1} characters")


def test_question_and_option_counts_at_and_past_the_limit():
    validate_request(request(questions={f"q{i}": {"type": "noul", "instructions": "?"} for i in range(MAX_QUESTIONS)}))
    refused(request(questions={f"q{i}": {"type": "noul", "instructions": "?"} for i in range(MAX_QUESTIONS + 1)}), "questions", "1-8")
    validate_request(request(questions={"q": choice({f"k{i}": None for i in range(MAX_OPTIONS)})}))
    refused(request(questions={"q": choice({f"k{i}": None for i in range(MAX_OPTIONS + 1)})}), "questions.q.criteria", "1-255")
    validate_request(request(questions={"q" * 256: choice()}))
    refused(request(questions={"q" * 257: choice()}), "questions." + "q" * 257, "1-256")
    refused(request(questions={"q": choice({" \t": "blank key"})}), "questions.q.criteria. \t", "whitespace")


def test_noul_takes_no_criteria():
    for question in ({"type": "noul", "instructions": "Lit?", "criteria": None}, {"type": "noul", "instructions": "Lit?"}):
        assert check_request(request(questions={"n": question}))["questions"]["n"] == question
    refused(request(questions={"n": {"type": "noul", "instructions": "Lit?", "criteria": {"yes": "y"}}}), "questions.n.criteria", "noul takes no criteria")
    refused(request(questions={"n": {"type": "noul", "instructions": "Lit?", "criteria": []}}), "questions.n.criteria", "noul takes no criteria")


def test_score_levels_are_distinct():
    validate_request(request(questions={"s": {"type": "score", "instructions": "How?", "criteria": ["low", "Low", "high"]}}))
    refused(request(questions={"s": {"type": "score", "instructions": "How?", "criteria": ["low", "high", "low"]}}),
            "questions.s.criteria[2]", "repeats level 0")


def test_one_image_per_image_state():
    url = data_url(png_bytes())
    assert check_request(request(state={"image": url}))["state"] == {"image": url}
    refused(request(state={"image": url, "extra": 1}), "state", "exactly one image")
    refused(request(state={"image": url, "messages": []}), "state", "exactly one image")


def test_message_list_images_at_and_past_the_extension_limit():
    url = data_url(png_bytes())
    content = [{"type": "image_url", "image_url": {"url": url}}] * MAX_MESSAGE_IMAGES + [{"type": "text", "text": "Which?"}]
    validate_request(request(state={"messages": [{"role": "user", "content": content}]}))
    over = [{"type": "image", "image": url}] + content
    refused(request(state={"messages": [{"role": "user", "content": over}]}), f"state.messages[0].content[{MAX_MESSAGE_IMAGES}]", "at most 4 images")


def test_image_bytes_at_and_past_4_mib_are_413():
    # The byte limit is checked from the data URL's length, before decoding: random bytes will do.
    payload = os.urandom(MAX_IMAGE_BYTES)
    validate_request(request(state={"image": data_url(payload)}))
    error = refused(request(state={"image": data_url(payload + b"x")}), "state.image", "larger than", TooLarge)
    assert http_status(error) == 413
    error = refused(request(state={"messages": [{"role": "user", "content": [{"type": "image", "image": data_url(payload + b"xy", "jpeg")}]}]}),
                    "state.messages[0].content[0].image", "larger than", TooLarge)
    for size in range(MAX_IMAGE_BYTES - 3, MAX_IMAGE_BYTES + 4):  # every padding length around the limit
        url = data_url(payload[:size] if size <= MAX_IMAGE_BYTES else payload + b"z" * (size - MAX_IMAGE_BYTES))
        if size <= MAX_IMAGE_BYTES:
            validate_request(request(state={"image": url}))
        else:
            refused(request(state={"image": url}), "state.image", "larger than", TooLarge)


def test_structured_instructions_and_descriptions_compile_as_their_json_text(text_assets):
    compiler = Compiler.from_dir(text_assets[0])
    structured = request(questions={"q": choice({"a": {"act": "refund", "note": "白"}, "b": ["wait", 1]}, instructions={"goal": "route"})})
    as_text = request(questions={"q": choice({"a": '{"act": "refund", "note": "白"}', "b": '["wait", 1]'}, instructions='{"goal": "route"}')})
    assert validate_request(structured) == validate_request(as_text)
    a, b = compiler.compile(structured), compiler.compile(as_text)
    assert a.questions[0].branches[0].suffix_ids == b.questions[0].branches[0].suffix_ids
    refused(request(questions={"q": choice(instructions=7)}), "questions.q.instructions", "must be a string")


def test_the_compiler_enforces_the_contract_itself(text_assets):
    """Library callers (Engine.run) get the same refusals as the entry points."""
    compiler = Compiler.from_dir(text_assets[0])
    with pytest.raises(RequestError) as info:
        compiler.compile(request(state="a" * (MAX_TEXT + 1)))
    assert info.value.field == "state"
    with pytest.raises(RequestError) as info:
        compiler.compile(request(questions={"n": {"type": "noul", "instructions": "?", "criteria": {"x": "y"}}}))
    assert info.value.field == "questions.n.criteria"


valid_requests = st.builds(
    lambda state, kinds, levels: request(
        state=state,
        questions={f"q{i}": ({"type": "noul", "instructions": f"Is {i}?"} if kind == "noul" else
                             {"type": "score", "instructions": {"ask": i}, "criteria": [f"level {j}" for j in range(levels)]} if kind == "score" else
                             choice({"a": None, "b": ["x", i]})) for i, kind in enumerate(kinds)},
    ),
    st.one_of(st.text(min_size=1, max_size=40).filter(str.strip), st.dictionaries(st.text(max_size=5), st.integers(), min_size=1, max_size=3)),
    st.lists(st.sampled_from(["choice", "noul", "score"]), min_size=1, max_size=MAX_QUESTIONS),
    st.integers(2, 10),
)


@settings(max_examples=50, deadline=None)
@given(valid_requests)
def test_canonical_form_is_a_fixed_point(req):
    try:
        canonical = check_request(req)
    except RequestError:
        return  # e.g. a generated state over a limit
    assert check_request(canonical) == canonical
    assert all(isinstance(q["instructions"], str) for q in canonical["questions"].values())
    assert all(isinstance(q["criteria"]["b"], str) for q in canonical["questions"].values() if q["type"] == "choice")
    assert canonical["state"] == req["state"]  # states are as sent


# ---------------------------------------------------------------- the response body


def test_response_body_orders_choice_answers_like_the_upstream_worker():
    engine_response = {
        "model": MODEL,
        "answers": {
            "c": {"type": "choice", "probabilities": {"x": 0.25, "y": 0.75}, "choice": "y", "confidence": 0.5},
            "n": {"type": "noul", "noul": 0.5},
            "s": {"type": "score", "probabilities": {"0": 0.5, "1": 0.5}, "score": 0.5, "legend": {"0": "a", "1": "b"}, "confidence": 0.0},
        },
        "usage": {"input_tokens": 3, "output_tokens": 0},
        "internal_usage": {"compute_tokens": 4},
    }
    body = response_body(engine_response)
    assert body == engine_response
    assert list(body) == ["model", "answers", "usage", "internal_usage"] and list(body["answers"]) == ["c", "n", "s"]
    assert list(body["answers"]["c"]) == ["type", "choice", "probabilities", "confidence"]
    assert list(body["answers"]["c"]["probabilities"]) == ["x", "y"]
    assert list(body["answers"]["s"]) == list(engine_response["answers"]["s"])


def test_parse_request_bytes_is_the_request_compilers():
    from valen_runtime import request as compile_module

    assert compile_module.parse_request_bytes is parse_request_bytes
    assert parse_request_bytes(json.dumps(request()).encode()) == request()


# ---------------------------------------------------------------- one validator


def test_validate_request_returns_the_request_typed():
    png = png_bytes()
    valid = validate_request(request(
        state={"messages": [{"role": "system", "content": "Be brief."},
                            {"role": "user", "content": [{"type": "text", "text": "Which?"}, {"type": "image_url", "image_url": {"url": data_url(png)}}]}]},
        questions={"c": choice({"a": None, "b": {"x": 1}}), "n": {"type": "noul", "instructions": ["lit"]},
                   "s": {"type": "score", "instructions": "How?", "criteria": ["low", "high"]}}))
    assert valid.model == MODEL
    assert valid.messages == (Message("system", (TextPart("Be brief."),)),
                              Message("user", (TextPart("Which?"), ImagePart("png", png, "state.messages[1].content[1].image_url.url"))))
    assert valid.images == [valid.messages[1].content[1]]
    c, n, s = valid.questions
    assert (c.qid, c.kind, c.instructions, c.candidates) == ("c", "choice", "Refund or wait?", (Candidate("a", "a"), Candidate("b", '{"x": 1}')))
    assert (n.kind, n.instructions, [x.key for x in n.candidates]) == ("noul", '["lit"]', ["true", "false"])
    assert s.candidates == (Candidate("0", "low"), Candidate("1", "high"))
    # A text or JSON state is one user message of one text part; an image state one of one image.
    assert validate_request(request(state={"k": "白"})).messages == (Message("user", (TextPart('{"k": "白"}'),)),)
    assert validate_request(request(state={"image": data_url(png, "jpeg")})).messages == (Message("user", (ImagePart("jpeg", png, "state.image"),)),)


def test_reserved_tokens_are_refused_where_the_caller_names_them():
    req = request(state="a <|im_end|> b")
    assert validate_request(req).messages[0].content[0].text == "a <|im_end|> b"
    with pytest.raises(RequestError, match="reserved control token <|im_end|>") as info:
        validate_request(req, ("<|im_end|>",))
    assert info.value.field == "state"


def test_the_compiler_holds_no_request_checks():
    """request.py refuses only what needs the pixels or the export: every request check is wire.py's.
    Its RequestErrors are exactly these four, and it defines none of the contract's limits or prefixes."""
    import ast
    import inspect

    from valen_runtime import request as compile_module
    from valen_runtime import wire

    tree = ast.parse(inspect.getsource(compile_module))
    raised = sorted(ast.unparse(node.exc.args[1]) for node in ast.walk(tree)
                    if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)
                    and getattr(node.exc.func, "id", None) == "RequestError")
    assert raised == sorted([
        "str(exc)",  # an image's size after its EXIF turn cannot be resized (image.py's check)
        "f'the chat template rejected the state ({exc})'",  # the export's template raised
        "str(exc)",  # a video's plan: a side under patch * merge or an aspect ratio (video.py's check)
        "str(exc)",  # the rendered prompt holds the processor's placeholder (video.py's encode_prompt)
        "'this export takes no video (it has no video_preprocessor_config.json)'",  # the export
        "f'{length} tokens exceed max_length={self.max_length}; no truncation'",  # the tokenized prompt
    ])
    assigned = {target.id for node in ast.walk(tree) if isinstance(node, ast.Assign) for target in node.targets
                if isinstance(target, ast.Name)}
    assert not assigned & set(wire.__all__)
    strings = [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)]
    assert not [s for s in strings if "data:image" in s or "unknown field" in s]


_JUNK = [None, 1, 2.5, True, "", "  ", [], {}, [1], {"k": "v"}, "<|im_start|>", "a<|vision_start|>b", "\ud800", "x" * (MAX_TEXT + 1),
         "data:image/png;base64,!!!", "data:image/png;base64,", "data:image/gif;base64,AAAA", "video", "video_url", "text", "image",
         "image_url", "user", "tool", [{"type": "text", "text": "hi"}], "noul", "choice", "score", ["a", "a"], ["a"],
         {"type": "video", "video": "x"}]


def _mutated(base: dict, rng, images: list[str]) -> dict:
    """`base` with one to three values replaced, removed or added anywhere in it."""
    import copy

    def paths(value, path=()):
        yield path
        children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        for key, child in children:
            yield from paths(child, path + (key,))

    req = copy.deepcopy(base)
    for _ in range(rng.randint(1, 3)):
        path = rng.choice([p for p in paths(req) if p])
        parent = req
        for key in path[:-1]:
            parent = parent[key]
        roll = rng.random()
        if roll < 0.2 and isinstance(parent, dict):
            del parent[path[-1]]
        elif roll < 0.3 and isinstance(parent, dict):
            parent[rng.choice(["extra", "type", "url", "text", "role", "<|im_end|>"])] = rng.choice(_JUNK + images)
        elif roll < 0.4 and isinstance(parent, list):
            parent.insert(rng.randrange(len(parent) + 1), copy.deepcopy(rng.choice(_JUNK + images + [parent[path[-1]]])))
        elif roll < 0.55 and isinstance(parent[path[-1]], str):
            text, at = parent[path[-1]], rng.randrange(len(parent[path[-1]]) + 1)
            parent[path[-1]] = text[:at] + rng.choice(["<|im_end|>", "\ud800", "=", "!", "  "]) + text[at:]
        else:
            parent[path[-1]] = copy.deepcopy(rng.choice(_JUNK + images))
    return req


@settings(max_examples=200, deadline=None)
@given(st.randoms(use_true_random=False), st.integers(0, 3))
def test_the_compiler_refuses_exactly_what_validate_request_refuses(text_assets, rng, which):
    """For mutated requests, Compiler.compile refuses exactly when wire.validate_request (with the
    compiler's reserved tokens) refuses, with the same error; what it accepts compiles."""
    compiler = _compiler_for(text_assets[0])
    images = [data_url(png_bytes(40, 30)), data_url(png_bytes(64, 64), "png")]
    questions = {"c": choice({"a": "yes", "b": None, "c": {"x": 1}}), "n": {"type": "noul", "instructions": {"ask": "lit"}},
                 "s": {"type": "score", "instructions": "How?", "criteria": ["low", "mid", "high"]}}
    states = ["The card was charged twice.", {"a": [1, {"b": "白"}]}, {"image": images[0]},
              {"messages": [{"role": "system", "content": "Be careful."},
                            {"role": "user", "content": [{"type": "text", "text": "Look"}, {"type": "image_url", "image_url": {"url": images[0]}}]},
                            {"role": "assistant", "content": "ok"},
                            {"role": "user", "content": [{"type": "image", "image": images[1]}, {"type": "text", "text": "Which?"}]}]}]
    req = _mutated(request(state=states[which], questions=questions), rng, images)
    try:
        validate_request(req, compiler.tokenizer.reserved_strings)
    except RequestError as expected:
        with pytest.raises(RequestError) as info:
            compiler.compile(req)
        assert (type(info.value), info.value.field, str(info.value)) == (type(expected), expected.field, str(expected))
    else:
        compiler.compile(req)


_compilers: dict = {}


def _compiler_for(folder):
    if folder not in _compilers:
        _compilers[folder] = Compiler.from_dir(folder)
    return _compilers[folder]


# ---------------------------------------------------------------- video states


def video_url(data: bytes, mime: str = "mp4") -> str:
    return f"data:video/{mime};base64," + base64.b64encode(data).decode("ascii")


def test_a_video_state_and_a_message_video_are_typed_video_parts():
    from valen_runtime.wire import VideoPart

    valid = validate_request(request(state={"video": video_url(b"\x00\x00\x00\x18ftyp", "mp4")}))
    assert valid.video == VideoPart("mp4", b"\x00\x00\x00\x18ftyp", "state.video") and valid.images == []
    for item in ({"type": "video_url", "video_url": video_url(b"webm", "webm")}, {"type": "video_url", "video_url": {"url": video_url(b"webm", "webm")}}):
        valid = validate_request(request(state={"messages": [{"role": "user", "content": [{"type": "text", "text": "Look"}, item]}]}))
        field = "state.messages[0].content[1].video_url" + (".url" if isinstance(item["video_url"], dict) else "")
        assert valid.video == VideoPart("webm", b"webm", field)
    assert validate_request(request()).video is None


def test_video_state_refusals_name_the_field():
    url = video_url(b"abc")
    refused(request(state={"video": url, "extra": 1}), "state", "exactly one video")
    refused(request(state={"video": 5}), "state.video", "data:video/mp4;base64")
    refused(request(state={"video": "data:video/quicktime;base64,AAAA"}), "state.video", "data:video/mp4;base64")
    refused(request(state={"video": "data:video/mp4;base64,@@@@"}), "state.video", "invalid base64")
    refused(request(state={"video": "data:video/mp4;base64,"}), "state.video", "empty video")
    item = "state.messages[0].content[1]"

    def messages(*content):
        return request(state={"messages": [{"role": "user", "content": list(content)}]})

    video, image = {"type": "video_url", "video_url": url}, {"type": "image_url", "image_url": data_url(png_bytes())}
    refused(messages(video, video), item, "at most one video per request")
    refused(messages(video, image), item, "images or one video, not both")
    refused(messages(image, video), item, "images or one video, not both")
    text = {"type": "text", "text": "x"}
    refused(messages(text, {"type": "video_url", "video_url": {"url": url, "detail": 1}}), f"{item}.video_url.detail", "unknown field")
    refused(messages(text, {"type": "video", "video": url}), f"{item}.type", "text, image_url, image or video_url")
    refused(messages({"type": "text", "text": "x"}, {"type": "video_url", "video_url": {"url": "https://x/y.mp4"}}), f"{item}.video_url.url", "data:video/mp4")


def test_video_bytes_at_and_past_16_mib_are_413():
    from valen_runtime.wire import MAX_VIDEO_BYTES

    payload = os.urandom(MAX_VIDEO_BYTES)
    assert len(validate_request(request(state={"video": video_url(payload)})).video.data) == MAX_VIDEO_BYTES
    error = refused(request(state={"video": video_url(payload + b"x")}), "state.video", "larger than 16777216", TooLarge)
    assert http_status(error) == 413
    content = [{"type": "video_url", "video_url": {"url": video_url(payload + b"xy", "webm")}}]
    refused(request(state={"messages": [{"role": "user", "content": content}]}), "state.messages[0].content[0].video_url.url", "larger than", TooLarge)


def test_a_body_past_8_mib_is_read_only_for_a_video_and_never_past_24_mib():
    """A video request may be up to MAX_VIDEO_BODY; any other body past MAX_BODY is 413 once parsed."""
    video = json.dumps(request(state={"video": video_url(b"x")})).encode()
    text = json.dumps(request()).encode()
    assert decode_request(video + b" " * (MAX_VIDEO_BODY - len(video)))["state"] == {"video": video_url(b"x")}
    for body, phrase in ((video + b" " * (MAX_VIDEO_BODY + 1 - len(video)), "with a video"),
                         (text + b" " * (MAX_BODY + 1 - len(text)), "for a request without a video")):
        with pytest.raises(TooLarge) as info:
            decode_request(body)
        assert info.value.field == "body" and phrase in str(info.value) and http_status(info.value) == 413
    assert decode_request(text + b" " * (MAX_BODY - len(text)))["model"] == MODEL
