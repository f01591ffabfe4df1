"""EngineOptions: how an Engine runs an export, with every default and every check in one place.

A field left as None takes the default for the device: on CUDA a long-lived engine runs the
shared-prefix mode on the fast path (`valen_runtime.fast`), compiled and replayed from CUDA
graphs; on the CPU it runs the reference's per-branch shape on the reference modules. Whatever
is given explicitly is kept, and an impossible combination is refused with one ValueError line.
Every choice is resolved here, once, when the options are made (the engine, the fast model and
the layouts read them and decide nothing themselves); nothing else (no environment variable, no
attribute set later) changes what an engine computes. `describe()` states them for reports.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DTYPES = ("bf16", "fp32")
MODES = ("per-branch", "shared-prefix")
KERNELS = ("torch", "fast")
LAYOUTS = ("one-pass", "batch")
DELTA_KERNELS = ("torch", "fla")
PATCH_EMBEDS = ("linear", "conv")


@dataclass(frozen=True)
class EngineOptions:
    """Args:
        device: "cpu", "cuda" or "cuda:N"; None: CUDA when it is available, else the CPU.
        dtype: compute dtype, "bf16" (the reference's) or "fp32" (the base's FP32 originals).
        mode: "per-branch" (every branch a fresh forward of state + suffix, the reference's
            shape) or "shared-prefix" (the state once, all branches continuing from it);
            None: shared-prefix on CUDA, per-branch on the CPU.
        kernels: "torch" (the reference modules, qwen35.py / vision.py) or "fast" (the
            fast path's fused layers, FLA, SDPA); None: fast for shared-prefix on CUDA.
        graphs: replay each request shape from a CUDA graph (shared-prefix on CUDA only; the fast
            path compiled only); None: on for shared-prefix on CUDA where that holds.
        compile: torch.compile the fast path (kernels="fast" only; the first request of a
            process then compiles for about a minute); None: on for the fast path on CUDA.
        layout: the shared-prefix layout of a state with a chunk-aligned prefix (a shorter state
            runs as rows in either; valen_runtime.layouts): "one-pass" (the fast model's) or
            "batch"; None: one-pass on the fast model where its delta rule takes packed sequences
            on the device (FLA on CUDA) and on the CPU, batch elsewhere (on CUDA the reference
            rule's varlen form loops over the sequences on the host).
        delta_kernel: the fast model's gated delta rule, "torch" (the reference rule) or "fla"
            (flash-linear-attention); None: fla for bf16 on CUDA where it imports (its products
            run in TF32 for fp32 inputs, so fp32 keeps the reference rule), else torch.
        patch_embed: the vision patch embed, "linear" (one GEMM) or "conv" (the reference's
            Conv3d); None: linear on the fast path wherever that has the conv's products, i.e.
            everywhere but fp32 on CUDA with cuDNN's TF32 on (`patch_gemm_matches_conv`); the
            reference modules always run the conv.
        batching: run_many sweeps several requests through the layers together (the one-pass
            layout in shared-prefix mode only); None: on wherever it can be.
        temperature: the softmax temperature of every answer (finite, > 0); None: the
            calibration file's when one is given, else 1.0.
        calibration: a calibration JSON with a scalar "temperature" (the Preview format), read
            once here and resolved into `temperature` (the field is None afterwards, so
            `dataclasses.replace` of resolved options works); exclusive with temperature.
    """

    device: str | None = None
    dtype: str = "bf16"
    mode: str | None = None
    kernels: str | None = None
    graphs: bool | None = None
    compile: bool | None = None
    layout: str | None = None
    delta_kernel: str | None = None
    patch_embed: str | None = None
    batching: bool | None = None
    temperature: float | None = None
    calibration: str | None = None

    def __post_init__(self):
        device = self.device if self.device is not None else _default_device()
        if not isinstance(device, str) or not (device == "cpu" or device == "cuda" or _is_cuda_index(device)):
            raise ValueError(f"device {device!r} is not cpu, cuda or cuda:N")
        cuda = device.startswith("cuda")
        mode = self.mode if self.mode is not None else ("shared-prefix" if cuda else "per-branch")
        kernels = self.kernels if self.kernels is not None else ("fast" if cuda and mode == "shared-prefix" else "torch")
        for name, value, allowed in (("dtype", self.dtype, DTYPES), ("mode", mode, MODES), ("kernels", kernels, KERNELS),
                                     ("layout", self.layout, LAYOUTS + (None,)), ("delta_kernel", self.delta_kernel, DELTA_KERNELS + (None,)),
                                     ("patch_embed", self.patch_embed, PATCH_EMBEDS + (None,))):
            if value not in allowed:
                raise ValueError(f"{name} {value!r} is not one of {', '.join(a for a in allowed if a is not None)}")
        fast = kernels == "fast"
        compile = self.compile if self.compile is not None else (cuda and fast)
        graphs = self.graphs if self.graphs is not None else (cuda and mode == "shared-prefix" and (compile or not fast))
        if graphs and not (cuda and mode == "shared-prefix"):
            raise ValueError("CUDA graphs need mode='shared-prefix' on a CUDA device")
        if graphs and fast and not compile:
            # Measured on the H200: the eager fast path's grouped LoRA gathers with a host index,
            # which a capture cannot copy; compiled, the gather is a kernel of its own.
            raise ValueError("CUDA graphs of the fast path need compile=True (its eager LoRA projection copies a host index)")
        if compile and not fast:
            raise ValueError("compile=True needs kernels='fast' (the reference modules always run eagerly)")

        delta_kernel = self.delta_kernel
        if delta_kernel is None:
            delta_kernel = "fla" if fast and cuda and self.dtype == "bf16" and _fla_available() else "torch"
        elif delta_kernel == "fla" and not (fast and cuda and self.dtype == "bf16" and _fla_available()):
            raise ValueError("delta_kernel='fla' needs kernels='fast', bf16 and CUDA with flash-linear-attention importable")
        layout = self.layout
        if layout is None:
            layout = "one-pass" if fast and (delta_kernel == "fla" or not cuda) else "batch"
        elif layout == "one-pass" and not fast:
            raise ValueError("layout='one-pass' needs kernels='fast' (the reference modules have no one-pass forward)")
        patch_embed = self.patch_embed
        if patch_embed is None:
            patch_embed = "linear" if fast and patch_gemm_matches_conv(self.dtype, device) else "conv"
        elif patch_embed == "linear" and not fast:
            raise ValueError("patch_embed='linear' needs kernels='fast' (the reference modules run the conv)")
        can_batch = mode == "shared-prefix" and layout == "one-pass"
        batching = self.batching if self.batching is not None else can_batch
        if batching and not can_batch:
            raise ValueError("batching=True needs mode='shared-prefix' and layout='one-pass' (one sweep of several requests)")

        temperature = self.temperature
        if temperature is not None and self.calibration is not None:
            raise ValueError("temperature and calibration are mutually exclusive")
        if self.calibration is not None:
            from pathlib import Path

            from .answers import load_temperature

            temperature = load_temperature(Path(self.calibration))
        temperature = 1.0 if temperature is None else temperature
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature <= 0:
            raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")

        for name, value in (("device", device), ("mode", mode), ("kernels", kernels), ("graphs", bool(graphs)), ("compile", bool(compile)),
                            ("layout", layout), ("delta_kernel", delta_kernel), ("patch_embed", patch_embed),
                            ("batching", bool(batching)), ("temperature", float(temperature)),
                            ("calibration", None)):  # read once: its temperature stands for it from here on
            object.__setattr__(self, name, value)

    @property
    def torch_device(self) -> torch.device:
        import torch

        return torch.device(self.device)

    def to_json(self) -> dict:
        return asdict(self)

    def describe(self) -> dict:
        """The resolved choices that decide what an engine computes, for reports (the calibration
        file only through the temperature it gave)."""
        out = self.to_json()
        del out["calibration"]
        return out

    def summary(self) -> str:
        """`describe()` as one line: "device=cpu dtype=bf16 mode=per-branch ..."."""
        return " ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in self.describe().items())


def patch_gemm_matches_conv(dtype: str, device: str) -> bool:
    """Whether the patch conv may run as a GEMM without changing its numbers.

    Only fp32 on CUDA differs: cuDNN convolutions use TF32 unless torch.backends.cudnn.allow_tf32
    is off (torch's default is on, and the reference keeps it), while our matmuls keep TF32 off.
    On the H200 the GEMM left fp32 image answers up to 6e-5 from the reference (text ones within 1e-5).
    """
    import torch

    return not (dtype == "fp32" and device.startswith("cuda") and torch.backends.cudnn.allow_tf32)


def _default_device() -> str:
    """cuda when torch sees a GPU, else cpu. torch is imported here, not with this module: the
    command lines check their other options first, and an error there should not wait for torch."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _fla_available() -> bool:
    from .fast.kernels import fla_available

    return fla_available()


def _is_cuda_index(device: str) -> bool:
    prefix, _, index = device.partition(":")
    return prefix == "cuda" and index.isdigit()
