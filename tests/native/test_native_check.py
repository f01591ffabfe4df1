"""Two independent readers of docs/export-format.md agree: valen-verify (Python) and
valen-native-check (Rust, native/). Both accept fresh tiny exports in both LoRA modes (the Rust
one also recomputes the conformance vectors) and both refuse each damaged copy with exit 1.

The Rust side is marked slow (its first build takes minutes: `make test` and `make native-check`
run it, `make test-fast` does not); it needs cargo and the crate's dependencies (Debian's packages,
`make native-deps`, or crates.io); without them it is skipped with one plain line
(`make native-check` and CI make that a failure instead; tests/native/conftest.py).
"""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

# valen_export.verify is imported in the tests that call it: it brings torch, which the pytest runs
# tests/native/test_native_build.py starts (collecting this module) need not import.

GOOD = ("separate", "merged", "single")
CHECK_TIMEOUT_S = 120  # the tiny exports are about 1 MiB; generous for a loaded 2-core machine


def run_native(binary, export_dir, vectors=None) -> subprocess.CompletedProcess:
    args = [str(binary), str(export_dir)] + (["--vectors", str(vectors)] if vectors else [])
    return subprocess.run(args, capture_output=True, text=True, timeout=CHECK_TIMEOUT_S)


@pytest.mark.parametrize("name", GOOD)
def test_python_reader_accepts_fresh_exports(native_exports, name):
    from valen_export.verify import verify_export

    assert verify_export(native_exports[name]) == []


@pytest.mark.slow
@pytest.mark.parametrize("name", GOOD)
def test_native_reader_accepts_fresh_exports_with_their_vectors(native_binary, native_exports, native_vectors, name):
    result = run_native(native_binary, native_exports[name], native_vectors[name])
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow
def test_native_reader_refuses_vectors_of_another_export(native_binary, native_exports, native_vectors):
    result = run_native(native_binary, native_exports["separate"], native_vectors["merged"])
    assert result.returncode == 1, result.stdout + result.stderr


@pytest.mark.slow
def test_native_reader_refuses_a_wrong_expected_value(native_binary, native_exports, native_vectors, tmp_path):
    vectors = json.loads(native_vectors["separate"].read_text())
    probe = vectors["projections"][0]
    # Move one expected value by ten times its own bound: no float32 computation lands there.
    probe["expected"][0][0] += 10 * probe["bound"][0][0]
    bad = tmp_path / "bad.vectors.json"
    bad.write_text(json.dumps(vectors))
    result = run_native(native_binary, native_exports["separate"], bad)
    assert result.returncode == 1, result.stdout + result.stderr


@pytest.mark.slow
def test_native_reader_usage_error_exits_2(native_binary):
    result = subprocess.run([str(native_binary)], capture_output=True, text=True, timeout=CHECK_TIMEOUT_S)
    assert result.returncode == 2


@pytest.fixture()
def damaged(request, native_exports, damages, tmp_path):
    """(path, word the refusal should mention) of a damaged copy of a fresh export."""
    damage, mode = damages[request.param]
    export = tmp_path / request.param
    shutil.copytree(native_exports[mode], export)
    return export, damage(export)


DAMAGE_NAMES = [
    "flipped-byte", "missing-lora-b", "wrong-dtype", "renamed-tensor", "unknown-format", "wrong-scale",
    "transposed-lora-a", "fp32-source-off", "trained-blocks-off", "nan-in-head", "extra-file", "listed-extra-file",
    "uppercase-hash",
]


@pytest.mark.parametrize("damaged", DAMAGE_NAMES, indirect=True)
def test_python_reader_refuses_damage(damaged):
    export, word = damaged
    from valen_export.verify import verify_export

    failures = verify_export(export)
    assert failures, "accepted a damaged export"
    assert any(word in line for line in failures), failures


@pytest.mark.slow
@pytest.mark.parametrize("damaged", DAMAGE_NAMES, indirect=True)
def test_native_reader_refuses_damage(native_binary, damaged):
    export, word = damaged
    result = run_native(native_binary, export)
    assert result.returncode == 1, f"exit {result.returncode}: {result.stdout}{result.stderr}"
    assert word in result.stdout + result.stderr, result.stdout + result.stderr


def test_every_damage_is_tested(damages):
    assert sorted(damages) == sorted(DAMAGE_NAMES)
