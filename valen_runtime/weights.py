"""Load an export directory into the runtime modules, one-to-one, without renaming.

Reads the manifest, checks file sizes (or full SHA-256 with verify="full"), builds the modules on
the meta device and assigns every tensor from the safetensors files after stripping the prefix
the manifest names. The key sets must match exactly (one sorted missing/unexpected error) and so
must shapes and dtypes. Never unpickles, never imports transformers or peft. The exporter made
every dtype decision; the only choice here is the compute dtype: "bf16" uses the files as they
are, "fp32" upcasts and takes the base's FP32 originals from `fp32_sources` where they exist.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import ModelConfig
from .errors import ValenError, WeightsError
from .head import DecisionHead
from .manifest import Manifest
from .qwen35 import TextModel, attach_lora
from .safetensors_file import SafetensorsFile, all_finite
from .vision import VisionModel

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass
class LoadedModel:
    manifest: Manifest
    config: ModelConfig
    text: TextModel
    vision: VisionModel
    head: DecisionHead
    dtype: torch.dtype
    device: torch.device


def _read_prefixed(files: list[Path], prefix: str, expected_dtype: str) -> dict[str, torch.Tensor]:
    """Read every tensor of `files` (names must start with `prefix`, dtypes must match, values finite)."""
    out: dict[str, torch.Tensor] = {}
    for path in files:
        sf = SafetensorsFile(path)
        for name, info in sf.tensors.items():
            if not name.startswith(prefix):
                raise WeightsError(f"{path}: tensor {name!r} lacks the prefix {prefix!r}")
            if info.dtype != expected_dtype:
                raise WeightsError(f"{path}: tensor {name!r} is {info.dtype}, expected {expected_dtype}")
            short = name[len(prefix):]
            if short in out:
                raise WeightsError(f"{path}: duplicate tensor {name!r}")
        for name, t in sf.iter_tensors():
            if not all_finite(t):
                raise WeightsError(f"{path}: tensor {name!r} holds non-finite values")
            out[name[len(prefix):]] = t
    return out


def _assign(module: torch.nn.Module, state: dict[str, torch.Tensor], where: str, dtype: torch.dtype, device) -> None:
    """Strict one-to-one assignment: same names, same shapes, then cast and place."""
    expected = module.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise WeightsError(f"{where}: missing={missing[:8]}{'...' if len(missing) > 8 else ''} unexpected={unexpected[:8]}{'...' if len(unexpected) > 8 else ''}")
    for name, t in state.items():
        if tuple(t.shape) != tuple(expected[name].shape):
            raise WeightsError(f"{where}: {name} has shape {list(t.shape)}, the model expects {list(expected[name].shape)}")
    placed = {n: t.to(device=device, dtype=dtype) for n, t in state.items()}
    module.load_state_dict(placed, strict=True, assign=True)


def resolve_device(device: str | torch.device) -> torch.device:
    """`device` as a torch.device this machine has; otherwise a ValenError naming what is available."""
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        resolved = None
    if resolved is not None and resolved.type == "cpu":
        return resolved
    if resolved is None or resolved.type != "cuda":
        raise ValenError(f"device {str(device)!r} is not cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise ValenError(f"device {str(device)!r} asked for, but CUDA is not available on this machine (torch {torch.__version__}); use --device cpu")
    if resolved.index is not None and resolved.index >= torch.cuda.device_count():
        raise ValenError(f"device {str(device)!r} asked for, but this machine has {torch.cuda.device_count()} CUDA device(s)")
    return resolved


def load_model(export_dir: str | Path, device: str | torch.device = "cpu", dtype: str = "bf16", verify: str = "size") -> LoadedModel:
    if dtype not in DTYPES:
        raise WeightsError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
    device = resolve_device(device)
    manifest = Manifest.load(export_dir)
    manifest.require_files(verify)
    try:
        config = ModelConfig.from_dict(json.loads(manifest.path("config.json").read_text()))
    except ValueError as e:  # JSON errors
        raise WeightsError(f"{manifest.root / 'config.json'}: {e}") from None
    torch_dtype = DTYPES[dtype]
    lang = manifest.data["language"]

    with torch.device("meta"):
        text = TextModel(config.text_config)
        vision = VisionModel(config.vision_config)
        head = DecisionHead(config.text_config.hidden_size, manifest.data["head"]["projection_dim"])

    text_state = _read_prefixed([manifest.path(f) for f in lang["files"]], lang["prefix"], "BF16")
    fp = manifest.data.get("fp32_sources") or {}
    if torch_dtype == torch.float32 and fp.get("file"):
        for name, t in _read_prefixed([manifest.path(fp["file"])], lang["prefix"], "F32").items():
            if name not in text_state:
                raise WeightsError(f"{manifest.path(fp['file'])}: {name} has no language tensor to replace")
            text_state[name] = t
    _assign(text, text_state, "language files", torch_dtype, device)

    lora = manifest.data["lora"]
    if lora.get("mode") == "separate":
        adapter = _read_prefixed([manifest.path(lora["file"])], lora["key_prefix"], "F32")
        ranks = {t.shape[0] for n, t in adapter.items() if n.endswith(".lora_A.weight")}
        if ranks != {lora.get("rank")}:
            raise WeightsError(f"{manifest.path(lora['file'])}: LoRA ranks {sorted(ranks)} differ from the manifest's lora.rank {lora.get('rank')}")
        scale = lora.get("scale")
        if not isinstance(scale, (int, float)) or not scale > 0:
            raise WeightsError(f"{manifest.root / 'valen_export.json'}: lora.scale must be a positive number")
        attach_lora(text, {n: t.to(device) for n, t in adapter.items()}, float(scale))
    elif lora.get("mode") != "merged":
        raise WeightsError(f"{manifest.root / 'valen_export.json'}: lora.mode {lora.get('mode')!r} is not separate or merged")

    vis = manifest.data["vision"]
    _assign(vision, _read_prefixed([manifest.path(vis["file"])], vis["prefix"], "BF16"), vis["file"], torch_dtype, device)
    hd = manifest.data["head"]
    _assign(head, _read_prefixed([manifest.path(hd["file"])], "", "F32"), hd["file"], torch.float32, device)
    for m in (text, vision, head):
        m.eval().requires_grad_(False)
    return LoadedModel(manifest, config, text, vision, head, torch_dtype, device)
