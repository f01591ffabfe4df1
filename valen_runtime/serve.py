"""`valen-serve`: a System1-Omni worker for one export (POST /v1/systemone, GET /health).

The contract is docs/wire-contract.md; the checks are wire.py's, shared with valen-run.

Lifecycle: the port is bound first (a taken port fails at once, before minutes of loading), then
the executor thread loads the export with a full hash check and warms up on real requests (on
CUDA, one per shape family the compiled functions and graphs specialise on); only then does the
socket listen, so /health answers "ready" from its first connection. SIGTERM, SIGINT or SIGHUP: stop
accepting, answer every admitted request, exit 0.

Threads: uvicorn's event loop reads and checks each request's headers and body; two parse
threads turn bodies into canonical requests; one executor thread owns the Engine and runs
requests in arrival order, up to `max_batch` of those already waiting at once (in one sweep of the
layers where the engine batches: `Engine.run_many`; it never waits for more to arrive).

Two separate bounds: at most `max_body_reads` requests (`max_body_reads_per_client` from one client
address) may be sending their bodies at once, and at most `queue_size + 1` requests, bodies read,
are admitted (being parsed, waiting or running). A client that sends headers and then idles holds
only a body-read slot, never inference capacity. Past either bound the answer is 503 (before the
body is read when that is already known); memory stays bounded by both counts times 8 MiB.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import io
import json
import logging
import math
import os
import platform
import queue
import re
import signal
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import click

from . import cancel
from .errors import RequestError, ValenError
from .wire import MAX_BODY, MODEL_NAME, decode_request, encode_response, http_status, response_body

log = logging.getLogger("valen_serve")

HEALTH = {"status": "ready", "model": MODEL_NAME, "modality": "multimodal"}
ROUTES = {("GET", "/health"), ("POST", "/v1/systemone")}
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")
_ASCII_DIGITS = re.compile(r"[0-9]{1,20}")
# Each drains: stop accepting, answer what was admitted, exit 0. SIGHUP's default would kill the
# process mid-request (exit 129), and a worker has no configuration to reload.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass(frozen=True)
class Settings:
    queue_size: int = 32  # requests admitted beyond the one running
    request_timeout: float = 55.0  # seconds from admission to answer; the frontend gives up at 60 s
    read_timeout: float = 15.0  # seconds for a request's headers, and again for its body (as upstream)
    max_batch: int = 1  # waiting requests the executor runs together (1: one at a time; docs/benchmarks.md has the trade-off)
    batch_wait: float = 0.0  # seconds an idle executor waits for more requests to join a batch
    max_body_reads: int = 128  # requests sending their bodies at once, from all clients
    max_body_reads_per_client: int = 64  # ... from one client address

    def __post_init__(self):
        for name, least in (("queue_size", 0), ("max_batch", 1), ("max_body_reads", 1), ("max_body_reads_per_client", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= {least}, got {value!r}")
        if not (math.isfinite(self.batch_wait) and 0 <= self.batch_wait <= 1):
            raise ValueError(f"--batch-wait-ms must be between 0 and 1000, got {self.batch_wait * 1e3:g}")
        for name in ("request_timeout", "read_timeout"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"--{name.replace('_', '-')} must be a finite number of seconds > 0, got {value!r}")


# ---------------------------------------------------------------- warmup


def _png_data_url(width: int, height: int, colour=None) -> str:
    from PIL import Image

    image = Image.new("RGB", (width, height), colour or "white")
    if colour is None:  # a gradient, so the vision tower sees varied pixels
        image.putdata([((x * 7) % 256, (y * 5) % 256, ((x + y) * 3) % 256) for y in range(height) for x in range(width)])
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def warmup_requests(full: bool) -> list[dict]:
    """Requests run before the worker reports ready.

    Basic (the upstream worker's pair): one text request and one 2 x 2 white PNG request. Full
    adds, for the CUDA fast path, each family its compiled functions and graphs specialise on,
    each at two sizes so torch.compile has made the sizes symbolic before the first client: a
    state under 64 tokens (every branch a row of one batch) and a longer one (the one-pass layout), one
    branch and several (choice, noul, score), and images of two sizes (the vision tower).
    """
    words = ("the agent reviewed the order and found two identical charges on the card while "
             "the customer waited for an answer about the refund policy of the bank").split()

    def text(n: int) -> str:
        return " ".join(words[(i * 7) % len(words)] for i in range(n))

    def request(state, questions) -> dict:
        return {"model": MODEL_NAME, "state": state, "questions": questions}

    only = {"_warmup": {"type": "choice", "instructions": "Choose the only candidate.", "criteria": {"ok": "OK"}}}
    requests = [request("Warmup: choose the only candidate.", only), request({"image": _png_data_url(2, 2, "white")}, only)]
    if not full:
        return requests
    choice2 = {"q": {"type": "choice", "instructions": "Refund?", "criteria": {"refund": "Refund it", "wait": "Wait"}}}
    mixed = {
        "next": {"type": "choice", "instructions": "Which move is best?", "criteria": {"up": "Move up", "down": "Move down", "left": "Move left", "right": "Move right"}},
        "blocked": {"type": "noul", "instructions": "Is the player blocked?"},
        "progress": {"type": "score", "instructions": "How close is it?", "criteria": ["not at all", "a little", "half way", "almost", "done"]},
    }
    for n in (8, 20, 120, 400):  # short states (rows), long states (one-pass)
        requests += [request(text(n), choice2), request(text(n + 3), mixed)]
    for side in (448, 320):
        state = {"messages": [{"role": "user", "content": [{"type": "image", "image": _png_data_url(side, side)}, {"type": "text", "text": text(30)}]}]}
        requests += [request(state, mixed), request({"image": _png_data_url(side, side * 3 // 4)}, choice2)]
    return requests


# ---------------------------------------------------------------- the executor


@dataclass
class Job:
    """One request for the executor; `future` gets the RunResult or the exception."""

    request: dict
    id: str = ""  # the request id, for the executor's own log lines
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    queued_at: float = field(default_factory=time.perf_counter)
    started_at: float | None = None
    batch: int = 0  # how many requests ran together with this one, itself included
    abandoned_at: float | None = None  # set by `abandon`: its client has been answered without it

    def abandon(self) -> None:
        """Nobody waits for this job any more: if it has not started it never will, and once every job
        of its batch is abandoned the engine stops at its next layer (cancel.py)."""
        self.abandoned_at = time.perf_counter()
        self.future.cancel()


def warmup_batches(requests: list[dict], max_batch: int) -> list[list[dict]]:
    """Groups of the full warmup's requests run together after them, so the CUDA fast path has
    compiled the combined one-pass sweep's variants (requests without a prefix only, several
    prefixes, a mix with images) before the first client: basic warmups (two requests) have none."""
    if max_batch < 2 or len(requests) <= 2:
        return []
    # warmup_requests(True): [basic (2) | short, short, short, short, long, long, long, long | images (4)]
    return [requests[2:4], requests[6:10][:max_batch], [requests[2], requests[8], *requests[10:12]][:max_batch]]


class Executor:
    """One thread owns the Engine: it loads it, warms it up, then runs jobs in arrival order, up to
    `max_batch` of those already queued together (`Engine.prepare_many` / `launch` / `collect`: one
    sweep where the engine batches; a request that fails fails alone). On CUDA the next batch's
    host work overlaps the device work of the one before it.

    A job abandoned before it started (its client's timeout passed) is skipped; a batch whose jobs
    are all abandoned while it runs stops at the engine's next layer (cancel.py) and is logged as
    "cancelled". Jobs are admitted by the HTTP side, which bounds how many wait.
    """

    def __init__(self, load: Callable[[], object], warmup: list[dict], max_batch: int = Settings.max_batch,
                 pipelined: bool | None = None, batch_wait: float = Settings.batch_wait):
        """pipelined: overlap the next batch's host work with the one in flight (None: on CUDA).
        batch_wait: seconds an idle executor, woken by one request, waits for more to join it."""
        self._load = load
        self._warmup = warmup
        self.max_batch = max_batch
        self.batch_wait = batch_wait
        self.pipelined = pipelined
        self.batches_run = 0  # executor sweeps with more than one request
        self._jobs: "queue.SimpleQueue[Job | None]" = queue.SimpleQueue()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="valen-executor", daemon=True)
        self.error: BaseException | None = None
        self.timings: dict[str, float] = {}
        self.engine_info: dict = {}

    def start(self) -> None:
        """Load and warm up on the executor thread; raises what loading raised."""
        self._thread.start()
        self._ready.wait()
        if self.error is not None:
            raise self.error

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, request: dict, request_id: str = "") -> Job:
        job = Job(request, request_id)
        self._jobs.put(job)
        return job

    def stop(self) -> None:
        """Let the thread finish the jobs it has, then end it."""
        self._jobs.put(None)
        self._thread.join()

    def _run(self) -> None:
        try:
            t0 = time.perf_counter()
            engine = self._load()
            batches = engine.batches and self.max_batch > 1
            self.engine_info = {"mode": engine.mode, "layout": ("one-pass" if engine.one_pass else "batch") + " where a prefix is shared, else rows",
                                "kernels": dict(engine.kernels), "cuda_graphs": engine.graphs is not None,
                                "max_batch": self.max_batch if batches else 1}
            t1 = time.perf_counter()
            # CUDA graphs capture a shape on its second use (fast/graphs.py): run everything twice.
            for _ in range(2 if engine.graphs is not None else 1):
                for request in self._warmup:
                    engine.run(request)
                for group in warmup_batches(self._warmup, self.max_batch) if batches else []:
                    for result in engine.run_many(group):
                        if isinstance(result, Exception):
                            raise result
            self.timings = {"load_s": t1 - t0, "warmup_s": time.perf_counter() - t1}
        except BaseException as exc:  # handed to start(), which raises it in the main thread
            self.error = exc
            return
        finally:
            self._ready.set()
        # An engine that does not batch runs requests one at a time, so each starts (and can still be
        # abandoned) on its own.
        take = self.max_batch if batches else 1
        # On CUDA, pipelined: the next jobs' host work (decoding, tokenizing, planning; their vision
        # towers queue behind the device work in flight) runs before the jobs in flight are
        # collected. On the CPU the device work is the executor's own, so nothing would overlap.
        pipelined = self.pipelined if self.pipelined is not None else engine.model.device.type == "cuda"
        in_flight, stopping = None, False
        while True:
            jobs = [] if stopping else self._take(take, block=in_flight is None)
            if jobs and jobs[-1] is None:
                jobs, stopping = jobs[:-1], True  # run what came before the stop, then end
            jobs = [j for j in jobs if j.future.set_running_or_notify_cancel()]  # skip the abandoned
            prepared = self._prepare(engine, jobs) if jobs else None
            if in_flight is not None:
                self._collect(engine, *in_flight)
            in_flight = (jobs, self._launch(engine, jobs, prepared)) if prepared is not None else None
            if in_flight is not None and not pipelined:
                self._collect(engine, *in_flight)
                in_flight = None
            if in_flight is None and stopping:
                return

    def _take(self, most: int, block: bool) -> list:
        """Up to `most` queued jobs, waiting for the first only when `block` (and then up to
        batch_wait for more); a None (stop) ends the list."""
        jobs, deadline = [], None
        while len(jobs) < most:
            try:
                if block and not jobs:
                    job = self._jobs.get()
                    deadline = time.perf_counter() + self.batch_wait
                elif deadline is not None and (left := deadline - time.perf_counter()) > 0:
                    job = self._jobs.get(timeout=left)
                else:
                    job = self._jobs.get_nowait()
            except queue.Empty:
                break
            jobs.append(job)
            if job is None:
                break
        return jobs

    def _prepare(self, engine, jobs: list[Job]):
        started = time.perf_counter()
        for job in jobs:
            job.started_at, job.batch = started, len(jobs)
        self.batches_run += len(jobs) > 1
        try:
            with cancel.scope(self._abandoned(jobs)):
                return engine.prepare_many([job.request for job in jobs])
        except BaseException as exc:  # not a request's own failure (prepare_many keeps those): all fail
            self._settle(jobs, [exc] * len(jobs))
            return None

    def _launch(self, engine, jobs: list[Job], prepared):
        with cancel.scope(self._abandoned(jobs)):
            return engine.launch(prepared)  # keeps what it raises for collect

    def _collect(self, engine, jobs: list[Job], batch) -> None:
        try:
            with cancel.scope(self._abandoned(jobs)):
                results = engine.collect(batch)
        except BaseException as exc:
            results = [exc] * len(jobs)
        self._settle(jobs, results)

    @staticmethod
    def _abandoned(jobs: list[Job]) -> Callable[[], bool]:
        """The batch's stop test: true once no job in it has a client waiting."""
        return lambda: all(job.abandoned_at is not None for job in jobs)

    @staticmethod
    def _settle(jobs: list[Job], results: list) -> None:
        """Hand each job its result or exception; log the jobs whose work was given up midway."""
        stopped = [job for job, result in zip(jobs, results) if isinstance(result, cancel.Cancelled)]
        if stopped:
            now = time.perf_counter()
            log.info({"event": "cancelled", "ids": [job.id for job in stopped],
                      "ran_ms": round((now - stopped[0].started_at) * 1e3, 3),
                      "ms_after_abandoned": round(min(now - job.abandoned_at for job in stopped) * 1e3, 3)})
        for job, result in zip(jobs, results):
            if isinstance(result, BaseException):
                job.future.set_exception(result)
            else:
                job.future.set_result(result)


# ---------------------------------------------------------------- the HTTP application


class _Answer(Exception):
    """Ends a request early with a status and a detail."""

    def __init__(self, status: int, detail: str):
        super().__init__(detail)
        self.status = status
        self.detail = detail


class _ClientGone(Exception):
    """The client closed the connection before its body was complete; nothing can be sent."""


def _json_response(status: int, body: dict, request_id: str):
    from starlette.responses import Response

    return Response(encode_response(body), status_code=status, media_type="application/json", headers={"x-request-id": request_id})


def _media_type(value: str | None) -> str:
    return (value or "").split(";", 1)[0].strip().lower()


class _BodyReads:
    """Slots for requests whose bodies are being read, in total and per client address (event loop only)."""

    def __init__(self, total: int, per_client: int):
        self.total, self.per_client = total, per_client
        self.by_client: dict[str, int] = {}

    def refusal(self, client: str) -> str | None:
        """Why a body from `client` cannot be read now, or None when it can."""
        if sum(self.by_client.values()) >= self.total:
            return f"too many request bodies being read: {self.total} (--max-body-reads)"
        if self.by_client.get(client, 0) >= self.per_client:
            return f"too many request bodies being read from {client}: {self.per_client} (--max-body-reads-per-client)"
        return None

    @contextlib.contextmanager
    def slot(self, client: str):
        self.by_client[client] = self.by_client.get(client, 0) + 1
        try:
            yield
        finally:
            self.by_client[client] -= 1
            if not self.by_client[client]:
                del self.by_client[client]


class WorkerApp:
    """The ASGI application: routing, admission, bounded body reading, status codes, one log line."""

    def __init__(self, executor: Executor, settings: Settings, draining: Callable[[], bool] = lambda: False):
        self.executor = executor
        self.settings = settings
        self.capacity = settings.queue_size + 1
        self.admitted = 0  # requests with their body read, parsing, waiting or running (event loop only)
        self.body_reads = _BodyReads(settings.max_body_reads, settings.max_body_reads_per_client)
        self.draining = draining
        self._parse_pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="valen-parse")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":  # lifespan is off; nothing else is served
            return
        from starlette.datastructures import Headers

        started = time.perf_counter()
        headers = Headers(scope=scope)
        supplied = headers.get("x-request-id", "")
        request_id = supplied if _REQUEST_ID.fullmatch(supplied) else uuid.uuid4().hex[:16]
        record = {"event": "request", "id": request_id, "method": scope["method"], "path": scope["path"]}
        try:
            if (scope["method"], scope["path"]) not in ROUTES:
                raise _Answer(404, "unknown route")
            if scope["path"] == "/health":
                status, body = self._health()
            else:
                client = (scope.get("client") or ("",))[0]
                status, body = 200, await self._systemone(headers, receive, record, started, client)
        except _Answer as answer:
            status, body = answer.status, {"detail": answer.detail}
        except _ClientGone:
            record.update(status=499, detail="client closed the connection before the body was complete", ms=_ms(started))
            log.info(record)
            return
        except Exception as exc:  # a bug here must still answer in the contract's shape
            record["error"] = f"{type(exc).__name__}: {exc}"
            status, body = 500, {"detail": "inference failed"}
        await _json_response(status, body, request_id)(scope, receive, send)
        record.update(status=status, ms=_ms(started))
        if status != 200:
            record["detail"] = body.get("detail", body.get("status"))
        log.info(record)

    def _health(self) -> tuple[int, dict]:
        if self.draining():
            return 503, {"detail": "shutting down"}
        if not self.executor.alive:
            return 503, {"detail": "the executor thread has stopped"}
        return 200, dict(HEALTH)

    async def _systemone(self, headers, receive, record: dict, started: float, client: str) -> dict:
        # Header checks in the upstream worker's order, all before a byte of the body is read.
        if "transfer-encoding" in headers:
            raise _Answer(411, "Content-Length is required; chunked request bodies are not accepted")
        lengths = headers.getlist("content-length")
        if len(lengths) != 1:
            raise _Answer(411, "exactly one Content-Length header is required")
        if not _ASCII_DIGITS.fullmatch(lengths[0].strip()):
            raise _Answer(400, "Content-Length is not a number")
        length = int(lengths[0])
        if length > MAX_BODY:
            raise _Answer(413, f"body is {length} bytes; the limit is {MAX_BODY}")
        content_types = headers.getlist("content-type")
        if len(content_types) > 1:  # conflicting or not, the body's type would be a guess
            raise _Answer(415, f"exactly one Content-Type header is allowed, got {len(content_types)}")
        if _media_type(headers.get("content-type")) != "application/json":
            raise _Answer(415, "Content-Type must be application/json")
        if self.draining():
            raise _Answer(503, "shutting down")
        self._check_capacity()  # full already: answered without reading the body
        refusal = self.body_reads.refusal(client)
        if refusal is not None:
            raise _Answer(503, refusal)
        with self.body_reads.slot(client):  # a slow or idle body holds this slot only, not capacity
            body = await self._read_body(receive, length)
        self._check_capacity()
        self.admitted += 1
        try:
            try:
                request = await asyncio.get_running_loop().run_in_executor(self._parse_pool, decode_request, body)
            except RequestError as exc:
                raise _Answer(http_status(exc), str(exc)) from None
            del body  # the parsed request is what waits
            return await self._run(request, record, started)
        finally:
            self.admitted -= 1

    def _check_capacity(self) -> None:
        if self.admitted >= self.capacity:
            raise _Answer(503, f"worker busy: {self.capacity} requests admitted (--queue-size {self.settings.queue_size} + 1)")

    async def _run(self, request: dict, record: dict, started: float) -> dict:
        job = self.executor.submit(request, record["id"])
        remaining = self.settings.request_timeout - (time.perf_counter() - started)
        try:
            result = await asyncio.wait_for(asyncio.wrap_future(job.future), timeout=max(remaining, 0.0))
        except asyncio.TimeoutError:
            job.abandon()
            if job.started_at is not None:  # the executor is still busy with it until its next layer
                record["executor"] = "still busy with it: the work stops at its next layer once no request of its batch is waited for"
            raise _Answer(503, f"not answered within {self.settings.request_timeout:g} s (--request-timeout); the worker is overloaded") from None
        except RequestError as exc:
            record["batch"] = job.batch  # it failed alone; its batch-mates went on
            raise _Answer(http_status(exc), str(exc)) from None
        except Exception as exc:
            record["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
            raise _Answer(500, "inference failed") from None
        response = result.response
        record.update(
            input_tokens=response["usage"]["input_tokens"], compute_tokens=response["internal_usage"]["compute_tokens"],
            queue_ms=round((job.started_at - job.queued_at) * 1e3, 3), run_ms=round((time.perf_counter() - job.started_at) * 1e3, 3),
            batch=job.batch,
        )
        return response_body(response)

    async def _read_body(self, receive, length: int) -> bytes:
        """The body, never more than `length` (<= MAX_BODY) bytes; 408 when it does not arrive in time."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.read_timeout
        chunks, size, more = [], 0, True
        while more:
            try:
                message = await asyncio.wait_for(receive(), timeout=max(deadline - loop.time(), 0.0))
            except asyncio.TimeoutError:
                raise _Answer(408, f"request body timed out: {size} of {length} bytes in {self.settings.read_timeout:g} s") from None
            if message["type"] == "http.disconnect":
                raise _ClientGone()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > length:  # the HTTP parser frames by Content-Length; this is a second guard
                raise _Answer(400, f"body is longer than its Content-Length {length}")
            chunks.append(chunk)
            more = message.get("more_body", False)
        if size != length:
            raise _Answer(400, f"incomplete body: {size} of {length} bytes")
        return b"".join(chunks)


def _ms(started: float) -> float:
    return round((time.perf_counter() - started) * 1e3, 3)


# ---------------------------------------------------------------- uvicorn


LINGER_S = 2.0  # how long a connection refused mid-body keeps discarding what the client still sends


class _LingeringTransport:
    """A transport whose close() lingers while the client is still sending a refused body.

    Closing a socket with unread data makes the kernel send a reset, which can destroy the answer
    (413, 503, ...) before the client reads it. Instead the write side is shut (the client sees
    the end of the answer), further input is discarded, and the socket closes once the client
    closes or after LINGER_S. Everything else is the wrapped transport's.
    """

    def __init__(self, transport, body_pending: Callable[[], bool]):
        self._transport = transport
        self._body_pending = body_pending
        self.discarding = False

    def __getattr__(self, name):
        return getattr(self._transport, name)

    def close(self) -> None:
        transport = self._transport
        if self.discarding or transport.is_closing():
            return
        if not self._body_pending() or not transport.can_write_eof():
            transport.close()
            return
        self.discarding = True
        transport.write_eof()
        transport.resume_reading()
        asyncio.get_running_loop().call_later(LINGER_S, transport.close)

    def is_closing(self) -> bool:
        return self.discarding or self._transport.is_closing()


def _protocol_class(read_timeout: float):
    """uvicorn's HTTP/1.1 protocol, changed in three ways: the parser's own refusals (malformed
    request line, conflicting Content-Length, ...) answer {"detail": ...} like every other error;
    a connection whose request headers do not arrive within read_timeout gets 408 and is closed
    (uvicorn itself never times out a request's headers); and a connection closed while the
    client is still sending its body lingers (_LingeringTransport), so the client reads the answer."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class WireProtocol(H11Protocol):
        _header_timer = None

        def connection_made(self, transport) -> None:
            self._lingering = _LingeringTransport(transport, lambda: self.conn.their_state is h11.SEND_BODY)
            super().connection_made(self._lingering)
            self._arm_header_timer()

        def connection_lost(self, exc) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)
            self._lingering._transport.close()

        def data_received(self, data: bytes) -> None:
            if not self._lingering.discarding:
                super().data_received(data)

        def eof_received(self) -> None:
            if self._lingering.discarding:
                self._lingering._transport.close()  # the client finished sending: close now

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:  # a request's headers are complete
                self._cancel_header_timer()

        def on_response_complete(self) -> None:
            cycle = self.cycle
            super().on_response_complete()
            if self.cycle is cycle and not self.transport.is_closing():
                self._arm_header_timer()  # the next request on this connection

        def send_400_response(self, msg: str) -> None:
            body = encode_response({"detail": "malformed HTTP request (the request line, headers or framing)"})
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), (b"connection", b"close")]
            for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
            self.transport.close()
            log.info({"event": "request", "status": 400, "detail": "malformed HTTP request"})

        def _arm_header_timer(self) -> None:
            self._cancel_header_timer()
            self._header_timer = self.loop.call_later(read_timeout, self._headers_timed_out)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_timed_out(self) -> None:
            self._header_timer = None
            if self.transport.is_closing() or (self.cycle is not None and not self.cycle.response_complete):
                return
            body = encode_response({"detail": f"request headers timed out after {read_timeout:g} s"})
            # No request was parsed, so h11 cannot frame a response: the bytes are written as is.
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                                 b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
            self.transport.close()
            log.info({"event": "request", "status": 408, "detail": "request headers timed out"})

    return WireProtocol


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, but a SIGTERM / SIGINT / SIGHUP that stopped it gracefully ends the process
        with exit 0 instead of being raised again once the server is down."""

        @contextlib.contextmanager
        def capture_signals(self):
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in STOP_SIGNALS}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return Server


class _JsonLines(logging.Formatter):
    """One JSON object per line: dict messages as they are, anything else as {"message": ...}."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {"ts": round(record.created, 3), "level": record.levelname.lower()}
        if isinstance(record.msg, dict):
            entry.update(record.msg)
        else:
            entry.update(logger=record.name, message=record.getMessage())
        return json.dumps(entry, ensure_ascii=False, default=str)


def _configure_logging() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonLines())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    log.setLevel(logging.INFO)
    logging.captureWarnings(True)  # a library's warning (Pillow on an odd image, ...) is a JSON line too, never raw text


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP: asyncio turns Nagle's algorithm off only on sockets that say they are TCP;
    # with proto 0, every answer on a kept-alive connection waited for a delayed ACK (40 ms).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot bind {host}:{port} ({exc.strerror or exc})") from None
    return sock


@contextlib.contextmanager
def _stop_on_signal_before_ready():
    """SIGTERM / SIGINT / SIGHUP while starting (imports, loading, warmup): stop at once, exit 0 (nothing is in flight)."""

    def stop(signum, frame):
        log.info({"event": "stopped", "reason": f"signal {signum} before ready"})
        sys.stderr.flush()
        # At once: the executor thread may be inside torch, which interpreter shutdown must not race.
        os._exit(0)

    previous = {sig: signal.signal(sig, stop) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _start(export_dir, host, port, device, dtype, mode, kernels, temperature, calibration, queue_size, max_batch, batch_wait_ms,
           request_timeout, read_timeout, max_body_reads, max_body_reads_per_client, threads, warmup, compile_,
           graphs) -> tuple[Executor, Settings, str, socket.socket]:
    """Check the options, bind the port, load and warm up: (executor, settings, device, socket)."""
    import torch

    from .answers import load_temperature
    from .engine import Engine
    from .options import EngineOptions

    settings = Settings(queue_size=queue_size, request_timeout=request_timeout, read_timeout=read_timeout, max_batch=max_batch,
                        batch_wait=batch_wait_ms / 1e3, max_body_reads=max_body_reads, max_body_reads_per_client=max_body_reads_per_client)
    if temperature is not None and calibration is not None:
        raise ValenError("--temperature and --calibration are mutually exclusive")
    temp = load_temperature(calibration) if calibration is not None else (1.0 if temperature is None else temperature)
    options = EngineOptions(device=device, dtype=dtype, mode=mode, kernels=kernels, compile=compile_, graphs=graphs)  # checked before binding
    dev = options.device
    if threads is not None:
        torch.set_num_threads(threads)
    sock = _bind(host, port)

    def load():
        return Engine.load(export_dir, options, verify="full", temperature=temp)

    full = warmup == "full" or (warmup == "auto" and dev.startswith("cuda"))
    executor = Executor(load, warmup_requests(full), settings.max_batch, batch_wait=settings.batch_wait)
    log.info({"event": "loading", "export": str(export_dir), "device": dev, "dtype": dtype, "warmup": "full" if full else "basic"})
    executor.start()
    return executor, settings, dev, sock


@click.command(name="valen-serve")
@click.option("--export", "export_dir", required=True, type=click.Path(path_type=Path), help="A valen-export output directory.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface to listen on (the frontend's backend URL points here).")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535), help="Port; 0 picks a free one (the ready log line names it).")
@click.option("--device", default=None, help="cpu or cuda (default: cuda when available).")
@click.option("--dtype", type=click.Choice(["bf16", "fp32"]), default="bf16", show_default=True)
@click.option("--mode", type=click.Choice(["per-branch", "shared-prefix"]), default=None, help="Execution mode (default: shared-prefix on CUDA, per-branch on CPU).")
@click.option("--kernels", type=click.Choice(["torch", "fast"]), default=None, help="The reference modules or the fast path (default: fast for shared-prefix on CUDA).")
@click.option("--temperature", type=float, default=None, help="Softmax temperature (default 1.0).")
@click.option("--calibration", type=click.Path(path_type=Path), default=None, help="Calibration JSON with a scalar 'temperature'.")
@click.option("--queue-size", default=Settings.queue_size, show_default=True, type=int, help="Requests admitted beyond the one running; one more is answered 503.")
@click.option("--max-batch", default=Settings.max_batch, show_default=True, type=int, help="Up to this many waiting requests run in one sweep of the layers (the fast path's shared-prefix mode; never waits for more); 1: one at a time.")
@click.option("--batch-wait-ms", default=0.0, show_default=True, type=float, help="How long an idle executor woken by one request waits for more to join its batch (0: never waits).")
@click.option("--request-timeout", default=Settings.request_timeout, show_default=True, type=float, help="Seconds from admission to answer; past it 503.")
@click.option("--read-timeout", default=Settings.read_timeout, show_default=True, type=float, help="Seconds for a request's headers, and for its body; past it 408.")
@click.option("--max-body-reads", default=Settings.max_body_reads, show_default=True, type=int, help="Requests that may be sending their bodies at once; one more is answered 503 (an idle body never takes --queue-size capacity).")
@click.option("--max-body-reads-per-client", default=Settings.max_body_reads_per_client, show_default=True, type=int, help="The same, from one client address.")
@click.option("--threads", type=click.IntRange(1, None), default=None, help="torch CPU threads (default: torch's, one per core); 1 keeps a busy shared machine from stalling the model's parallel loops.")
@click.option("--warmup", type=click.Choice(["auto", "basic", "full"]), default="auto", show_default=True, help="basic: one text and one image request; full: every shape family the CUDA fast path compiles (auto: full on CUDA).")
@click.option("--compile/--no-compile", "compile_", default=None, help="torch.compile the CUDA fast path (default: on for CUDA).")
@click.option("--cuda-graphs/--no-cuda-graphs", "graphs", default=None, help="Capture CUDA graphs (default: on for CUDA).")
def main(export_dir, host, port, device, dtype, mode, kernels, temperature, calibration, queue_size, max_batch, batch_wait_ms, request_timeout,
         read_timeout, max_body_reads, max_body_reads_per_client, threads, warmup, compile_, graphs) -> None:
    """Serve an export as a System1-Omni worker: POST /v1/systemone, GET /health.

    \b
    Example:
      valen-serve --export build/demo/export-separate --port 8000
      curl -s localhost:8000/health
    """
    _configure_logging()
    try:
        with _stop_on_signal_before_ready():
            executor, settings, dev, sock = _start(export_dir, host, port, device, dtype, mode, kernels, temperature, calibration,
                                                   queue_size, max_batch, batch_wait_ms, request_timeout, read_timeout, max_body_reads,
                                                   max_body_reads_per_client, threads, warmup, compile_, graphs)
    except (ValenError, ValueError, OSError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    import torch
    import uvicorn

    server = None
    app = WorkerApp(executor, settings, draining=lambda: server is not None and server.should_exit)
    config = uvicorn.Config(
        app, http=_protocol_class(settings.read_timeout), lifespan="off", log_config=None, access_log=False, server_header=False,
        timeout_keep_alive=5, timeout_graceful_shutdown=int(settings.request_timeout + settings.read_timeout) + 5,
        h11_max_incomplete_event_size=64 * 1024,  # request line + headers
    )
    server = _server_class()(config)
    sock.listen(128)
    bound_host, bound_port = sock.getsockname()[:2]
    url_host = f"[{bound_host}]" if ":" in bound_host else bound_host
    log.info({"event": "ready", "url": f"http://{url_host}:{bound_port}", "port": bound_port, "device": dev,
              "device_name": torch.cuda.get_device_name(dev) if dev.startswith("cuda") else (platform.processor() or platform.machine()),
              "dtype": dtype, "torch_threads": torch.get_num_threads(), **executor.engine_info, **{k: round(v, 3) for k, v in executor.timings.items()},
              "queue_size": settings.queue_size, "max_body_reads": settings.max_body_reads,
              "max_body_reads_per_client": settings.max_body_reads_per_client, "batch_wait_ms": settings.batch_wait * 1e3, "request_timeout_s": settings.request_timeout, "read_timeout_s": settings.read_timeout,
              "versions": {"python": platform.python_version(), "torch": torch.__version__, "uvicorn": uvicorn.__version__}})
    server.run(sockets=[sock])
    executor.stop()
    log.info({"event": "stopped", "reason": "signal" if server.should_exit else "server ended"})
    sys.exit(0)


if __name__ == "__main__":
    main()
