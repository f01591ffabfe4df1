"""The reference's prompt builder, written from docs/valen-model.md (not from valen_runtime.request).

It runs inside the reference process and uses the pinned stack's own processor:
`processor.apply_chat_template(messages, tokenize=True, add_generation_prompt=False,
return_dict=True, return_tensors="pt", processor_kwargs=dict(media_kwargs, return_metadata=True))`
for the state, and `processor.tokenizer.encode(text, add_special_tokens=False)` once per suffix
segment. The runtime's compiler is a separate implementation (its own Jinja rendering, tokenizer
and image pipeline); the harness compares the two token for token.

Wire request -> Valen record, as the System1-Omni worker does it (docs/wire-contract.md):
- a string state is one user turn;
- `{"image": data URL}` is decoded to a file (`input.png` / `input.jpg` in a request-scoped temp
  directory) and becomes a user turn holding one `image_url` item pointing at that file;
- `{"video": data URL}` (`data:video/mp4` or `data:video/webm`) is decoded to `input.mp4` /
  `input.webm` the same way and becomes a user turn holding one `video_url` item;
- `{"messages": [...]}` is copied; image items carrying data URLs (`image_url` with a string or
  `{"url": ...}`, or `image`) and `video_url` items (a string or `{"url": ...}`) are decoded to
  files the same way and become `image_url` / `video_url` items; one video per request, and no
  image beside it (the wire contract);
- any other object or array is text, serialised with `json.dumps(ensure_ascii=False)`;
- a null choice criterion defaults to its key.
Valen's compiler then rewrites every `image_url` item to `{"type": "image", "path": <abs>}` and
every `video_url` item to `{"type": "video", "path": <abs>}`, which the processor loads itself
(images: PIL open, EXIF transpose, RGB; videos: `load_video` through `torchvision.io.read_video`,
which the reference process installs from parity/video_reader.py) and preprocesses with its
torchvision backends. Nothing here decodes, samples, resizes or normalises pixels.
"""

from __future__ import annotations

import base64
import copy
import json
from dataclasses import dataclass, field
from pathlib import Path

# valen/data/schema.py, byte for byte (docs/valen-model.md).
NOUL_CANDIDATES = (
    ("true", "True / 是：满足问题中的条件。"),
    ("false", "False / 否：不满足问题中的条件。"),
)
QUESTION_TYPES = ("choice", "noul", "score")
IMAGE_MIME = {"data:image/png;base64,": ".png", "data:image/jpeg;base64,": ".jpg"}
VIDEO_MIME = {"data:video/mp4;base64,": ".mp4", "data:video/webm;base64,": ".webm"}


class PromptError(ValueError):
    """The reference compiler rejects the request (Valen raises ValueError in the same places)."""


@dataclass
class RefBranch:
    suffix_ids: list[int]
    candidate_positions: list[int]
    decision_position: int


@dataclass
class RefQuestion:
    qid: str
    kind: str
    keys: list[str]
    descriptions: list[str]
    branches: list[RefBranch]


@dataclass
class RefPrompt:
    """What Valen's Compiler.compile returns, minus the model inputs kept in `base`."""

    base: dict  # processor output: input_ids [1, B], attention_mask, mm_token_type_ids, pixel_values, image_grid_thw (or the video pair)
    questions: list[RefQuestion]
    logical_tokens: int
    compute_tokens: int
    media: list[dict] = field(default_factory=list)

    def to_json(self) -> dict:
        questions = [
            question_json(q.qid, q.kind, q.keys, q.descriptions,
                          [(br.suffix_ids, br.candidate_positions, br.decision_position) for br in q.branches])
            for q in self.questions
        ]
        return prompt_json(self.base, questions, self.logical_tokens, self.compute_tokens, self.media)


def question_json(qid: str, kind: str, keys, descriptions, branches) -> dict:
    """One question of the prompt record; branches: (suffix ids, candidate positions, decision position)."""
    return {
        "qid": qid,
        "kind": kind,
        "keys": list(keys),
        "descriptions": list(descriptions),
        "branches": [
            {"suffix_ids": list(ids), "candidate_positions": list(cands), "decision_position": int(decision)}
            for ids, cands, decision in branches
        ],
    }


def prompt_json(base: dict, questions: list[dict], logical_tokens: int, compute_tokens: int, media: list[dict]) -> dict:
    """The prompt record every reference source produces (rebuilt here, or Valen's own compiler), so
    the harness compares one schema. base: the processor's output for the state."""
    return {
        "input_ids": base["input_ids"][0].tolist(),
        "mm_token_type_ids": base["mm_token_type_ids"][0].tolist() if "mm_token_type_ids" in base else None,
        "image_grid_thw": base["image_grid_thw"].tolist() if "image_grid_thw" in base else None,
        "video_grid_thw": base["video_grid_thw"].tolist() if "video_grid_thw" in base else None,
        "questions": questions,
        "logical_tokens": int(logical_tokens),
        "compute_tokens": int(compute_tokens),
        "media": media,
    }


# ---------------------------------------------------------------- wire request -> record


def _write_data_url(url, media_dir: Path, stem: str, kinds: dict, what: str) -> Path:
    expected = " or ".join(f"{prefix}..." for prefix in kinds)
    if not isinstance(url, str):
        raise PromptError(f"{what}: expected a {expected} URL")
    for prefix, suffix in kinds.items():
        if url.startswith(prefix):
            data = base64.b64decode(url[len(prefix):], validate=True)
            path = media_dir / f"{stem}{suffix}"
            path.write_bytes(data)
            return path.resolve()
    raise PromptError(f"{what}: expected a {expected} URL")


def _item_url(item: dict, kind: str):
    url = item.get(kind)
    return url.get("url") if isinstance(url, dict) else url


def wire_to_state(state, media_dir: Path):
    """Wire `state` -> a Valen record state (str or {"messages": [...]}) with media files on disk."""
    media_dir = Path(media_dir)
    if isinstance(state, str):
        return state
    if isinstance(state, dict) and list(state) == ["image"]:
        path = _write_data_url(state["image"], media_dir, "input", IMAGE_MIME, "image")
        return {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": str(path)}}]}]}
    if isinstance(state, dict) and list(state) == ["video"]:
        path = _write_data_url(state["video"], media_dir, "input", VIDEO_MIME, "video")
        return {"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": str(path)}}]}]}
    if isinstance(state, dict) and list(state) == ["messages"]:
        messages = copy.deepcopy(state["messages"])
        images = videos = 0
        for message in messages:
            content = message.get("content")
            if not isinstance(content, list):
                continue
            for i, item in enumerate(content):
                kind = item.get("type") if isinstance(item, dict) else None
                if kind in ("image_url", "image"):
                    path = _write_data_url(_item_url(item, kind), media_dir, f"input-{images}", IMAGE_MIME, "image")
                    images += 1
                    content[i] = {"type": "image_url", "image_url": {"url": str(path)}}
                elif kind == "video_url":
                    videos += 1
                    if videos > 1:
                        raise PromptError("state.messages: at most one video per request")
                    path = _write_data_url(_item_url(item, kind), media_dir, "input", VIDEO_MIME, "video")
                    content[i] = {"type": "video_url", "video_url": {"url": str(path)}}
        if videos and images:
            raise PromptError("state.messages: a video state holds no image beside the video")
        return {"messages": messages}
    return json.dumps(state, ensure_ascii=False)


def wire_candidates(question: dict) -> list[tuple[str, str]]:
    """(key, description) pairs per docs/valen-model.md"""
    kind = question.get("type")
    criteria = question.get("criteria")
    if kind == "noul":
        return list(NOUL_CANDIDATES)
    if kind == "choice":
        if not isinstance(criteria, dict) or not 1 <= len(criteria) <= 255:
            raise PromptError("choice criteria must be an object with 1-255 entries")
        return [(k, k if v is None else v) for k, v in criteria.items()]
    if kind == "score":
        if not isinstance(criteria, list) or not 2 <= len(criteria) <= 10:
            raise PromptError("score criteria must be a list of 2-10 descriptions")
        return [(str(i), d) for i, d in enumerate(criteria)]
    raise PromptError(f"unsupported question type {kind!r}")


# ---------------------------------------------------------------- Valen's compiler, from the spec


class ReferencePromptBuilder:
    def __init__(self, processor, max_length: int = 8192, media_kwargs: dict | None = None):
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.max_length = max_length
        self.media_kwargs = dict(media_kwargs or {})
        self.special = list(self.tokenizer.all_special_tokens)

    def _reject_special(self, text: str, where: str) -> None:
        if any(t in text for t in self.special):
            raise PromptError(f"reserved tokenizer control token in {where}")

    def messages(self, state) -> tuple[list[dict], list[dict]]:
        """§8.3: state -> chat messages with media rewritten to {"type": "image", "path": abs}."""
        messages = [{"role": "user", "content": state}] if isinstance(state, str) else copy.deepcopy(state["messages"])
        media = []
        for message in messages:
            if message.get("role") not in ("user", "assistant", "system"):
                raise PromptError("unsupported state role")
            if isinstance(message["content"], str):
                message["content"] = [{"type": "text", "text": message["content"]}]
            for item in message["content"]:
                kind = item["type"]
                if kind == "text":
                    self._reject_special(item["text"], "state")
                    continue
                if kind not in ("image_url", "video_url"):
                    raise PromptError(f"unsupported content type {kind!r}")
                url = item[kind]["url"] if isinstance(item[kind], dict) else item[kind]
                if "://" in url:
                    raise PromptError("remote media are not accepted")
                path = Path(url).resolve(strict=True)
                media.append({"path": str(path), "type": kind})
                item.clear()
                item.update(type=kind[: -len("_url")], path=str(path))
        return messages, media

    def encode_segment(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def build(self, wire_request: dict, media_dir: Path) -> RefPrompt:
        questions = wire_request["questions"]
        if not isinstance(questions, dict) or not questions:
            raise PromptError("questions must be a non-empty object")
        parsed = []
        for qid, q in questions.items():
            kind = q.get("type")
            instructions = q.get("instructions")
            if kind not in QUESTION_TYPES:
                raise PromptError(f"{qid}: unsupported question type {kind!r}")
            if not isinstance(instructions, str) or not instructions.strip():
                raise PromptError(f"{qid}: instructions must be non-empty text")
            pairs = wire_candidates(q)
            for key, desc in pairs:
                if not isinstance(key, str) or not key or not isinstance(desc, str) or not desc.strip():
                    raise PromptError(f"{qid}: every key and description must be non-empty text")
            parsed.append((qid, kind, instructions, pairs))

        state = wire_to_state(wire_request["state"], media_dir)
        messages, media = self.messages(state)
        base = dict(
            self.processor.apply_chat_template(
                messages,
                tokenize=True,
                add_generation_prompt=False,
                return_dict=True,
                return_tensors="pt",
                processor_kwargs=dict(self.media_kwargs, return_metadata=True),
            )
        )
        base.pop("video_metadata", None)
        for key in ("image_grid_thw", "video_grid_thw"):
            if key in base:
                grid = base[key]
                media.append({key: grid.tolist(), "visual_tokens": int(grid.prod(-1).sum()) // 4})
        B = int(base["input_ids"].shape[1])
        logical, compute = B, 0
        out = []
        for qid, kind, instructions, pairs in parsed:
            for value in [instructions] + [v for pair in pairs for v in pair]:
                self._reject_special(value, f"question {qid}")
            groups = [[p] for p in pairs] if kind == "score" else [pairs]
            branches = []
            for group in groups:
                suffix = self.encode_segment("<|im_start|>user\n")
                suffix += self.encode_segment(f"Task: {kind}\nQuestion: {instructions}\nCandidates:\n")
                positions = []
                for key, desc in group:
                    suffix += self.encode_segment(desc if kind == "score" else f"{key}: {desc}")
                    positions.append(B + len(suffix) - 1)
                    suffix += self.encode_segment("\n")
                suffix += self.encode_segment("Decision:")
                length = B + len(suffix)
                if length > self.max_length:
                    raise PromptError(f"{qid}: {length} tokens exceed max_length={self.max_length}; no truncation")
                branches.append(RefBranch(suffix, positions, length - 1))
                logical += len(suffix)
                compute += length
            out.append(RefQuestion(qid, kind, [k for k, _ in pairs], [d for _, d in pairs], branches))
        return RefPrompt(base, out, logical, compute, media)

    def branch_inputs(self, prompt: RefPrompt, branch: RefBranch) -> dict:
        """§8.6: the model inputs of one branch (no position_ids)."""
        import torch

        base = prompt.base
        suffix = torch.tensor([branch.suffix_ids], dtype=torch.long)
        inputs = {k: v for k, v in base.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids")}
        inputs["input_ids"] = torch.cat([base["input_ids"], suffix], dim=1)
        inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
        if "mm_token_type_ids" in base:
            inputs["mm_token_type_ids"] = torch.cat([base["mm_token_type_ids"], torch.zeros_like(suffix)], dim=1)
        return inputs
