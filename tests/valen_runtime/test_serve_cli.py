"""valen-serve's process (serve/cli.py): its log is one JSON object per line on stderr, library
warnings included; a stop signal at any moment of its life ends it with exit 0 and a `stopped` line.

Logging is configured in a child process: it changes the root logger of the process it runs in.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from valen_runtime.serve.cli import _StopSignals

SCRIPT = """
import logging, warnings
from valen_runtime.serve.cli import _configure_logging, log
_configure_logging()
warnings.warn("a library's odd-input warning", UserWarning)
log.info({"event": "after"})
logging.getLogger("some.library").warning("plain %s", "text")
"""


def test_a_library_warning_becomes_one_json_line_of_the_warnings_logger():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    entries = [json.loads(line) for line in done.stderr.splitlines()]  # raises on any raw text line
    assert all(isinstance(entry, dict) for entry in entries)
    warning = [entry for entry in entries if entry.get("logger") == "py.warnings"]
    assert len(warning) == 1 and "a library's odd-input warning" in warning[0]["message"] and warning[0]["level"] == "warning"
    assert {"event": "after"}.items() <= next(entry for entry in entries if entry.get("event")).items()
    assert any(entry.get("logger") == "some.library" and entry["message"] == "plain text" for entry in entries)


def test_a_stop_signal_once_the_server_exists_asks_it_to_drain():
    class Server:
        calls = []

        def handle_exit(self, signum, frame):
            self.calls.append(signum)

    handler = _StopSignals()
    handler.server = Server()
    handler(signal.SIGTERM, None)  # with a server: never the immediate exit of the starting phase
    assert Server.calls == [signal.SIGTERM]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_stop_signal_right_at_the_ready_line_drains_and_exits_0(tiny_export, signum):
    """The signal arrives as the ready line is read, before uvicorn has installed its own handlers:
    the worker still stops gracefully (exit 0, a `stopped` line), not by the signal's default action."""
    cmd = [sys.executable, "-m", "valen_runtime.serve", "--export", str(tiny_export["separate"]), "--port", "0", "--device", "cpu"]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stderr:
            if json.loads(line).get("event") == "ready":
                proc.send_signal(signum)
                break
        rest = proc.stderr.read()
        assert proc.wait(timeout=60) == 0, rest
    finally:
        if proc.poll() is None:
            proc.kill()
    stopped = [json.loads(line) for line in rest.splitlines() if '"stopped"' in line]
    assert len(stopped) == 1 and stopped[0]["reason"] == "signal" and "Traceback" not in rest, rest
