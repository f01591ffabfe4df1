"""The thread pool images decode on while the compiler tokenizes (shared by every compiler)."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

from .wire import MAX_MESSAGE_IMAGES

# Images decode on these threads while the calling thread tokenizes: PIL's decoders, zlib and
# torch's resize run without the GIL. One per image a request may carry; shared by every compiler.
DECODE_THREADS = MAX_MESSAGE_IMAGES
_decode_pool: ThreadPoolExecutor | None = None
_decode_pool_lock = threading.Lock()


def shared_decode_pool() -> ThreadPoolExecutor:
    global _decode_pool
    with _decode_pool_lock:
        if _decode_pool is None:
            _decode_pool = ThreadPoolExecutor(max_workers=DECODE_THREADS, thread_name_prefix="valen-image")
        return _decode_pool


def _forget_decode_pool_after_fork() -> None:
    # A forked child inherits the pool object but not its threads: start a fresh one there.
    global _decode_pool, _decode_pool_lock
    _decode_pool, _decode_pool_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_decode_pool_after_fork)
