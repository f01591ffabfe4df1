"""The ASGI application: the two routes, admission (at most queue_size + 1 requests with their
bodies read), handing requests to the executor, status codes and one log line per request."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import re
import time
import uuid
from typing import Callable

from ..errors import RequestError
from ..wire import MODEL_NAME, decode_request, encode_response, http_status, response_body
from .admission import Executor
from .protocol import _Answer, _BodyReads, _ClientGone, check_body_headers, read_body
from .settings import Settings

log = logging.getLogger("valen_serve")

HEALTH = {"status": "ready", "model": MODEL_NAME, "modality": "multimodal"}
WARMING_UP = "warming up"  # the 503 detail while the executor loads and warms up (listening already)
ROUTES = {("GET", "/health"), ("POST", "/v1/systemone")}
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")


def _internal_error(record: dict, exc: Exception) -> tuple[int, dict]:
    """A bug's answer in the contract's shape; its request's log line names the error."""
    record["error"] = f"{type(exc).__name__}: {exc}"
    return 500, {"detail": "inference failed"}


def _json_response(status: int, body: dict, request_id: str):
    from starlette.responses import Response

    return Response(encode_response(body), status_code=status, media_type="application/json", headers={"x-request-id": request_id})


class WorkerApp:
    """The ASGI application: routing, admission, bounded body reading, status codes, one log line."""

    def __init__(self, executor: Executor, settings: Settings, draining: Callable[[], bool] = lambda: False):
        self.executor = executor
        self.settings = settings
        self.capacity = settings.queue_size + 1
        self.admitted = 0  # requests with their body read, parsing, waiting or running (event loop only)
        self.body_reads = _BodyReads(settings.max_body_reads, settings.max_body_reads_per_client, settings.max_large_body_reads)
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
        except _ClientGone as gone:
            record.update(status=499, detail=str(gone), ms=_ms(started))
            log.info(record)
            return
        except Exception as exc:  # a bug here must still answer in the contract's shape
            status, body = _internal_error(record, exc)
        try:
            response = _json_response(status, body, request_id)
        except ValueError as exc:  # a body JSON cannot hold (a NaN): a bug, answered likewise
            status, body = _internal_error(record, exc)
            response = _json_response(status, body, request_id)
        await response(scope, receive, send)
        record.update(status=status, ms=_ms(started))
        if status != 200:
            record["detail"] = body.get("detail", body.get("status"))
        log.info(record)

    def _warming_up(self) -> bool:
        return self.executor.progress.stage in ("loading", "warmup")

    def _health(self) -> tuple[int, dict]:
        """Answered on the event loop from the executor's progress: never queued behind inference."""
        if self.draining():
            return 503, {"detail": "shutting down"}
        if self._warming_up():
            return 503, {"detail": WARMING_UP, "warmup": self.executor.progress.snapshot()}
        if not self.executor.alive:
            return 503, {"detail": "the executor thread has stopped"}
        return 200, dict(HEALTH)

    async def _systemone(self, headers, receive, record: dict, started: float, client: str) -> dict:
        length = check_body_headers(headers)
        if self.draining():
            raise _Answer(503, "shutting down")
        if self._warming_up():  # refused at once: nothing waits for the warmup
            raise _Answer(503, WARMING_UP)
        self._check_capacity()  # full already: answered without reading the body
        refusal = self.body_reads.refusal(client, length)
        if refusal is not None:
            raise _Answer(503, refusal)
        with self.body_reads.slot(client, length):  # a slow or idle body holds this slot only, not capacity
            body = await read_body(receive, length, self.settings.read_timeout)
        self._check_capacity()
        self.admitted += 1
        try:
            try:
                request = await asyncio.get_running_loop().run_in_executor(self._parse_pool, decode_request, body)
            except RequestError as exc:
                raise _Answer(http_status(exc), str(exc)) from None
            del body  # the parsed request is what waits
            return await self._run(request, record, started, receive)
        finally:
            self.admitted -= 1

    def _check_capacity(self) -> None:
        if self.admitted >= self.capacity:
            raise _Answer(503, f"worker busy: {self.capacity} requests admitted (--queue-size {self.settings.queue_size} + 1)")

    async def _run(self, request: dict, record: dict, started: float, receive) -> dict:
        job = self.executor.submit(request, record["id"])
        remaining = self.settings.request_timeout - (time.perf_counter() - started)
        try:
            result = await _answer_unless_gone(job.future, receive, max(remaining, 0.0))
        except (asyncio.TimeoutError, _ClientGone) as given_up:
            if job.abandon():  # the executor is still busy with it until its next layer
                record["executor"] = "still busy with it: the work stops at its next layer once no request of its batch is waited for"
            if isinstance(given_up, _ClientGone):
                raise
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
        # Where its batch's time went; a request rerun alone after its batch failed has no prepare_s.
        timings = result.timings
        if "prepare_s" in timings:
            record["prepare_ms"] = round(timings["prepare_s"] * 1e3, 3)
        if "model_s" in timings:
            record["model_ms"] = round(timings["model_s"] * 1e3, 3)
        if "graph" in timings:
            record["graph"] = timings["graph"]
        return response_body(response)


async def _answer_unless_gone(future, receive, timeout: float):
    """The job's result, unless its client disconnects first (_ClientGone: nobody would read the
    answer, so its work is given up like a timed-out request's) or `timeout` passes (TimeoutError).
    With the body read, the server's next message for this request is its disconnect."""
    answer = asyncio.wrap_future(future)

    async def disconnected() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    gone = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({answer, gone}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if answer in done:
        return answer.result()
    answer.cancel()  # a job not started yet never starts
    if gone in done:
        raise _ClientGone("client closed the connection before its answer")
    raise asyncio.TimeoutError


def _ms(started: float) -> float:
    return round((time.perf_counter() - started) * 1e3, 3)

