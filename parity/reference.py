"""The pinned Valen reference, rebuilt from the training checkpoint and the base (docs/valen-model.md, §9).

Never reads an export: exporter bugs must show up as parity failures. Import this module only in
the reference process (`parity.reference_worker`), after `parity.isolation.install_blocker()`:
transformers picks up fla / causal-conv1d / kernels at import time when they are importable.

Build, step by step as Valen's `build_model` + `load_checkpoint`:
1. `Qwen3_5ForConditionalGeneration.from_pretrained(base, dtype, attn_implementation="eager",
   local_files_only=True, output_loading_info=True)`; any loading-info entry is an error.
2. Keep `.model` (Qwen3_5Model); freeze it.
3. PEFT LoRA on every `nn.Linear` of `language_model` (rank / alpha from the checkpoint config,
   lora_dropout 0, bias "none", no task_type).
4. Stage vision_top: unfreeze `visual.blocks[-4:]` and `visual.merger`.
5. Wrap with an FP32 bilinear head (`head.decision`, `head.candidate`, no bias).
6. `torch.load(checkpoint.pt, weights_only=True)`; the payload's weight names must equal the
   requires_grad parameter names exactly; base manifest revision / weight hashes must match;
   `load_state_dict(strict=False)` with no unexpected keys.
"""

from __future__ import annotations

import json
import math
import platform
from importlib import metadata
from pathlib import Path

import torch
from torch import nn

from parity import video_reader

LORA_PREFIX = "backbone.language_model.base_model.model."


class ReferenceBuildError(RuntimeError):
    """The reference could not be built faithfully (never silently degraded)."""


class DecisionHead(nn.Module):
    """valen.modeling.qwen.model.DecisionHead: FP32 projections of FP32-cast hidden rows."""

    def __init__(self, hidden_size: int, projection_dim: int = 256):
        super().__init__()
        self.decision = nn.Linear(hidden_size, projection_dim, bias=False)
        self.candidate = nn.Linear(hidden_size, projection_dim, bias=False)
        self.scale = math.sqrt(projection_dim)

    def forward(self, hidden, positions, decision_position):
        d = self.decision(hidden[0, decision_position].float())
        c = self.candidate(hidden[0, positions].float())
        return (c * d).sum(-1) / self.scale


class ValenReference(nn.Module):
    def __init__(self, backbone, projection_dim: int):
        super().__init__()
        self.backbone = backbone
        self.head = DecisionHead(backbone.config.text_config.hidden_size, projection_dim)


def read_base_manifest(model_path: Path) -> dict | None:
    """docs/valen-model.md lookup: valen_manifest.json, else exactly one *_manifest.json."""
    model_path = Path(model_path)
    named = model_path / "valen_manifest.json"
    if named.exists():
        return json.loads(named.read_text())
    found = []
    for p in sorted(model_path.glob("*_manifest.json")):
        try:
            data = json.loads(p.read_text())
        except ValueError:
            continue
        if isinstance(data.get("revision"), str) and isinstance(data.get("weight_sha256"), dict):
            found.append(data)
    if len(found) > 1:
        raise ReferenceBuildError(f"{model_path}: several *_manifest.json candidates")
    return found[0] if found else None


def _dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _qualname(fn) -> str | None:
    return None if fn is None else f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__name__', repr(fn))}"


def environment(device: str, dtype: str) -> dict:
    """What the reference process really ran with (recorded in every report)."""
    import transformers
    from transformers.utils import import_utils as iu

    mod = __import__("transformers.models.qwen3_5.modeling_qwen3_5", fromlist=["x"])
    import importlib.util

    env = {
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "peft": _dist_version("peft"),
            "tokenizers": _dist_version("tokenizers"),
            "torchvision": _dist_version("torchvision"),
            "pillow": _dist_version("pillow"),
            "safetensors": _dist_version("safetensors"),
        },
        "kernels": {
            "is_flash_linear_attention_available": bool(iu.is_flash_linear_attention_available()),
            "is_causal_conv1d_available": bool(iu.is_causal_conv1d_available()),
            "is_kernels_available": bool(iu.is_kernels_available()),
            "is_torchcodec_available": bool(iu.is_torchcodec_available()),
            "find_spec": {n: importlib.util.find_spec(n) is not None for n in ("fla", "causal_conv1d", "kernels", "torchcodec")},
            # What modeling_qwen3_5 actually bound at import time (None = PyTorch fallback).
            "qwen3_5_is_fast_path_available": bool(mod.is_fast_path_available),
            "qwen3_5_FusedRMSNormGated": None if mod.FusedRMSNormGated is None else repr(mod.FusedRMSNormGated),
            "qwen3_5_causal_conv1d_fn": None if mod.causal_conv1d_fn is None else repr(mod.causal_conv1d_fn),
            "qwen3_5_chunk_gated_delta_rule": _qualname(mod.chunk_gated_delta_rule),
        },
        "device": device,
        "device_name": torch.cuda.get_device_name(0) if device.startswith("cuda") else platform.processor() or platform.machine(),
        "dtype": dtype,
        "tf32": {
            "cuda.matmul.allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
            "cudnn.allow_tf32": bool(torch.backends.cudnn.allow_tf32),
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
        },
        "torch_num_threads": torch.get_num_threads(),
        "attn_implementation": "eager",
        # Who decodes a video path for the processor (torchcodec blocked): parity.video_reader's
        # torchvision 0.21 read_video on PyAV, with PyAV's and its FFmpeg's versions.
        "video_decoder": video_reader.decoder_environment(),
    }
    return env


def build_reference(checkpoint_dir: Path, base_dir: Path, device: str = "cpu", dtype: str = "bf16"):
    """Returns (model, config, processor): the Valen model with the checkpoint loaded, in eval mode."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoProcessor, Qwen3_5ForConditionalGeneration

    checkpoint_dir, base_dir = Path(checkpoint_dir), Path(base_dir)
    config = json.loads((checkpoint_dir / "config.json").read_text(encoding="utf-8"))
    if config.get("stage") != "vision_top":
        raise ReferenceBuildError(f"{checkpoint_dir}/config.json: stage {config.get('stage')!r}; the Preview reference is vision_top")
    # fp64 is the CPU gate's extra truth for fp32 runs; transformers still runs its norms, the delta
    # rule and our FP32 head in fp32 inside it (docs/parity.md).
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}[dtype]

    container, info = Qwen3_5ForConditionalGeneration.from_pretrained(
        str(base_dir), dtype=torch_dtype, attn_implementation="eager", local_files_only=True, output_loading_info=True
    )
    bad = {k: v for k, v in info.items() if v}
    if bad:
        raise ReferenceBuildError(f"{base_dir}: from_pretrained loading info not empty: {bad}")
    backbone = container.model
    del container
    backbone.requires_grad_(False)
    targets = [name for name, module in backbone.language_model.named_modules() if isinstance(module, nn.Linear)]
    backbone.language_model = get_peft_model(
        backbone.language_model,
        LoraConfig(
            r=config.get("lora_rank", 32),
            lora_alpha=config.get("lora_alpha", 64),
            lora_dropout=0.0,
            target_modules=targets,
            bias="none",
        ),
    )
    backbone.visual.merger.requires_grad_(True)
    for block in backbone.visual.blocks[-4:]:
        block.requires_grad_(True)
    model = ValenReference(backbone, config.get("projection_dim", 256))
    model.base_manifest = read_base_manifest(base_dir)

    payload = torch.load(checkpoint_dir / "checkpoint.pt", map_location="cpu", weights_only=True)
    weights = payload["weights"]
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    if set(weights) != trainable:
        missing = sorted(trainable - set(weights))
        unexpected = sorted(set(weights) - trainable)
        raise ReferenceBuildError(f"Trainable checkpoint mismatch: missing={missing[:5]} ({len(missing)}), unexpected={unexpected[:5]} ({len(unexpected)})")
    expected = payload.get("base_manifest")
    if expected:
        actual = model.base_manifest
        if not actual or actual.get("revision") != expected.get("revision") or actual.get("weight_sha256") != expected.get("weight_sha256"):
            raise ReferenceBuildError("Base model revision differs from checkpoint")
    result = model.load_state_dict(weights, strict=False)
    if result.unexpected_keys:
        raise ReferenceBuildError(f"unexpected checkpoint keys: {result.unexpected_keys[:5]}")
    model.to(device).eval()

    processor = AutoProcessor.from_pretrained(str(base_dir), local_files_only=True)
    return model, config, processor


@torch.no_grad()
def question_logits(model: ValenReference, builder, prompt, device: str) -> list[torch.Tensor]:
    """§9: one full forward per branch (use_cache=False), head on FP32-cast rows, concatenated."""
    out = []
    for q in prompt.questions:
        rows = []
        for br in q.branches:
            inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in builder.branch_inputs(prompt, br).items()}
            model.backbone.rope_deltas = None  # no state carried between calls
            hidden = model.backbone(**inputs, use_cache=False, return_dict=True).last_hidden_state
            rows.append(model.head(hidden, br.candidate_positions, br.decision_position))
        out.append(torch.cat(rows).float().cpu())
    return out

