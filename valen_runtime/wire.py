"""The /v1/systemone wire contract, one module for every entry point (docs/wire-contract.md).

`valen-serve`, `valen-run`, `valen-parity --requests` and `Compiler.compile` all go through here:
- bounded reading (`read_limited`, `read_request_source`): never more than a limit + 1 byte;
- strict JSON (`parse_request_bytes`): UTF-8, no duplicate keys, no NaN / Infinity, no lone
  surrogates, no nesting deeper than MAX_DEPTH;
- the request's shape and limits (`check_request`), which returns the request in canonical form:
  instructions and descriptions sent as JSON objects or arrays become their JSON text;
- every further check of a request (`validate_request`): the text that enters the prompt, the
  message structure, the images' and the video's base64; it returns a typed `ValidRequest`, all the
  compiler reads;
- the response body (`response_body`): answers in the upstream worker's key order.

This is the only validator. What the compiler can still refuse needs the pixels or the export:
an image's header and decode, a video's container, codec, frames and sizes (video.probe_video),
the chat template's own refusal, max_length.
Every refusal is a RequestError naming the JSON path; `http_status` maps it to the worker's code:
BodyError 400 (the body is not a usable JSON object), TooLarge 413 (a body, image or video over
its byte limit), anything else 422 (the request is well-formed JSON that the contract, the
decoders or max_length refuse).
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterable, Union

from .errors import RequestError
from .limits import MAX_ASPECT_RATIO, MAX_IMAGE_BYTES, MAX_PIXELS, MAX_SIDE, MAX_VIDEO_BYTES

MODEL_NAME = "valen-preview-0923"
MAX_BODY = 8 * 1024 * 1024
# A request carrying a video may be larger: the 16 MiB video is some 22.4 MiB of base64. Readers
# take up to this much; a body past MAX_BODY that holds no video is refused once parsed.
MAX_VIDEO_BODY = 24 * 1024 * 1024
MAX_QUESTIONS = 8
MAX_OPTIONS = 255
# Characters: a text state (a JSON state counts as its JSON text), and each question's
# instructions plus its descriptions together (as the upstream worker counts them).
MAX_TEXT = 16384
MAX_NAME = 256  # question names and option keys: 1..256 characters
MIN_SCORE_LEVELS = 2
MAX_SCORE_LEVELS = 10
# The message-list extension's image limit. Each image within the single-image limits becomes at
# most 1024 tokens (1,048,576 pixels / 32^2 per merged token), so 4 images use at most half of
# max_length (8192) and leave the other half for the text and the longest question.
MAX_MESSAGE_IMAGES = 4
# Objects and arrays nested inside each other, the request object itself being level 1. Well under
# what Python's JSON parser and serialiser reach before a RecursionError in any thread (about
# 1,000 levels less the caller's stack), so every depth past it gets the same 400.
MAX_DEPTH = 512

QUESTION_TYPES = ("choice", "noul", "score")
# Each accepted data URL prefix and the image format its payload must decode as.
DATA_URL_FORMATS = {"data:image/png;base64,": "png", "data:image/jpeg;base64,": "jpeg"}
DATA_URL_PREFIXES = tuple(DATA_URL_FORMATS)
# Each accepted video data URL prefix and the container (video.VIDEO_CONTAINERS) it must hold.
VIDEO_URL_FORMATS = {"data:video/mp4;base64,": "mp4", "data:video/webm;base64,": "webm"}
VIDEO_URL_PREFIXES = tuple(VIDEO_URL_FORMATS)
ROLES = ("user", "assistant", "system")
# Fixed noul candidates, byte for byte as in Valen's schema.py (docs/valen-model.md).
NOUL_CANDIDATES = (
    ("true", "True / \u662f\uff1a\u6ee1\u8db3\u95ee\u9898\u4e2d\u7684\u6761\u4ef6\u3002"),
    ("false", "False / \u5426\uff1a\u4e0d\u6ee1\u8db3\u95ee\u9898\u4e2d\u7684\u6761\u4ef6\u3002"),
)

__all__ = [
    "MODEL_NAME", "MAX_BODY", "MAX_VIDEO_BODY", "MAX_VIDEO_BYTES", "MAX_IMAGE_BYTES", "MAX_PIXELS", "MAX_SIDE", "MAX_ASPECT_RATIO", "MAX_QUESTIONS",
    "MAX_OPTIONS", "MAX_TEXT", "MAX_NAME", "MIN_SCORE_LEVELS", "MAX_SCORE_LEVELS", "MAX_MESSAGE_IMAGES", "MAX_DEPTH",
    "BodyError", "TooLarge", "http_status", "read_limited", "read_request_source", "parse_request_bytes",
    "check_request", "validate_request", "holds_video", "decode_request", "response_body", "encode_response",
    "ValidRequest", "Message", "TextPart", "ImagePart", "VideoPart", "ValidQuestion", "Candidate", "NOUL_CANDIDATES",
]


class BodyError(RequestError):
    """The body is not a usable JSON object (HTTP 400)."""

    status = 400


class TooLarge(RequestError):
    """A body, file, image or video is over its byte limit (HTTP 413)."""

    status = 413


def http_status(error: RequestError) -> int:
    """The worker's status code for a refused request: 400 (BodyError: not a usable JSON object),
    413 (TooLarge: a body, image or video past its byte limit), else 422 (the contract, a decoder
    or max_length refused a well-formed request)."""
    return getattr(error, "status", 422)


# ---------------------------------------------------------------- bounded reading


def read_limited(stream: BinaryIO, limit: int = MAX_BODY, what: str = "body") -> bytes:
    """Read a whole stream, but never more than `limit` + 1 bytes; TooLarge past the limit."""
    data = stream.read(limit + 1)
    if len(data) > limit:
        raise TooLarge(what, f"more than {limit} bytes; the limit is {limit}")
    return data


def read_request_source(source: str, limit: int = MAX_VIDEO_BODY) -> bytes:
    """A request from a file path, or "-" for standard input, read with `read_limited` (up to the
    video body limit; `parse_request_bytes` refuses a body past MAX_BODY that holds no video)."""
    if source == "-":
        return read_limited(sys.stdin.buffer, limit, "stdin")
    with open(Path(source), "rb") as handle:
        return read_limited(handle, limit, source)


# ---------------------------------------------------------------- strict JSON


def parse_request_bytes(data: bytes) -> dict:
    """A request body -> the JSON object it holds; BodyError / TooLarge otherwise. A body may be
    up to MAX_VIDEO_BODY bytes if it holds a video (`holds_video`), else up to MAX_BODY."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise BodyError("body", "expected bytes")
    data = bytes(data)
    if len(data) > MAX_VIDEO_BODY:
        raise TooLarge("body", f"body is {len(data)} bytes; the limit is {MAX_VIDEO_BODY} with a video, {MAX_BODY} without")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BodyError("body", f"invalid UTF-8 at byte {exc.start}") from exc

    def no_duplicates(pairs):
        result = {}
        for key, value in pairs:
            if key in result:
                raise BodyError("body", f"duplicate key {key!r}")
            result[key] = value
        return result

    def no_constant(name):
        raise BodyError("body", f"{name} is not valid JSON")

    def finite_float(literal):
        value = float(literal)
        if not math.isfinite(value):
            raise BodyError("body", f"number {literal} is out of range")
        return value

    try:
        value = json.loads(text, object_pairs_hook=no_duplicates, parse_constant=no_constant, parse_float=finite_float)
        # A \ud800-style escape decodes to a lone surrogate, which is not Unicode text.
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except BodyError:
        raise
    except RecursionError as exc:
        raise _too_deep() from exc
    except UnicodeEncodeError as exc:
        raise BodyError("body", "a string holds a lone surrogate escape; not valid Unicode text") from exc
    except ValueError as exc:  # JSONDecodeError, oversized integer literals
        raise BodyError("body", f"invalid JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise BodyError("body", "the request must be a JSON object")
    if len(data) > MAX_BODY and not holds_video(value):
        raise TooLarge("body", f"body is {len(data)} bytes; the limit is {MAX_BODY} for a request without a video")
    return value


def holds_video(request: dict) -> bool:
    """Whether a parsed request's state is a video state or a message list with a video_url item
    (by shape alone: what decides its body limit; whether the video is valid is checked later)."""
    state = request.get("state")
    if not isinstance(state, dict):
        return False
    if "video" in state:
        return True
    messages = state.get("messages")
    return isinstance(messages, list) and any(
        isinstance(message, dict) and isinstance(message.get("content"), list)
        and any(isinstance(item, dict) and item.get("type") == "video_url" for item in message["content"])
        for message in messages)


def _too_deep() -> BodyError:
    return BodyError("body", f"JSON nested too deeply; at most {MAX_DEPTH} levels of objects and arrays")


def _check_depth(value) -> None:
    """BodyError when objects and arrays nest deeper than MAX_DEPTH (walked without recursion)."""
    level = [value] if isinstance(value, (dict, list)) else []
    depth = 0
    while level:
        depth += 1
        if depth > MAX_DEPTH:
            raise _too_deep()
        level = [child for container in level for child in (container.values() if isinstance(container, dict) else container)
                 if isinstance(child, (dict, list))]


def decode_request(data: bytes) -> dict:
    """Bytes -> the request in canonical form, checked against the contract's shape and limits
    (`check_request`): what every entry point runs before queueing a request for the engine."""
    return check_request(parse_request_bytes(data))


# ---------------------------------------------------------------- the validated request


@dataclass(frozen=True)
class TextPart:
    text: str


@dataclass(frozen=True)
class ImagePart:
    """An image of the state: its data URL's payload, base64-decoded (the header and pixels are
    the compiler's to decode). `field` is the JSON path decode errors name."""

    mime_format: str  # png | jpeg, from the data URL's prefix
    data: bytes
    field: str


@dataclass(frozen=True)
class VideoPart:
    """The state's video: its data URL's payload, base64-decoded (container, codec and frames are
    the compiler's to decode, with video.probe_video). `field` is the JSON path errors name."""

    mime_format: str  # mp4 | webm, from the data URL's prefix
    data: bytes
    field: str


ContentPart = Union[TextPart, ImagePart, VideoPart]


@dataclass(frozen=True)
class Message:
    role: str  # user | assistant | system
    content: tuple[ContentPart, ...]


@dataclass(frozen=True)
class Candidate:
    key: str  # choice: the option key; score: the grade "0", "1", ...; noul: true / false
    description: str


@dataclass(frozen=True)
class ValidQuestion:
    qid: str
    kind: str  # choice | noul | score
    instructions: str
    candidates: tuple[Candidate, ...]  # in the request's order


@dataclass(frozen=True)
class ValidRequest:
    """A request that passed every check of the contract: what the compiler compiles.

    Every state is a list of chat messages: text (and a JSON state, as its JSON text) is one user
    message with one text part, an image (video) state one user message with one image (video)
    part. A state holds at most one video, and never a video and images together.
    """

    model: str
    messages: tuple[Message, ...]
    questions: tuple[ValidQuestion, ...]

    @property
    def images(self) -> list[ImagePart]:
        """The state's images in prompt order."""
        return [part for message in self.messages for part in message.content if isinstance(part, ImagePart)]

    @property
    def video(self) -> VideoPart | None:
        """The state's video, if it has one."""
        return next((part for message in self.messages for part in message.content if isinstance(part, VideoPart)), None)


# ---------------------------------------------------------------- shape and limits


def validate_request(request, reserved_tokens: Iterable[str] = ()) -> ValidRequest:
    """Check a parsed request against the whole contract and return it typed (a ValidRequest).

    reserved_tokens: strings no text that enters the prompt may hold (the export's control
    tokens; `Compiler` passes its tokenizer's). Checks run in a fixed order, so a request with
    several problems is always refused for the same one: the shape and limits (`check_request`),
    then the questions' text, then the state's messages, images and video.
    """
    canonical = check_request(request)
    reserved = tuple(reserved_tokens)
    questions = tuple(_valid_question(qid, question, reserved) for qid, question in canonical["questions"].items())
    return ValidRequest(MODEL_NAME, _valid_messages(canonical["state"], reserved), questions)


def check_request(request) -> dict:
    """The request's shape and limits, from its JSON alone; returns it in canonical form (a new dict).

    Canonical form: instructions and choice descriptions sent as JSON objects or arrays become
    their JSON text, as the upstream worker reads them (Valen's prompt takes text there);
    everything else is as sent (an object state becomes its JSON text, and a null description its
    key, in `validate_request`'s result). Nothing is decoded here: the message structure, the
    text's control tokens and the images' and video's base64 are `validate_request`'s further checks.
    """
    if not isinstance(request, dict):
        raise BodyError("body", "the request must be a JSON object")
    _check_depth(request)  # before anything serialises a nested value
    for key in request:
        if key not in ("model", "state", "questions"):
            raise RequestError(str(key), "unknown field; a request has exactly model, state, questions")
    for key in ("model", "state", "questions"):
        if key not in request:
            raise RequestError(key, "required")
    if request["model"] != MODEL_NAME:
        raise RequestError("model", f"must be {MODEL_NAME!r}")
    questions = _questions(request["questions"])  # questions first, as the upstream worker checks them
    return {"model": MODEL_NAME, "state": _state(request["state"]), "questions": questions}


def _as_text(value, field: str, what: str) -> str:
    """A string as is; a JSON object or array as its JSON text (ensure_ascii=False, as upstream)."""
    if isinstance(value, str):
        return value
    if isinstance(value, (dict, list)):
        try:
            return json.dumps(value, ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise RequestError(field, f"{what} cannot be serialised as JSON ({exc})") from exc
    raise RequestError(field, f"{what} must be a string (or a JSON object or array, read as its JSON text)")


def _name(value, field: str, what: str) -> str:
    if not isinstance(value, str):
        raise RequestError(field, f"{what} must be a string")
    if not 1 <= len(value) <= MAX_NAME:
        raise RequestError(field, f"{what} must be 1-{MAX_NAME} characters, got {len(value)}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RequestError(field, "contains an unpaired surrogate; not valid Unicode text") from exc
    return value


def _questions(questions) -> dict:
    if not isinstance(questions, dict):
        raise RequestError("questions", "must be an object {name: question}")
    if not 1 <= len(questions) <= MAX_QUESTIONS:
        raise RequestError("questions", f"must hold 1-{MAX_QUESTIONS} questions, got {len(questions)}")
    canonical = {}
    for qid, question in questions.items():
        field = f"questions.{qid}"
        _name(qid, field, "question name")
        if not isinstance(question, dict):
            raise RequestError(field, "must be an object with type, instructions, criteria")
        for key in question:
            if key not in ("type", "instructions", "criteria"):
                raise RequestError(f"{field}.{key}", "unknown field; allowed: type, instructions, criteria")
        kind = question.get("type")
        if kind not in QUESTION_TYPES:
            raise RequestError(f"{field}.type", f"must be one of {', '.join(QUESTION_TYPES)}")
        instructions = _as_text(question.get("instructions"), f"{field}.instructions", "instructions")
        if not instructions.strip():
            raise RequestError(f"{field}.instructions", "must be non-empty text")
        criteria = _criteria(kind, question.get("criteria"), f"{field}.criteria")
        if criteria is None:  # noul: its fixed candidates are not the client's text
            descriptions = []
        elif isinstance(criteria, dict):
            descriptions = [key if description is None else description for key, description in criteria.items()]
        else:
            descriptions = criteria
        chars = len(instructions) + sum(len(d) for d in descriptions)
        if chars > MAX_TEXT:
            raise RequestError(field, f"instructions and descriptions are {chars} characters together; the limit is {MAX_TEXT} per question")
        canonical[qid] = {**question, "instructions": instructions}
        if criteria is not None:
            canonical[qid]["criteria"] = criteria
    return canonical


def _criteria(kind: str, criteria, field: str):
    if kind == "noul":
        if criteria is not None:
            raise RequestError(field, "noul takes no criteria (its candidates are fixed: true, false); leave criteria out")
        return None
    if kind == "choice":
        if not isinstance(criteria, dict):
            raise RequestError(field, "choice criteria must be an object {key: description}")
        if not 1 <= len(criteria) <= MAX_OPTIONS:
            raise RequestError(field, f"choice needs 1-{MAX_OPTIONS} criteria, got {len(criteria)}")
        canonical = {}
        for key, description in criteria.items():
            item_field = f"{field}.{key}"
            _name(key, item_field, "option key")
            if not key.strip():
                raise RequestError(item_field, "option key must not be only whitespace")
            if description is not None:  # null means the key (_valid_question substitutes it)
                description = _as_text(description, item_field, "description")
                if not description.strip():
                    raise RequestError(item_field, "description must be non-empty text")
            canonical[key] = description
        return canonical
    if not isinstance(criteria, list):
        raise RequestError(field, "score criteria must be a list of level descriptions")
    if not MIN_SCORE_LEVELS <= len(criteria) <= MAX_SCORE_LEVELS:
        raise RequestError(field, f"score needs {MIN_SCORE_LEVELS}-{MAX_SCORE_LEVELS} levels, got {len(criteria)}")
    first_index: dict[str, int] = {}
    for index, description in enumerate(criteria):
        item_field = f"{field}[{index}]"
        if not isinstance(description, str):
            raise RequestError(item_field, "description must be a string")
        if not description.strip():
            raise RequestError(item_field, "description must be non-empty text")
        if description in first_index:
            raise RequestError(item_field, f"repeats level {first_index[description]}; score levels must be distinct")
        first_index[description] = index
    return list(criteria)


def _check_text_state(text: str, field: str = "state") -> str:
    if not text.strip():
        raise RequestError(field, "must not be empty or whitespace-only")
    if len(text) > MAX_TEXT:
        raise RequestError(field, f"text state is {len(text)} characters; the limit is {MAX_TEXT}")
    return text


def _state(state):
    """Text, {image: data URL}, {video: data URL}, {messages: [...]} (our extension), or a JSON
    object / array (text)."""
    if isinstance(state, str):
        return _check_text_state(state)
    if isinstance(state, dict) and "video" in state:
        if list(state) != ["video"]:
            raise RequestError("state", f"a video state holds exactly one video and no other key, got keys {sorted(map(str, state))}")
        _check_video_url(state["video"], "state.video")
        return state
    if isinstance(state, dict) and "image" in state:
        if list(state) != ["image"]:
            raise RequestError("state", f"an image state holds exactly one image and no other key, got keys {sorted(map(str, state))}")
        _check_image_url(state["image"], "state.image")
        return state
    if isinstance(state, dict) and list(state) == ["messages"]:
        _check_messages(state["messages"])
        return state
    if isinstance(state, (dict, list)):
        _check_text_state(_as_text(state, "state", "state"))  # limited as the JSON text the prompt holds
        return state
    raise RequestError("state", "must be text, a JSON object or array, {image: data URL}, {video: data URL} or {messages: [...]}")


def _check_image_url(url, field: str) -> None:
    """Prefix and byte size of a data URL, from its length alone (`_image_part` decodes it)."""
    if not isinstance(url, str) or not url.startswith(DATA_URL_PREFIXES):
        raise RequestError(field, "must be a data:image/png;base64,… or data:image/jpeg;base64,… URL")
    _check_payload_size(url.split(",", 1)[1], MAX_IMAGE_BYTES, "image", field)


def _check_video_url(url, field: str) -> None:
    """Prefix and byte size of a video data URL, from its length alone (`_video_part` decodes it)."""
    if not isinstance(url, str) or not url.startswith(VIDEO_URL_PREFIXES):
        raise RequestError(field, "must be a data:video/mp4;base64,… or data:video/webm;base64,… URL")
    _check_payload_size(url.split(",", 1)[1], MAX_VIDEO_BYTES, "video", field)


def _check_payload_size(payload: str, limit: int, what: str, field: str) -> None:
    if len(payload) > 4 * -(-limit // 3):
        raise TooLarge(field, f"{what} is larger than {limit} bytes")
    # Valid base64 of n bytes is 4 * ceil(n / 3) characters with up to two '=' of padding.
    decoded = len(payload) // 4 * 3 - len(payload[-2:]) + len(payload[-2:].rstrip("="))
    if decoded > limit:
        raise TooLarge(field, f"{what} is larger than {limit} bytes ({decoded})")


def _check_messages(messages) -> None:
    """Count the extension's images, video and text; the message structure is `_valid_message_list`'s check.

    Walks tolerantly: shapes `_valid_message_list` refuses are skipped here, so its field paths
    stay the ones a client sees for them.
    """
    if not isinstance(messages, list):
        return
    images, videos, chars = 0, 0, 0
    for index, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            chars += len(content)
            continue
        if not isinstance(content, list):
            continue
        for item_index, item in enumerate(content):
            item_field = f"state.messages[{index}].content[{item_index}]"
            kind = item.get("type") if isinstance(item, dict) else None
            if kind == "text" and isinstance(item.get("text"), str):
                chars += len(item["text"])
            elif kind in ("image_url", "image", "video_url"):
                if kind == "video_url":
                    videos += 1
                    if videos > 1:
                        raise RequestError(item_field, "at most one video per request")
                else:
                    images += 1
                    if images > MAX_MESSAGE_IMAGES:
                        raise RequestError(item_field, f"at most {MAX_MESSAGE_IMAGES} images per request")
                if images and videos:  # the item that made the mix is the one named
                    raise RequestError(item_field, "a state holds images or one video, not both")
                url = item.get(kind)
                url_field = f"{item_field}.{kind}"
                if isinstance(url, dict):
                    url, url_field = url.get("url"), f"{url_field}.url"
                if kind == "video_url" and isinstance(url, str) and url.startswith(VIDEO_URL_PREFIXES):
                    _check_video_url(url, url_field)
                elif kind != "video_url" and isinstance(url, str) and url.startswith(DATA_URL_PREFIXES):
                    _check_image_url(url, url_field)
    if chars > MAX_TEXT:
        raise RequestError("state.messages", f"the messages' text is {chars} characters; the limit is {MAX_TEXT}")


# ---------------------------------------------------------------- text, messages and images


def _prompt_text(value, field: str, reserved: tuple[str, ...], what: str = "text") -> str:
    """Text that enters the prompt: a string of valid Unicode holding none of the reserved tokens."""
    if not isinstance(value, str):
        raise RequestError(field, f"{what} must be a string")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RequestError(field, "contains an unpaired surrogate; not valid Unicode text") from exc
    for token in reserved:
        if token in value:
            raise RequestError(field, f"contains the reserved control token {token}")
    return value


def _valid_question(qid: str, question: dict, reserved: tuple[str, ...]) -> ValidQuestion:
    """A canonical question (`check_request`) with its text checked and its candidates listed."""
    field = f"questions.{qid}"
    kind = question["type"]
    instructions = _prompt_text(question["instructions"], f"{field}.instructions", reserved, "instructions")
    field = f"{field}.criteria"
    if kind == "noul":
        candidates = [Candidate(key, description) for key, description in NOUL_CANDIDATES]
    elif kind == "choice":
        candidates = []
        for key, description in question["criteria"].items():
            item_field = f"{field}.{key}"
            _prompt_text(key, item_field, reserved, "option key")
            if description is None:
                description = key  # a null criterion defaults to its key
            candidates.append(Candidate(key, _prompt_text(description, item_field, reserved, "description")))
    else:  # score: level i is grade i
        candidates = [Candidate(str(i), _prompt_text(d, f"{field}[{i}]", reserved, "description"))
                      for i, d in enumerate(question["criteria"])]
    return ValidQuestion(qid, kind, instructions, tuple(candidates))


def _valid_messages(state, reserved: tuple[str, ...]) -> tuple[Message, ...]:
    """A state that passed `check_request` -> its chat messages, text checked, images and video decoded."""
    if isinstance(state, dict) and list(state) == ["image"]:
        return (Message("user", (_image_part(state["image"], "state.image"),)),)
    if isinstance(state, dict) and list(state) == ["video"]:
        return (Message("user", (_video_part(state["video"], "state.video"),)),)
    if isinstance(state, dict) and list(state) == ["messages"]:
        return _valid_message_list(state["messages"], reserved)
    text = state if isinstance(state, str) else json.dumps(state, ensure_ascii=False, allow_nan=False)
    return (Message("user", (TextPart(_prompt_text(text, "state", reserved, "state")),)),)


def _valid_message_list(messages, reserved: tuple[str, ...]) -> tuple[Message, ...]:
    """The message structure, in order. Runs after `_check_messages` counted the images and the
    text, so those limits are refused first wherever in the list they are passed."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("state.messages", "must be a non-empty list of messages")
    result = []
    for index, message in enumerate(messages):
        field = f"state.messages[{index}]"
        if not isinstance(message, dict):
            raise RequestError(field, "must be an object with role and content")
        _only_keys(message, ("role", "content"), field)
        role = message.get("role")
        if role not in ROLES:
            raise RequestError(f"{field}.role", f"must be one of {', '.join(ROLES)}")
        content = message.get("content")
        if isinstance(content, str):
            result.append(Message(role, (TextPart(_prompt_text(content, f"{field}.content", reserved)),)))
            continue
        if not isinstance(content, list) or not content:
            raise RequestError(f"{field}.content", "must be a string or a non-empty list of items")
        parts: list[ContentPart] = []
        for item_index, item in enumerate(content):
            item_field = f"{field}.content[{item_index}]"
            if not isinstance(item, dict):
                raise RequestError(item_field, "must be an object with a type")
            kind = item.get("type")
            if kind == "text":
                _only_keys(item, ("type", "text"), item_field)
                parts.append(TextPart(_prompt_text(item.get("text"), f"{item_field}.text", reserved)))
            elif kind in ("image_url", "image", "video_url"):
                _only_keys(item, ("type", kind), item_field)
                url = item.get(kind)
                url_field = f"{item_field}.{kind}"
                if isinstance(url, dict):
                    _only_keys(url, ("url",), url_field)
                    url, url_field = url.get("url"), f"{url_field}.url"
                parts.append((_video_part if kind == "video_url" else _image_part)(url, url_field))
            else:
                raise RequestError(f"{item_field}.type", "must be text, image_url, image or video_url")
        result.append(Message(role, tuple(parts)))
    return tuple(result)


def _only_keys(item: dict, allowed: tuple[str, ...], field: str) -> None:
    for key in item:
        if key not in allowed:
            raise RequestError(f"{field}.{key}", f"unknown field; allowed: {', '.join(allowed)}")


def _decoded_data_url(url, field: str, formats: dict[str, str], what: str) -> tuple[str, bytes]:
    """A data URL with one of `formats`' prefixes -> (its format, its decoded bytes); its size was
    checked from its length (`_check_payload_size`). what: "image" or "video", for the messages."""
    prefix = next((p for p in formats if url.startswith(p)), None) if isinstance(url, str) else None
    if prefix is None:
        raise RequestError(field, f"must be a {' or '.join(p + '…' for p in formats)} URL")
    try:
        data = base64.b64decode(url[len(prefix):].encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError) as exc:
        raise RequestError(field, "invalid base64 payload") from exc
    if not data:
        raise RequestError(field, f"empty {what}")
    return formats[prefix], data


def _image_part(url, field: str) -> ImagePart:
    return ImagePart(*_decoded_data_url(url, field, DATA_URL_FORMATS, "image"), field)


def _video_part(url, field: str) -> VideoPart:
    return VideoPart(*_decoded_data_url(url, field, VIDEO_URL_FORMATS, "video"), field)


# ---------------------------------------------------------------- the response


# The upstream worker's answer key order for choice; noul and score (our extensions) keep
# Valen's order (docs/wire-contract.md).
_CHOICE_ORDER = ("type", "choice", "probabilities", "confidence")


def response_body(response: dict) -> dict:
    """An engine response -> the wire body: model, answers, usage, internal_usage; choice answers as
    type, choice, probabilities, confidence."""
    answers = {}
    for qid, answer in response["answers"].items():
        if answer.get("type") == "choice":
            answer = {key: answer[key] for key in _CHOICE_ORDER}
        answers[qid] = answer
    return {"model": response["model"], "answers": answers, "usage": response["usage"], "internal_usage": response["internal_usage"]}


def encode_response(body: dict) -> bytes:
    """The bytes of a JSON body as the worker writes them (UTF-8, no NaN)."""
    return json.dumps(body, ensure_ascii=False, allow_nan=False).encode("utf-8")
