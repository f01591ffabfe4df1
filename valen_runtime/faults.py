"""Fault seams: the runtime functions a negative control may replace, and the one way to do it.

The parity gate is trusted only while realistic defects make it fail (parity/controls.py). A
control that patched whatever private name it found would break silently when the runtime is
refactored; instead each defect goes through a seam named here. A seam is a function the runtime
looks up by its module attribute at call time, so a replacement reaches every caller (eager code,
and torch.compile, which guards on the attribute and recompiles). Renaming or moving one of these
functions means updating its entry here; tests/parity/test_negative_controls.py then proves each
control still bites.

Nothing in the runtime calls `replaced`: no flag, environment variable or request reaches it.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator

# seam name -> (module, attribute path inside it)
SEAMS: dict[str, tuple[str, str]] = {
    # the fast path's GDN q/k L2 norm (eager and compiled layers alike); the reference keeps its own
    "fast-l2norm": ("valen_runtime.fast.layers", "l2norm"),
    # the text rotary embedding's interleaving of the three M-RoPE sections
    "mrope-interleave": ("valen_runtime.qwen35", "TextRotaryEmbedding._interleave"),
    # logits -> probabilities at the engine's temperature, on the device (Engine.queue_outputs)
    "probabilities": ("valen_runtime.engine", "queue_probabilities"),
    # the image resize's target size (request compiling)
    "image-smart-resize": ("valen_runtime.image", "smart_resize"),
}


@contextlib.contextmanager
def replaced(seam: str, make: Callable[[Callable], Callable]) -> Iterator[None]:
    """Inside the block, seam's function is `make(original)`; the original comes back afterwards."""
    if seam not in SEAMS:
        raise KeyError(f"unknown fault seam {seam!r}; known: {', '.join(sorted(SEAMS))}")
    module_name, path = SEAMS[seam]
    *owners, name = path.split(".")
    owner = importlib.import_module(module_name)
    for part in owners:
        owner = getattr(owner, part)
    original = getattr(owner, name)
    setattr(owner, name, make(original))
    try:
        yield
    finally:
        setattr(owner, name, original)
