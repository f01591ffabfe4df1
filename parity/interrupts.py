"""SIGTERM / SIGHUP / SIGINT for the harness's front doors: unwind, but never inside a critical section.

`valen-parity` and the gate start reference worker processes and temporary folders. On a stop
signal they must stop and wait for every worker and remove every folder before exiting, so no
child outlives them. Three pieces make that hold:

- `unwinding_on_signals(cleanup)` turns SIGTERM / SIGHUP into `SystemExit(128 + signal)` and SIGINT
  into KeyboardInterrupt, raised in the main thread, so `finally` blocks run (stop the workers,
  remove the folders). Only the first signal is raised: one that lands while the process already
  unwinds is dropped, so it cannot cut a cleanup short. On the way out it runs `cleanup` (the
  backstop for a cleanup that a signal pre-empted, e.g. one landing as an ordinary exception
  unwinds into a `finally`).
- `critical()` marks a few lines that must not be cut in half (create a folder or a process *and*
  record it where the cleanup finds it). A signal that lands inside is remembered and raised when
  the outermost section ends.

Why not block the signals with `pthread_sigmask`: that masks only the calling thread. A
process-directed signal is then delivered to any other thread (torch's and tokenizers' pools),
whose C handler still schedules the Python handler, which runs in the main thread at its next
bytecode: inside the section. Python handlers always run in the main thread, so flags that only
the main thread reads and writes are exact.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable

_depth = 0  # nesting of critical() in the main thread
_pending: int | None = None  # a signal that landed inside a critical section
_unwinding = False  # a signal has been raised: later ones are dropped


def _exit_for(signum: int) -> BaseException:
    return KeyboardInterrupt() if signum == signal.SIGINT else SystemExit(128 + signum)


def _raise_or_defer(signum, frame):
    global _pending, _unwinding
    if _unwinding:
        return
    if _depth > 0:
        if _pending is None:
            _pending = signum
        return
    _unwinding = True
    raise _exit_for(signum)


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _default_action(sig: int) -> bool:
    handler = signal.getsignal(sig)
    return handler is (signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)


@contextlib.contextmanager
def unwinding_on_signals(cleanup: Callable[[], None] | None = None):
    """SIGTERM, SIGHUP and SIGINT unwind the main thread while inside (only those still at their
    default action: a caller's own handler, or nohup's ignored SIGHUP, is left alone); `cleanup`
    runs on the way out, whatever happened; the previous handlers come back afterwards. Elsewhere
    than the main thread only `cleanup` applies."""
    global _pending, _unwinding
    taken = [sig for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT) if _default_action(sig)] if _main_thread() else []
    previous = {sig: signal.getsignal(sig) for sig in taken}
    for sig in taken:
        signal.signal(sig, _raise_or_defer)
    try:
        yield
    finally:
        try:
            if cleanup is not None:
                with critical():
                    cleanup()
        finally:
            for sig in taken:
                signal.signal(sig, previous[sig])
            if taken:
                _pending, _unwinding = None, False


@contextlib.contextmanager
def critical():
    """Defer stop signals until the block ends; the block then exits with the signal's exception
    (in place of an exception of its own: either way the caller unwinds), unless the process is
    already unwinding from an earlier one. Nestable; a no-op outside the main thread."""
    global _depth, _pending, _unwinding
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
            if not _unwinding:
                _unwinding = True
                raise _exit_for(signum)
