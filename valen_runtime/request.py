"""Wire request -> token ids, pixels and readout positions (docs/valen-model.md).

`Compiler.compile(request)` validates a /v1/systemone request (docs/wire-contract.md), builds the
shared state prefix the way transformers 5.4.0's `apply_chat_template(..., tokenize=True)` does,
and appends each branch's suffix segment by segment, recording candidate and decision positions.
Nothing here runs a model; every expected failure is a RequestError naming the JSON path.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import jinja2
import torch

from .errors import ConfigError, RequestError
from .image import ImageConfig, ImageLimits, decode_image, patch_grid, patchify, resize_for_patches, stack_images
from .tokenizer import Tokenizer

# The wire contract (limits, strict JSON, request shape) lives in wire.py; re-exported for callers.
from .wire import (  # noqa: F401
    MAX_BODY,
    MAX_MESSAGE_IMAGES,
    MAX_NAME,
    MAX_OPTIONS,
    MAX_QUESTIONS,
    MAX_SCORE_LEVELS,
    MAX_TEXT,
    MIN_SCORE_LEVELS,
    MODEL_NAME,
    parse_request_bytes,
    validate_request,
)

DEFAULT_MAX_LENGTH = 8192

QUESTION_TYPES = ("choice", "noul", "score")
# Fixed noul candidates, byte for byte as in Valen's schema.py (docs/valen-model.md).
NOUL_CANDIDATES = (
    ("true", "True / \u662f\uff1a\u6ee1\u8db3\u95ee\u9898\u4e2d\u7684\u6761\u4ef6\u3002"),
    ("false", "False / \u5426\uff1a\u4e0d\u6ee1\u8db3\u95ee\u9898\u4e2d\u7684\u6761\u4ef6\u3002"),
)
_DATA_URL_PREFIXES = {"data:image/png;base64,": "png", "data:image/jpeg;base64,": "jpeg"}
_ROLES = ("user", "assistant", "system")


@dataclass
class ImageInputs:
    """A state's images, decoded and resized: all the vision tower needs, known before the text
    is tokenized (so an engine can start the tower while the host tokenizes).

    Images are kept as resized uint8 [1, C, H, W] tensors; `pixel_values_on(device)` turns them
    into the processor's fp32 patches where the vision tower runs (bit-identical on every device,
    and 4x fewer bytes to upload).
    """

    images: list[torch.Tensor]  # resized uint8 [1, C, H, W], prompt order
    grid_thw: torch.Tensor  # [n_images, 3] int64
    config: ImageConfig

    def pixel_values_on(self, device: torch.device | str) -> torch.Tensor:
        """[N, C * tp * p * p] fp32 patches of all images, computed on `device`."""
        patches = [patchify(image.to(device, non_blocking=True), self.config) for image in self.images]
        return stack_images(patches)[0]


@dataclass
class StateInputs:
    """The shared prefix (length B): what the processor returns for the state messages.

    `pixel_values` is the CPU result, as the processor returns it; `image_inputs` what an engine
    uploads instead (see ImageInputs).
    """

    input_ids: list[int]
    mm_token_type_ids: list[int]  # 1 on image placeholder tokens, else 0
    images: list[torch.Tensor]  # resized uint8 [1, C, H, W], prompt order
    image_grid_thw: torch.Tensor | None  # [n_images, 3] int64
    image_config: ImageConfig | None = None

    @property
    def image_inputs(self) -> ImageInputs | None:
        return ImageInputs(self.images, self.image_grid_thw, self.image_config) if self.images else None

    def pixel_values_on(self, device: torch.device | str) -> torch.Tensor | None:
        """[N, C * tp * p * p] fp32 patches of all images, computed on `device`."""
        return self.image_inputs.pixel_values_on(device) if self.images else None

    @property
    def pixel_values(self) -> torch.Tensor | None:
        return self.pixel_values_on("cpu")


@dataclass
class Branch:
    """One forward pass: state + suffix. Positions are absolute in the concatenation."""

    suffix_ids: list[int]
    candidate_positions: list[int]
    decision_position: int


@dataclass
class Question:
    qid: str
    kind: str  # choice | noul | score
    keys: list[str]
    descriptions: list[str]
    branches: list[Branch]


@dataclass
class CompiledRequest:
    model: str
    state: StateInputs
    questions: list[Question]
    logical_tokens: int  # B + sum of suffix lengths (state counted once)
    compute_tokens: int  # sum over branches of B + suffix length


@dataclass
class _Candidate:
    key: str
    description: str


@dataclass
class _ParsedQuestion:
    qid: str
    kind: str
    instructions: str
    candidates: list[_Candidate]


@dataclass
class _ImageItem:
    data: bytes
    mime_format: str
    field: str


class Compiler:
    """Builds CompiledRequest objects for one exported model folder."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        image_config: ImageConfig,
        max_length: int = DEFAULT_MAX_LENGTH,
        media_kwargs: dict | None = None,
        image_limits: ImageLimits = ImageLimits(),
    ):
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length <= 0:
            raise ConfigError(f"max_length must be a positive integer, got {max_length!r}")
        self.tokenizer = tokenizer
        self.image_config = image_config.with_media_kwargs(media_kwargs or {})
        self.max_length = max_length
        self.media_kwargs = dict(media_kwargs or {})
        self.image_limits = image_limits
        self.image_token = tokenizer.special_tokens_map.get("image_token", "<|image_pad|>")
        self.image_token_id = tokenizer.token_id(self.image_token)
        self.video_token = tokenizer.special_tokens_map.get("video_token", "<|video_pad|>")
        self.video_token_id = tokenizer.token_id(self.video_token)
        # Question pieces recur from request to request (an agent asks the same questions of
        # every new state): their token ids are cached, the state is always tokenized afresh.
        self._piece_ids: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self.piece_cache_size = 4096

    def _encode_piece(self, text: str) -> list[int]:
        """`tokenizer.encode(text)` for a question piece, through a bounded LRU cache."""
        ids = self._piece_ids.get(text)
        if ids is None:
            ids = self._piece_ids[text] = tuple(self.tokenizer.encode(text))
            if len(self._piece_ids) > self.piece_cache_size:
                self._piece_ids.popitem(last=False)
        else:
            self._piece_ids.move_to_end(text)
        return list(ids)

    @classmethod
    def from_dir(cls, export_dir: Path, max_length: int = DEFAULT_MAX_LENGTH, media_kwargs: dict | None = None) -> "Compiler":
        """Read tokenizer.json, tokenizer_config.json, chat_template.jinja, preprocessor_config.json."""
        export_dir = Path(export_dir)
        tokenizer = Tokenizer.from_dir(export_dir)
        image_config = ImageConfig.from_file(export_dir / "preprocessor_config.json")
        return cls(tokenizer, image_config, max_length=max_length, media_kwargs=media_kwargs)

    # ---------------------------------------------------------------- public entry points

    def compile_bytes(self, data: bytes, on_images: Callable[[ImageInputs], None] | None = None) -> CompiledRequest:
        return self.compile(parse_request_bytes(data), on_images)

    def compile(self, request: dict, on_images: Callable[[ImageInputs], None] | None = None) -> CompiledRequest:
        """Validate a parsed request and compile it; raises RequestError on any bad input.

        on_images: called with the state's images once they are decoded and resized, before the
        state is tokenized (not for text-only states); an engine starts the vision tower there.
        """
        request = validate_request(request)  # the wire contract (keys, model, shapes, limits), then what needs the export
        questions = self._parse_questions(request["questions"])
        messages, images = self._parse_state(request["state"])
        state = self._encode_state(messages, images, on_images)
        compiled = [self._compile_question(q, len(state.input_ids)) for q in questions]
        base = len(state.input_ids)
        suffix_total = sum(len(b.suffix_ids) for q in compiled for b in q.branches)
        branch_count = sum(len(q.branches) for q in compiled)
        return CompiledRequest(
            model=MODEL_NAME,
            state=state,
            questions=compiled,
            logical_tokens=base + suffix_total,
            compute_tokens=branch_count * base + suffix_total,
        )

    # ---------------------------------------------------------------- validation

    def _check_text(self, value, field: str, *, what: str = "text") -> str:
        if not isinstance(value, str):
            raise RequestError(field, f"{what} must be a string")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise RequestError(field, "contains an unpaired surrogate; not valid Unicode text") from exc
        for token in self.tokenizer.reserved_strings:
            if token in value:
                raise RequestError(field, f"contains the reserved control token {token}")
        return value

    def _parse_questions(self, questions: dict) -> list[_ParsedQuestion]:
        """Questions that passed the wire contract (validate_request: shapes, names, limits); what
        is left needs the export: control tokens in the text that enters the prompt, and the
        candidate lists."""
        parsed = []
        for qid, question in questions.items():
            field = f"questions.{qid}"
            instructions = self._check_text(question["instructions"], f"{field}.instructions", what="instructions")
            candidates = self._parse_criteria(question["type"], question.get("criteria"), f"{field}.criteria")
            parsed.append(_ParsedQuestion(qid, question["type"], instructions, candidates))
        return parsed

    def _parse_criteria(self, kind: str, criteria, field: str) -> list[_Candidate]:
        if kind == "noul":
            return [_Candidate(key, description) for key, description in NOUL_CANDIDATES]
        if kind == "choice":
            result = []
            for key, description in criteria.items():
                item_field = f"{field}.{key}"
                self._check_text(key, item_field, what="option key")
                if description is None:
                    description = key  # a null criterion defaults to its key
                result.append(_Candidate(key, self._check_text(description, item_field, what="description")))
            return result
        # score: level i is grade i
        return [_Candidate(str(i), self._check_text(d, f"{field}[{i}]", what="description")) for i, d in enumerate(criteria)]

    def _parse_state(self, state) -> tuple[list[dict], list[_ImageItem]]:
        """State -> chat messages (Valen's shape after media rewriting) and the images in order."""
        if isinstance(state, str):
            self._check_text(state, "state", what="state")
            if not state.strip():
                raise RequestError("state", "must not be empty or whitespace-only")
            return [{"role": "user", "content": [{"type": "text", "text": state}]}], []
        if isinstance(state, dict) and list(state) == ["image"]:
            image = self._parse_data_url(state["image"], "state.image")
            return [{"role": "user", "content": [{"type": "image"}]}], [image]
        if isinstance(state, dict) and list(state) == ["messages"]:
            return self._parse_messages(state["messages"])
        if isinstance(state, (dict, list)):
            try:
                text = json.dumps(state, ensure_ascii=False, allow_nan=False)
            except RecursionError as exc:
                raise RequestError("state", "nested too deeply") from exc
            except (TypeError, ValueError) as exc:
                raise RequestError("state", f"cannot be serialised as JSON ({exc})") from exc
            self._check_text(text, "state", what="state")
            return [{"role": "user", "content": [{"type": "text", "text": text}]}], []
        raise RequestError("state", "must be text, a JSON object or array, {image: data URL} or {messages: [...]}")

    def _parse_messages(self, messages) -> tuple[list[dict], list[_ImageItem]]:
        if not isinstance(messages, list) or not messages:
            raise RequestError("state.messages", "must be a non-empty list of messages")
        result, images = [], []
        for index, message in enumerate(messages):
            field = f"state.messages[{index}]"
            if not isinstance(message, dict):
                raise RequestError(field, "must be an object with role and content")
            for key in message:
                if key not in ("role", "content"):
                    raise RequestError(f"{field}.{key}", "unknown field; allowed: role, content")
            role = message.get("role")
            if role not in _ROLES:
                raise RequestError(f"{field}.role", f"must be one of {', '.join(_ROLES)}")
            content = message.get("content")
            if isinstance(content, str):
                self._check_text(content, f"{field}.content")
                result.append({"role": role, "content": [{"type": "text", "text": content}]})
                continue
            if not isinstance(content, list) or not content:
                raise RequestError(f"{field}.content", "must be a string or a non-empty list of items")
            items = []
            for item_index, item in enumerate(content):
                item_field = f"{field}.content[{item_index}]"
                if not isinstance(item, dict):
                    raise RequestError(item_field, "must be an object with a type")
                kind = item.get("type")
                if kind == "text":
                    _only_keys(item, ("type", "text"), item_field)
                    items.append({"type": "text", "text": self._check_text(item.get("text"), f"{item_field}.text")})
                elif kind in ("image_url", "image"):
                    _only_keys(item, ("type", kind), item_field)
                    url = item.get(kind)
                    url_field = f"{item_field}.{kind}"
                    if isinstance(url, dict):
                        _only_keys(url, ("url",), url_field)
                        url, url_field = url.get("url"), f"{url_field}.url"
                    images.append(self._parse_data_url(url, url_field))
                    if len(images) > MAX_MESSAGE_IMAGES:
                        raise RequestError(item_field, f"at most {MAX_MESSAGE_IMAGES} images per request")
                    items.append({"type": "image"})
                elif kind in ("video", "video_url"):
                    raise RequestError(f"{item_field}.type", "video input is not supported")
                else:
                    raise RequestError(f"{item_field}.type", "must be text, image_url or image")
            result.append({"role": role, "content": items})
        return result, images

    def _parse_data_url(self, url, field: str) -> _ImageItem:
        if not isinstance(url, str):
            raise RequestError(field, "must be a data:image/png;base64,… or data:image/jpeg;base64,… URL")
        for prefix, mime_format in _DATA_URL_PREFIXES.items():
            if url.startswith(prefix):
                payload = url[len(prefix):]
                break
        else:
            raise RequestError(field, "must be a data:image/png;base64,… or data:image/jpeg;base64,… URL")
        limit = self.image_limits.max_bytes
        if len(payload) > 4 * ((limit + 2) // 3):
            raise RequestError(field, f"image is larger than {limit} bytes")
        try:
            data = base64.b64decode(payload.encode("ascii"), validate=True)
        except (binascii.Error, UnicodeEncodeError, ValueError) as exc:
            raise RequestError(field, "invalid base64 payload") from exc
        if not data:
            raise RequestError(field, "empty image")
        return _ImageItem(data, mime_format, field)

    # ---------------------------------------------------------------- encoding

    def _encode_state(self, messages: list[dict], images: list[_ImageItem],
                      on_images: Callable[[ImageInputs], None] | None = None) -> StateInputs:
        resized, grids = [], []
        for image in images:
            decoded = decode_image(image.data, image.mime_format, image.field, self.image_limits)
            try:
                batch = resize_for_patches(decoded, self.image_config)  # uint8 [1, C, H, W]
            except ValueError as exc:
                raise RequestError(image.field, str(exc)) from exc
            resized.append(batch)
            grids.append(patch_grid(batch, self.image_config))
        grid_thw = torch.tensor(grids, dtype=torch.int64) if grids else None
        if on_images is not None and resized:
            on_images(ImageInputs(resized, grid_thw, self.image_config))
        try:
            text = self.tokenizer.render_chat(messages, add_generation_prompt=False)
        except jinja2.TemplateError as exc:
            raise RequestError("state", f"the chat template rejected the state ({exc})") from exc
        if text.count(self.image_token) != len(resized):
            raise ConfigError(
                f"chat template emitted {text.count(self.image_token)} {self.image_token} for {len(resized)} images"
            )
        if self.video_token in text:
            raise ConfigError(f"chat template emitted {self.video_token} without a video")
        merge_length = self.image_config.merge_size**2
        # Same expansion as Qwen3VLProcessor.__call__: each placeholder, in order, becomes
        # t * h * w / merge^2 copies; then the whole text is tokenized once. The processor's
        # temporary marker would turn user text "<|placeholder|>" into image tokens there, so
        # such a state is refused rather than compiled differently.
        placeholder = "<|placeholder|>"
        if resized and placeholder in text:
            raise RequestError("state", f"text must not contain {placeholder} together with images")
        for grid_t, grid_h, grid_w in grids:
            count = grid_t * grid_h * grid_w // merge_length
            text = text.replace(self.image_token, placeholder * count, 1)
        text = text.replace(placeholder, self.image_token)
        input_ids = self.tokenizer.encode_prompt(text)
        mm_token_type_ids = [
            1 if token == self.image_token_id else 2 if token == self.video_token_id else 0 for token in input_ids
        ]
        return StateInputs(input_ids, mm_token_type_ids, resized, grid_thw, self.image_config)

    def _compile_question(self, question: _ParsedQuestion, base_length: int) -> Question:
        encode = self._encode_piece
        if question.kind == "score":
            groups = [[candidate] for candidate in question.candidates]  # one grade per branch
        else:
            groups = [question.candidates]
        header = encode("<|im_start|>user\n")
        task = encode(f"Task: {question.kind}\nQuestion: {question.instructions}\nCandidates:\n")
        newline = encode("\n")
        decision = encode("Decision:")
        branches = []
        for group in groups:
            suffix = header + task
            positions = []
            for candidate in group:
                if question.kind == "score":
                    text = candidate.description  # never the grade id
                else:
                    text = f"{candidate.key}: {candidate.description}"
                suffix += encode(text)
                positions.append(base_length + len(suffix) - 1)
                suffix += newline
            suffix += decision
            length = base_length + len(suffix)
            if length > self.max_length:
                raise RequestError(
                    f"questions.{question.qid}",
                    f"{question.qid}: {length} tokens exceed max_length={self.max_length}; no truncation",
                )
            branches.append(Branch(suffix_ids=suffix, candidate_positions=positions, decision_position=length - 1))
        return Question(
            qid=question.qid,
            kind=question.kind,
            keys=[c.key for c in question.candidates],
            descriptions=[c.description for c in question.candidates],
            branches=branches,
        )


def _only_keys(item: dict, allowed: tuple[str, ...], field: str) -> None:
    for key in item:
        if key not in allowed:
            raise RequestError(f"{field}.{key}", f"unknown field; allowed: {', '.join(allowed)}")
