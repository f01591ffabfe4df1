"""Wire request -> token ids, pixels and readout positions (docs/valen-model.md).

`Compiler.compile(request)` validates a /v1/systemone request with `wire.validate_request` (the one
validator, docs/wire-contract.md) and compiles the ValidRequest it returns: it builds the shared
state prefix the way transformers 5.4.0's `apply_chat_template(..., tokenize=True)` does, and
appends each branch's suffix segment by segment, recording candidate and decision positions.
Nothing here runs a model; what it refuses (a RequestError naming the JSON path) needs the pixels
or the export: an image that does not decode, a video that `video.probe_video` refuses, the chat
template's refusal, max_length.

A video state compiles in an order that costs least first: probe (count the frames, check every
limit), plan (sampled frames, grid, timestamps: the token count), render and tokenize, lay out the
questions (max_length), and only then decode the sampled frames and hand them to `on_images`.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import jinja2
import torch

from .errors import ConfigError, RequestError
from .image import (
    ImageConfig,
    ImageLimits,
    fast_png_pixels,
    grid_for_size,
    image_to_tensor,
    load_image,
    open_image,
    patch_grid,
    patchify,
    resize_for_patches,
    stack_images,
)
from .decode_pool import shared_decode_pool
from .phases import PHASES, Phases  # noqa: F401  (PHASES: re-exported for callers)
from .tokenizer import Tokenizer
from .video import VideoConfig, VideoLimits, VideoPlan, decode_frames, encode_prompt, patchify_video, plan_video, probe_video

# The wire contract (limits, strict JSON, every check of a request) lives in wire.py: the compiler
# compiles what `validate_request` returns. Re-exported for callers.
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
    NOUL_CANDIDATES,
    QUESTION_TYPES,
    ImagePart,
    Message,
    TextPart,
    ValidQuestion,
    ValidRequest,
    VideoPart,
    parse_request_bytes,
    validate_request,
)

DEFAULT_MAX_LENGTH = 8192


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
class VideoInputs:
    """A state's video, its sampled frames decoded and resized: all the vision tower needs
    (`Engine.vision_features` takes it as it takes ImageInputs).

    The frames are kept as uint8 [T, C, H, W]; `pixel_values_on(device)` turns them into the
    processor's fp32 pixel_values_videos where the tower runs (IEEE-exact on every device).
    """

    frames: torch.Tensor  # uint8 [T, C, H, W], the sampled frames in order
    grid_thw: torch.Tensor  # [1, 3] int64: (frame pairs, height / patch, width / patch)
    config: VideoConfig

    def pixel_values_on(self, device: torch.device | str) -> torch.Tensor:
        """[t * h * w, C * tp * p * p] fp32 patches of the video, computed on `device`."""
        return patchify_video(self.frames.to(device, non_blocking=True), self.config)[0]


@dataclass
class StateInputs:
    """The shared prefix (length B): what the processor returns for the state messages.

    `pixel_values` is the CPU result, as the processor returns it; `image_inputs` what an engine
    uploads instead (see ImageInputs). A video state has no images and one video: its
    `video_frames`, `video_grid_thw` and `video_inputs` stand where the image ones do.
    """

    input_ids: list[int]
    mm_token_type_ids: list[int]  # 1 on image placeholder tokens, 2 on video ones, else 0
    images: list[torch.Tensor]  # resized uint8 [1, C, H, W], prompt order
    image_grid_thw: torch.Tensor | None  # [n_images, 3] int64
    image_config: ImageConfig | None = None
    video_frames: torch.Tensor | None = None  # resized uint8 [T, C, H, W], the sampled frames
    video_grid_thw: torch.Tensor | None = None  # [1, 3] int64
    video_config: VideoConfig | None = None

    @property
    def video_inputs(self) -> VideoInputs | None:
        return VideoInputs(self.video_frames, self.video_grid_thw, self.video_config) if self.video_frames is not None else None

    @property
    def vision_inputs(self) -> ImageInputs | VideoInputs | None:
        """What the vision tower reads for this state: its images, its video, or None (text)."""
        return self.video_inputs if self.video_frames is not None else self.image_inputs

    def pixel_values_videos_on(self, device: torch.device | str) -> torch.Tensor | None:
        """[t * h * w, C * tp * p * p] fp32 patches of the video, computed on `device`."""
        return self.video_inputs.pixel_values_on(device) if self.video_frames is not None else None

    @property
    def pixel_values_videos(self) -> torch.Tensor | None:
        return self.pixel_values_videos_on("cpu")

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
class _PreparedImage:
    batch: torch.Tensor  # resized uint8 [1, C, H, W]
    grid: tuple[int, int, int]
    seconds: dict[str, float]  # decode, to_tensor, resize (on the thread that ran them)


@dataclass
class _PendingImage:
    header_size: tuple[int, int]  # (width, height) before any EXIF turn
    result: Future | _PreparedImage  # a Future while a pool thread decodes it

    def wait(self) -> _PreparedImage:
        return self.result.result() if isinstance(self.result, Future) else self.result


# One image with a short text decodes on the calling thread: handing it to a pool thread costs
# about 0.1 ms (request (a), docs/benchmarks.md), and the tokenizer needs about 0.22 us a
# character (request (c)), so overlap pays from some 500 characters; 1000 keeps a margin.
_OVERLAP_MIN_TEXT_CHARS = 1000


class Compiler:
    """Builds CompiledRequest objects for one exported model folder."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        image_config: ImageConfig,
        max_length: int = DEFAULT_MAX_LENGTH,
        media_kwargs: dict | None = None,
        image_limits: ImageLimits = ImageLimits(),
        decode_in_thread: bool | None = None,
        video_config: VideoConfig | None = None,
        video_limits: VideoLimits = VideoLimits(),
    ):
        """decode_in_thread: decode and resize images on a shared worker pool while this thread
        renders and tokenizes the state (True), or everything on the caller (False); None (the
        default) uses the pool only where there is work to overlap (`_worth_a_thread`). The
        results are the same either way.
        video_config: the export's video processor settings (before media_kwargs); None: the
        compiler refuses video states (an export without video_preprocessor_config.json)."""
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length <= 0:
            raise ConfigError(f"max_length must be a positive integer, got {max_length!r}")
        self.tokenizer = tokenizer
        self.image_config = image_config.with_media_kwargs(media_kwargs or {})
        self.max_length = max_length
        self.media_kwargs = dict(media_kwargs or {})
        self.image_limits = image_limits
        self.video_config = video_config.with_media_kwargs(media_kwargs or {}) if video_config is not None else None
        self.video_limits = video_limits
        self.decode_in_thread = decode_in_thread
        self.image_token = tokenizer.special_tokens_map.get("image_token", "<|image_pad|>")
        self.video_token = tokenizer.special_tokens_map.get("video_token", "<|video_pad|>")
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
    def from_dir(cls, export_dir: Path, max_length: int = DEFAULT_MAX_LENGTH, media_kwargs: dict | None = None,
                 decode_in_thread: bool | None = None) -> "Compiler":
        """Read tokenizer.json, tokenizer_config.json, chat_template.jinja, preprocessor_config.json
        and, where the folder has it, video_preprocessor_config.json."""
        export_dir = Path(export_dir)
        tokenizer = Tokenizer.from_dir(export_dir)
        image_config = ImageConfig.from_file(export_dir / "preprocessor_config.json")
        video_path = export_dir / "video_preprocessor_config.json"
        video_config = VideoConfig.from_file(video_path) if video_path.is_file() else None
        return cls(tokenizer, image_config, max_length=max_length, media_kwargs=media_kwargs, decode_in_thread=decode_in_thread,
                   video_config=video_config)

    # ---------------------------------------------------------------- public entry points

    def compile_bytes(self, data: bytes, on_images: Callable[[ImageInputs | VideoInputs], None] | None = None,
                      timings: dict | None = None) -> CompiledRequest:
        phases = Phases(timings)
        request = parse_request_bytes(data)
        phases.lap("json")
        return self.compile(request, on_images, timings)

    def compile(self, request: dict, on_images: Callable[[ImageInputs | VideoInputs], None] | None = None,
                timings: dict | None = None) -> CompiledRequest:
        """Validate a parsed request and compile it; raises RequestError on any bad input.

        on_images: called on this thread with the state's images as soon as they are decoded and
            resized (not for text-only states), before the questions are laid out; an engine
            starts the vision tower there. The state's text is tokenized while the images decode.
            A video state's VideoInputs come last instead: after the questions passed max_length,
            so a prompt too long is refused before any frame is converted.
        timings: when given, seconds per phase are added to it (see `PHASES`).
        """
        phases = Phases(timings)
        valid = validate_request(request, self.tokenizer.reserved_strings)  # the whole contract: wire.py
        phases.lap("validate")
        return self._compile_valid(valid, on_images, phases)

    def _compile_valid(self, valid: ValidRequest, on_images: Callable[[ImageInputs | VideoInputs], None] | None,
                       phases: Phases) -> CompiledRequest:
        """A request `validate_request` returned (with this compiler's reserved tokens) -> token
        ids, pixels and positions. What is refused here needs the export or the pixels: an image
        that does not decode or is past ImageLimits, a video past VideoLimits, a prompt past
        max_length."""
        messages = [_template_message(message) for message in valid.messages]
        images = valid.images
        phases.lap("state_parse")
        if valid.video is not None:
            return self._compile_video(messages, valid.video, valid.questions, on_images, phases)
        state = self._encode_state(messages, images, on_images, phases)
        compiled = [self._compile_question(q, len(state.input_ids)) for q in valid.questions]
        phases.lap("questions")
        return _assemble(state, compiled)

    def _compile_video(self, messages: list[dict], video: VideoPart, questions: tuple[ValidQuestion, ...],
                       on_images: Callable[[ImageInputs | VideoInputs], None] | None, phases: Phases) -> CompiledRequest:
        """A video state: probe and plan (every limit, the token count), render and tokenize, the
        questions (max_length), then decode the sampled frames and call `on_images` with them."""
        if self.video_config is None:
            raise RequestError(video.field, "this export takes no video (it has no video_preprocessor_config.json)")
        probe = probe_video(video.data, video.mime_format, video.field, self.video_limits)
        try:
            plan = plan_video(probe.frame_count, probe.fps, probe.height, probe.width, self.video_config)
        except ValueError as exc:  # a side under patch * merge, an aspect ratio the processor refuses
            raise RequestError(video.field, str(exc)) from exc
        phases.lap("video_probe")
        text = self._render_state(messages, 0, video_count=1)
        phases.lap("template")
        input_ids, mm_token_type_ids = self._tokenize_state(text, [], videos=[plan])
        phases.lap("tokenize")
        compiled = [self._compile_question(q, len(input_ids)) for q in questions]
        phases.lap("questions")
        frames = decode_frames(video.data, probe, plan, video.field, self.video_limits)  # uint8 [T, 3, H', W']
        phases.lap("video_decode")
        video_inputs = VideoInputs(frames, torch.tensor([plan.grid_thw], dtype=torch.int64), self.video_config)
        if on_images is not None:
            on_images(video_inputs)
            phases.lap("on_images")
        state = StateInputs(input_ids, mm_token_type_ids, [], None, self.image_config,
                            video_frames=frames, video_grid_thw=video_inputs.grid_thw, video_config=self.video_config)
        return _assemble(state, compiled)

    # ---------------------------------------------------------------- encoding

    def _encode_state(self, messages: list[dict], images: list[ImagePart],
                      on_images: Callable[[ImageInputs], None] | None = None,
                      phases: Phases | None = None) -> StateInputs:
        """Images decode on the pool while this thread renders and tokenizes the state with the
        grids the headers predict. Only each grid's token count enters the text, and an EXIF turn
        swaps height and width, which keeps it; a count that still differs re-tokenizes. Without
        the pool the images are ready first and `on_images` runs before the tokenizer."""
        phases = phases or Phases(None)
        pending = self._start_images(images, self._worth_a_thread(messages, images))
        phases.lap("image_open")
        image_inputs = None
        if all(isinstance(item.result, _PreparedImage) for item in pending):
            image_inputs = self._hand_over_images(pending, on_images, phases)
        predicted = self._predicted_grids(pending)
        try:
            text = self._render_state(messages, len(images))
            phases.lap("template")
            encoded = self._tokenize_state(text, predicted) if predicted is not None else None
            phases.lap("tokenize")
        except BaseException:
            _results(pending)  # an image's error comes first, as when everything ran in order
            raise
        if image_inputs is None:
            image_inputs = self._hand_over_images(pending, on_images, phases)
        grids = [list(item.grid) for item in _results(pending)]
        if encoded is None or [math.prod(g) for g in grids] != [math.prod(g) for g in predicted]:
            encoded = self._tokenize_state(text, grids)
            phases.lap("tokenize")
        input_ids, mm_token_type_ids = encoded
        if image_inputs is None:
            return StateInputs(input_ids, mm_token_type_ids, [], None, self.image_config)
        return StateInputs(input_ids, mm_token_type_ids, image_inputs.images, image_inputs.grid_thw, self.image_config)

    def _hand_over_images(self, pending: list[_PendingImage], on_images: Callable[[ImageInputs], None] | None,
                          phases: Phases) -> ImageInputs | None:
        """Wait for the decodes (in order; the first error is raised) and call `on_images` with
        them; None for a text state."""
        prepared = _results(pending)
        phases.lap("image_wait")
        if not prepared:
            return None
        for item in prepared:
            phases.add(item.seconds)
        grid_thw = torch.tensor([item.grid for item in prepared], dtype=torch.int64)  # [n_images, 3]
        image_inputs = ImageInputs([item.batch for item in prepared], grid_thw, self.image_config)
        if on_images is not None:
            on_images(image_inputs)
            phases.lap("on_images")
        return image_inputs

    def _worth_a_thread(self, messages: list[dict], images: list[ImagePart]) -> bool:
        """Whether to decode on the pool: always or never if the compiler was told; by default when
        the images can decode side by side or the text takes long enough to tokenize."""
        if self.decode_in_thread is not None:
            return self.decode_in_thread and bool(images)
        if len(images) > 1:
            return True
        text_chars = sum(len(item["text"]) for message in messages for item in message["content"] if item["type"] == "text")
        return bool(images) and text_chars >= _OVERLAP_MIN_TEXT_CHARS

    def _start_images(self, images: list[ImagePart], in_threads: bool) -> list[_PendingImage]:
        """Check each header (in order, on this thread) and start its decode; [] for text states."""
        pool = shared_decode_pool() if in_threads else None
        pending: list[_PendingImage] = []
        for image in images:
            try:
                opened = open_image(image.data, image.mime_format, image.field, self.image_limits)
            except RequestError:
                _results(pending)  # an earlier image's decode error comes first
                raise
            size = opened.size
            if pool is None:  # on this thread: libspng may decode it (it holds the GIL, so never on the pool)
                pending.append(_PendingImage(size, self._prepare_image(opened, image.field, encoded=image.data)))
            else:
                decoding = threading.Event()
                pending.append(_PendingImage(size, pool.submit(self._prepare_image, opened, image.field, decoding)))
                # The tokenizer keeps the GIL for a whole encode: hand the GIL over until the
                # pool thread has reached PIL's decoder (which lets it go), or it waits that long.
                decoding.wait()
        return pending

    def _prepare_image(self, opened, field: str, decoding: threading.Event | None = None,
                       encoded: bytes | None = None) -> _PreparedImage:
        """Decode, to tensor, resize (this thread or a pool thread): uint8 [1, C, H, W] and its
        patch grid. With `encoded` (the file's bytes), a plain PNG decodes through libspng."""
        started = time.perf_counter()
        if decoding is not None:
            decoding.set()
        pixels = fast_png_pixels(encoded, opened.size) if encoded is not None else None  # uint8 [3, H, W]
        decoded_at = time.perf_counter()
        if pixels is None:
            decoded = load_image(opened, field)
            decoded_at = time.perf_counter()
            pixels = image_to_tensor(decoded)  # uint8 [3, H, W]
        tensor_at = time.perf_counter()
        try:
            batch = resize_for_patches(pixels, self.image_config)  # uint8 [1, C, H, W]
        except ValueError as exc:
            raise RequestError(field, str(exc)) from exc
        seconds = {"decode": decoded_at - started, "to_tensor": tensor_at - decoded_at, "resize": time.perf_counter() - tensor_at}
        return _PreparedImage(batch, patch_grid(batch, self.image_config), seconds)

    def _predicted_grids(self, pending: list[_PendingImage]) -> list[list[int]] | None:
        """The grids the opened headers promise (None when one cannot be predicted: the decode's
        own error is then the one to report)."""
        grids = []
        for item in pending:
            if isinstance(item.result, _PreparedImage):
                grids.append(list(item.result.grid))
                continue
            width, height = item.header_size
            try:
                grids.append(list(grid_for_size(height, width, self.image_config)))
            except ValueError:
                return None
        return grids

    def _render_state(self, messages: list[dict], image_count: int, video_count: int = 0) -> str:
        """The chat template's text of the state, checked for the image and video tokens."""
        try:
            text = self.tokenizer.render_chat(messages, add_generation_prompt=False)
        except jinja2.TemplateError as exc:
            raise RequestError("state", f"the chat template rejected the state ({exc})") from exc
        if text.count(self.image_token) != image_count:
            raise ConfigError(f"chat template emitted {text.count(self.image_token)} {self.image_token} for {image_count} images")
        if text.count(self.video_token) != video_count:
            raise ConfigError(f"chat template emitted {text.count(self.video_token)} {self.video_token} for {video_count} videos")
        return text

    def _tokenize_state(self, text: str, grids: list[list[int]], videos: Sequence[VideoPlan] = ()) -> tuple[list[int], list[int]]:
        """(input_ids, mm_token_type_ids) of the rendered state with each image's token expanded to
        t * h * w / merge^2 image tokens and each video to its stamped frame pairs (encode_prompt)."""
        merge_length = self.image_config.merge_size**2
        counts = [grid_t * grid_h * grid_w // merge_length for grid_t, grid_h, grid_w in grids]
        try:
            return encode_prompt(self.tokenizer, text, videos=videos, image_token_counts=counts)
        except ValueError as exc:  # user text holding the processor's <|placeholder|> marker
            raise RequestError("state", str(exc)) from exc

    def _compile_question(self, question: ValidQuestion, base_length: int) -> Question:
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
                raise RequestError(f"questions.{question.qid}", f"{length} tokens exceed max_length={self.max_length}; no truncation")
            branches.append(Branch(suffix_ids=suffix, candidate_positions=positions, decision_position=length - 1))
        return Question(
            qid=question.qid,
            kind=question.kind,
            keys=[c.key for c in question.candidates],
            descriptions=[c.description for c in question.candidates],
            branches=branches,
        )


def _assemble(state: StateInputs, questions: list[Question]) -> CompiledRequest:
    base = len(state.input_ids)
    suffix_total = sum(len(b.suffix_ids) for q in questions for b in q.branches)
    branch_count = sum(len(q.branches) for q in questions)
    return CompiledRequest(
        model=MODEL_NAME,
        state=state,
        questions=questions,
        logical_tokens=base + suffix_total,
        compute_tokens=branch_count * base + suffix_total,
    )


def _results(pending: list[_PendingImage]) -> list[_PreparedImage]:
    """Wait for every started image, in order; the first failure (in image order) is raised."""
    return [item.wait() for item in pending]


def _template_message(message: Message) -> dict:
    """A validated message in the chat template's shape (Valen's, after media rewriting)."""
    content = [{"type": "text", "text": part.text} if isinstance(part, TextPart)
               else {"type": "video"} if isinstance(part, VideoPart) else {"type": "image"} for part in message.content]
    return {"role": message.role, "content": content}
