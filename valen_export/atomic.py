"""Write a directory so that it appears complete or not at all (used by valen-export and valen-fetch).

The work happens in `.OUT.partial-PID` beside OUT; `commit()` fsyncs it and renames it onto OUT,
which succeeds only onto a missing or empty directory, so two runs racing for OUT cannot both
win. Any exception (SIGTERM, SIGHUP and Ctrl-C included) removes the partial directory; a SIGKILL leaves
it behind, and the next run into the same parent removes it once its pid is gone. A failed write
becomes one line naming the file that was being written (`current`).
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import threading
from pathlib import Path
from typing import Callable

from .errors import ExportError

_DISK_ERRORS = {errno.ENOSPC: "no space left on device", errno.EFBIG: "file size limit exceeded", errno.EDQUOT: "disk quota exceeded"}


class AtomicDirectory:
    """Context manager: `with AtomicDirectory(out) as job:` write under `job.tmp`, then `job.commit(...)`."""

    def __init__(self, out: Path):
        self.out = Path(out)
        self.tmp = self.out.parent / f".{self.out.name}.partial-{os.getpid()}"
        self.current = "the temporary directory"  # what is being written, for error messages
        self._restore_sigterm: Callable[[], None] = lambda: None

    def __enter__(self) -> "AtomicDirectory":
        try:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            clean_stale_partials(self.out)
        except OSError as e:
            raise ExportError(f"{self.out.parent}: cannot create the output's parent directory ({e.strerror})") from None
        self._restore_sigterm = _sigterm_unwinds()
        try:
            if self.tmp.exists():
                shutil.rmtree(self.tmp)
            self.tmp.mkdir()
        except BaseException as e:
            self.__exit__(type(e), e, e.__traceback__)
            raise
        return self

    def commit(self, what: str, hint: str) -> None:
        """fsync and move into place; `what` and `hint` word the error when OUT was filled meanwhile."""
        fsync_dir(self.tmp)
        try:
            os.rename(self.tmp, self.out)  # atomic onto a missing or empty directory
        except OSError as e:
            raise ExportError(f"{self.out}: could not move {what} into place ({e.strerror}); {hint}") from None
        fsync_dir(self.out.parent)

    def __exit__(self, exc_type, exc, tb) -> bool:
        self._restore_sigterm()
        if exc is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            if isinstance(exc, OSError):
                raise _write_failure(exc, self.out, self.current) from None
        return False


def clean_stale_partials(out: Path) -> None:
    """Remove temporary directories left by runs that were killed (their pid is gone)."""
    for p in out.parent.glob(f".{out.name}.partial-*"):
        try:
            pid = int(p.name.rsplit("-", 1)[1])
            os.kill(pid, 0)
        except (ValueError, ProcessLookupError):
            shutil.rmtree(p, ignore_errors=True)
        except PermissionError:
            pass


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_failure(e: OSError, out: Path, current: str) -> ExportError:
    """One line for a failed write (disk full, file size limit, I/O error), naming the file being written."""
    what = _DISK_ERRORS.get(e.errno) or e.strerror or str(e).strip() or type(e).__name__
    code = f" ({errno.errorcode[e.errno]})" if e.errno in errno.errorcode else ""
    return ExportError(f"{out}: writing {current} failed: {what}{code}; the partial export was removed and {out} was not created")


def _sigterm_unwinds() -> Callable[[], None]:
    """While a run writes, turn SIGTERM and SIGHUP (a closed terminal) into SystemExit(128 + signal)
    so the temporary directory is removed (SIGINT already unwinds as KeyboardInterrupt). Only from
    the main thread, and only for signals that still have their default action; returns the
    function that restores the previous handlers."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def unwind(signum, frame):
        raise SystemExit(128 + signum)

    taken = [sig for sig in (signal.SIGTERM, signal.SIGHUP) if signal.getsignal(sig) is signal.SIG_DFL]
    for sig in taken:
        signal.signal(sig, unwind)

    def restore() -> None:
        for sig in taken:
            signal.signal(sig, signal.SIG_DFL)

    return restore
