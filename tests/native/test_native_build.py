"""How native/ builds: the usual way from crates.io with the committed Cargo.lock, or offline from
Debian's packaged crates as an explicit opt-in (native/offline/), and what the checks do when
neither is possible (native/README.md, "Build").
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NATIVE = REPO / "native"
LOCK = NATIVE / "Cargo.lock"
DEBIAN_OPT_IN = NATIVE / "offline" / "debian.toml"
PREPARE = NATIVE / "offline" / "debian_crates.py"
CRATES_IO = "registry+https://github.com/rust-lang/crates.io-index"
DEBIAN_CRATES = Path(os.environ.get("VALEN_DEBIAN_CRATES") or "/usr/share/cargo/registry")
CARGO_TIMEOUT_S = 120  # resolution only, no download, no build


def lock_packages() -> list[dict]:
    return tomllib.loads(LOCK.read_text(encoding="utf-8"))["package"]


def manifest() -> dict:
    return tomllib.loads((NATIVE / "Cargo.toml").read_text(encoding="utf-8"))


# --- the committed lock file is one cargo accepts with the normal registry ------------------------


def test_lock_packages_come_from_crates_io_with_their_checksums():
    root = manifest()["package"]["name"]
    packages = lock_packages()
    assert [p["name"] for p in packages if "source" not in p] == [root]
    for p in packages:
        if p["name"] == root:
            assert "checksum" not in p
            continue
        assert p.get("source") == CRATES_IO, p
        assert re.fullmatch(r"[0-9a-f]{64}", p.get("checksum", "")), p
    ids = [(p["name"], p["version"]) for p in packages]
    assert len(ids) == len(set(ids))


def test_lock_pins_the_versions_cargo_toml_asks_for():
    # Cargo.toml asks for what Debian 12 packages, so both ways build the same sources.
    locked = {p["name"]: p["version"] for p in lock_packages()}
    for name, spec in manifest()["dependencies"].items():
        wanted = spec if isinstance(spec, str) else spec["version"]
        assert locked.get(name) == wanted, f"{name}: Cargo.toml asks for {wanted}, Cargo.lock has {locked.get(name)}"


def test_lock_lists_exactly_the_packages_the_crate_reaches():
    packages = {p["name"]: p for p in lock_packages()}
    reached, todo = set(), [manifest()["package"]["name"]]
    while todo:
        name = todo.pop()
        if name in reached:
            continue
        reached.add(name)
        for dep in packages[name].get("dependencies", []):
            assert dep in packages, f"{name} depends on {dep}, which Cargo.lock does not list"
            todo.append(dep)
    assert reached == set(packages)


# --- without the opt-in, nothing points cargo at Debian's crates -----------------------------------


def test_no_cargo_config_in_the_repository():
    # Cargo reads .cargo/config.toml from the working directory upwards: one here would apply to
    # every build from the checkout.
    for directory in (REPO, NATIVE):
        for name in ("config", "config.toml"):
            assert not (directory / ".cargo" / name).exists(), directory / ".cargo" / name


def offline_metadata(cargo: str, cwd: Path, cargo_home: Path, *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, CARGO_HOME=str(cargo_home), PATH=f"{Path(cargo).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    return subprocess.run(
        [cargo, "metadata", "--offline", "--locked", "--format-version", "1", "--manifest-path", str(NATIVE / "Cargo.toml"), *extra],
        capture_output=True, text=True, timeout=CARGO_TIMEOUT_S, env=env, cwd=cwd,
    )


@pytest.mark.parametrize("cwd", ["root", "native"])
def test_without_the_opt_in_cargo_resolves_from_crates_io(cargo, tmp_path, cwd):
    # An empty CARGO_HOME: no user configuration, no downloaded crates. Offline, the only possible
    # failure is crates.io's index not being at hand; a directory source must not come into it.
    result = offline_metadata(cargo, REPO if cwd == "root" else NATIVE, tmp_path / "cargo-home")
    assert result.returncode != 0, "resolved offline with an empty CARGO_HOME: some configuration replaced crates.io"
    assert "crates.io index" in result.stderr, result.stderr
    assert "directory source" not in result.stderr, result.stderr


def test_opt_in_resolves_offline_from_debian_crates_with_the_committed_lock(cargo, tmp_path, build_lock):
    if not DEBIAN_CRATES.is_dir():
        pytest.skip(f"offline opt-in not tested: Debian's crates are not installed ({DEBIAN_CRATES}; `make native-deps`)")
    prepared = subprocess.run([sys.executable, str(PREPARE), "--from", str(DEBIAN_CRATES)], capture_output=True, text=True, timeout=CARGO_TIMEOUT_S)
    assert prepared.returncode == 0, prepared.stderr
    before = LOCK.read_bytes()
    result = offline_metadata(cargo, tmp_path, tmp_path / "cargo-home", "--config", str(DEBIAN_OPT_IN))
    assert result.returncode == 0, result.stderr
    assert LOCK.read_bytes() == before
    resolved = {(p["name"], p["version"]) for p in json.loads(result.stdout)["packages"]}
    assert resolved == {(p["name"], p["version"]) for p in lock_packages()}


# --- native/offline/debian_crates.py ---------------------------------------------------------------

PLACEHOLDER = "Could not get crate checksum"  # what Debian records when it had no .crate file


def fake_lock(path: Path, crates: dict[str, str]) -> Path:
    """A lock file naming `crates` ({"name-version": checksum}) from crates.io, beside a root package."""
    text = 'version = 4\n\n[[package]]\nname = "root"\nversion = "0.1.0"\n'
    for crate, checksum in crates.items():
        name, version = crate.rsplit("-", 1)
        text += f'\n[[package]]\nname = "{name}"\nversion = "{version}"\nsource = "{CRATES_IO}"\nchecksum = "{checksum}"\n'
    path.write_text(text)
    return path


def fake_debian_crate(registry: Path, crate: str, package_checksum: str, files: dict | None = None) -> None:
    (registry / crate / "src").mkdir(parents=True)
    (registry / crate / "src" / "lib.rs").write_text("// a crate\n")
    (registry / crate / ".cargo-checksum.json").write_text(json.dumps({"package": package_checksum, "files": files or {}}))


def prepare(registry: Path, out: Path, lock: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(PREPARE), "--from", str(registry), "--out", str(out), "--lock", str(lock)],
        capture_output=True, text=True, timeout=60,
    )


def test_prepare_copies_the_locked_crates_and_fills_in_missing_checksums(tmp_path):
    registry, out = tmp_path / "registry", tmp_path / "out"
    fake_debian_crate(registry, "cfg-if-1.0.0", PLACEHOLDER)
    fake_debian_crate(registry, "half-1.6.0", "b" * 64, files={"src/lib.rs": "c" * 64})
    fake_debian_crate(registry, "unlocked-2.0.0", "d" * 64)
    lock = fake_lock(tmp_path / "Cargo.lock", {"cfg-if-1.0.0": "a" * 64, "half-1.6.0": "b" * 64})
    result = prepare(registry, out, lock)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["cfg-if-1.0.0", "half-1.6.0"]
    assert json.loads((out / "cfg-if-1.0.0" / ".cargo-checksum.json").read_text()) == {"package": "a" * 64, "files": {}}
    assert json.loads((out / "half-1.6.0" / ".cargo-checksum.json").read_text()) == {"package": "b" * 64, "files": {"src/lib.rs": "c" * 64}}
    assert (out / "half-1.6.0" / "src" / "lib.rs").read_text() == "// a crate\n"
    assert json.loads((registry / "cfg-if-1.0.0" / ".cargo-checksum.json").read_text())["package"] == PLACEHOLDER  # source untouched


def test_prepare_refuses_a_checksum_debian_records_differently(tmp_path):
    registry, out = tmp_path / "registry", tmp_path / "out"
    fake_debian_crate(registry, "cfg-if-1.0.0", PLACEHOLDER)
    fake_debian_crate(registry, "half-1.6.0", "e" * 64)
    lock = fake_lock(tmp_path / "Cargo.lock", {"cfg-if-1.0.0": "a" * 64, "half-1.6.0": "b" * 64})
    result = prepare(registry, out, lock)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "half-1.6.0" in lines[0] and "e" * 64 in lines[0] and "b" * 64 in lines[0], result.stderr
    assert "Traceback" not in result.stderr
    assert not out.exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []


@pytest.mark.parametrize("problem", ["missing-crate", "lock-placeholder", "no-registry"])
def test_prepare_names_what_is_missing_and_writes_nothing(tmp_path, problem):
    registry, out = tmp_path / "registry", tmp_path / "out"
    out.mkdir()
    (out / "earlier").mkdir()  # an earlier copy stays as it was
    fake_debian_crate(registry, "cfg-if-1.0.0", PLACEHOLDER)
    crates = {"cfg-if-1.0.0": "a" * 64}
    if problem == "missing-crate":
        crates["typenum-1.16.0"] = "f" * 64
    elif problem == "lock-placeholder":
        crates["cfg-if-1.0.0"] = PLACEHOLDER
    result = prepare(registry if problem != "no-registry" else tmp_path / "absent", out, fake_lock(tmp_path / "Cargo.lock", crates))
    assert result.returncode == 1
    expected = {"missing-crate": "typenum-1.16.0", "lock-placeholder": "cfg-if 1.0.0", "no-registry": "absent"}[problem]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], result.stderr
    assert [p.name for p in out.iterdir()] == ["earlier"]


# --- what `make test` says when the Rust reader cannot be built, and what CI makes of it ----------


def run_native_tests(tmp_path: Path, env_changes: dict[str, str | None], *selection: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), HYPOTHESIS_PROFILE="ci")
    for key in ("VALEN_NATIVE_REQUIRED", "VALEN_CARGO", "VALEN_DEBIAN_CRATES"):
        env.pop(key, None)
    for key, value in env_changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *selection],
        capture_output=True, text=True, timeout=600, env=env, cwd=REPO,
    )


# Every Rust reader test (several test functions, so the one line must fold their skips); each
# asks for native_binary first, so without it nothing else is built.
READER_TESTS = ("tests/native/test_native_check.py", "-m", "slow")


@pytest.mark.slow
@pytest.mark.parametrize("report", ["-ra", "-rN"])  # pyproject.toml's -ra prints it; with -rN, the conftest
def test_without_cargo_the_native_tests_skip_with_one_line(tmp_path, report):
    result = run_native_tests(tmp_path, {"VALEN_CARGO": ""}, *READER_TESTS, report)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [line for line in result.stdout.splitlines() if "native check not run" in line]
    assert len(lines) == 1 and "cargo not found" in lines[0], result.stdout


@pytest.mark.slow
def test_without_cargo_a_required_native_check_fails(tmp_path):
    result = run_native_tests(tmp_path, {"VALEN_CARGO": "", "VALEN_NATIVE_REQUIRED": "1"}, *READER_TESTS)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "native check required (VALEN_NATIVE_REQUIRED=1) but cargo not found" in result.stdout


@pytest.mark.slow
def test_without_any_crates_the_native_tests_skip_with_one_line(cargo, tmp_path):
    # No Debian crates and crates.io unreachable: an empty CARGO_HOME and a proxy nobody listens on.
    unreachable = {
        "VALEN_CARGO": cargo, "VALEN_DEBIAN_CRATES": str(tmp_path / "no-debian-crates"),
        "CARGO_HOME": str(tmp_path / "cargo-home"), "CARGO_HTTP_PROXY": "http://127.0.0.1:9", "CARGO_NET_RETRY": "0",
    }
    result = run_native_tests(tmp_path, unreachable, *READER_TESTS)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [line for line in result.stdout.splitlines() if "native check not run" in line]
    assert len(lines) == 1 and "no crates" in lines[0] and "make native-deps" in lines[0], result.stdout
    required = run_native_tests(tmp_path, {**unreachable, "VALEN_NATIVE_REQUIRED": "1"}, *READER_TESTS)
    assert required.returncode == 1, required.stdout + required.stderr


@pytest.mark.slow
def test_a_required_native_check_fails_when_no_native_reader_test_ran(tmp_path):
    # As when `make test` deselects tests/native's slow tests: CI must not pass without the reader.
    selection = ("tests/native/test_native_build.py", "-k", "lock_pins")
    assert run_native_tests(tmp_path, {}, *selection).returncode == 0
    result = run_native_tests(tmp_path, {"VALEN_NATIVE_REQUIRED": "1"}, *selection)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "no test ran the Rust reader" in result.stdout


@pytest.mark.parametrize("outcome", [pytest.skip, pytest.fail], ids=["skip", "fail"])
def test_a_hanging_cargo_ends_in_one_line_not_a_traceback(outcome, bounded_run):
    """A registry that never answers or a stuck build: the conftest's bounded run turns the
    timeout into the caller's skip (no crates) or failure (the build), naming what hung."""
    expected = pytest.skip.Exception if outcome is pytest.skip else pytest.fail.Exception
    with pytest.raises(expected, match=r"`cargo fetch` did not finish within 0.2 s"):
        bounded_run([sys.executable, "-c", "import time; time.sleep(30)"], "`cargo fetch`", outcome, timeout=0.2)
