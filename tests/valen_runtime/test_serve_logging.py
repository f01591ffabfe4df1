"""valen-serve's log (serve/cli.py): one JSON object per line on stderr, library warnings included.

Runs in a child process: configuring logging changes the root logger of the process it runs in.
"""

from __future__ import annotations

import json
import subprocess
import sys

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
