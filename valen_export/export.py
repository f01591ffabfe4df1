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
from importlib import metadata
from pathlib import Path
from typing import Callable

import torch

from valen_runtime.manifest import FORMAT, MANIFEST_NAME
from valen_runtime.safetensors_file import StreamingWriter, all_finite

from . import inventory
from . import tensor_table as table
from .atomic import AtomicDirectory
from .errors import ExportError
from .plan import MERGE_RULE, ExportPlan, plan_export
from .sources import Base, check_base_inventory, check_trainable_set, load_pins, open_base, open_checkpoint
from .verify import schema_problems

MODEL_ID = "valen-preview-0923"
EXPORTER_VERSION = "0.1.0"
DEFAULT_PINS = Path(__file__).resolve().parent.parent / "manifests" / "valen-preview-0923.json"
DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3
HEAD_FORMULA = "logit_k = <W_candidate . float32(h_k), W_decision . float32(h_decision)> * logit_scale"


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


def manifest_sections(plan: ExportPlan) -> dict:
    """The manifest's language, lora, vision, head, fp32_sources, dtype_decisions and dropped sections."""
    separate = plan.lora_mode == "separate"
    lora = plan.lora
    vision = plan.file(table.VISION_FILE)
    rounded = plan.rounded
    return {
        "language": {
            "prefix": table.LANGUAGE_PREFIX,
            "files": plan.language_files,
            "index": table.INDEX_FILE if plan.indexed else None,
            "tensors": plan.language_tensors,
            "dtype": table.LANGUAGE.dtype,
        },
        "lora": {
            "mode": plan.lora_mode,
            "file": table.LORA_FILE if separate else None,
            "rank": lora.rank,
            "alpha": lora.alpha,
            "scale": lora.scale,
            "pairs": len(table.lora_targets(plan.cfg)),
            "dtype": table.LORA_DTYPE if separate else None,
            "key_prefix": table.LORA_KEY_PREFIX if separate else None,
            "merge_rule": MERGE_RULE if not separate else None,
        },
        "vision": {
            "file": table.VISION_FILE,
            "prefix": table.VISION_PREFIX,
            "tensors": len(vision.tensors),
            "trained_blocks": plan.trained_blocks,
            "trained_merger": plan.trained_merger,
            "dtype": table.VISION.dtype,
        },
        "head": {
            "file": table.HEAD_FILE,
            "tensors": {t.name: {"shape": list(t.shape), "dtype": table.HEAD.dtype} for t in plan.head_tensors},
            "projection_dim": plan.projection_dim,
            "logit_scale": plan.projection_dim**-0.5,
            "formula": HEAD_FORMULA,
        },
        "fp32_sources": {"file": table.FP32_SOURCES_FILE if rounded else None, "tensors": list(rounded)},
        "dtype_decisions": [
            {
                "pattern": "model.language_model.layers.*." + suffix,
                "count": sum(1 for r in rounded if r.endswith(suffix)),
                "from": "F32",
                "to": "BF16",
                "rule": "round to nearest even (torch .to(torch.bfloat16))",
                "why": "the pinned reference loads the base with from_pretrained(dtype=bfloat16), which rounds them; the native loader accepts BF16 only. FP32 originals kept in " + table.FP32_SOURCES_FILE,
            }
            for suffix in inventory.FP32_IN_BASE_SUFFIXES
            if any(r.endswith(suffix) for r in rounded)
        ]
        + [
            {"pattern": "model.visual.*", "count": len(vision.tensors), "from": "BF16", "to": "BF16", "rule": "unchanged", "why": "base and trained vision weights are BF16"},
            {"pattern": "head.*", "count": len(plan.head_tensors), "from": "F32", "to": "F32", "rule": "unchanged", "why": "the reference head runs in FP32"},
        ],
        "dropped": ["mtp.*", "lm_head.weight (tied to embed_tokens; Valen never reads logits)"],
    }


def language_index(plan: ExportPlan) -> dict:
    """model.safetensors.index.json: total tensor bytes of the language shards and {tensor: shard}, sorted."""
    shards = [f for f in plan.files if f.name in plan.language_files]
    weight_map = {t.name: f.name for f in shards for t in f.tensors}
    return {"metadata": {"total_size": sum(f.nbytes for f in shards)}, "weight_map": dict(sorted(weight_map.items()))}


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


def _default_pins_hint(checkpoint_dir: Path) -> str:
    """What to do when the built-in pins refuse a checkpoint: usually a synthetic fixture exported without its pins."""
    fixture_pins = checkpoint_dir.parent / "pins.json"
    where = f"pass --pins {fixture_pins}" if fixture_pins.is_file() else "pass --pins OUT/pins.json"
    return f"; the built-in pins are for the real Valen-Preview-0923 release: a valen-fixture OUT comes with its own OUT/pins.json ({where})"


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
    hash_hint = "" if pins_path else _default_pins_hint(Path(checkpoint_dir))
    pins_path = Path(pins_path) if pins_path else DEFAULT_PINS
    pins = load_pins(pins_path)
    _check_destination(out, base_dir, checkpoint_dir)

    checkpoint = open_checkpoint(Path(checkpoint_dir), pins, log, hash_hint=hash_hint)
    base = open_base(Path(base_dir), pins, checkpoint, log)
    check_base_inventory(base)
    check_trainable_set(checkpoint, base, pins)
    missing_assets = [a for a in table.REQUIRED_COPIED_FILES if not (base.folder / a).is_file()]
    if missing_assets:
        raise ExportError(f"{base.folder}: missing required file(s) {missing_assets}")

    reader = _Reader(base)
    plan = plan_export(checkpoint, base, pins, lora_mode, max_shard_bytes, reader)
    files, fragments = plan.files, manifest_sections(plan)

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
                writer = StreamingWriter(tmp / pf.name, [(t.name, t.dtype, t.shape) for t in pf.tensors], metadata=table.SAFETENSORS_METADATA)
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
            if plan.indexed:
                job.current = table.INDEX_FILE
                records[table.INDEX_FILE] = _write_bytes(tmp / table.INDEX_FILE, (json.dumps(language_index(plan), indent=2) + "\n").encode())
            for asset in table.COPIED_FILES:
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
            problems = schema_problems(manifest)
            if problems:  # a bug here, never bad input: the schema describes what this function writes
                raise ExportError(f"{MANIFEST_NAME} would break manifests/valen-native-1.schema.json: {problems[0]}")
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
