"""`--valen-source PATH`: use a pinned Liuziyu77/Valen checkout as the reference instead of
`parity.reference` / `parity.prompt`.

Only a checkout at exactly the pinned commit with no local changes is accepted. The adapter drives
Valen's own code; module and function names are those of docs/valen-model.md and are **presumed** for
750bfcfb (read at c24142cd / 06251f9d; no pinned checkout was available offline when this was
written):

- `valen.modeling.model.build_model(config)` -> the Valen model (`.backbone`, `.head`);
- `valen.training.checkpoint.load_checkpoint(path, model)`;
- `valen.data.compiler.Compiler(processor, media_root, max_length, media_kwargs)` and
  `Compiler.compile(record)` -> CompiledState(questions, logical_tokens, compute_tokens, media);
- the model's `forward(question)` -> the question's concatenated logits.

Answers are still formed by the harness from the logits (the same §10 code for both sides).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

PINNED_COMMIT = "750bfcfbb48a5275534a9c912257ebe83ca57a97"


class ValenSourceError(Exception):
    """The checkout is missing, not git, at another commit, modified, or its API is not as presumed."""


def check_checkout(path) -> str:
    """Return the checkout's HEAD when it is the pinned commit with a clean tree; else raise."""
    path = Path(path)
    if not path.is_dir():
        raise ValenSourceError(f"{path}: --valen-source must be a directory (a Liuziyu77/Valen checkout)")
    try:
        head = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ValenSourceError(f"{path}: cannot run git ({e})") from None
    if head.returncode != 0:
        raise ValenSourceError(f"{path}: not a git checkout (git rev-parse HEAD failed); the Valen source must be a checkout at {PINNED_COMMIT}")
    commit = head.stdout.strip()
    if commit != PINNED_COMMIT:
        raise ValenSourceError(f"{path}: checkout is at {commit}, not the pinned Valen commit {PINNED_COMMIT}")
    top = subprocess.run(["git", "-C", str(path), "rev-parse", "--show-toplevel"], capture_output=True, text=True, timeout=30)
    if top.returncode != 0 or Path(top.stdout.strip()).resolve() != path.resolve():
        raise ValenSourceError(f"{path}: not the top of the Valen checkout")
    dirty = subprocess.run(["git", "-C", str(path), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, timeout=30)
    if dirty.returncode != 0 or dirty.stdout.strip():
        raise ValenSourceError(f"{path}: the checkout has local modifications; the reference must be the pinned code as committed")
    if not (path / "valen" / "__init__.py").is_file():
        raise ValenSourceError(f"{path}: no valen/ package at the top of the checkout")
    return commit


class _Prompt:
    """The harness's view of one Valen CompiledState (same fields as parity.prompt.RefPrompt.to_json)."""

    def __init__(self, compiled, im_start_id: int):
        self.compiled = compiled
        self.questions = compiled.questions
        first = compiled.questions[0].branches[0].inputs
        ids = first["input_ids"][0].tolist()
        # The suffix opens with the only <|im_start|> after the state (special tokens are refused in text).
        self.B = max(i for i, t in enumerate(ids) if t == im_start_id)
        self.base = {k: v for k, v in first.items()}
        self.base["input_ids"] = first["input_ids"][:, : self.B]
        if "mm_token_type_ids" in first:
            self.base["mm_token_type_ids"] = first["mm_token_type_ids"][:, : self.B]

    def to_json(self) -> dict:
        from .prompt import prompt_json, question_json

        questions = [
            question_json(q.qid, q.kind, q.keys, q.descriptions,
                          [(br.inputs["input_ids"][0, self.B :].tolist(), br.candidate_positions, br.decision_position)
                           for br in q.branches])
            for q in self.questions
        ]
        media = [{k: v for k, v in m.items() if k != "sampling"} for m in self.compiled.media]
        return prompt_json(self.base, questions, self.compiled.logical_tokens, self.compiled.compute_tokens, media)


class _Builder:
    def __init__(self, compiler, processor):
        self.compiler = compiler
        self.im_start_id = processor.tokenizer.convert_tokens_to_ids("<|im_start|>")

    def build(self, wire_request: dict, media_dir: Path) -> _Prompt:
        from .prompt import wire_to_state

        state = wire_to_state(wire_request["state"], media_dir)
        questions = {}
        for qid, q in wire_request["questions"].items():
            q = dict(q)
            if q.get("type") == "choice" and isinstance(q.get("criteria"), dict):
                q["criteria"] = {k: (k if v is None else v) for k, v in q["criteria"].items()}
            questions[qid] = q
        record = {"group_id": "valen-parity", "request": {"state": state, "questions": questions}}
        return _Prompt(self.compiler.compile(record), self.im_start_id)


class ValenSource:
    def __init__(self, path):
        self.path = Path(path).resolve()
        self.commit = check_checkout(self.path)

    def describe(self) -> dict:
        return {"kind": "valen-source", "path": str(self.path), "commit": self.commit, "api": "presumed (docs/valen-model.md module names)"}

    def build(self, checkpoint, base, device: str, dtype: str):
        """Returns (model, config, processor, builder) built by Valen's own code."""
        import torch  # noqa: F401  (imported before Valen so the blocker and TF32 flags already apply)

        if str(self.path) not in sys.path:
            sys.path.insert(0, str(self.path))
        try:
            from transformers import AutoProcessor
            from valen.data.compiler import Compiler
            from valen.modeling.model import build_model
            from valen.training.checkpoint import load_checkpoint
        except ImportError as e:
            raise ValenSourceError(f"{self.path}: Valen API not as presumed ({e})") from None
        checkpoint, base = Path(checkpoint), Path(base)
        config = json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))
        config["model_path"] = str(base)
        config["dtype"] = dtype
        config["device"] = device
        config["gradient_checkpointing"] = False
        model = build_model(config)
        model.to(device)
        load_checkpoint(str(checkpoint / "checkpoint.pt"), model)
        model.eval()
        processor = AutoProcessor.from_pretrained(str(base), local_files_only=True)
        compiler = Compiler(processor, media_root=".", max_length=config.get("max_length", 8192), media_kwargs=config.get("media_kwargs") or {})
        return model, config, processor, _Builder(compiler, processor)

    @staticmethod
    def question_logits(model, builder, prompt: _Prompt, device: str):
        import torch

        with torch.no_grad():
            return [model(q).float().cpu() for q in prompt.questions]
