"""Negative controls: realistic defects the parity gate must fail (test-only; nothing here is
reachable from valen-run, valen-parity or any environment variable).

Each control is either a damaged copy of an export or an in-process replacement of one runtime
function through its fault seam (valen_runtime/faults.py), applied only inside a
`with control.applied():` block, and names which gate
configurations run the code it damages (`exercised_by`). `parity.gate --controls` and
tests/parity/test_negative_controls.py run every control in every such configuration and expect
the gate to fail it.

- lora-element: +0.05 on one FP32 element of layers.1.linear_attn.in_proj_qkv.lora_A in a copy
  of the separate export, its manifest hash updated (so the runtime loads it without complaint).
- l2norm-dtype: the fast path's GDN q/k L2 norm computed in bf16 whatever the activation dtype
  (a kernel written for bf16 only); fp32 runs of the fast path see it.
- mrope-sections: the height and width sections of the runtime's interleaved M-RoPE swapped.
- probabilities-swap: the engine (its device softmax) attaches the first question's first two probabilities to each
  other's keys.
- resize-half-up: the runtime's smart_resize rounds side / factor half up instead of half to even.
- temperature-ignored: the engine answers at temperature 1 whatever its options say (the gate's
  configuration at a temperature other than 1 must catch it).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from valen_runtime import faults
from valen_runtime.options import EngineOptions

LORA_TENSOR = "layers.1.linear_attn.in_proj_qkv.lora_A"
LORA_DELTA = 0.05


def perturb_lora_element(src: Path, dst: Path, name_part: str = LORA_TENSOR, delta: float = LORA_DELTA) -> str:
    """A copy of export `src` at `dst` with `delta` added to the first FP32 element of the LoRA
    tensor whose name contains `name_part`; the manifest's sha256 and size are updated. Unchanged
    files are hard links (the 2b export is 4.5 GB); the two changed files are new files."""
    src, dst = Path(src), Path(dst)
    if dst.exists():
        shutil.rmtree(dst)
    try:
        shutil.copytree(src, dst, copy_function=os.link)
    except OSError:  # another file system: copy
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst)
    path = dst / "adapter_model.safetensors"
    data = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    name = next(k for k in header if name_part in k)
    if header[name]["dtype"] != "F32":
        raise ValueError(f"{name}: expected an F32 tensor, got {header[name]['dtype']}")
    start = 8 + n + header[name]["data_offsets"][0]
    (value,) = struct.unpack("<f", data[start : start + 4])
    data[start : start + 4] = struct.pack("<f", value + delta)
    path.unlink()  # a hard link to the original: write a new file, never into the shared one
    path.write_bytes(bytes(data))
    manifest_path = dst / "valen_export.json"
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    manifest["files"]["adapter_model.safetensors"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    manifest_path.unlink()
    manifest_path.write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return name


def l2norm_in_bf16():
    """The fast path's GDN layers (eager and compiled alike) normalise q/k in bf16 whatever the
    model dtype. The reference modules keep their own l2norm."""
    import torch

    def make(l2norm):
        def bf16_l2norm(x, eps: float = 1e-6):
            return l2norm(x.to(torch.bfloat16), eps).to(x.dtype)

        return bf16_l2norm

    return faults.replaced("fast-l2norm", make)


def mrope_sections_swapped():
    """The text rotary embedding uses (t, w, h) where the config says (t, h, w)."""

    def make(interleave):
        def swapped(self, freqs):
            t, h, w = self.mrope_section
            saved, self.mrope_section = self.mrope_section, (t, w, h)
            try:
                return interleave(self, freqs)
            finally:
                self.mrope_section = saved

        return swapped

    return faults.replaced("mrope-interleave", make)


def probabilities_swapped():
    """The engine's probabilities with the first multi-candidate question's first two exchanged
    (on the device, before the host reads them)."""

    def make(queue_probabilities):
        def swapping(logits, counts, temperature=1.0):
            values = queue_probabilities(logits, counts, temperature)  # [logits..., probabilities...], a fresh tensor
            start = sum(counts)
            for count in counts:
                if count >= 2:
                    values[[start, start + 1]] = values[[start + 1, start]]
                    break
                start += count
            return values

        return swapping

    return faults.replaced("probabilities", make)


def temperature_ignored():
    """The engine's softmax at temperature 1 whatever its options say (a calibration never applied)."""

    def make(queue_probabilities):
        def at_one(logits, counts, temperature=1.0):
            return queue_probabilities(logits, counts, 1.0)

        return at_one

    return faults.replaced("probabilities", make)


def resize_rounding_half_up():
    """smart_resize with side / factor rounded half up (floor(x + 0.5)) instead of half to even."""

    def make(smart_resize):
        def half_up(height, width, factor, min_pixels, max_pixels):
            h_bar = math.floor(height / factor + 0.5) * factor
            w_bar = math.floor(width / factor + 0.5) * factor
            if h_bar * w_bar > max_pixels or h_bar * w_bar < min_pixels:
                return smart_resize(height, width, factor, min_pixels, max_pixels)
            return h_bar, w_bar

        return half_up

    return faults.replaced("image-smart-resize", make)


@dataclass(frozen=True)
class Control:
    name: str
    what: str
    patch: Callable | None  # context manager factory for code mutations
    damages_export: bool  # lora-element: a damaged copy of the separate export instead of a patch
    exercised_by: Callable[[str, EngineOptions], bool]  # (lora mode, options) -> runs the damaged code
    requests: Callable[[str, dict], bool]  # (request id, request) -> exercises the damage

    @contextlib.contextmanager
    def applied(self):
        if self.patch is None:
            yield
        else:
            with self.patch():
                yield


def _is_visual(rid: str, req: dict) -> bool:
    """An image or a video state: M-RoPE's height and width sections differ only there."""
    state = json.dumps(req["state"])
    return "data:image/" in state or "data:video/" in state


def _fast(options: EngineOptions) -> bool:
    """Whether the fast path runs (EngineOptions has resolved the engine's own choice: fast for
    shared-prefix on CUDA)."""
    return options.kernels == "fast"


CONTROLS = (
    Control("lora-element", f"+{LORA_DELTA} on one element of {LORA_TENSOR} (separate export, manifest re-hashed)", None, True,
            lambda lora, options: lora == "separate", lambda rid, req: True),
    Control("l2norm-dtype", "the fast path's GDN q/k L2 norm in bf16 whatever the model dtype", l2norm_in_bf16, False,
            lambda lora, options: _fast(options), lambda rid, req: True),
    Control("mrope-sections", "the height and width M-RoPE sections swapped in the runtime's rotary embedding", mrope_sections_swapped, False,
            lambda lora, options: True, _is_visual),
    Control("probabilities-swap", "two probabilities swapped in the engine's outputs", probabilities_swapped, False,
            lambda lora, options: True, lambda rid, req: any(len(q.get("criteria") or [0, 0]) >= 2 for q in req["questions"].values())),
    Control("resize-half-up", "smart_resize rounding side / factor half up", resize_rounding_half_up, False,
            lambda lora, options: True, lambda rid, req: "-half" in rid),
    Control("temperature-ignored", "the engine's probabilities at temperature 1 whatever its options say", temperature_ignored, False,
            lambda lora, options: options.temperature != 1.0, lambda rid, req: True),
)
BY_NAME = {c.name: c for c in CONTROLS}


def subset(control: Control, requests: list[tuple[str, str, dict]], limit: int) -> list[tuple[str, str, dict]]:
    """Up to `limit` requests that exercise the control (the first ones, in set order)."""
    chosen = [(c, n, r) for c, n, r in requests if control.requests(f"{c}/{n}", r)]
    if not chosen:
        raise ValueError(f"control {control.name}: no request in the set exercises it")
    return chosen[:limit]
