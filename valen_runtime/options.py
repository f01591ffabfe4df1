"""EngineOptions: how an Engine runs an export, with every default and every check in one place.

A field left as None takes the default for the device: on CUDA a long-lived engine runs the
shared-prefix mode on the fast path (`valen_runtime.fast`), compiled and replayed from CUDA
graphs; on the CPU it runs the reference's per-branch shape on the reference modules. Whatever
is given explicitly is kept, and an impossible combination is refused with one ValueError line.
Nothing else (no environment variable, no attribute set later) changes what an engine computes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

DTYPES = ("bf16", "fp32")
MODES = ("per-branch", "shared-prefix")
KERNELS = ("torch", "fast")


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
        graphs: replay each request shape from a CUDA graph (shared-prefix on CUDA only);
            None: on for shared-prefix on CUDA.
        compile: torch.compile the fast path (kernels="fast" only; the first request of a
            process then compiles for about a minute); None: on for the fast path on CUDA.
    """

    device: str | None = None
    dtype: str = "bf16"
    mode: str | None = None
    kernels: str | None = None
    graphs: bool | None = None
    compile: bool | None = None

    def __post_init__(self):
        device = self.device if self.device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
        if not isinstance(device, str) or not (device == "cpu" or device == "cuda" or _is_cuda_index(device)):
            raise ValueError(f"device {device!r} is not cpu, cuda or cuda:N")
        cuda = device.startswith("cuda")
        mode = self.mode if self.mode is not None else ("shared-prefix" if cuda else "per-branch")
        kernels = self.kernels if self.kernels is not None else ("fast" if cuda and mode == "shared-prefix" else "torch")
        graphs = self.graphs if self.graphs is not None else (cuda and mode == "shared-prefix")
        compile = self.compile if self.compile is not None else (cuda and kernels == "fast")
        for name, value, allowed in (("dtype", self.dtype, DTYPES), ("mode", mode, MODES), ("kernels", kernels, KERNELS)):
            if value not in allowed:
                raise ValueError(f"{name} {value!r} is not one of {', '.join(allowed)}")
        if graphs and not (cuda and mode == "shared-prefix"):
            raise ValueError("CUDA graphs need mode='shared-prefix' on a CUDA device")
        if compile and kernels != "fast":
            raise ValueError("compile=True needs kernels='fast' (the reference modules always run eagerly)")
        for name, value in (("device", device), ("mode", mode), ("kernels", kernels), ("graphs", bool(graphs)), ("compile", bool(compile))):
            object.__setattr__(self, name, value)

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    def to_json(self) -> dict:
        return asdict(self)


def _is_cuda_index(device: str) -> bool:
    prefix, _, index = device.partition(":")
    return prefix == "cuda" and index.isdigit()
