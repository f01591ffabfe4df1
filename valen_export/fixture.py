"""Synthetic Valen artifacts with the released layout: a Qwen3.5 base folder, a Valen training
checkpoint folder and a pins file, with random weights.

`tiny` builds in seconds for CPU tests; `2b` has the Qwen3.5-2B shapes (presumed config in
`manifests/qwen3.5-2b.config.json`) for GPU measurements. Everything the real artifacts carry is
reproduced: base F32 `A_log` / gated-norm tensors next to BF16 weights, an `mtp.*` tensor, the
tokenizer/processor files, `valen_manifest.json`; `checkpoint.pt` with PEFT key names incl.
`.default`, optimizer, rng and distributed entries, `base_manifest`, and optionally an RLCD
`training_state` holding decoy reference weights under the same keys.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from valen_runtime.safetensors_file import StreamingWriter, sha256_file

from . import inventory
from .fixture_files import write_text_assets

REPO_ROOT = Path(__file__).resolve().parent.parent
PREVIEW_PINS = REPO_ROOT / "manifests" / "valen-preview-0923.json"
CONFIG_2B = REPO_ROOT / "manifests" / "qwen3.5-2b.config.json"

BASE_WEIGHTS_FILE = "model.safetensors-00001-of-00001.safetensors"  # the name hinted for the 2B base

TINY_TEXT = {
    "model_type": "qwen3_5_text",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    "full_attention_interval": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "attn_output_gate": True,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-06,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000000,
        # Rotary half 8 split unequally (temporal > height > width, like 2B's [11, 11, 10]) so that a
        # swap of two sections changes which axis drives a frequency that matters at these sizes.
        "partial_rotary_factor": 0.5,
        "mrope_section": [4, 3, 1],
        "mrope_interleaved": True,
    },
    "mtp_num_hidden_layers": 1,
    "mamba_ssm_dtype": "float32",
    "dtype": "bfloat16",
}
TINY_VISION = {
    "model_type": "qwen3_5",
    "depth": 6,  # deeper than the 4 trained blocks, so untrained base blocks exist too
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "in_channels": 3,
    "patch_size": 16,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "out_hidden_size": 64,
    "num_position_embeddings": 64,
    "hidden_act": "gelu_pytorch_tanh",
    "deepstack_visual_indexes": [],
}


@dataclass(frozen=True)
class Fixture:
    root: Path
    base: Path
    checkpoint: Path
    pins: Path

    @classmethod
    def at(cls, root: Path) -> "Fixture":
        """The fixture build_fixture wrote (or will write) in `root`."""
        return cls(root, root / "base", root / "checkpoint", root / "pins.json")


def preset_config(preset: str, token_ids: dict) -> dict:
    """The base config.json for a preset, with the fixture tokenizer's special-token ids."""
    if preset == "tiny":
        config = {
            "architectures": ["Qwen3_5ForConditionalGeneration"],
            "model_type": "qwen3_5",
            "tie_word_embeddings": True,
            "text_config": copy.deepcopy(TINY_TEXT),
            "vision_config": copy.deepcopy(TINY_VISION),
            "dtype": "bfloat16",
        }
        config["text_config"]["vocab_size"] = token_ids["vocab_size"]
    elif preset == "2b":
        config = json.loads(CONFIG_2B.read_text())
    else:
        raise ValueError(f"unknown preset {preset!r}; expected tiny or 2b")
    for key in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        config[key] = token_ids[key]
    config["text_config"]["eos_token_id"] = token_ids["eos_token_id"]
    if config["text_config"]["vocab_size"] < token_ids["vocab_size"]:
        raise ValueError("fixture tokenizer is larger than the preset vocabulary")
    return config


def _random_tensor(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Random values with roughly trained-model statistics, so no block is trivially zero or huge."""
    if name.endswith("A_log"):
        return torch.empty(shape).uniform_(1.0, 16.0, generator=gen).log()
    if name.endswith("dt_bias"):
        return 1.0 + 0.5 * torch.randn(shape, generator=gen)
    if name.endswith("conv1d.weight"):
        return torch.empty(shape).uniform_(-0.5, 0.5, generator=gen)
    if name.endswith("embed_tokens.weight"):
        return torch.randn(shape, generator=gen)
    if len(shape) == 1:
        # RMSNorm weights are zero-centred (1 + w); LayerNorm weights and biases get the same spread.
        centre = 1.0 if (name.endswith("linear_attn.norm.weight") or ".norm1.weight" in name or ".norm2.weight" in name or name.endswith("merger.norm.weight")) else 0.0
        return centre + 0.1 * torch.randn(shape, generator=gen)
    fan_in = 1
    for d in shape[1:]:
        fan_in *= d
    return torch.randn(shape, generator=gen) * (fan_in**-0.5)


# Tensors larger than this are drawn and written in blocks of rows: whole, the 2b preset's
# embedding is a 2 GiB float32 draw plus its 1 GiB bf16 copy, most of the command's peak memory.
BLOCK_ELEMENTS = 1 << 22


def _random_blocks(name: str, shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator, block_elements: int = BLOCK_ELEMENTS):
    """_random_tensor(name, shape, gen).to(dtype), yielded as consecutive blocks of rows, the same values.

    torch's CPU normal sampler draws a tensor's uniforms in one sequence, transforms them 16 at a
    time and redraws the last 16 when the count is not a multiple of 16. Every block but the last
    holds a multiple of 16 elements and the last at least 16 (a row has 16 or more), so the
    generator is consumed exactly as by one whole draw (tests/valen_export/test_fixture.py checks).
    """
    row_elements = 1
    for d in shape[1:]:
        row_elements *= d
    block_rows = block_elements // max(row_elements, 1) // 16 * 16
    if len(shape) < 2 or shape[0] * row_elements <= block_elements or block_rows == 0 or row_elements < 16:
        yield _random_tensor(name, shape, gen).to(dtype)
        return
    for start in range(0, shape[0], block_rows):
        rows = min(block_rows, shape[0] - start)
        yield _random_tensor(name, (rows,) + tuple(shape[1:]), gen).to(dtype)


def _size_text(size: int) -> str:
    return f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"


def _base_dtype(name: str) -> torch.dtype:
    return torch.float32 if name.endswith(inventory.FP32_IN_BASE_SUFFIXES) else torch.bfloat16


def base_tensor_plan(config: dict) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    tc = inventory.text_config(config)
    plan = [(inventory.LANGUAGE_PREFIX + n, _base_dtype(n), s) for n, s in inventory.language_shapes(config).items()]
    plan += [(inventory.VISION_PREFIX + n, torch.bfloat16, s) for n, s in inventory.vision_shapes(config).items()]
    # The released checkpoint also carries a multi-token-prediction head; loaders ignore it.
    h = tc["hidden_size"]
    plan += [("mtp.fc.weight", torch.bfloat16, (h, 2 * h)), ("mtp.norm.weight", torch.bfloat16, (h,))]
    return sorted(plan)


def write_base(base: Path, preset: str, seed: int, progress=None, log=None) -> dict:
    """Write the base folder; returns its valen_manifest.json dict."""
    base.mkdir(parents=True)
    token_ids = write_text_assets(base)
    config = preset_config(preset, token_ids)
    (base / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    gen = torch.Generator().manual_seed(seed)
    plan = base_tensor_plan(config)
    if log:
        size = sum(math.prod(shape) * dtype.itemsize for _, dtype, shape in plan)
        log(f"base/{BASE_WEIGHTS_FILE}: {len(plan)} random tensors, {_size_text(size)}")
    writer = StreamingWriter(base / BASE_WEIGHTS_FILE, plan, metadata={"format": "pt"})
    for done, (name, dtype, shape) in enumerate(plan, 1):
        writer.write_blocks(name, dtype, shape, _random_blocks(name, shape, dtype, gen))
        if progress:
            progress(done, len(plan))
    digest, size = writer.close()
    index = {"metadata": {"total_size": size}, "weight_map": {name: BASE_WEIGHTS_FILE for name, _, _ in plan}}
    (base / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")

    media_defaults = {
        name: json.loads((base / name).read_text())
        for name in ("preprocessor_config.json", "video_preprocessor_config.json")
        if (base / name).exists()
    }
    manifest = {
        "repo": f"valen-fixture/qwen3.5-{preset}",
        # A fixture has no hub commit; a content-derived id keeps the revision pin meaningful.
        "revision": hashlib.sha1(f"{preset}:{seed}:{digest}".encode()).hexdigest(),
        "versions": {"torch": str(torch.__version__)},
        "weight_sha256": {BASE_WEIGHTS_FILE: digest},
        "processor": "Qwen3VLProcessor",
        "hidden_size": inventory.text_config(config)["hidden_size"],
        "media_defaults": media_defaults,
    }
    (base / "valen_manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def checkpoint_config(preset: str) -> dict:
    """The training-run config as Valen's trainer writes it (stage vision_top, flat layout)."""
    return {
        "stage": "vision_top",
        "method": "sft",
        "architecture": "qwen",
        "model_path": f"models/Qwen3.5-{preset}",
        "data": "data/train.jsonl",
        "data_sha256": hashlib.sha256(b"fixture").hexdigest(),
        "output": "runs/valen-fixture",
        "device": "cuda:0",
        "dtype": "bf16",
        "seed": 0,
        "epochs": 1,
        "max_steps": 0,
        "tokens_per_step": 65536,
        "gradient_checkpointing": True,
        "lora_rank": 32,
        "lora_alpha": 64,
        "lora_lr": 1e-4,
        "merger_lr": 1e-5,
        "head_lr": 1e-3,
        "vision_lr": 1e-5,
        "rps_weight": 0.0,
        "projection_dim": 256,
        "max_length": 8192,
        "save_every": 1000,
    }


def trainable_weights(base: Path, config: dict, rule: dict, seed: int) -> dict[str, torch.Tensor]:
    """Trained values: random LoRA (B non-zero so it matters), perturbed vision blocks and merger, head."""
    from valen_runtime.safetensors_file import SafetensorsFile

    gen = torch.Generator().manual_seed(seed + 1)
    base_file = SafetensorsFile(base / BASE_WEIGHTS_FILE)
    weights: dict[str, torch.Tensor] = {}
    dtypes = {"F32": torch.float32, "BF16": torch.bfloat16}
    for name, (shape, dtype) in inventory.trainable_shapes(config, rule).items():
        if ".lora_A." in name:
            t = torch.randn(shape, generator=gen) * (shape[1] ** -0.5)
        elif ".lora_B." in name:
            t = torch.randn(shape, generator=gen) * 0.05
        elif name.startswith(inventory.PAYLOAD_VISION_PREFIX):
            base_name = inventory.VISION_PREFIX + name[len(inventory.PAYLOAD_VISION_PREFIX) :]
            t = base_file.read(base_name).float()
            t = t + 0.05 * t.abs().mean().clamp_min(0.01) * torch.randn(shape, generator=gen)
        else:  # head
            t = torch.randn(shape, generator=gen) * (shape[1] ** -0.5)
        weights[name] = t.to(dtypes[dtype]).contiguous()
    return weights


def write_checkpoint(ckpt: Path, base: Path, base_manifest: dict, preset: str, seed: int, rlcd: bool, log=None) -> str:
    """Write checkpoint/config.json and checkpoint.pt the way Valen's trainer does; returns the sha256."""
    ckpt.mkdir(parents=True)
    config = json.loads((base / "config.json").read_text())
    rule = json.loads(PREVIEW_PINS.read_text())["trainable_inventory"]
    weights = trainable_weights(base, config, rule, seed)
    if log:
        size = sum(t.numel() * t.element_size() for t in weights.values()) * (2 if rlcd else 1)
        log(f"checkpoint/checkpoint.pt: {len(weights)} trained tensors{' and their RLCD decoys' if rlcd else ''}, {_size_text(size)}")
    train_config = checkpoint_config(preset)
    if rlcd:
        train_config["method"] = "rlcd"
        train_config["rlcd"] = {"group_size": 4, "num_iterations": 1, "beta": 0.04, "clip_epsilon": 0.2}
    names = sorted(weights)
    payload = {
        "weights": weights,
        "optimizer": {
            "state": {0: {"step": torch.tensor(10.0), "exp_avg": torch.zeros(4), "exp_avg_sq": torch.zeros(4)}},
            "param_groups": [{"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "params": list(range(len(names)))}],
        },
        "config": train_config,
        "progress": {"epoch": 0, "cursor": 0, "step": 10, "order": [0, 1, 2], "optimizer_steps": 10},
        "rng": {"sampler_seed": seed, "epoch": 0},
        "python_rng": random.Random(seed).getstate(),
        "torch_rng": torch.Generator().manual_seed(seed).get_state(),
        "cuda_rng_current": None,
        "base_manifest": base_manifest,
        "distributed": {"world_size": 1, "rank_states": [{"rank": 0}]},
    }
    if rlcd:
        # Pre-RL values under the same key names: an exporter must never pick these up.
        gen = torch.Generator().manual_seed(seed + 7)
        payload["training_state"] = {
            "reference_weights": {n: (t.float() + torch.randn(t.shape, generator=gen)).to(t.dtype) for n, t in weights.items()}
        }
    tmp = ckpt / "checkpoint.tmp"
    torch.save(payload, tmp)
    tmp.rename(ckpt / "checkpoint.pt")
    (ckpt / "config.json").write_text(json.dumps(train_config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return sha256_file(ckpt / "checkpoint.pt")


def fixture_pins(config: dict, base_manifest: dict, checkpoint_sha: str, preset: str) -> dict:
    """A pins file in the Preview's schema, pointing at the synthetic artifacts."""
    pins = json.loads(PREVIEW_PINS.read_text())
    pins["model_id"] = f"valen-fixture-{preset}"
    pins["checkpoint"].update(
        repo=f"valen-fixture/checkpoint-{preset}",
        revision=hashlib.sha1(checkpoint_sha.encode()).hexdigest(),
        alternate_revisions=[],
        checkpoint_sha256=checkpoint_sha,
        license="synthetic test artifact",
    )
    pins["base"].update(repo=base_manifest["repo"], revision=base_manifest["revision"], license="synthetic test artifact")
    expected = inventory.trainable_shapes(config, pins["trainable_inventory"])
    counts = {"lora": 0, "vision": 0, "head": 0}
    for name in expected:
        key = "lora" if ".lora_" in name else "vision" if name.startswith(inventory.PAYLOAD_VISION_PREFIX) else "head"
        counts[key] += 1
    pins["trainable_inventory"]["counts"] = {"total": len(expected), **counts}
    return pins


def build_fixture(out: Path, preset: str = "tiny", seed: int = 0, rlcd: bool = False, progress=None, log=None) -> Fixture:
    """Write OUT/base, OUT/checkpoint and OUT/pins.json. OUT must not exist or be empty.
    progress(done, total) is called after each base tensor (the bulk of the time); log(line)
    before each file that takes a while, naming it and its size."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out}: exists and is not empty; choose a new directory")
    tmp = out.parent / f".{out.name}.tmp-fixture"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        base_manifest = write_base(tmp / "base", preset, seed, progress, log)
        sha = write_checkpoint(tmp / "checkpoint", tmp / "base", base_manifest, preset, seed, rlcd, log)
        config = json.loads((tmp / "base" / "config.json").read_text())
        pins = fixture_pins(config, base_manifest, sha, preset)
        (tmp / "pins.json").write_text(json.dumps(pins, indent=2) + "\n")
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Fixture.at(out)
