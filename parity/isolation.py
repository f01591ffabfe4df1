"""Keep the fast-kernel packages out of the reference process (docs/numerics.md).

transformers 5.4.0 swaps in flash-linear-attention (`fla`: chunked gated delta rule and the fused
gated RMSNorm), `causal_conv1d`, hub `kernels` and `torchcodec` whenever they are importable. The
pinned Valen environment had none of them, so the reference must not see them even when they are
installed next to it (the `cuda` extra installs fla-core). Two layers:

1. `clean_environment(env)` (parent side): drops PYTHONPATH entries that name a blocked package, so
   a stray checkout on the path is not even visible.
2. `install_blocker()` (reference process, before transformers is imported): sets
   `sys.modules[name] = None` for each blocked top-level name, which makes both
   `importlib.util.find_spec(name)` (what transformers' `is_*_available` checks call) return None
   and `import name` raise ModuleNotFoundError, and puts a meta-path finder first that refuses
   the names and their submodules should the `sys.modules` entry ever be removed.

This module imports nothing heavy on purpose: it must run before torch / transformers.
"""

from __future__ import annotations

import importlib.abc
import os
import sys

BLOCKED = ("fla", "causal_conv1d", "kernels", "torchcodec")


class BlockedImportFinder(importlib.abc.MetaPathFinder):
    """Refuses the blocked top-level packages and everything under them."""

    def __init__(self, names=BLOCKED):
        self.names = tuple(names)

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".", 1)[0] in self.names:
            raise ModuleNotFoundError(f"{fullname} is blocked in the parity reference process", name=fullname)
        return None


def install_blocker(names=BLOCKED) -> None:
    for name in names:
        loaded = [m for m in sys.modules if (m == name or m.startswith(name + ".")) and sys.modules[m] is not None]
        if loaded:
            raise RuntimeError(f"{name} was imported before the parity blocker was installed: {loaded[:3]}")
        sys.modules[name] = None
    if not any(isinstance(f, BlockedImportFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, BlockedImportFinder(names))


def clean_environment(env: dict | None = None, names=BLOCKED) -> dict:
    """A copy of `env` (default os.environ) whose PYTHONPATH drops entries mentioning a blocked name."""
    env = dict(os.environ if env is None else env)
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    kept = [p for p in parts if not any(n in p.replace("-", "_").lower() for n in names)]
    if kept:
        env["PYTHONPATH"] = os.pathsep.join(kept)
    else:
        env.pop("PYTHONPATH", None)
    # Hub access is never wanted: the reference loads local folders only.
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    return env
