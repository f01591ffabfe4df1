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


def test_every_wheel_the_gpu_run_installs_is_one_make_gpu_wheels_fetches():
    """gpu_run.sh installs `.whl/NAME-*.whl` files offline; each NAME must be pinned in
    fetch_gpu_wheels.sh (wheel names spell '-' as '_'), or the run stops on the missing wheel."""
    script = (REPO / "benchmarks" / "gpu_run.sh").read_text(encoding="utf-8")
    fetch = (REPO / "benchmarks" / "fetch_gpu_wheels.sh").read_text(encoding="utf-8")
    installed = set(re.findall(r"\.whl/([\w.]+)-\*\.whl", script))
    pinned = {name.replace("-", "_").lower() for name in re.findall(r'"([\w.-]+)==[\w.]+"', fetch)}
    assert {"av", "transformers", "fla_core"} <= installed, "the pattern is stale"
    assert installed - pinned == set()


def test_every_script_a_gpu_run_step_starts_exists():
    script = (REPO / "benchmarks" / "gpu_run.sh").read_text(encoding="utf-8")
    named = set(re.findall(r"python3 (benchmarks/\w+\.py)", script))
    assert "benchmarks/video_latency.py" in named
    assert [path for path in sorted(named) if not (REPO / path).is_file()] == []
