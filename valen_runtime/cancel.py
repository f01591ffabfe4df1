"""Cooperative cancellation of the engine's work.

A thread runs engine work under `scope(stop)`; the model calls `checkpoint()` between its layers
(text and vision), which raises `Cancelled` once `stop()` is true. `valen-serve` uses it so a
request whose client already got its 503 stops computing within a layer instead of holding the
executor until it finishes. Outside a scope `checkpoint()` does nothing: `valen-run`, the parity
harness and the warmup are never cancelled.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator

_local = threading.local()


class Cancelled(Exception):
    """The work was given up: everyone who wanted its result has stopped waiting for it."""


@contextlib.contextmanager
def _thread_setting(name: str, value) -> Iterator[None]:
    """This thread's `name` is `value` inside the block; the previous value comes back after (nests)."""
    previous = getattr(_local, name, None)
    setattr(_local, name, value)
    try:
        yield
    finally:
        setattr(_local, name, previous)


def scope(stop: Callable[[], bool]):
    """Run the body with `stop` as this thread's cancellation test (scopes nest; the outer one returns after)."""
    return _thread_setting("stop", stop)


def shielded():
    """No checkpoint raises inside: work that must finish whole once begun (a CUDA graph's
    side-stream warm-up and capture, whose cache bookkeeping and stream order a raise would cut)."""
    return _thread_setting("shielded", True)


def checkpoint() -> None:
    """Raise Cancelled when this thread's scope says stop; cheap enough to call between layers."""
    stop = getattr(_local, "stop", None)
    if stop is not None and not getattr(_local, "shielded", False) and stop() and not _inside_traced_work():
        raise Cancelled("stopped between layers: the request was abandoned")


def _inside_traced_work() -> bool:
    # A CUDA graph being captured (or a function being compiled) must see the whole layer stack;
    # the work then stops at the next checkpoint outside it. (torch imported here: the serve CLI
    # imports this module, and its option errors should not wait for torch.)
    import torch

    return torch.compiler.is_compiling() or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
