"""flash-linear-attention's kernel configurations, chosen ahead of time for the GPUs they were tuned on.

FLA autotunes each Triton kernel on its first use: it compiles every candidate configuration (3 to
12 per kernel here, again for each specialisation: plain or packed sequences, with or
without a final state) and times them. On a cold start that is tens of seconds before the first
answer. FLA can instead read the configuration to use from a directory of JSON files, one per
kernel (its `FLA_CONFIG_DIR` and `FLA_CACHE_MODE` environment variables; fla/ops/utils/cache.py).

This module ships such directories, `fla_configs/<GPU name>/`, written by `benchmarks/tune_fla.py`
from FLA's own autotuning of valen-serve's warmup on that GPU, and points FLA at the one for the
GPU in use before FLA is first imported. The lookup is FLA's "fuzzy" mode: a kernel call whose
key matches a tuned entry in structure (dtypes and flags; sizes may differ) uses its
configuration; anything else autotunes as before. Nothing is set, and FLA autotunes as before,
when the GPU has no folder here, when the folder was tuned with another fla-core version, or
when FLA was imported before the runtime; when the user set FLA_CONFIG_DIR or FLA_CACHE_MODE,
FLA does what those say. The variables are set in this process's environment, so child
processes inherit them. The configurations are ones FLA's autotuner picked among its own
candidates, so results are those of an autotuned run that chose the same.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

CONFIGS = Path(__file__).parent / "fla_configs"
MANIFEST = "tuned.json"  # beside the per-kernel files: the versions and GPU they were tuned with


def gpu_folder_name(device_name: str) -> str:
    """The folder name for a GPU, as FLA names its own config folders (non-alphanumerics to _)."""
    return re.sub(r"[^0-9A-Za-z]+", "_", device_name).strip("_") or "unknown_gpu"


def shipped_dir(device_name: str, fla_version: str | None, root: Path = CONFIGS) -> Path | None:
    """The tuned folder for this GPU when it was tuned with this fla-core version, else None."""
    folder = root / gpu_folder_name(device_name)
    try:
        tuned = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(tuned, dict) or fla_version is None:
        return None
    return folder if tuned.get("fla_core") == fla_version else None


def use_shipped_configs(device_name: str, fla_version: str | None, environ=os.environ, root: Path = CONFIGS) -> str:
    """Point FLA at this GPU's tuned folder (call before FLA is imported; FLA reads the mode at
    import). Returns what the ready line reports: where FLA's configurations come from."""
    if "FLA_CONFIG_DIR" in environ or "FLA_CACHE_MODE" in environ:
        return "FLA_CONFIG_DIR/FLA_CACHE_MODE as set"
    if "fla.ops.utils.cache" in sys.modules:  # the module that reads FLA_CACHE_MODE, once, at import
        return "autotuned (FLA imported before the runtime)"
    folder = shipped_dir(device_name, fla_version, root)
    if folder is None:
        return "autotuned"
    environ["FLA_CONFIG_DIR"] = str(folder)
    environ["FLA_CACHE_MODE"] = "fuzzy"
    return f"tuned for {folder.name}"


def autotuners() -> dict[str, list]:
    """FLA's autotuned kernels imported so far, by kernel name. Several FLA modules define kernels
    of one name (recompute_w_u_fwd_kernel, chunk_fwd_kernel_o): FLA's config files are per name,
    so their entries share a file."""
    from triton.runtime.autotuner import Autotuner

    found: dict[str, dict[int, Autotuner]] = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("fla.") or module is None:
            continue
        for value in list(vars(module).values()):
            while value is not None and not isinstance(value, Autotuner) and hasattr(value, "fn"):
                value = value.fn  # triton.heuristics(...) around the autotuner
            if isinstance(value, Autotuner):
                found.setdefault(getattr(value.fn, "__name__", repr(value.fn)), {})[id(value)] = value
    return {kernel: list(tuners.values()) for kernel, tuners in found.items()}


def kernels_configured() -> dict[str, bool]:
    """FLA's kernels that have a configuration chosen so far, each with whether FLA timed its
    candidates to choose it (Triton's autotuner sets `bench_time` when it does), rather than
    reading it from a config folder."""
    return {kernel: any(hasattr(t, "bench_time") for t in configured)
            for kernel, tuners in autotuners().items() if (configured := [t for t in tuners if t.cache])}


def dump(folder: Path, device_name: str) -> dict[str, int]:
    """Write every autotuned FLA kernel's chosen configurations to `folder` in FLA's config-file
    format, and the manifest; returns entries per kernel. Kernels FLA has not tuned are left out."""
    import torch
    import triton
    from fla.ops.utils.cache import AutotuneKey

    from .kernels import fla_version

    folder.mkdir(parents=True, exist_ok=True)
    counts = {}
    for kernel, tuners in sorted(autotuners().items()):
        entries = {}
        for key, config in [item for tuner in tuners for item in tuner.cache.items()]:
            entries[AutotuneKey.key_hash(tuple(key))] = {
                "autotune_key": AutotuneKey.normalize_autotune_key(list(key)),
                "config": {"kwargs": dict(config.kwargs), "num_warps": config.num_warps, "num_stages": config.num_stages,
                           "num_ctas": getattr(config, "num_ctas", 1), "maxnreg": getattr(config, "maxnreg", None)},
            }
        if not entries:
            continue
        (folder / f"{kernel}.json").write_text(json.dumps(
            {"kernel_name": kernel, "triton_version": triton.__version__, "autotune_entries": entries}, indent=1, sort_keys=True) + "\n")
        counts[kernel] = len(entries)
    (folder / MANIFEST).write_text(json.dumps(
        {"gpu": device_name, "fla_core": fla_version(), "triton": triton.__version__, "torch": torch.__version__.split("+")[0],
         "tuned_by": "benchmarks/tune_fla.py", "kernels": counts}, indent=1, sort_keys=True) + "\n")
    return counts
