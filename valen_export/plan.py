"""Planning an export: every output tensor's name, dtype, shape and where its value comes from.

Names and shapes come from the table (`tensor_table`); this module adds the value rules along
four seams: the dtype policy (`language_tensors`), the LoRA merge (`merged_weight`), the
sharding of the language tensors (`shard`) and the per-file plans (adapter, vision overlay,
head). Nothing is read or written here: each PlannedTensor carries a `produce()` the writer
calls once, so peak memory stays at one tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from valen_runtime.config import ModelConfig

from . import inventory
from . import tensor_table as table
from .errors import ExportError
from .sources import Base, Checkpoint

DTYPES = {"BF16": torch.bfloat16, "F32": torch.float32}
# The merge, as PEFT computes its delta: (B @ A) * scale in FP32, added to the FP32 view of W, one rounding.
MERGE_RULE = "W' = bf16(float32(W) + (B @ A) * scale)"


@dataclass
class PlannedTensor:
    name: str  # name in the output file
    dtype: torch.dtype
    shape: tuple[int, ...]
    produce: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


@dataclass
class PlannedFile:
    name: str
    tensors: list[PlannedTensor] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass(frozen=True)
class Lora:
    """The checkpoint's FP32 LoRA: rank, alpha and PEFT's plain scaling alpha / rank."""

    weights: dict
    rank: int
    alpha: int | float

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def pair(self, module: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(A [rank, in], B [out, rank]) of `layers.{i}.{module}`."""
        p = inventory.PAYLOAD_LORA_PREFIX + module
        return self.weights[p + ".lora_A.default.weight"], self.weights[p + ".lora_B.default.weight"]


def merged_weight(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """MERGE_RULE: W [out, in] any dtype, A [r, in], B [out, r] -> BF16 [out, in]."""
    return (w.float() + (b.float() @ a.float()) * scale).to(torch.bfloat16)


@dataclass
class ExportPlan:
    files: list[PlannedFile]
    cfg: ModelConfig
    lora_mode: str
    lora: Lora
    language_files: list[str]
    indexed: bool  # language shards come with model.safetensors.index.json
    language_tensors: int
    rounded: list[str]  # language tensors that were FP32 in the base, rounded to BF16
    trained_blocks: list[int]
    trained_merger: bool
    head_tensors: list[PlannedTensor]
    projection_dim: int

    def file(self, name: str) -> PlannedFile | None:
        return next((f for f in self.files if f.name == name), None)


def language_tensors(base: Base, cfg: ModelConfig, lora: Lora, lora_mode: str, read) -> tuple[list[PlannedTensor], list[PlannedTensor]]:
    """(BF16 language tensors, FP32 originals of the base tensors that had to be rounded).

    Dtype policy: every language tensor is written BF16. A base tensor stored FP32 is rounded to
    nearest even (what from_pretrained(dtype=bfloat16) does) and its original kept aside; any
    other base dtype is refused. In merged mode each LoRA target is folded in by `merged_weight`.
    """
    targets = table.lora_targets(cfg)
    out, originals = [], []
    for name, shape in table.expand(table.LANGUAGE, cfg).items():
        full = table.LANGUAGE_PREFIX + name
        src_dtype = base.weight_files[base.tensor_file[full]].tensors[full].dtype
        if src_dtype == "F32":
            originals.append(PlannedTensor(full, torch.float32, shape, (lambda f=full: read(f).float())))
        elif src_dtype != "BF16":
            raise ExportError(f"{base.folder}: base tensor {full} is {src_dtype}; expected BF16 or F32")
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        if lora_mode == "merged" and module in targets:
            produce = lambda f=full, m=module: merged_weight(read(f), *lora.pair(m), lora.scale)  # noqa: E731
        else:
            produce = lambda f=full: read(f).to(torch.bfloat16)  # noqa: E731 - round-to-nearest-even
        out.append(PlannedTensor(full, torch.bfloat16, shape, produce))
    return out, originals


def shard(tensors: list[PlannedTensor], max_shard_bytes: int) -> list[PlannedFile]:
    """Language files: one `model.safetensors` when max_shard_bytes <= 0, else greedy shards in name order.

    A shard is closed before a tensor that would take it past the limit (a tensor larger than
    the limit gets a shard of its own); shards are named model-0000k-of-0000n.safetensors.
    """
    if max_shard_bytes <= 0:
        return [PlannedFile(table.SINGLE_LANGUAGE_FILE, list(tensors))]
    shards: list[list[PlannedTensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    n = len(shards)
    return [PlannedFile(table.LANGUAGE_SHARD.format(k=k + 1, n=n), s) for k, s in enumerate(shards)]


def adapter_file(cfg: ModelConfig, lora: Lora) -> PlannedFile:
    """The FP32 adapter: A [rank, in] and B [out, rank] per target, renamed for the native loader, sorted."""
    tensors = []
    for module, (out_f, in_f) in table.lora_targets(cfg).items():
        a, b = lora.pair(module)
        key = table.LORA_KEY_PREFIX + module
        tensors.append(PlannedTensor(table.LORA_A.format(module=key), torch.float32, (lora.rank, in_f), (lambda t=a: t.float())))
        tensors.append(PlannedTensor(table.LORA_B.format(module=key), torch.float32, (out_f, lora.rank), (lambda t=b: t.float())))
    return PlannedFile(table.LORA_FILE, sorted(tensors, key=lambda t: t.name))


def vision_file(cfg: ModelConfig, weights: dict, blocks: list[int], merger: bool, read) -> PlannedFile:
    """The complete BF16 vision inventory: base tensors, with the trained blocks and merger overlaid."""
    overlaid = set(table.overlaid_vision(cfg, blocks, merger))
    tensors = []
    for name, shape in table.expand(table.VISION, cfg).items():
        if name in overlaid:
            produce = lambda k=inventory.PAYLOAD_VISION_PREFIX + name: weights[k].to(torch.bfloat16)  # noqa: E731
        else:
            produce = lambda f=table.VISION_PREFIX + name: read(f).to(torch.bfloat16)  # noqa: E731
        tensors.append(PlannedTensor(table.VISION_PREFIX + name, torch.bfloat16, shape, produce))
    return PlannedFile(table.VISION_FILE, tensors)


def head_file(cfg: ModelConfig, weights: dict, projection_dim: int) -> PlannedFile:
    shapes = table.expand(table.HEAD, cfg, table.symbols_for(cfg, projection_dim=projection_dim))
    return PlannedFile(
        table.HEAD_FILE,
        [PlannedTensor(n, torch.float32, s, (lambda k=inventory.PAYLOAD_HEAD_PREFIX + n: weights[k].float())) for n, s in shapes.items()],
    )


def plan_export(checkpoint: Checkpoint, base: Base, pins: dict, lora_mode: str, max_shard_bytes: int, read) -> ExportPlan:
    """Decide every output file and tensor, in writing order: language, adapter, vision, head, FP32 sources."""
    cfg = table.model_config(base.config)
    rule = pins["trainable_inventory"]
    lora = Lora(checkpoint.weights, checkpoint.config["lora_rank"], checkpoint.config["lora_alpha"])
    language, originals = language_tensors(base, cfg, lora, lora_mode, read)
    files = shard(language, max_shard_bytes)
    language_files = [f.name for f in files]
    if lora_mode == "separate":
        files.append(adapter_file(cfg, lora))
    blocks = inventory.trained_vision_blocks(base.config, rule["vision"]["trained_blocks_from_end"])
    merger = bool(rule["vision"].get("merger", True))
    files.append(vision_file(cfg, checkpoint.weights, blocks, merger, read))
    head = head_file(cfg, checkpoint.weights, rule["head"]["projection_dim"])
    files.append(head)
    if originals:
        files.append(PlannedFile(table.FP32_SOURCES_FILE, originals))
    return ExportPlan(
        files=files,
        cfg=cfg,
        lora_mode=lora_mode,
        lora=lora,
        language_files=language_files,
        indexed=max_shard_bytes > 0,
        language_tensors=len(language),
        rounded=[t.name for t in originals],
        trained_blocks=blocks,
        trained_merger=merger,
        head_tensors=head.tensors,
        projection_dim=rule["head"]["projection_dim"],
    )
