"""The README's example requests, run as written against the demo's export, print its example outputs.

Every bash block of README.md that shows a response (a `# {"model": ...}` line) runs in bash in
a scratch directory where `make demo`'s export has been built (valen_export/demo.py), with
`valen-run` and `curl` replaced by shell functions that record the request and where it was sent
(a curl goes to the export of the README's last `valen-serve` before it). Each recorded request
is then answered by the engine valen-run and valen-serve run on the CPU, and the answer compared
with the README's next `# {...}` line.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"

# bf16 matrix products round differently on CPUs with and without AVX-512 BF16 (oneDNN's kernels):
# limited to AVX2 (ONEDNN_MAX_CPU_ISA=AVX2) the examples' probabilities moved by up to 0.0013.
# The README says so; anything past this is a stale README, not a different CPU.
PROBABILITY_TOLERANCE = 0.005

# Shell stand-ins: each request is written to $CAPTURE/<n>.json with its argv in <n>.argv.
STUBS = r'''
record() {  # record KIND ARGV... ; the request body on stdin
  local n=$(( $(cat "$CAPTURE/count") + 1 )); echo "$n" > "$CAPTURE/count"
  cat > "$CAPTURE/$n.json"; printf '%s\n' "$@" > "$CAPTURE/$n.argv"
}
valen-run() {
  local source="${@: -1}"
  if [ "$source" = - ]; then record valen-run "$@"; else record valen-run "$@" < "$source"; fi
}
curl() {
  local body= url= previous=
  for arg in "$@"; do
    [ "$previous" = -d ] && body=$arg
    case "$arg" in *localhost*) url=$arg;; esac
    previous=$arg
  done
  case "$url" in */v1/systemone) printf '%s' "$body" | record curl "$@";; esac
}
python() { "$PY" "$@"; }
python3() { "$PY" "$@"; }
'''


def example_blocks() -> list[str]:
    blocks = re.findall(r"^```bash\n(.*?)^```", README.read_text(encoding="utf-8"), flags=re.M | re.S)
    return [b for b in blocks if re.search(r'^# \{"model"', b, flags=re.M)]


def expected_responses(block: str) -> list[str]:
    return re.findall(r'^# (\{"model".*)$', block, flags=re.M)


def same_answer(got, want, path="response") -> list[str]:
    """Differences between two responses: structure, key order and every value exact, except
    probabilities and confidences within PROBABILITY_TOLERANCE."""
    if isinstance(want, dict):
        if not isinstance(got, dict) or list(got) != list(want):
            return [f"{path}: keys {list(got) if isinstance(got, dict) else got!r}, README shows {list(want)}"]
        return [d for k in want for d in same_answer(got[k], want[k], f"{path}.{k}")]
    if isinstance(want, float) and isinstance(got, float):
        return [] if math.isclose(got, want, rel_tol=0, abs_tol=PROBABILITY_TOLERANCE) else [f"{path}: {got}, README shows {want}"]
    return [] if got == want and type(got) is type(want) else [f"{path}: {got!r}, README shows {want!r}"]


@pytest.fixture(scope="module")
def demo_cwd(tmp_path_factory):
    """A scratch directory holding build/demo as `make demo` leaves it."""
    from valen_export.demo import build_exports

    cwd = tmp_path_factory.mktemp("readme")
    build_exports(cwd / "build" / "demo", report=lambda line: None)
    return cwd


@pytest.fixture(scope="module")
def engine(demo_cwd):
    from valen_runtime.engine import Engine
    from valen_runtime.options import EngineOptions

    return Engine.load(demo_cwd / "build" / "demo" / "export-separate", EngineOptions(device="cpu"), verify="full")


def test_readme_shows_example_responses():
    blocks = example_blocks()
    assert len(blocks) >= 2 and sum(len(expected_responses(b)) for b in blocks) >= 4


@pytest.mark.parametrize("index", range(len(example_blocks())))
def test_readme_example_outputs_match_the_demo_export(index, demo_cwd, engine, tmp_path):
    from valen_runtime.cli import main as valen_run
    from valen_runtime.wire import decode_request, encode_response, response_body

    block = example_blocks()[index]
    capture = tmp_path / "capture"
    capture.mkdir()
    (capture / "count").write_text("0")
    env = {"PATH": "/usr/bin:/bin", "PY": sys.executable, "CAPTURE": str(capture), "HOME": str(tmp_path)}
    before = {p.name for p in demo_cwd.iterdir()}
    run = subprocess.run(["bash", "-euo", "pipefail", "-c", STUBS + block + "\nwait\n"], cwd=demo_cwd, env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    added = sorted({p.name for p in demo_cwd.iterdir()} - before)
    assert not added, f"the examples wrote {added} into the directory they run in (the repository root); build/ is for that"

    expected = expected_responses(block)
    count = int((capture / "count").read_text())
    assert count == len(expected), f"{count} requests sent, {len(expected)} responses shown"
    for n, shown in enumerate(expected, 1):
        argv = (capture / f"{n}.argv").read_text().splitlines()
        if argv[0] == "valen-run":
            valen_run.make_context("valen-run", argv[1:])  # the README's flags are valen-run's
            export = argv[argv.index("--export") + 1]
        else:
            assert argv[0] == "curl"
            readme = README.read_text(encoding="utf-8")
            export = re.findall(r"^valen-serve --export (\S+)", readme[: readme.index(block)], flags=re.M)[-1]
        assert export == "build/demo/export-separate", f"example {n} asks {export}, not the demo's export"
        request = decode_request((capture / f"{n}.json").read_bytes())
        got = encode_response(response_body(engine.answer(request))).decode("utf-8")
        problems = same_answer(json.loads(got), json.loads(shown))
        assert not problems, f"README block {index + 1}, response {n}: {problems}\nthe demo export prints:\n{got}"
