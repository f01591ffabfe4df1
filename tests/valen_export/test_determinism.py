"""Determinism across processes: the same inputs export to byte-identical files, and the runtime
answers the same request with bitwise-identical logits and an identical response text, in
separate Python processes with different PYTHONHASHSEED values (so no dict/set iteration order,
hash seed or process state leaks into the output). Both run two processes side by side; the
export test takes about 4 s (in `make test-fast`), the runtime test about 12 s (marked slow).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REQUEST = {
    "model": "valen-preview-0923",
    "state": "The card was charged twice.",
    "questions": {"q": {"type": "choice", "instructions": "What next?", "criteria": {"refund": "Refund it", "wait": "Wait"}}},
}

EXPORT_SCRIPT = """
import sys
from valen_export.export import export
checkpoint, base, pins, out = sys.argv[1:5]
for mode in ("separate", "merged"):
    export(checkpoint, base, f"{out}/{mode}", lora_mode=mode, pins_path=pins, progress=False)
"""

RUN_SCRIPT = """
import json, sys
from valen_runtime.engine import Engine
from valen_runtime.options import EngineOptions
out = {}
for mode in ("separate", "merged"):
    engine = Engine.load(f"{sys.argv[1]}/{mode}", EngineOptions(device="cpu", dtype="bf16"))
    result = engine.run(json.loads(sys.argv[2]))
    out[mode] = {
        "response": json.dumps(result.response, ensure_ascii=False),
        "logits": [t.contiguous().numpy().tobytes().hex() for t in result.logits],
        "dtypes": [str(t.dtype) for t in result.logits],
    }
print(json.dumps(out))
"""


def run_side_by_side(args_per_seed: dict[str, list], timeout=600) -> dict[str, str]:
    procs = {}
    for seed, args in args_per_seed.items():
        env = dict(os.environ, PYTHONHASHSEED=seed)
        procs[seed] = subprocess.Popen([sys.executable, *map(str, args)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    outs = {}
    for seed, p in procs.items():
        stdout, stderr = p.communicate(timeout=timeout)
        assert p.returncode == 0, stderr
        outs[seed] = stdout
    return outs


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_export_is_byte_identical_across_processes(tiny_fixture, tiny_export, tmp_path):
    fx = tiny_fixture
    run_side_by_side({seed: ["-c", EXPORT_SCRIPT, fx.checkpoint, fx.base, fx.pins, tmp_path / seed] for seed in ("1", "4242")})
    a, b = tree(tmp_path / "1"), tree(tmp_path / "4242")
    assert sorted(a) == sorted(b)
    different = [name for name in a if a[name] != b[name]]
    assert different == [], f"differ between processes: {different}"
    # ... and equal to the session's in-process export (a third process, this one).
    for mode in ("separate", "merged"):
        c = tree(tiny_export[mode])
        assert {k: v for k, v in a.items() if k.startswith(mode + "/")} == {f"{mode}/{k}": v for k, v in c.items()}


@pytest.mark.slow
def test_runtime_answers_bitwise_identical_across_processes(tiny_export, tmp_path):
    root = tiny_export["separate"].parent
    outs = run_side_by_side({seed: ["-c", RUN_SCRIPT, root, json.dumps(REQUEST)] for seed in ("1", "4242")})
    a, b = (json.loads(o) for o in outs.values())
    assert a == b  # response text and every logit's bytes
    for mode in ("separate", "merged"):
        response = json.loads(a[mode]["response"])
        assert response["model"] == "valen-preview-0923"
        assert list(response["answers"]["q"]["probabilities"]) == ["refund", "wait"]
        assert a[mode]["dtypes"] == ["torch.float32"]
