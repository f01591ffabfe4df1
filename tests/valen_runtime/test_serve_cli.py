"""valen-serve's process (serve/cli.py): its log is one JSON object per line on stderr, library
warnings included; a stop signal at any moment of its life ends it with exit 0 and a `stopped` line.

Logging is configured in a child process: it changes the root logger of the process it runs in.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys

import pytest

from valen_runtime.errors import ValenError
from valen_runtime.serve.cli import _error_line, _StopSignals

from .conftest import rest_of_stderr, start_serve

SCRIPT = """
import logging, warnings
import torch
from valen_runtime.serve.cli import _configure_logging, _torch_logs_as_json_lines, log
_configure_logging()
_torch_logs_as_json_lines()  # as the executor does once torch is imported
warnings.warn("a library's odd-input warning", UserWarning)
log.info({"event": "after"})
logging.getLogger("some.library").warning("plain %s", "text")
logging.getLogger("torch.utils.cpp_extension").warning("No CUDA runtime is found")
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
    assert any(entry.get("logger") == "torch.utils.cpp_extension" for entry in entries)  # torch's own handler is plain text


def test_a_stop_signal_once_the_executor_is_warm_asks_the_server_to_drain():
    class Server:  # uvicorn.Server's part the handler uses
        calls = []
        should_exit = False

        def handle_exit(self, signum, frame):
            self.calls.append(signum)
            self.should_exit = True

    class Executor:
        ready = concurrent.futures.Future()

    Executor.ready.set_result(None)
    handler = _StopSignals()
    handler.server, handler.executor = Server(), Executor()
    handler(signal.SIGTERM, None)  # warm: never the immediate exit of the starting phase
    assert Server.calls == [signal.SIGTERM]
    handler(signal.SIGINT, None)  # draining already: uvicorn would force the exit, so it never sees this one
    assert Server.calls == [signal.SIGTERM]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_stop_signal_right_at_the_ready_line_drains_and_exits_0(tiny_export, signum):
    """The signal arrives as the ready line is read, before uvicorn has installed its own handlers:
    the worker still stops gracefully (exit 0, a `stopped` line), not by the signal's default action."""
    proc = start_serve("--export", str(tiny_export["separate"]), "--port", "0", "--device", "cpu")
    try:
        for line in proc.stderr:
            if json.loads(line).get("event") == "ready":
                proc.send_signal(signum)
                break
        rest = rest_of_stderr(proc)
        assert proc.returncode == 0, rest
    finally:
        if proc.poll() is None:
            proc.kill()
    stopped = [json.loads(line) for line in rest.splitlines() if '"stopped"' in line]
    assert len(stopped) == 1 and stopped[0]["reason"] == "signal" and "Traceback" not in rest, rest


def test_a_failure_while_loading_or_warming_up_is_one_line():
    assert _error_line(ValenError("valen_head.safetensors: sha256 mismatch")) == "error: valen_head.safetensors: sha256 mismatch"
    assert _error_line(RuntimeError("CUDA out of memory.\nTried to allocate 2 GiB")) == \
        "error: loading or warming up failed: RuntimeError: CUDA out of memory."


# ---------------------------------------------------------------- --compile-cache


def test_the_compile_cache_directory_comes_from_the_option_the_environment_or_xdg(monkeypatch, tmp_path):
    from valen_runtime import compile_cache

    monkeypatch.delenv(compile_cache.ENV_VAR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.resolve_dir(None) == tmp_path / "xdg" / "valen" / "compile"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert compile_cache.resolve_dir(None) == tmp_path / "home" / ".cache" / "valen" / "compile"
    monkeypatch.setenv(compile_cache.ENV_VAR, str(tmp_path / "env"))
    assert compile_cache.resolve_dir(None) == tmp_path / "env"
    assert compile_cache.resolve_dir(str(tmp_path / "option")) == tmp_path / "option"  # the option wins
    monkeypatch.setenv(compile_cache.ENV_VAR, "none")
    assert compile_cache.resolve_dir(None) is None and compile_cache.resolve_dir("None") is None
    assert compile_cache.use(None) == {"dir": None}  # 'none': torch's own defaults, nothing set
    from valen_runtime.options import EngineOptions

    assert not compile_cache.compiles(EngineOptions(device="cpu"))  # nothing compiled: the directory is left alone
    assert compile_cache.compiles(EngineOptions(device="cpu", dtype="fp32", mode="shared-prefix", kernels="fast", compile=True))


def test_an_unwritable_compile_cache_is_one_line_and_exit_2_before_loading(tiny_export, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    cmd = [sys.executable, "-m", "valen_runtime.serve", "--export", str(tiny_export["separate"]), "--port", "0", "--device", "cpu",
           "--dtype", "fp32", "--mode", "shared-prefix", "--kernels", "fast", "--compile", "--compile-cache", str(blocker / "cache")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr and '"loading"' not in done.stderr, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"error: --compile-cache {blocker / 'cache'}: cannot write there"), line


COMPILE_IN_A_FRESH_PROCESS = """
import json, sys
from pathlib import Path
from valen_runtime import compile_cache
reported = compile_cache.use(Path(sys.argv[1]))  # before torch, as the command lines call it
import torch
double_sine = torch.compile(lambda x: torch.sin(x) * 2 + 1, fullgraph=True)
double_sine(torch.arange(8.0))
print(json.dumps({**reported, **compile_cache.counters()}))
"""


@pytest.mark.inductor
def test_a_second_process_loads_the_first_ones_compiled_graph_from_the_compile_cache(tmp_path):
    """torch.compile on the CPU (inductor C++) in two fresh processes pointed at one --compile-cache
    directory: the first compiles and fills DIR/inductor, the second gets an FX graph cache hit.
    (valen-serve and valen-run call compile_cache.use with the option's directory; on the H200 a
    restarted worker's ready line counted 17 hits and no miss, docs/benchmarks.md.)"""
    cache = tmp_path / "compile-cache"
    env = {key: value for key, value in os.environ.items() if not key.startswith(("TORCHINDUCTOR_", "TRITON_"))}
    # Scalar C++ compiled in the process: the SIMD probes and the compile pool (seconds of CPU per
    # fresh process and cache) are not what this test is about; the cache's wiring is.
    env.update(TORCHINDUCTOR_VEC_ISA_OK="0", TORCHINDUCTOR_COMPILE_THREADS="1")

    def compile_once() -> dict:
        done = subprocess.run([sys.executable, "-c", COMPILE_IN_A_FRESH_PROCESS, str(cache)], capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.splitlines()[-1])

    first = compile_once()
    assert first["dir"] == str(cache) and first["fx_graph_misses"] == 1 and first["fx_graph_hits"] == 0, first
    assert any((cache / "inductor").iterdir())
    second = compile_once()
    assert second["fx_graph_hits"] == 1 and second["fx_graph_misses"] == 0, second


def test_the_serve_command_checks_its_options_before_importing_torch():
    # An option error is answered in a fraction of a second; torch (2 s to import) comes with loading.
    script = "import sys; import valen_runtime.serve.cli; print(sorted(m for m in ('torch', 'transformers', 'av') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[]", (done.stdout, done.stderr[-1000:])
