"""`valen-serve`: a System1-Omni worker for one export (POST /v1/systemone, GET /health).

The contract is docs/wire-contract.md; the checks are wire.py's, shared with valen-run.

Lifecycle: the port is bound and listens first (a taken port fails at once, before minutes of
loading), then the executor thread loads the export with a full hash check and warms up on real
requests (on CUDA, one per shape family the compiled functions and graphs specialise on) while
uvicorn already serves: /health answers 503 "warming up" with the executor's progress, requests
503 "warming up", until it is warm. SIGTERM, SIGINT or SIGHUP: before then stop at once; after,
stop accepting, answer every admitted request; exit 0.

Threads: uvicorn's event loop reads and checks each request's headers and body; two parse
threads turn bodies into canonical requests; one executor thread owns the Engine and runs
requests in arrival order, up to `max_batch` of those already waiting at once (in one sweep of the
layers where the engine batches: `Engine.run_many`; it never waits for more to arrive).

Two separate bounds: at most `max_body_reads` requests (`max_body_reads_per_client` from one client
address, `max_large_body_reads` of them declaring more than 8 MiB, as only a video request may, up
to 24 MiB) may be sending their bodies at once, and at most `queue_size + 1` requests, bodies read,
are admitted (being parsed, waiting or running). A client that sends headers and then idles holds
only a body-read slot, never inference capacity. Past either bound the answer is 503 (before the
body is read when that is already known), so the memory of bodies stays bounded by these counts.

Modules: settings.py (Settings: the limits; ServeSettings: everything a process runs with),
warmup.py (the warmup requests and batches), admission.py (Job, Executor: the executor thread,
batching, giving up on abandoned jobs), protocol.py (header checks, body-read slots, body reads,
uvicorn's HTTP/1.1 protocol with the header timeout and lingering close), app.py (WorkerApp: the
routes, admission, status codes, log lines), cli.py (the click command, logging, signals).
"""

from .admission import Executor, Job
from .app import HEALTH, ROUTES, WorkerApp
from .cli import STOP_SIGNALS, _bind, main, settings_from_command_line
from .settings import ServeSettings, Settings
from .warmup import warmup_batches, warmup_requests

__all__ = ["HEALTH", "ROUTES", "STOP_SIGNALS", "Executor", "Job", "ServeSettings", "Settings", "WorkerApp", "_bind", "main",
           "settings_from_command_line", "warmup_batches", "warmup_requests"]
