"""`export()`: checkpoint.pt + Qwen3.5 base -> a `valen-native/1` directory (docs/export-format.md).

Order of work: verify every input (sources.py), plan every output tensor (name, dtype, shape,
where its value comes from), then stream tensor by tensor into a temporary directory beside the
destination, hash each file, write the manifest last and rename the directory into place. All
renaming and dtype decisions are made here and recorded in the manifest; loaders map names
one-to-one.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Callable

import torch

from valen_runtime.safetensors_file import StreamingWriter, all_finite

from . import inventory
from .atomic import AtomicDirectory
from .errors import ExportError
from .sources import Base, Checkpoint, check_base_inventory, check_trainable_set, load_pins, open_base, open_checkpoint

FORMAT = "valen-native/1"
MANIFEST_NAME = "valen_export.json"
MODEL_ID = "valen-preview-0923"
EXPORTER_VERSION = "0.1.0"
DEFAULT_PINS = Path(__file__).resolve().parent.parent / "manifests" / "valen-preview-0923.json"
DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3

LORA_FILE = "adapter_model.safetensors"
LORA_KEY_PREFIX = "base_model.model.model.language_model."  # the native lora.rs naming
VISION_FILE = "vision.safetensors"
HEAD_FILE = "valen_head.safetensors"
FP32_SOURCES_FILE = "fp32_sources.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Copied byte-for-byte from the base when present; config.json and tokenizer.json are required.
TEXT_ASSETS = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "processor_config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
)
REQUIRED_ASSETS = ("config.json", "tokenizer.json", "chat_template.jinja", "preprocessor_config.json")


@dataclass
class PlannedTensor:
    name: str  # name in the output file
    dtype: torch.dtype
    shape: tuple[int, ...]
    produce: Callable[[], torch.Tensor]


@dataclass
class PlannedFile:
    name: str
    tensors: list[PlannedTensor] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(t.dtype.itemsize * _numel(t.shape) for t in self.tensors)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class _Reader:
    """Reads base tensors one at a time, keeping file handles open for the export's duration."""

    def __init__(self, base: Base):
        self.base = base
        self.handles = {}

    def __call__(self, name: str) -> torch.Tensor:
        fname = self.base.tensor_file[name]
        if fname not in self.handles:
            self.handles[fname] = open(self.base.folder / fname, "rb")
        return self.base.weight_files[fname].read(name, self.handles[fname])

    def close(self):
        for h in self.handles.values():
            h.close()


def plan_export(checkpoint: Checkpoint, base: Base, pins: dict, lora_mode: str, max_shard_bytes: int, read) -> tuple[list[PlannedFile], dict]:
    """Decide every output tensor; returns (files, manifest fragments)."""
    tc = inventory.text_config(base.config)
    rank = checkpoint.config["lora_rank"]
    alpha = checkpoint.config["lora_alpha"]
    scale = alpha / rank  # PEFT's plain-LoRA scaling, read from the checkpoint config
    weights = checkpoint.weights
    linears = inventory.linear_shapes(tc)
    rounded: list[str] = []

    def lora_pair(module: str) -> tuple[torch.Tensor, torch.Tensor]:
        p = inventory.PAYLOAD_LORA_PREFIX + module
        return weights[p + ".lora_A.default.weight"], weights[p + ".lora_B.default.weight"]

    def language_tensor(name: str) -> Callable[[], torch.Tensor]:
        full = inventory.LANGUAGE_PREFIX + name
        module = name[: -len(".weight")] if name.endswith(".weight") else None

        def produce():
            t = read(full)
            if lora_mode == "merged" and module in linears:
                a, b = lora_pair(module)
                # PEFT's delta (B @ A) * scale in FP32, added to the FP32 view of W, rounded to BF16 once.
                return (t.float() + (b.float() @ a.float()) * scale).to(torch.bfloat16)
            return t.to(torch.bfloat16)  # round-to-nearest-even, as from_pretrained(dtype=bf16) does

        return produce

    lang_shapes = inventory.language_shapes(base.config)
    lang_tensors = []
    fp32_sources = []
    for name, shape in lang_shapes.items():
        full = inventory.LANGUAGE_PREFIX + name
        src_dtype = base.weight_files[base.tensor_file[full]].tensors[full].dtype
        if src_dtype == "F32":
            rounded.append(full)
            fp32_sources.append(PlannedTensor(full, torch.float32, shape, (lambda f=full: read(f).float())))
        elif src_dtype != "BF16":
            raise ExportError(f"{base.folder}: base tensor {full} is {src_dtype}; expected BF16 or F32")
        lang_tensors.append(PlannedTensor(full, torch.bfloat16, shape, language_tensor(name)))

    files: list[PlannedFile] = []
    if max_shard_bytes <= 0:
        files.append(PlannedFile("model.safetensors", lang_tensors))
    else:
        shards: list[list[PlannedTensor]] = [[]]
        size = 0
        for t in lang_tensors:
            nb = t.dtype.itemsize * _numel(t.shape)
            if shards[-1] and size + nb > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(t)
            size += nb
        n = len(shards)
        files += [PlannedFile(f"model-{k + 1:05d}-of-{n:05d}.safetensors", s) for k, s in enumerate(shards)]
    language_files = [f.name for f in files]

    if lora_mode == "separate":
        lora_tensors = []
        for module, (out_f, in_f) in linears.items():
            a, b = lora_pair(module)
            lora_tensors.append(PlannedTensor(f"{LORA_KEY_PREFIX}{module}.lora_A.weight", torch.float32, (rank, in_f), (lambda t=a: t.float())))
            lora_tensors.append(PlannedTensor(f"{LORA_KEY_PREFIX}{module}.lora_B.weight", torch.float32, (out_f, rank), (lambda t=b: t.float())))
        files.append(PlannedFile(LORA_FILE, sorted(lora_tensors, key=lambda t: t.name)))

    trained_blocks = inventory.trained_vision_blocks(base.config, pins["trainable_inventory"]["vision"]["trained_blocks_from_end"])
    vision_tensors = []
    for name, shape in inventory.vision_shapes(base.config).items():
        payload_key = inventory.PAYLOAD_VISION_PREFIX + name
        if payload_key in weights:
            produce = lambda k=payload_key: weights[k].to(torch.bfloat16)
        else:
            produce = lambda f=inventory.VISION_PREFIX + name: read(f).to(torch.bfloat16)
        vision_tensors.append(PlannedTensor(inventory.VISION_PREFIX + name, torch.bfloat16, shape, produce))
    files.append(PlannedFile(VISION_FILE, vision_tensors))

    head_rule = pins["trainable_inventory"]["head"]
    head_tensors = [
        PlannedTensor(n, torch.float32, tuple(weights[inventory.PAYLOAD_HEAD_PREFIX + n].shape), (lambda k=inventory.PAYLOAD_HEAD_PREFIX + n: weights[k].float()))
        for n in sorted(head_rule["names"])
    ]
    files.append(PlannedFile(HEAD_FILE, head_tensors))
    if fp32_sources:
        files.append(PlannedFile(FP32_SOURCES_FILE, fp32_sources))

    fragments = {
        "language": {
            "prefix": inventory.LANGUAGE_PREFIX,
            "files": language_files,
            "index": INDEX_FILE if max_shard_bytes > 0 else None,
            "tensors": len(lang_tensors),
            "dtype": "BF16",
        },
        "lora": {
            "mode": lora_mode,
            "file": LORA_FILE if lora_mode == "separate" else None,
            "rank": rank,
            "alpha": alpha,
            "scale": scale,
            "pairs": len(linears),
            "dtype": "F32" if lora_mode == "separate" else None,
            "key_prefix": LORA_KEY_PREFIX if lora_mode == "separate" else None,
            "merge_rule": "W' = bf16(float32(W) + (B @ A) * scale)" if lora_mode == "merged" else None,
        },
        "vision": {"file": VISION_FILE, "prefix": inventory.VISION_PREFIX, "tensors": len(vision_tensors), "trained_blocks": trained_blocks, "dtype": "BF16"},
        "head": {
            "file": HEAD_FILE,
            "tensors": {t.name: {"shape": list(t.shape), "dtype": "F32"} for t in head_tensors},
            "projection_dim": head_rule["projection_dim"],
            "logit_scale": head_rule["projection_dim"] ** -0.5,
            "formula": "logit_k = <W_candidate . float32(h_k), W_decision . float32(h_decision)> * logit_scale",
        },
        "fp32_sources": {"file": FP32_SOURCES_FILE if fp32_sources else None, "tensors": [t.name for t in fp32_sources]},
        "dtype_decisions": [
            {
                "pattern": "model.language_model.layers.*." + suffix,
                "count": sum(1 for r in rounded if r.endswith(suffix)),
                "from": "F32",
                "to": "BF16",
                "rule": "round to nearest even (torch .to(torch.bfloat16))",
                "why": "the pinned reference loads the base with from_pretrained(dtype=bfloat16), which rounds them; the native loader accepts BF16 only. FP32 originals kept in " + FP32_SOURCES_FILE,
            }
            for suffix in inventory.FP32_IN_BASE_SUFFIXES
            if any(r.endswith(suffix) for r in rounded)
        ]
        + [
            {"pattern": "model.visual.*", "count": len(vision_tensors), "from": "BF16", "to": "BF16", "rule": "unchanged", "why": "base and trained vision weights are BF16"},
            {"pattern": "head.*", "count": len(head_tensors), "from": "F32", "to": "F32", "rule": "unchanged", "why": "the reference head runs in FP32"},
        ],
        "dropped": ["mtp.*", "lm_head.weight (tied to embed_tokens; Valen never reads logits)"],
    }
    return files, fragments


def _exporter_sha256() -> str:
    h = hashlib.sha256()
    root = Path(__file__).resolve().parent
    for p in sorted(root.glob("*.py")) + [root.parent / "valen_runtime" / "safetensors_file.py"]:
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def producer_runtime() -> dict:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "safetensors": _version("safetensors"),
        "transformers": _version("transformers"),
        "platform": platform.platform(terse=True),
    }


def _check_destination(out: Path, base: Path, checkpoint: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out}: already exists and is not an empty directory; choose a new --out")
    resolved = out.resolve()
    for src in (base, checkpoint):
        s = Path(src).resolve()
        if resolved == s or s in resolved.parents:
            raise ExportError(f"{out}: must not be inside the input folder {src}")


def export(
    checkpoint_dir: Path,
    base_dir: Path,
    out: Path,
    lora_mode: str = "separate",
    pins_path: Path | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    progress: bool | None = None,
    log: Callable[[str], None] | None = None,
) -> dict:
    """Export and return the manifest. Nothing appears at `out` unless the export completes."""
    if lora_mode not in ("separate", "merged"):
        raise ExportError(f"--lora: {lora_mode!r} is not one of separate, merged")
    out = Path(out)
    log = log or (lambda msg: None)
    pins_path = Path(pins_path) if pins_path else DEFAULT_PINS
    pins = load_pins(pins_path)
    _check_destination(out, base_dir, checkpoint_dir)

    checkpoint = open_checkpoint(Path(checkpoint_dir), pins, log)
    base = open_base(Path(base_dir), pins, checkpoint, log)
    check_base_inventory(base)
    check_trainable_set(checkpoint, base, pins)
    missing_assets = [a for a in REQUIRED_ASSETS if not (base.folder / a).is_file()]
    if missing_assets:
        raise ExportError(f"{base.folder}: missing required file(s) {missing_assets}")

    reader = _Reader(base)
    files, fragments = plan_export(checkpoint, base, pins, lora_mode, max_shard_bytes, reader)

    bar = None
    try:
        with AtomicDirectory(out) as job:
            tmp = job.tmp
            total = sum(len(f.tensors) for f in files)
            show = sys.stderr.isatty() if progress is None else progress
            if show:
                from tqdm import tqdm

                bar = tqdm(total=total, unit="tensor", desc=f"export ({lora_mode})", file=sys.stderr)
            records: dict[str, dict] = {}
            for pf in files:
                job.current = pf.name
                writer = StreamingWriter(tmp / pf.name, [(t.name, t.dtype, t.shape) for t in pf.tensors], metadata={"format": "pt"})
                try:
                    for t in pf.tensors:
                        value = t.produce()
                        if not all_finite(value):
                            raise ExportError(f"{pf.name}: tensor {t.name} would hold non-finite values")
                        writer.write(t.name, value)
                        if bar:
                            bar.update(1)
                except BaseException:
                    writer.abort()
                    raise
                sha, size = writer.close()
                records[pf.name] = {"sha256": sha, "size": size}
                line = f"wrote {pf.name} ({len(pf.tensors)} tensors, {size / 2**20:.1f} MiB)"
                if bar:
                    bar.write(line, file=sys.stderr)  # printed above the bar instead of through it
                else:
                    log(line)
            if fragments["language"]["index"]:
                weight_map = {t.name: pf.name for pf in files if pf.name in fragments["language"]["files"] for t in pf.tensors}
                total_size = sum(pf.nbytes for pf in files if pf.name in fragments["language"]["files"])
                index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
                job.current = INDEX_FILE
                records[INDEX_FILE] = _write_bytes(tmp / INDEX_FILE, (json.dumps(index, indent=2) + "\n").encode())
            for asset in TEXT_ASSETS:
                src = base.folder / asset
                if src.is_file():
                    job.current = asset
                    records[asset] = _write_bytes(tmp / asset, src.read_bytes())

            manifest = {
                "format": FORMAT,
                "model_id": MODEL_ID,
                "pins": pins,
                "source": {
                    "checkpoint_sha256": checkpoint.sha256,
                    "base_revision": base.revision,
                    "base_weight_sha256": base.weight_sha256,
                },
                **fragments,
                "prompt": {
                    "max_length": checkpoint.config.get("max_length", 8192),
                    "media_kwargs": checkpoint.config.get("media_kwargs") or {},
                },
                "files": dict(sorted(records.items())),
                "exporter": {"name": "valen-export", "version": EXPORTER_VERSION, "sha256": _exporter_sha256()},
                "producer_runtime": producer_runtime(),
            }
            job.current = MANIFEST_NAME
            _write_bytes(tmp / MANIFEST_NAME, (json.dumps(manifest, indent=2, ensure_ascii=False) + "\n").encode())
            job.commit("the finished export", "another export may have won the race")
    finally:
        if bar:
            bar.close()
        reader.close()
    log(f"export complete: {out}")
    return manifest


def _write_bytes(path: Path, data: bytes) -> dict:
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
