"""`valen-serve`'s command: check the options into one ServeSettings, bind and listen on the port,
then serve with uvicorn while the executor thread loads and warms up (503 "warming up" until warm)
and until a stop signal; plus the process's JSON log lines."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import platform
import signal
import socket
import sys
import time
from pathlib import Path

import click

from .. import compile_cache as compile_cache_module
from ..cli_options import compile_cache_option, engine_options, resolve, temperature_options, threads_option
from ..errors import ValenError
from .admission import Executor
from .app import WorkerApp
from .protocol import _protocol_class
from .settings import ServeSettings, Settings
from .warmup import warmup_requests

log = logging.getLogger("valen_serve")

# Each drains: stop accepting, answer what was admitted, exit 0. SIGHUP's default would kill the
# process mid-request (exit 129), and a worker has no configuration to reload.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _stop_signals() -> tuple[int, ...]:
    """The stop signals this process takes: SIGHUP only where it is not ignored (under nohup the
    worker must outlive its terminal)."""
    return tuple(sig for sig in STOP_SIGNALS if not (sig == signal.SIGHUP and signal.getsignal(sig) is signal.SIG_IGN))


def _server_class(stop_signals: "_StopSignals", executor: Executor, announce):
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, but its signals stay with the worker's one handler (`stop_signals`): a
        SIGTERM / SIGINT / SIGHUP that stopped it gracefully ends the process with exit 0 instead of
        being raised again once the server is down, and one during warmup stops at once. It serves
        while `executor` loads and warms up, and calls `announce` once that is done."""

        failure: BaseException | None = None  # what loading or warmup raised (the server stopped then)

        async def serve(self, sockets=None) -> None:
            self.failure = await _serve_while_warming_up(self, super().serve(sockets), executor, announce)

        @contextlib.contextmanager
        def capture_signals(self):
            previous = {sig: signal.signal(sig, stop_signals) for sig in _stop_signals()}
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


class _StopSignals:
    """SIGTERM / SIGINT / SIGHUP over the worker's whole life, one handler, so that no moment between
    loading and serving leaves a signal its default action (which kills without a `stopped` line):
    until the executor is warm (imports, loading, warmup; requests are only answered 503 then) stop
    at once with exit 0; once it is, ask the server to drain."""

    def __init__(self):
        self.server = None
        self.executor = None

    def install(self) -> None:
        for sig in _stop_signals():
            signal.signal(sig, self)

    def __call__(self, signum, frame):
        warm = self.executor is not None and self.executor.ready.done()
        if self.server is not None and warm:
            if self.server.should_exit:
                # uvicorn would force the exit on a second signal, cancelling the accepted requests
                # (plain-text 500s): the drain goes on, as the first signal promised.
                log.info({"event": "signal", "signal": signum, "detail": "already draining: every accepted request is still answered (SIGKILL stops at once)"})
                return
            self.server.handle_exit(signum, frame)  # sets should_exit: a server not yet running starts and drains
            return
        log.info({"event": "stopped", "reason": f"signal {signum} before ready"})
        sys.stderr.flush()
        # At once: the executor thread may be inside torch (loading, compiling), which interpreter
        # shutdown must not race; what uvicorn has open is only 503 answers and /health.
        os._exit(0)


def settings_from_command_line(export_dir, host, port, device, dtype, mode, kernels, graphs, compile_, temperature, calibration,
                               queue_size, max_batch, batch_wait_ms, request_timeout, read_timeout, max_body_reads,
                               max_body_reads_per_client, max_large_body_reads, threads, warmup, compile_cache=None) -> ServeSettings:
    """Every option checked (ValueError / ValenError: one line) and resolved, before the port is bound."""
    limits = Settings(queue_size=queue_size, request_timeout=request_timeout, read_timeout=read_timeout, max_batch=max_batch,
                      batch_wait=batch_wait_ms / 1e3, max_body_reads=max_body_reads, max_body_reads_per_client=max_body_reads_per_client,
                      max_large_body_reads=max_large_body_reads)
    options = resolve(device, dtype, mode, kernels, graphs, compile_, temperature, calibration)
    full = warmup == "full" or (warmup == "auto" and options.device.startswith("cuda"))
    return ServeSettings(export_dir=export_dir, host=host, port=port, options=options, threads=threads,
                         full_warmup=full, limits=limits, compile_cache=compile_cache_module.resolve_dir(compile_cache))


def _torch_logs_as_json_lines() -> None:
    """torch gives its loggers their own plain-text stderr handler (no propagation), so a message
    such as the C++ compiler's "No CUDA runtime is found" would break the one-JSON-line log:
    they write through the root's JSON handler instead."""
    logging.getLogger("torch").handlers[:] = logging.getLogger().handlers


def _executor(settings: ServeSettings) -> Executor:
    """The executor for the export; started by main once the port listens."""
    import torch

    from ..engine import Engine

    _torch_logs_as_json_lines()

    if settings.threads is not None:
        torch.set_num_threads(settings.threads)

    def load():
        return Engine.load(settings.export_dir, settings.options, verify="full")

    return Executor(load, warmup_requests(settings.full_warmup), settings.limits.max_batch, batch_wait=settings.limits.batch_wait)


async def _serve_while_warming_up(server, serve, executor: Executor, announce) -> BaseException | None:
    """Run `serve` (the server's coroutine) while the executor loads and warms up, `announce` once it
    is warm, then until the server stops: None, or what loading or warmup raised (the server is
    stopped then)."""
    serving = asyncio.create_task(serve)
    loop, warm = asyncio.get_running_loop(), asyncio.Event()

    def wake(_):
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits any more
            loop.call_soon_threadsafe(warm.set)

    executor.ready.add_done_callback(wake)
    waiting = asyncio.create_task(warm.wait())
    await asyncio.wait({serving, waiting}, return_when=asyncio.FIRST_COMPLETED)
    if warm.is_set():
        failure = executor.ready.exception()
        if failure is not None:
            server.should_exit = True
            await serving
            return failure
        announce()
    else:
        waiting.cancel()
    await serving
    return None


def _url(sock: socket.socket) -> tuple[str, int]:
    bound_host, bound_port = sock.getsockname()[:2]
    url_host = f"[{bound_host}]" if ":" in bound_host else bound_host
    return f"http://{url_host}:{bound_port}", bound_port


def _error_line(exc: BaseException) -> str:
    """One line for a failure at startup: the message of the refusals users cause, else its type too."""
    if isinstance(exc, (ValenError, ValueError, OSError)):
        return f"error: {exc}"
    first = (str(exc).splitlines() or [""])[0]
    return f"error: loading or warming up failed: {type(exc).__name__}: {first}"


@click.command(name="valen-serve")
@click.option("--export", "export_dir", required=True, type=click.Path(path_type=Path), help="A valen-export output directory.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface to listen on (the frontend's backend URL points here).")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535), help="Port; 0 picks a free one (the ready log line names it).")
@engine_options
@temperature_options
@click.option("--queue-size", default=Settings.queue_size, show_default=True, type=int, help="Requests admitted beyond the one running; one more is answered 503.")
@click.option("--max-batch", default=Settings.max_batch, show_default=True, type=int, help="Up to this many waiting requests run in one sweep of the layers (the fast path's shared-prefix mode; never waits for more); 1: one at a time.")
@click.option("--batch-wait-ms", default=0.0, show_default=True, type=float, help="How long an idle executor woken by one request waits for more to join its batch (0: never waits).")
@click.option("--request-timeout", default=Settings.request_timeout, show_default=True, type=float, help="Seconds from admission to answer; past it 503.")
@click.option("--read-timeout", default=Settings.read_timeout, show_default=True, type=float, help="Seconds for a request's headers, and for its body; past it 408.")
@click.option("--max-body-reads", default=Settings.max_body_reads, show_default=True, type=int, help="Requests that may be sending their bodies at once; one more is answered 503 (an idle body never takes --queue-size capacity).")
@click.option("--max-body-reads-per-client", default=Settings.max_body_reads_per_client, show_default=True, type=int, help="The same, from one client address.")
@click.option("--max-large-body-reads", default=Settings.max_large_body_reads, show_default=True, type=int, help="The same, for bodies over 8 MiB (only a video request may be larger, up to 24 MiB).")
@threads_option()
@compile_cache_option
@click.option("--warmup", type=click.Choice(["auto", "basic", "full"]), default="auto", show_default=True, help="basic: one text and one image request; full: every shape family the CUDA fast path compiles (auto: full on CUDA).")
def main(**command_line) -> None:
    """Serve an export as a System1-Omni worker: POST /v1/systemone, GET /health.

    \b
    Example:
      valen-serve --export build/demo/export-separate --port 8000
      curl -s localhost:8000/health
    """
    started = time.perf_counter()
    _configure_logging()
    stop_signals = _StopSignals()
    stop_signals.install()
    try:
        settings = settings_from_command_line(**command_line)
        # Before anything compiles; an engine that compiles nothing leaves the directory alone.
        cache = compile_cache_module.use(settings.compile_cache if compile_cache_module.compiles(settings.options) else None)
        sock = _bind(settings.host, settings.port)
        executor = _executor(settings)
    except (ValenError, ValueError, OSError) as exc:
        click.echo(_error_line(exc), err=True)
        sys.exit(2)
    import torch
    import uvicorn

    limits, dev = settings.limits, settings.options.device
    server = None
    app = WorkerApp(executor, limits, draining=lambda: server is not None and server.should_exit)
    config = uvicorn.Config(
        app, http=_protocol_class(limits.read_timeout), lifespan="off", log_config=None, access_log=False, server_header=False,
        timeout_keep_alive=5, timeout_graceful_shutdown=int(limits.request_timeout + limits.read_timeout) + 5,
        h11_max_incomplete_event_size=64 * 1024,  # request line + headers
    )
    url, bound_port = _url(sock)

    def announce():
        log.info({"event": "ready", "url": url, "port": bound_port, "device": dev,
                  "device_name": torch.cuda.get_device_name(dev) if dev.startswith("cuda") else (platform.processor() or platform.machine()),
                  "dtype": settings.options.dtype, "torch_threads": torch.get_num_threads(), **executor.engine_info, **executor.timings,
                  "ready_s": round(time.perf_counter() - started, 3), "compile_cache": {**cache, **compile_cache_module.counters()},
                  "queue_size": limits.queue_size, "max_body_reads": limits.max_body_reads,
                  "max_body_reads_per_client": limits.max_body_reads_per_client, "max_large_body_reads": limits.max_large_body_reads, "batch_wait_ms": limits.batch_wait * 1e3, "request_timeout_s": limits.request_timeout, "read_timeout_s": limits.read_timeout,
                  "options": settings.options.describe(),
                  "versions": {"python": platform.python_version(), "torch": torch.__version__, "uvicorn": uvicorn.__version__}})

    server = _server_class(stop_signals, executor, announce)(config)
    stop_signals.server, stop_signals.executor = server, executor
    # Listening from here: until warm, /health says how far warmup has got and requests are 503.
    sock.listen(128)
    log.info({"event": "loading", "url": url, "port": bound_port, "export": str(settings.export_dir), "device": dev,
              "dtype": settings.options.dtype, "warmup": "full" if settings.full_warmup else "basic", "compile_cache": cache["dir"]})
    executor.start()
    server.run(sockets=[sock])
    if server.failure is not None:
        click.echo(_error_line(server.failure), err=True)
        sys.exit(2)
    if not executor.ready.done():  # the server ended by itself during warmup: nothing is in flight
        log.info({"event": "stopped", "reason": "server ended before ready"})
        sys.stderr.flush()
        os._exit(1)
    executor.stop()
    log.info({"event": "stopped", "reason": "signal" if server.should_exit else "server ended"})
    sys.exit(0)
