"""The synthetic artifacts the GPU benchmarks run on: a fixture of one preset and its two exports
(LoRA separate and merged) under one work folder, each built only when missing."""

from __future__ import annotations

import sys
import time
from pathlib import Path


def fixture_and_exports(work: Path, preset: str) -> tuple[Path, dict[str, Path]]:
    """-> (the fixture folder, {"separate": export, "merged": export}); timings on stderr."""
    from valen_export.export import export
    from valen_export.fixture import build_fixture

    fx = work / f"fixture-{preset}"
    t = time.perf_counter()
    if not (fx / "pins.json").exists():
        build_fixture(fx, preset=preset, seed=0)
    print(f"fixture ready in {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
    exports = {mode: work / f"export-{preset}-{mode}" for mode in ("separate", "merged")}
    t = time.perf_counter()
    for mode, path in exports.items():
        if not (path / "valen_export.json").exists():
            export(fx / "checkpoint", fx / "base", path, lora_mode=mode, pins_path=fx / "pins.json", progress=False)
    print(f"exports ready in {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
    return fx, exports
