"""`valen-parity` hygiene: an export that no longer matches its manifest is refused before anything
is compared, --requests goes through the wire contract, and the reference's temporary folder
(`valen-parity-ref-*`) is removed on every exit path: success, a usage error, SIGTERM."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from parity.cli import main


def _args(tiny_fixture, export, *extra):
    return ["--export", str(export), "--checkpoint", str(tiny_fixture.checkpoint), "--base", str(tiny_fixture.base), "--threads", "1", *extra]


def _invoke(args):
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    return result.exit_code, result.output


@pytest.fixture()
def temp_root(tmp_path, monkeypatch):
    """tempfile's directory for this test, so what the harness leaves there can be listed."""
    root = tmp_path / "tmp"
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    return root


def _leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.glob("valen-parity-ref-*"))


def test_a_damaged_export_is_refused_before_comparing(tiny_fixture, tiny_export, tmp_path, temp_root):
    damaged = tmp_path / "damaged"
    shutil.copytree(tiny_export["separate"], damaged)
    vision = damaged / "vision.safetensors"
    data = bytearray(vision.read_bytes())
    data[-3] ^= 0x40  # same size: only the hashes show it
    vision.write_bytes(bytes(data))
    t0 = time.monotonic()
    code, out = _invoke(_args(tiny_fixture, damaged, "--case", "text"))
    assert code == 2 and out.count("\n") == 1 and out.startswith("error: "), out
    assert "vision.safetensors: sha256" in out and "nothing was compared" in out
    assert time.monotonic() - t0 < 30  # refused before the reference process (tens of seconds) is started
    assert _leftovers(temp_root) == []


def test_requests_file_goes_through_the_wire_contract(tiny_fixture, tiny_export, tmp_path, temp_root):
    requests = tmp_path / "requests.jsonl"
    noul = {"model": "valen-preview-0923", "state": "x", "questions": {"n": {"type": "noul", "instructions": "?", "criteria": {"a": "b"}}}}
    requests.write_text(json.dumps(noul) + "\n")
    code, out = _invoke(_args(tiny_fixture, tiny_export["separate"], "--requests", str(requests)))
    assert code == 2 and f"{requests}:1: refused by the wire contract (questions.n.criteria: noul takes no criteria" in out
    requests.write_text('{"model": "valen-preview-0923", "state": "x", "state": "y"}\n')
    code, out = _invoke(_args(tiny_fixture, tiny_export["separate"], "--requests", str(requests)))
    assert code == 2 and f"{requests}:1: not a JSON request (body: duplicate key 'state')" in out
    with open(requests, "wb") as handle:
        handle.truncate(25 * 1024 * 1024)  # one 25 MiB line of zeros: read no further than the video body limit + 2
    code, out = _invoke(_args(tiny_fixture, tiny_export["separate"], "--requests", str(requests)))
    assert code == 2 and f"{requests}:1: longer than the 25165824-byte body limit of a request with a video" in out
    padded = json.dumps({**noul, "questions": {"n": {"type": "noul", "instructions": "?"}}})
    requests.write_text(padded[:-1] + " " * (9 * 1024 * 1024) + "}\n")  # 9 MiB without a video
    code, out = _invoke(_args(tiny_fixture, tiny_export["separate"], "--requests", str(requests)))
    assert code == 2 and f"{requests}:1: refused by the wire contract (body: body is" in out and "the limit is 8388608 for a request without a video" in out
    assert _leftovers(temp_root) == []


def test_the_reference_folder_is_removed_after_a_run_and_after_a_usage_error(tiny_fixture, tiny_export, tmp_path, temp_root):
    code, out = _invoke(_args(tiny_fixture, tiny_export["separate"], "--case", "text"))
    assert code == 0, out
    assert _leftovers(temp_root) == []
    pins = json.loads(Path(tiny_fixture.pins).read_text())
    pins["checkpoint"]["checkpoint_sha256"] = "0" * 64  # refused after the reference ran (check_pins)
    wrong = tmp_path / "pins.json"
    wrong.write_text(json.dumps(pins))
    code, out = _invoke(_args(tiny_fixture, tiny_export["separate"], "--case", "text", "--pins", str(wrong)))
    assert code == 2 and "pins expect checkpoint.pt 000" in out, out
    assert _leftovers(temp_root) == []


@pytest.mark.slow
def test_sigterm_while_the_reference_runs_removes_its_folder(tiny_fixture, tiny_export, tmp_path):
    root = tmp_path / "tmp"
    root.mkdir()
    cmd = [sys.executable, "-m", "parity.cli", *_args(tiny_fixture, tiny_export["separate"], "--case", "all")]
    proc = subprocess.Popen(cmd, env=dict(os.environ, TMPDIR=str(root)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (_leftovers(root) and list(root.glob("valen-parity-ref-*/job.json"))):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    job = next(root.glob("valen-parity-ref-*/job.json"))
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM and "Traceback" not in err, err
    assert _leftovers(root) == []
    # The reference process went with it (subprocess.run kills its child when interrupted).
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            assert str(job) not in cmdline.read_bytes().decode(errors="replace"), cmdline
        except OSError:
            pass


def test_a_reference_job_is_registered_before_its_processes_start(tiny_fixture, tmp_path, monkeypatch):
    """A signal may land after start_reference returns and before the caller stores the job: the
    job must already be in the caller's dict (`started`) by then, or its worker outlives the run.
    Here: every worker process starts only once the dict holds the job."""
    from parity import reference_run

    started, seen = {}, []

    class Recorded:
        def __init__(self, *args, **kwargs):
            seen.append(dict(started))

        def poll(self):
            return 0

        def wait(self, timeout=None):
            return 0

    monkeypatch.setattr(reference_run.subprocess, "Popen", Recorded)
    request = ("text/0", {"model": "valen-preview-0923", "state": "x", "questions": {"q": {"type": "noul", "instructions": "Ok?"}}})
    job = reference_run.start_reference(tiny_fixture.checkpoint, tiny_fixture.base, [request, request], dtype="fp32",
                                        workdir=tmp_path, shards=2, started=started)
    assert started == {"fp32": job} and len(seen) == 2 and all(s == {"fp32": job} for s in seen)
    job.remove_temporary()
