"""benchmarks/gpu_run.sh's tests step names the files it collects (the GPU machine lacks some of
what other test files import): every file holding a gpu-marked test must be among them, or its
tests would never run anywhere."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_every_file_with_gpu_tests_is_collected_by_the_gpu_run():
    script = (REPO / "benchmarks" / "gpu_run.sh").read_text(encoding="utf-8")
    step = script[script.index('== *" tests "* ]]'):]
    step = step[: step.index("\nfi\n")]
    listed = set(re.findall(r"tests/[\w/]+(?:\.py)?", step))
    marked = {p for p in (REPO / "tests").rglob("test_*.py") if re.search(r"\bpytest\.mark\.gpu\b", p.read_text(encoding="utf-8"))}
    assert marked, "no gpu-marked test found: the pattern is stale"
    missing = [str(p.relative_to(REPO)) for p in marked
               if not any(str(p.relative_to(REPO)) == entry or str(p.relative_to(REPO)).startswith(entry.rstrip("/") + "/") for entry in listed)]
    assert not missing, f"gpu-marked tests that benchmarks/gpu_run.sh's tests step never collects: {missing}"
