"""The native check's fixtures: the Rust reader built from native/, and damaged copies of exports.

The reader is built with `--locked --offline` once its crates are at hand: from Debian's packaged
sources when /usr/share/cargo/registry exists (the opt-in of native/README.md: a copy made by
native/offline/debian_crates.py, and `--config native/offline/debian.toml`), else from crates.io
(`cargo fetch` first). When cargo or the crates cannot be had, the Rust side is skipped with one
plain reason; VALEN_NATIVE_REQUIRED=1 (`make native-check`, CI) turns that into a failure, and also
fails a run in which no native reader test ran. VALEN_CARGO (the Makefile's CARGO; empty: none) and
VALEN_DEBIAN_CRATES override where cargo and Debian's crates are looked for.
Each damage helper changes one thing in a copy of a good export and re-hashes the changed file in
the manifest, so only the check aimed at that thing can catch it (the flipped byte is the
exception: it is meant for the hash check).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

from ..conftest import run_wide

REPO = Path(__file__).resolve().parents[2]
NATIVE = REPO / "native"
CRATE = NATIVE / "Cargo.toml"
BINARY = NATIVE / "target" / "release" / "valen-native-check"
DEBIAN_OPT_IN = NATIVE / "offline" / "debian.toml"
PREPARE_DEBIAN_CRATES = NATIVE / "offline" / "debian_crates.py"
BUILD_TIMEOUT_S = 900  # a cold release build of the crate and its dependencies on 2 cores
FETCH_TIMEOUT_S = 600
NATIVE_READER = ("native_reader", True)  # user property of the tests that run the Rust reader


def find_cargo() -> str | None:
    if "VALEN_CARGO" in os.environ:
        return os.environ["VALEN_CARGO"] or None
    found = shutil.which("cargo")
    if found:
        return found
    home = Path.home() / ".cargo" / "bin" / "cargo"  # rustup's default place, often not on PATH
    return str(home) if home.is_file() else None


def debian_crates_dir() -> Path:
    return Path(os.environ.get("VALEN_DEBIAN_CRATES") or "/usr/share/cargo/registry")


def native_required() -> bool:
    return os.environ.get("VALEN_NATIVE_REQUIRED") == "1"


def cargo_env(cargo: str) -> dict[str, str]:
    return dict(os.environ, PATH=f"{Path(cargo).parent}{os.pathsep}{os.environ.get('PATH', '')}")  # rustc beside cargo


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


SKIP_PREFIX = "native check not run: "
NO_CARGO = 'cargo not found (not on PATH, not in ~/.cargo/bin); README.md, "Check an export natively", says how to get it'


def _unavailable(reason: str):
    if native_required():
        pytest.fail(f"native check required (VALEN_NATIVE_REQUIRED=1) but {reason}")
    pytest.skip(SKIP_PREFIX + reason)


def run_bounded(args: list[str], what: str, on_timeout, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run with capture and a timeout; a command that hangs (a registry that never
    answers, a stuck build) ends in `on_timeout(message)` (a skip or a failure), not a traceback."""
    timeout = kwargs.pop("timeout")
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=timeout, **kwargs)
    except subprocess.TimeoutExpired:
        on_timeout(f"{what} did not finish within {timeout} s")
        raise AssertionError("unreachable: on_timeout must skip or fail")


def crate_source_args(cargo: str, env: dict[str, str]) -> list[str]:
    """cargo arguments that make every crate local: Debian's (the opt-in) when its directory exists, else crates.io's, fetched."""
    debian = debian_crates_dir()
    if debian.is_dir():
        prepare = run_bounded(
            [sys.executable, str(PREPARE_DEBIAN_CRATES), "--from", str(debian)],
            "preparing Debian's crates", _unavailable, timeout=FETCH_TIMEOUT_S,
        )
        if prepare.returncode != 0:
            _unavailable(f"Debian's crates in {debian} do not match native/Cargo.lock (`make native-deps` installs them): {prepare.stderr.strip().splitlines()[0]}")
        return ["--config", str(DEBIAN_OPT_IN)]
    for offline in (["--offline"], []):  # crates cargo downloaded before need no network
        fetch = run_bounded(
            [cargo, "fetch", "--locked", *offline, "--manifest-path", str(CRATE)],
            "`cargo fetch` from crates.io", _unavailable, timeout=FETCH_TIMEOUT_S, env=env, cwd=NATIVE,
        )
        if fetch.returncode == 0:
            break
    if fetch.returncode != 0:
        _unavailable(
            f"cargo found, but no crates: `cargo fetch` from crates.io failed ({last_line(fetch.stderr)}) "
            f"and Debian's are not installed ({debian} missing; `make native-deps`, as root)"
        )
    return []


@contextmanager
def one_build_at_a_time():
    """Serialize builds across processes (pytest-xdist workers): each replaces the copy of Debian's crates."""
    (NATIVE / "target").mkdir(exist_ok=True)
    with open(NATIVE / "target" / ".valen-build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@pytest.fixture(scope="session")
def native_binary() -> Path:
    """Path of a freshly built valen-native-check; skips (see the module's docstring) when it cannot be built."""
    cargo = find_cargo()
    if cargo is None:
        _unavailable(NO_CARGO)
    env = cargo_env(cargo)
    with one_build_at_a_time():
        build = run_bounded(
            [cargo, "build", "--release", "--locked", "--offline", *crate_source_args(cargo, env), "--manifest-path", str(CRATE)],
            "cargo build of native/", pytest.fail, timeout=BUILD_TIMEOUT_S, env=env, cwd=NATIVE,
        )
    if build.returncode != 0:
        # A build failure is a real failure, not a skip: the crate is part of the product.
        pytest.fail("cargo build of native/ failed:\n" + build.stderr[-4000:])
    return BINARY


@pytest.fixture()
def cargo() -> str:
    """cargo, for the tests of how the crate resolves (no build); without it, the native_binary skip."""
    found = find_cargo()
    if found is None:
        _unavailable(NO_CARGO)
    return found


@pytest.fixture()
def build_lock():
    with one_build_at_a_time():
        yield


# --- one line when the Rust reader was skipped; VALEN_NATIVE_REQUIRED=1 also means that it ran ------


def _native_skip_reason(report) -> str | None:
    if report.skipped and isinstance(report.longrepr, tuple) and len(report.longrepr) == 3:
        reason = str(report.longrepr[2]).removeprefix("Skipped: ")
        if reason.startswith(SKIP_PREFIX):
            return reason
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    # pytest reports a fixture's skip at each test's own line, so `-ra` would print one line per
    # test function; one location for all of them folds them into a single line.
    outcome = yield
    report = outcome.get_result()
    reason = _native_skip_reason(report)
    if reason is not None:
        report.longrepr = (str(Path(__file__).relative_to(REPO)), _unavailable.__code__.co_firstlineno, reason)


def pytest_terminal_summary(terminalreporter):
    if terminalreporter.hasopt("s"):  # `-ra` / `-rs` already printed the folded line
        return
    reasons = {reason for report in terminalreporter.stats.get("skipped", []) if (reason := _native_skip_reason(report))}
    for reason in sorted(reasons):
        terminalreporter.write_line(reason)


_native_reader_passes = 0


def pytest_runtest_setup(item):
    if "native_binary" in getattr(item, "fixturenames", ()) and NATIVE_READER not in item.user_properties:
        item.user_properties.append(NATIVE_READER)


def pytest_runtest_logreport(report):
    global _native_reader_passes
    if report.when == "call" and report.passed and NATIVE_READER in report.user_properties:
        _native_reader_passes += 1


def pytest_sessionfinish(session, exitstatus):
    if hasattr(session.config, "workerinput"):  # a pytest-xdist worker: the controller sees every report
        return
    if native_required() and exitstatus == pytest.ExitCode.OK and _native_reader_passes == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        line = "native check required (VALEN_NATIVE_REQUIRED=1) but no test ran the Rust reader (tests/native, marked slow)"
        if reporter is not None:
            reporter.write_line(line, red=True)
        else:
            print(line, file=sys.stderr)


# --- damaging an export -------------------------------------------------------------------------


def load_manifest(export: Path) -> dict:
    return json.loads((export / "valen_export.json").read_text())


def save_manifest(export: Path, manifest: dict) -> None:
    # The exporter's own formatting, so the only change is the one a test makes.
    (export / "valen_export.json").write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def rehash(export: Path, *names: str) -> None:
    """Record the current size and SHA-256 of `names` in the manifest."""
    manifest = load_manifest(export)
    for name in names:
        data = (export / name).read_bytes()
        manifest["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    save_manifest(export, manifest)


def rewrite_tensors(export: Path, file: str, change) -> None:
    """Rewrite safetensors `file` as change({name: tensor}) returns it, then re-hash it."""
    from valen_runtime.safetensors_file import SafetensorsFile, write_file  # torch: only where needed (tests/conftest.py)

    path = export / file
    tensors = dict(SafetensorsFile(path).iter_tensors())
    tensors = change(tensors)
    path.unlink()
    write_file(path, tensors, metadata={"format": "pt"})
    rehash(export, file)


def language_file_of(export: Path, name: str) -> str:
    manifest = load_manifest(export)
    lang = manifest["language"]
    if lang["index"] is None:
        return lang["files"][0]
    return json.loads((export / lang["index"]).read_text())["weight_map"][name]


def flip_byte(export: Path) -> str:
    """One byte in the middle of the vision file's data, manifest untouched: the hash check's case."""
    path = export / "vision.safetensors"
    data = bytearray(path.read_bytes())
    data[len(data) - 100] ^= 0x01
    path.write_bytes(bytes(data))
    return "vision.safetensors"


def drop_lora_b(export: Path) -> str:
    """Remove one lora_B tensor from the adapter (A stays)."""
    victim = "base_model.model.model.language_model.layers.0.mlp.down_proj.lora_B.weight"

    def change(t):
        assert victim in t
        del t[victim]
        return t

    rewrite_tensors(export, "adapter_model.safetensors", change)
    return "down_proj"


def wrong_dtype(export: Path) -> str:
    """One language tensor stored as F32 instead of BF16 (same values, same name and shape)."""
    name = "model.language_model.layers.0.mlp.up_proj.weight"
    rewrite_tensors(export, language_file_of(export, name), lambda t: {**t, name: t[name].float()})
    return "up_proj"


def rename_tensor(export: Path) -> str:
    """One language tensor under a name the table does not have; the index follows the rename."""
    old = "model.language_model.layers.0.post_attention_layernorm.weight"
    new = "model.language_model.layers.0.post_attention_norm.weight"
    file = language_file_of(export, old)

    def change(t):
        t[new] = t.pop(old)
        return t

    rewrite_tensors(export, file, change)
    manifest = load_manifest(export)
    if manifest["language"]["index"]:
        index_path = export / manifest["language"]["index"]
        index = json.loads(index_path.read_text())
        index["weight_map"][new] = index["weight_map"].pop(old)
        index["weight_map"] = dict(sorted(index["weight_map"].items()))
        index_path.write_text(json.dumps(index, indent=2) + "\n")
        rehash(export, manifest["language"]["index"])
    return "post_attention"


def unknown_format(export: Path) -> str:
    manifest = load_manifest(export)
    manifest["format"] = "valen-native/2"
    save_manifest(export, manifest)
    return "valen-native/2"


def wrong_scale(export: Path) -> str:
    """lora.scale no longer alpha / rank (a loader would apply twice the adapter)."""
    manifest = load_manifest(export)
    manifest["lora"]["scale"] = 2 * manifest["lora"]["scale"]
    save_manifest(export, manifest)
    return "scale"


def transposed_lora_a(export: Path) -> str:
    """One LoRA A stored as [in, rank] instead of [rank, in]."""
    name = "base_model.model.model.language_model.layers.0.mlp.gate_proj.lora_A.weight"  # [rank, in] with in != rank
    rewrite_tensors(export, "adapter_model.safetensors", lambda t: {**t, name: t[name].T.contiguous()})
    return "gate_proj"


def fp32_source_off(export: Path) -> str:
    """An FP32 source that no longer rounds to the shipped BF16 value."""
    name = "model.language_model.layers.0.linear_attn.A_log"
    rewrite_tensors(export, "fp32_sources.safetensors", lambda t: {**t, name: t[name] + 1.0})
    return "A_log"


def trained_blocks_off(export: Path) -> str:
    manifest = load_manifest(export)
    manifest["vision"]["trained_blocks"] = [b - 1 for b in manifest["vision"]["trained_blocks"]]
    save_manifest(export, manifest)
    return "trained_blocks"


def nan_in_head(export: Path) -> str:
    def change(t):
        w = t["decision.weight"].clone()
        w[0, 0] = float("nan")
        return {**t, "decision.weight": w}

    rewrite_tensors(export, "valen_head.safetensors", change)
    return "decision.weight"


def extra_file(export: Path) -> str:
    (export / "notes.txt").write_text("not part of the export\n")
    return "notes.txt"


def listed_extra_file(export: Path) -> str:
    """A file that is no part of the format, listed in the manifest with its correct hash."""
    (export / "notes.txt").write_text("not part of the export\n")
    rehash(export, "notes.txt")
    return "notes.txt"


def uppercase_hash(export: Path) -> str:
    manifest = load_manifest(export)
    entry = manifest["files"]["config.json"]
    entry["sha256"] = entry["sha256"].upper()
    save_manifest(export, manifest)
    return "sha256"


# name -> (damage, the LoRA mode of the export it applies to)
DAMAGES = {
    "flipped-byte": (flip_byte, "separate"),
    "missing-lora-b": (drop_lora_b, "separate"),
    "wrong-dtype": (wrong_dtype, "merged"),
    "renamed-tensor": (rename_tensor, "separate"),
    "unknown-format": (unknown_format, "merged"),
    "wrong-scale": (wrong_scale, "separate"),
    "transposed-lora-a": (transposed_lora_a, "separate"),
    "fp32-source-off": (fp32_source_off, "merged"),
    "trained-blocks-off": (trained_blocks_off, "separate"),
    "nan-in-head": (nan_in_head, "merged"),
    "extra-file": (extra_file, "separate"),
    "listed-extra-file": (listed_extra_file, "merged"),
    "uppercase-hash": (uppercase_hash, "merged"),
}


@pytest.fixture(scope="session")
def native_exports(tiny_fixture, tmp_path_factory) -> dict[str, Path]:
    """Fresh exports of the tiny fixture: separate, merged (sharded, the default) and single (no index)."""
    from valen_export.export import export

    with run_wide(tmp_path_factory, "native-exports") as (root, fill):  # built once per run, not per worker
        out = {}
        for name, mode, shard in (("separate", "separate", 2 * 1024**3), ("merged", "merged", 2 * 1024**3), ("single", "separate", 0)):
            out[name] = root / name
            if fill:
                export(tiny_fixture.checkpoint, tiny_fixture.base, out[name], lora_mode=mode, pins_path=tiny_fixture.pins, max_shard_bytes=shard, progress=False)
        return out


@pytest.fixture(scope="session")
def native_vectors(native_exports, tmp_path_factory) -> dict[str, Path]:
    from valen_export.vectors import write_vectors

    with run_wide(tmp_path_factory, "native-vectors") as (root, fill):
        out = {}
        for name, export_dir in native_exports.items():
            out[name] = root / f"{name}.json"
            if fill:
                write_vectors(export_dir, out[name])
        return out


@pytest.fixture(scope="session")
def damages() -> dict:
    return DAMAGES


@pytest.fixture()
def bounded_run():
    """`run_bounded`, for the test of how a hanging cargo ends."""
    return run_bounded
