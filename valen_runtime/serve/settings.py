"""The worker's limits (admission, timeouts, body reads) and everything `valen-serve` was started with."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from ..options import EngineOptions


@dataclass(frozen=True)
class Settings:
    queue_size: int = 32  # requests admitted beyond the one running
    request_timeout: float = 55.0  # seconds from admission to answer; the frontend gives up at 60 s
    read_timeout: float = 15.0  # seconds for a request's headers, and again for its body (as upstream)
    max_batch: int = 1  # waiting requests the executor runs together (1: one at a time; docs/benchmarks.md has the trade-off)
    batch_wait: float = 0.0  # seconds an idle executor waits for more requests to join a batch
    max_body_reads: int = 128  # requests sending their bodies at once, from all clients
    max_body_reads_per_client: int = 64  # ... from one client address
    max_large_body_reads: int = 4  # ... of them declaring more than MAX_BODY (only a video request may be that large)

    def __post_init__(self):
        for name, least in (("queue_size", 0), ("max_batch", 1), ("max_body_reads", 1), ("max_body_reads_per_client", 1),
                            ("max_large_body_reads", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= {least}, got {value!r}")
        if not (math.isfinite(self.batch_wait) and 0 <= self.batch_wait <= 1):
            raise ValueError(f"--batch-wait-ms must be between 0 and 1000, got {self.batch_wait * 1e3:g}")
        for name in ("request_timeout", "read_timeout"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"--{name.replace('_', '-')} must be a finite number of seconds > 0, got {value!r}")



@dataclass(frozen=True)
class ServeSettings:
    """Everything one `valen-serve` process runs with, checked and resolved once in main()."""

    export_dir: Path
    host: str
    port: int
    options: EngineOptions  # every engine choice, the temperature included, resolved for the device
    threads: int | None
    full_warmup: bool
    limits: Settings
    compile_cache: Path | None = None  # --compile-cache's directory; None: torch's own defaults
