"""Admission's inner side: the executor thread that owns the Engine and runs admitted jobs in
arrival order, in batches of those already waiting, and gives up on jobs nobody waits for (cancel.py)."""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from .. import cancel
from .settings import Settings
from .warmup import run_warmup_step, warmup_steps

log = logging.getLogger("valen_serve")


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

    def abandon(self) -> bool:
        """Nobody waits for this job any more: if it has not started it never will, and once every job
        of its batch is abandoned the engine stops at its next layer (cancel.py). True when the
        executor had already taken it (the future's own state, set before `started_at` is)."""
        self.abandoned_at = time.perf_counter()
        return not self.future.cancel()


@dataclass
class WarmupProgress:
    """How far loading and warmup have got; written by the executor thread, read by /health."""

    stage: str = "loading"  # loading, warmup, then ready (or failed)
    done: int = 0  # warmup steps run (a request, or a group run together), over every pass
    total: int | None = None  # known once the engine is loaded (passes and groups depend on it)
    started: float | None = None  # perf_counter when loading began

    def snapshot(self) -> dict:
        elapsed = 0.0 if self.started is None else time.perf_counter() - self.started
        return {"stage": self.stage, "done": self.done, "total": self.total, "elapsed_s": round(elapsed, 1)}


class Executor:
    """One thread owns the Engine: it loads it, warms it up, then runs jobs in arrival order, up to
    `max_batch` of those already queued together (`Engine.prepare_many` / `launch` / `collect`: one
    sweep where the engine batches; a request that fails fails alone). On CUDA the next batch's
    host work overlaps the device work of the one before it, which is answered at the first check
    after the device is done with it (before each of the next batch's requests and its plan).

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
        # Resolved on the executor thread once warm (None) or with what loading or warmup raised.
        self.ready: concurrent.futures.Future = concurrent.futures.Future()
        self.progress = WarmupProgress()
        self._thread = threading.Thread(target=self._run, name="valen-executor", daemon=True)
        self.timings: dict = {}
        self.engine_info: dict = {}

    def start(self) -> None:
        """Start the executor thread: it loads and warms up (see `progress`), resolves `ready`, then
        runs jobs; jobs submitted before then wait for it."""
        self.progress.started = time.perf_counter()
        self._thread.start()

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
            engine, batches = self._load_and_warm_up()
        except BaseException as exc:  # for whoever waits on `ready` (valen-serve's main thread)
            self.progress.stage = "failed"
            self.ready.set_exception(exc)
            return
        self.progress.stage = "ready"
        self.ready.set_result(None)
        # An engine that does not batch runs requests one at a time, so each starts (and can still be
        # abandoned) on its own.
        take = self.max_batch if batches else 1
        # On CUDA, pipelined: the next jobs' host work (decoding, tokenizing, planning; their vision
        # towers queue behind the device work in flight) runs while the jobs in flight are on the
        # device, and those are collected once it is done (collect_if_done), at the latest before
        # the next launch. On the CPU the device work is the executor's own, so nothing would overlap.
        pipelined = self.pipelined if self.pipelined is not None else engine.model.device.type == "cuda"
        in_flight, stopping = None, False

        def collect_if_done() -> None:
            # Between two requests of the next batch's host work: once the batch in flight is done
            # on the device, answer it now rather than after all of that work (with host work longer
            # than the device's, its clients would otherwise wait for both).
            nonlocal in_flight
            if in_flight is None:
                return
            try:
                done = engine.device_done(in_flight[1])
            except Exception:  # a CUDA error of that batch: its own collect reports it, to its jobs
                done = True
            if done:
                current, in_flight = in_flight, None  # taken first: never collected twice
                self._collect(engine, *current)

        while True:
            jobs = [] if stopping else self._take(take, block=in_flight is None)
            if jobs and jobs[-1] is None:
                jobs, stopping = jobs[:-1], True  # run what came before the stop, then end
            jobs = [j for j in jobs if j.future.set_running_or_notify_cancel()]  # skip the abandoned
            prepared = self._prepare(engine, jobs, collect_if_done) if jobs else None
            if in_flight is not None:
                self._collect(engine, *in_flight)
            in_flight = (jobs, self._launch(engine, jobs, prepared)) if prepared is not None else None
            if in_flight is not None and not pipelined:
                self._collect(engine, *in_flight)
                in_flight = None
            if in_flight is None and stopping:
                return

    def _load_and_warm_up(self):
        """Load the engine and run the warmup, step by step in `progress` and one log line per step:
        (engine, whether it batches)."""
        progress = self.progress
        t0 = time.perf_counter()
        engine = self._load()
        batches = engine.batches and self.max_batch > 1
        self.engine_info = {"mode": engine.mode, "layout": ("one-pass" if engine.one_pass else "batch") + " where a prefix is shared, else rows",
                            "kernels": dict(engine.kernels), "cuda_graphs": engine.graphs is not None,
                            "max_batch": self.max_batch if batches else 1}
        t1 = time.perf_counter()
        # One pass: on CUDA each step's first use compiles (and autotunes) and captures its graphs.
        steps = warmup_steps(self._warmup, self.max_batch if batches else 1)
        progress.total, progress.stage = len(steps), "warmup"
        log.info({"event": "loaded", "load_s": round(t1 - t0, 3), "warmup_steps": progress.total})
        with engine.warming_up():  # every graph key captured on its first use, images and batches too
            for step in steps:
                step_started = time.perf_counter()
                run_warmup_step(engine, step)
                progress.done += 1
                now = time.perf_counter()
                log.info({"event": "warmup", "done": progress.done, "total": progress.total,
                          "step_s": round(now - step_started, 3), "elapsed_s": round(now - progress.started, 3)})
        self.timings = {"load_s": round(t1 - t0, 3), "warmup_s": round(time.perf_counter() - t1, 3)}
        return engine, batches

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

    def _prepare(self, engine, jobs: list[Job], between: Callable[[], None]):
        started = time.perf_counter()
        for job in jobs:
            job.started_at, job.batch = started, len(jobs)
        self.batches_run += len(jobs) > 1
        try:
            with cancel.scope(self._abandoned(jobs)):
                batch = engine.prepare_many([job.request for job in jobs], between=between)
        except BaseException as exc:  # not a request's own failure (prepare_many keeps those): all fail
            self._settle(jobs, [exc] * len(jobs))
            return None
        # A request that failed to compile (bad input) is answered now, not after its batch-mates'
        # device work (with --request-timeout, its 4xx would otherwise become a 503).
        for job, entry in zip(jobs, batch.prepared):
            if isinstance(entry, BaseException):
                job.future.set_exception(entry)
        return batch

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
        """The batch's stop test: true once no job in it has a client waiting (each given up, or
        already answered: its request failed to compile)."""
        return lambda: all(job.abandoned_at is not None or job.future.done() for job in jobs)

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
            if job.future.done():  # answered when its compile failed (_prepare)
                continue
            if isinstance(result, BaseException):
                job.future.set_exception(result)
            else:
                job.future.set_result(result)

