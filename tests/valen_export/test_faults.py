"""Faults during an export, with real processes and real timing (no hooks in the exporter):
SIGKILL at several moments, a full disk (RLIMIT_FSIZE in the child, SIGXFSZ ignored, so write()
fails with EFBIG), two exports racing for one OUT, Ctrl-C (SIGINT), SIGTERM and SIGHUP.

The invariant everywhere: OUT is absent (or, if it existed empty, untouched) unless an export
completed; a killed export's `.OUT.partial-PID` is removed by the next export into the same
parent, and that export succeeds and verifies.

The subprocess tests use a "medium" fixture (tiny layout, hidden size 512: a 27 MB language shard)
so that the write phase lasts a second or two and each moment can be hit by polling.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import pytest

from valen_export.errors import ExportError
from valen_export.export import export
from valen_export.verify import verify_export

VENV_BIN = Path(sys.executable).parent
LANG = "model-00001-of-00001.safetensors"


@pytest.fixture(scope="module")
def medium_fixture(tmp_path_factory):
    from valen_export import fixture as fx

    with mock.patch.dict(fx.TINY_TEXT, {"hidden_size": 512, "intermediate_size": 2048}), mock.patch.dict(fx.TINY_VISION, {"out_hidden_size": 512}):
        return fx.build_fixture(tmp_path_factory.mktemp("medium") / "fx", preset="tiny", seed=3)


def export_cmd(fx, out) -> list:
    return [VENV_BIN / "valen-export", "--checkpoint", fx.checkpoint, "--base", fx.base, "--pins", fx.pins, "--out", out, "--no-progress"]


def start(fx, out, **kw) -> subprocess.Popen:
    return subprocess.Popen(export_cmd(fx, out), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def partials(out: Path) -> list[Path]:
    return sorted(out.parent.glob(f".{out.name}.partial-*"))


def wait_until(proc: subprocess.Popen, predicate, timeout: float = 120.0) -> bool:
    """Poll (1 ms) until predicate() holds; False if the process ended first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.001)
    raise TimeoutError("moment never reached")


def mid_file(partial: Path, name: str) -> bool:
    """`name` exists in the partial directory, its header is written and its data is not complete."""
    p = partial / name
    try:
        with open(p, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                return False
            (n,) = struct.unpack("<Q", raw)
            header = json.loads(f.read(n))
        size = p.stat().st_size
    except (OSError, ValueError):
        return False
    final = 8 + n + max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
    return 8 + n < size < final


def own_partial(out: Path, proc: subprocess.Popen) -> Path:
    """The partial directory of the export running as `proc` (atomic.py names it by PID)."""
    return out.parent / f".{out.name}.partial-{proc.pid}"


def assert_clean_rerun(fx, out: Path) -> None:
    m = export(fx.checkpoint, fx.base, out, pins_path=fx.pins, progress=False)
    assert m["format"] == "valen-native/1"
    assert partials(out) == [], "the rerun must remove stale partial directories of dead exports"
    assert verify_export(out, rehash=False) == []


# -- in-process: stale partial handling (fast) -------------------------------------------------


def test_stale_partials_of_dead_pids_are_removed_live_ones_kept(tiny_fixture, tmp_path):
    out = tmp_path / "out"
    dead = tmp_path / ".out.partial-999999999"  # above pid_max: certainly not running
    dead.mkdir()
    (dead / LANG).write_bytes(b"half a shard")
    live = tmp_path / f".out.partial-{os.getppid()}"  # a running process (our parent) owns this one
    live.mkdir()
    export(tiny_fixture.checkpoint, tiny_fixture.base, out, pins_path=tiny_fixture.pins, progress=False)
    assert not dead.exists() and live.exists()
    assert verify_export(out) == []


def test_refused_export_creates_nothing(tiny_fixture, tmp_path):
    out = tmp_path / "out"
    pins = json.loads(tiny_fixture.pins.read_text())
    pins["checkpoint"]["checkpoint_sha256"] = "0" * 64
    (tmp_path / "pins.json").write_text(json.dumps(pins))
    with pytest.raises(ExportError):
        export(tiny_fixture.checkpoint, tiny_fixture.base, out, pins_path=tmp_path / "pins.json", progress=False)
    assert not out.exists() and partials(out) == []


# -- subprocesses: kills, full disk, races, signals (slow) --------------------------------------


@pytest.mark.slow
def test_sigkill_at_several_moments_then_rerun(medium_fixture, tmp_path):
    out = tmp_path / "out"
    # Each predicate looks at the running export's own partial directory: a stale one left by the
    # previous kill (removed only once the new export gets going) must not count as reached.
    moments = {
        "while starting (imports, hashing)": None,  # killed after a fixed delay instead
        "partial directory created": lambda own: own.is_dir(),
        "mid-tensor in the language shard": lambda own: mid_file(own, LANG),
        "language shard complete, adapter being written": lambda own: (own / "adapter_model.safetensors").exists(),
        "last tensor file being written": lambda own: (own / "valen_head.safetensors").exists(),
    }
    observed = {}
    for moment, predicate in moments.items():
        proc = start(medium_fixture, out)
        own = own_partial(out, proc)
        if predicate is None:
            time.sleep(0.5)
            reached = proc.poll() is None
        else:
            reached = wait_until(proc, lambda: predicate(own))
        snapshot = sorted(p.name for p in own.iterdir()) if reached and own.is_dir() else []
        proc.kill()
        proc.wait()
        assert reached, f"{moment}: the export finished before the moment was reached"
        assert not out.exists(), f"{moment}: OUT appeared"
        observed[moment] = (snapshot, [p.name for p in partials(out)])
        if predicate is not None:
            assert own.is_dir(), f"{moment}: expected the killed export's partial directory {own.name}, got {partials(out)}"
    assert_clean_rerun(medium_fixture, out)
    print(json.dumps(observed, indent=1))


@pytest.mark.slow
def test_full_disk_efbig_fails_cleanly_and_leaves_out_untouched(medium_fixture, tmp_path):
    out = tmp_path / "out"
    out.mkdir()  # an existing empty OUT must stay exactly that

    def limit_file_size():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() then fails with EFBIG instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (4 * 2**20, 4 * 2**20))

    r = subprocess.run(export_cmd(medium_fixture, out), capture_output=True, text=True, preexec_fn=limit_file_size, timeout=300)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, r.stderr
    assert LANG in errors[0] and "file size limit exceeded (EFBIG)" in errors[0] and "partial export was removed" in errors[0]
    assert out.is_dir() and list(out.iterdir()) == []
    assert partials(out) == []
    assert_clean_rerun(medium_fixture, out)


@pytest.mark.slow
def test_two_exports_racing_for_one_out(medium_fixture, tmp_path):
    out = tmp_path / "out"
    procs = [start(medium_fixture, out) for _ in range(2)]
    results = [(p.wait(timeout=300), p.stdout.read(), p.stderr.read()) for p in procs]
    codes = sorted(rc for rc, _, _ in results)
    assert codes == [0, 2], results
    loser = next(err for rc, _, err in results if rc == 2)
    errors = [ln for ln in loser.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in loser
    assert "another export may have won the race" in errors[0] or "already exists and is not an empty directory" in errors[0]
    print(errors[0])
    assert partials(out) == []
    assert verify_export(out) == []


@pytest.mark.slow
@pytest.mark.parametrize("sig,expected_rc", [(signal.SIGINT, 1), (signal.SIGTERM, 128 + signal.SIGTERM), (signal.SIGHUP, 128 + signal.SIGHUP)],
                         ids=["SIGINT", "SIGTERM", "SIGHUP"])
def test_interrupt_removes_the_temporary_directory(medium_fixture, tmp_path, sig, expected_rc):
    out = tmp_path / "out"
    # A closed terminal sends SIGHUP to a process with the default action (nohup'd test runs ignore it).
    # pytest-xdist's workers ignore SIGINT, and an ignored signal stays ignored across exec: both at
    # their default, as in a terminal.
    proc = start(medium_fixture, out, preexec_fn=lambda: [signal.signal(s, signal.SIG_DFL) for s in (signal.SIGHUP, signal.SIGINT)])
    assert wait_until(proc, lambda: mid_file(own_partial(out, proc), LANG)), "finished before the interrupt"
    proc.send_signal(sig)
    rc = proc.wait(timeout=60)
    err = proc.stderr.read()
    assert rc == expected_rc, err
    assert "Traceback" not in err
    if sig == signal.SIGINT:
        assert "Aborted!" in err  # click's answer to KeyboardInterrupt
    assert not out.exists()
    assert partials(out) == [], "the interrupted export must remove its own partial directory"
