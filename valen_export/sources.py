"""Open and verify the two inputs of an export: the Valen checkpoint folder and the Qwen3.5 base.

Everything is checked before anything is written: the pins (checkpoint.pt SHA-256, base
revision), the base weight hashes against `payload["base_manifest"]`, the training config, and
the exact trainable set (names, shapes, dtypes, finite values). `checkpoint.pt` is unpickled with
`weights_only=True` only, and only `payload["weights"]` is used (never `training_state`).
"""

from __future__ import annotations

import json
import pickle
from dataclasses import dataclass
from pathlib import Path

import torch

from valen_runtime.errors import ConfigError, WeightsError
from valen_runtime.safetensors_file import SafetensorsFile, all_finite, sha256_file

from . import inventory, tensor_table
from .errors import ExportError

DTYPE_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def read_json(path: Path, what: str) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ExportError(f"{path}: missing ({what})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ExportError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ExportError(f"{path}: expected a JSON object ({what})")
    return data


def load_pins(path: Path) -> dict:
    pins = read_json(path, "pins")
    if pins.get("schema") != "valen-pins/1":
        raise ExportError(f"{path}: field 'schema' is {pins.get('schema')!r}, expected 'valen-pins/1'")
    for field in ("checkpoint", "base", "expected_config", "trainable_inventory"):
        if not isinstance(pins.get(field), dict):
            raise ExportError(f"{path}: missing object field {field!r}")
    head = pins["trainable_inventory"].get("head")
    names = head.get("names") if isinstance(head, dict) else None
    if not isinstance(names, list) or sorted(map(str, names)) != tensor_table.head_names():
        raise ExportError(f"{path}: trainable_inventory.head.names is {names!r}, expected {tensor_table.head_names()} (the valen-native/1 head)")
    return pins


@dataclass
class Checkpoint:
    folder: Path
    config: dict
    sha256: str
    weights: dict[str, torch.Tensor]
    base_manifest: dict | None


@dataclass
class Base:
    folder: Path
    config: dict
    revision: str
    weight_files: dict[str, SafetensorsFile]  # file name -> parsed header
    weight_sha256: dict[str, str]
    tensor_file: dict[str, str]  # tensor name -> file name


def shown(name) -> str:
    """A key as it can be shown on one line (control characters escaped)."""
    return str(name).encode("unicode_escape").decode("ascii")


def check_training_config(config: dict, expected: dict, where: str) -> None:
    for key, want in expected.items():
        if key not in config:
            raise ExportError(f"{where}: missing field {key!r} (expected {want!r})")
        got = config[key]
        # Plain JSON scalars only: a tensor or container here would make `!=` ambiguous.
        if not isinstance(got, (str, int, float, bool)) or isinstance(got, bool) != isinstance(want, bool) or got != want:
            raise ExportError(f"{where}: field {key!r} is {shown(repr(got))[:80]}, expected {want!r}")


def open_checkpoint(folder: Path, pins: dict, progress=None, hash_hint: str = "") -> Checkpoint:
    """hash_hint is appended to a checkpoint.pt hash mismatch (what to do about it)."""
    folder = Path(folder)
    config = read_json(folder / "config.json", "Valen training config")
    check_training_config(config, pins["expected_config"], str(folder / "config.json"))
    path = folder / "checkpoint.pt"
    if not path.is_file():
        raise ExportError(f"{path}: missing")
    if progress:
        progress(f"hashing {path.name}")
    sha = sha256_file(path)
    want = pins["checkpoint"].get("checkpoint_sha256")
    if sha != want:
        raise ExportError(f"{path}: sha256 {sha} does not match the pinned {want} (pins checkpoint.checkpoint_sha256){hash_hint}")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        # torch's message is long; keep the line that names the refused global.
        lines = [ln.strip() for ln in str(e).splitlines() if "Unsupported" in ln or "GLOBAL" in ln]
        first = lines[0].split(" was not")[0] if lines else type(e).__name__
        raise ExportError(f"{path}: refused by weights_only unpickling (it needs arbitrary code): {first}") from None
    except Exception as e:  # noqa: BLE001 - a corrupt archive surfaces as many exception types inside torch.load
        first = shown(str(e).strip().splitlines()[0]) if str(e).strip() else type(e).__name__
        raise ExportError(f"{path}: cannot be read as a torch.save archive (truncated or corrupt?): {first}") from None
    if not isinstance(payload, dict) or not isinstance(payload.get("weights"), dict):
        raise ExportError(f"{path}: expected a dict with a 'weights' dict (a Valen training checkpoint)")
    bad_keys = [k for k in payload["weights"] if not isinstance(k, str)]
    if bad_keys:
        raise ExportError(f"{path}: payload['weights'] has non-string keys, e.g. {shown(repr(bad_keys[0]))[:80]}")
    if isinstance(payload.get("config"), dict):
        check_training_config(payload["config"], pins["expected_config"], f"{path} payload['config']")
    base_manifest = payload.get("base_manifest")
    if base_manifest is not None and not isinstance(base_manifest, dict):
        raise ExportError(f"{path}: payload['base_manifest'] is a {type(base_manifest).__name__}, expected a dict or None")
    return Checkpoint(folder, config, sha, payload["weights"], base_manifest)


def weight_file_names(folder: Path) -> list[str]:
    """Base weight files: the index's values when an index exists, else every *.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        data = read_json(index, "base weight index")
        wm = data.get("weight_map")
        if not isinstance(wm, dict) or not wm:
            raise ExportError(f"{index}: field 'weight_map' must be a non-empty object")
        names = sorted(set(wm.values()))
    else:
        names = sorted(p.name for p in folder.glob("*.safetensors"))
    if not names:
        raise ExportError(f"{folder}: no base weights (*.safetensors) found")
    for n in names:
        p = (folder / n).resolve()
        if "/" in n or n.startswith(".") or p.parent != folder.resolve():
            raise ExportError(f"{folder}: weight file {n!r} leaves the base folder")
    return names


def open_base(folder: Path, pins: dict, checkpoint: Checkpoint, progress=None) -> Base:
    folder = Path(folder)
    config = read_json(folder / "config.json", "base model config")
    if config.get("model_type") != "qwen3_5":
        raise ExportError(f"{folder / 'config.json'}: model_type is {config.get('model_type')!r}, expected 'qwen3_5'")
    manifest = read_json(folder / "valen_manifest.json", "base manifest written by valen-fetch / prepare_model")
    revision = manifest.get("revision")
    want_rev = pins["base"]["revision"]
    if revision != want_rev:
        raise ExportError(f"{folder / 'valen_manifest.json'}: revision {revision!r} does not match the pinned base revision {want_rev!r}")
    ckpt_manifest = checkpoint.base_manifest
    if not ckpt_manifest:
        raise ExportError(f"{checkpoint.folder / 'checkpoint.pt'}: payload has no base_manifest; cannot verify the base")
    if ckpt_manifest.get("revision") != revision:
        raise ExportError(
            f"{folder / 'valen_manifest.json'}: revision {revision!r} differs from the checkpoint's base_manifest revision {ckpt_manifest.get('revision')!r}"
        )
    expected_hashes = ckpt_manifest.get("weight_sha256")
    if (
        not isinstance(expected_hashes, dict)
        or not expected_hashes
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in expected_hashes.items())
    ):
        raise ExportError(f"{checkpoint.folder / 'checkpoint.pt'}: base_manifest.weight_sha256 must be a non-empty {{file: sha256}} object")
    names = weight_file_names(folder)
    if sorted(expected_hashes) != names:
        raise ExportError(
            f"{folder}: base weight files {names} differ from the checkpoint's base_manifest.weight_sha256 files {sorted(expected_hashes)}"
        )
    files: dict[str, SafetensorsFile] = {}
    hashes: dict[str, str] = {}
    for n in names:
        if progress:
            progress(f"hashing base {n}")
        digest = sha256_file(folder / n)
        if digest != expected_hashes[n]:
            raise ExportError(f"{folder / n}: sha256 {digest} does not match base_manifest.weight_sha256 {expected_hashes[n]}")
        try:
            files[n] = SafetensorsFile(folder / n)
        except WeightsError as e:
            raise ExportError(str(e)) from None
        hashes[n] = digest
    tensor_file: dict[str, str] = {}
    for n, f in files.items():
        for t in f.tensors:
            if t in tensor_file:
                raise ExportError(f"{folder}: tensor {t!r} appears in both {tensor_file[t]} and {n}")
            tensor_file[t] = n
    return Base(folder, config, revision, files, hashes, tensor_file)


def check_base_inventory(base: Base) -> None:
    """Every language and vision tensor the config implies must be present with its shape."""
    problems = []
    try:
        tensor_table.model_config(base.config)  # the runtime's own refusals, once, naming the file
    except ConfigError as e:
        raise ExportError(f"{base.folder / 'config.json'}: {e}") from None
    expected = {inventory.LANGUAGE_PREFIX + n: s for n, s in inventory.language_shapes(base.config).items()}
    expected.update({inventory.VISION_PREFIX + n: s for n, s in inventory.vision_shapes(base.config).items()})
    for name, shape in expected.items():
        file = base.tensor_file.get(name)
        if file is None:
            problems.append(f"missing {name}")
            continue
        got = base.weight_files[file].tensors[name].shape
        if tuple(got) != tuple(shape):
            problems.append(f"{name} has shape {list(got)}, expected {list(shape)}")
    if problems:
        raise ExportError(f"{base.folder}: base weights do not match config.json: " + "; ".join(sorted(problems)[:10]) + (f" (+{len(problems) - 10} more)" if len(problems) > 10 else ""))


def check_trainable_set(checkpoint: Checkpoint, base: Base, pins: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """The strict trainable-set check of Valen's load_checkpoint, plus shapes, dtypes and finiteness."""
    where = checkpoint.folder / "checkpoint.pt"
    rule = pins["trainable_inventory"]
    expected = inventory.trainable_shapes(base.config, rule)
    got = set(checkpoint.weights)
    missing, unexpected = sorted(set(expected) - got), sorted(got - set(expected))
    if missing or unexpected:
        def show(xs):
            return "[" + ", ".join(shown(x) for x in xs[:5]) + (f", ... {len(xs) - 5} more" if len(xs) > 5 else "") + "]"
        raise ExportError(f"{where}: trainable checkpoint mismatch: missing={show(missing)} unexpected={show(unexpected)}")
    counts = rule.get("counts", {})
    if counts.get("total") is not None and counts["total"] != len(expected):
        raise ExportError(f"{where}: base config implies {len(expected)} trainable tensors, pins trainable_inventory.counts.total says {counts['total']}")
    for name, (shape, dtype) in expected.items():
        t = checkpoint.weights[name]
        if not isinstance(t, torch.Tensor):
            raise ExportError(f"{where}: weights[{name!r}] is a {type(t).__name__}, expected a tensor")
        if t.is_sparse or t.layout != torch.strided:
            raise ExportError(f"{where}: weights[{name!r}] has layout {t.layout}, expected a dense tensor")
        if tuple(t.shape) != tuple(shape):
            raise ExportError(f"{where}: weights[{name!r}] has shape {list(t.shape)}, expected {list(shape)}")
        if DTYPE_NAMES.get(t.dtype) != dtype:
            raise ExportError(f"{where}: weights[{name!r}] has dtype {t.dtype}, expected {dtype}")
        if not all_finite(t):
            raise ExportError(f"{where}: weights[{name!r}] holds non-finite values")
    return expected
