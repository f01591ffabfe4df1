"""SIGTERM / SIGHUP for the harness's front doors: unwind, but never inside a critical section.

`valen-parity` and the gate start reference worker processes and temporary folders. On SIGTERM or
SIGHUP they must stop and wait for every worker and remove every folder before exiting, so no child
outlives them. Two pieces make that hold:

- `unwinding_on_signals()` turns SIGTERM / SIGHUP into `SystemExit(128 + signal)` raised in the main
  thread, so `finally` blocks run (stop the workers, remove the folders).
- `critical()` marks a few lines that must not be cut in half (create a folder or a process *and*
  record it where the cleanup finds it). A signal that lands inside is remembered and raised when
  the outermost section ends.

Why not block the signals with `pthread_sigmask`: that masks only the calling thread. A
process-directed signal is then delivered to any other thread (torch's and tokenizers' pools),
whose C handler still schedules the Python handler, which runs in the main thread at its next
bytecode: inside the section. Python handlers always run in the main thread, so a flag that only
the main thread reads and writes is exact.
"""

from __future__ import annotations

import contextlib
import signal
import threading

UNWOUND = (signal.SIGTERM, signal.SIGHUP)

_depth = 0  # nesting of critical() in the main thread
_pending: int | None = None  # a signal that landed inside a critical section


def _raise_or_defer(signum, frame):
    global _pending
    if _depth > 0:
        if _pending is None:
            _pending = signum
        return
    raise SystemExit(128 + signum)


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def unwinding_on_signals():
    """SIGTERM and SIGHUP raise SystemExit(128 + signal) in the main thread while inside (only
    where they still have their default action: a caller's own handler is left alone); the
    previous handlers come back afterwards. Elsewhere than the main thread this does nothing."""
    global _pending
    taken = [sig for sig in UNWOUND if signal.getsignal(sig) is signal.SIG_DFL] if _main_thread() else []
    for sig in taken:
        signal.signal(sig, _raise_or_defer)
    try:
        yield
    finally:
        for sig in taken:
            signal.signal(sig, signal.SIG_DFL)
        _pending = None


@contextlib.contextmanager
def critical():
    """Defer SIGTERM / SIGHUP until the block ends; the block then exits with SystemExit(128 + signal)
    (in place of an exception of its own: either way the caller unwinds). Nestable; a no-op outside
    the main thread."""
    global _depth, _pending
    if not _main_thread():
        yield
        return
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0 and _pending is not None:
            signum, _pending = _pending, None
            raise SystemExit(128 + signum)
