"""Persistent compile caches (`--compile-cache`): torch.compile's Inductor and Triton outputs, and
Triton's autotuning results, kept in one directory so a restarted process loads what an earlier
one compiled instead of compiling it again.

Every cache entry is keyed by what produced it (the graph and its source, the torch and Triton
versions, the device and its compute capability), so one directory can be shared by exports,
torch versions and GPUs; a key that changed only misses.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ENV_VAR = "VALEN_COMPILE_CACHE"
DISABLED = "none"


def default_dir() -> Path:
    """$XDG_CACHE_HOME/valen/compile, else ~/.cache/valen/compile."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "valen" / "compile"


def resolve_dir(value: str | None) -> Path | None:
    """The cache directory of `--compile-cache` (None: the environment's VALEN_COMPILE_CACHE, else
    the default); "none" turns the persistent cache off (None)."""
    if value is None:
        value = os.environ.get(ENV_VAR) or None
    if value is None:
        return default_dir()
    if value.strip().lower() == DISABLED:
        return None
    if not value.strip():
        raise ValueError("--compile-cache must be a directory or 'none', got an empty value")
    return Path(value).expanduser()


def compiles(options) -> bool:
    """Whether an engine with these EngineOptions compiles anything: torch.compile, or Triton
    kernels on CUDA (the fast path's); elsewhere the cache directory is left alone (not created)."""
    return bool(options.compile) or str(options.device).startswith("cuda")


def use(directory: Path | None) -> dict:
    """Point Inductor and Triton at `directory` (its inductor/ and triton/ folders) and turn on the
    FX graph, AOTAutograd and Triton autotuning caches; call before anything is compiled. Returns
    what the ready line reports. Raises ValueError (one line) when the directory cannot be written."""
    if directory is None:
        return {"dir": None}
    inductor, triton = directory / "inductor", directory / "triton"
    try:
        for folder in (inductor, triton):
            folder.mkdir(parents=True, exist_ok=True)
            probe = folder / f".write-test-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
    except OSError as exc:
        raise ValueError(f"--compile-cache {directory}: cannot write there ({exc.strerror or exc}); "
                         f"give a writable directory or 'none'") from None
    # The environment is what Inductor and Triton read, and it reaches compile worker processes too.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(inductor)
    os.environ["TRITON_CACHE_DIR"] = str(triton)
    os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "1"
    os.environ["TORCHINDUCTOR_AUTOGRAD_CACHE"] = "1"
    os.environ["TRITON_CACHE_AUTOTUNING"] = "1"  # Triton versions without this knob ignore it
    # Modules imported already read their configuration at import: set it there too, where it exists.
    _set_if_present("torch._inductor.config", "fx_graph_cache", True)
    _set_if_present("torch._functorch.config", "enable_autograd_cache", True)
    knobs = sys.modules.get("triton.knobs")
    autotuning = getattr(knobs, "autotuning", None)
    if autotuning is not None and hasattr(autotuning, "cache"):
        autotuning.cache = True
    return {"dir": str(directory)}


def _set_if_present(module_name: str, name: str, value) -> None:
    module = sys.modules.get(module_name)
    if module is not None and hasattr(module, name):
        setattr(module, name, value)


def counters() -> dict:
    """This process's FX graph and AOTAutograd cache hits and misses so far (what a warm cache saves)."""
    utils = sys.modules.get("torch._dynamo.utils")
    found = getattr(utils, "counters", None)
    if found is None:
        return {}
    inductor, aot = found.get("inductor", {}), found.get("aot_autograd", {})
    return {"fx_graph_hits": inductor.get("fxgraph_cache_hit", 0), "fx_graph_misses": inductor.get("fxgraph_cache_miss", 0),
            "aot_autograd_hits": aot.get("autograd_cache_hit", 0), "aot_autograd_misses": aot.get("autograd_cache_miss", 0)}
