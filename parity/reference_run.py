"""The reference side: the pinned reference in its own process (`parity.reference_worker`), and a
cache of its results.

`start_reference` launches one worker process per shard and returns at once, so several dtypes
(the requested one, the fp32 truth, fp64 on the CPU) and the runtime can run side by side;
`ReferenceJob.wait()` collects them into one `ReferenceRun`. With a cache directory, finished
results are kept under a key of everything they depend on (checkpoint, base, device, dtype,
requests, threads, the reference's own code) and reused by later runs of the same requests.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from valen_runtime.safetensors_file import sha256_file

from . import isolation
from .errors import UsageProblem
from .interrupts import critical

REPO_ROOT = Path(__file__).resolve().parent.parent
WORKER_FILES = ("isolation.py", "prompt.py", "reference.py", "reference_worker.py", "valen_source.py", "video_reader.py")
REFERENCE_DTYPES = ("bf16", "fp32", "fp64")


@dataclass
class ReferenceRun:
    """One dtype's reference results for a request set; records are looked up by request id."""

    dtype: str
    data: dict  # the worker's reference.json (of the first shard for environment and checkpoint)
    seconds: float  # wall time of the worker processes (0 when every shard came from the cache)
    cached: bool = False
    by_id: dict = field(default_factory=dict)

    def __post_init__(self):
        self.by_id = {r["id"]: r for r in self.data["results"]}

    def _load(self, rid: str, key: str):
        rec = self.by_id[rid]
        path = rec.get(key)
        return None if path is None else torch.load(path, map_location="cpu", weights_only=True)

    def pixel_values(self, rid: str) -> torch.Tensor | None:
        return self._load(rid, "pixel_values_path")

    def pixel_values_videos(self, rid: str) -> torch.Tensor | None:
        return self._load(rid, "pixel_values_videos_path")

    def rotary(self, rid: str) -> dict | None:
        """{"positions": [3, T] int64, "tables": [2, T, R] fp32} of the request's first branch."""
        return self._load(rid, "rotary_path")


def _check_inputs(checkpoint: Path, base: Path) -> None:
    for path, what in ((checkpoint / "checkpoint.pt", "checkpoint"), (checkpoint / "config.json", "checkpoint"), (base / "config.json", "base")):
        if not path.is_file():
            raise UsageProblem(f"{path}: missing; --{what} must be a Valen {what} folder")


def cache_key(checkpoint: Path, base: Path, device: str, dtype: str, requests: list[tuple[str, dict]], valen_source: str | None, threads: int | None) -> str:
    h = hashlib.sha256()
    parts = {
        "checkpoint_sha256": sha256_file(checkpoint / "checkpoint.pt"),
        "checkpoint_config": (checkpoint / "config.json").read_text(encoding="utf-8"),
        "base_files": {p.name: sha256_file(p) if p.suffix != ".safetensors" else (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(base.iterdir()) if p.is_file()},
        "device": device,
        "dtype": dtype,
        "valen_source": valen_source,
        "threads": threads,
        "requests": [req for _, req in requests],  # ids are labels only: results are remapped by position
        # The code that runs in the reference process: a change to it invalidates cached results.
        "worker": {n: sha256_file(Path(__file__).resolve().parent / n) for n in WORKER_FILES},
    }
    h.update(json.dumps(parts, sort_keys=True, ensure_ascii=False).encode())
    return h.hexdigest()[:32]


def _read_results(directory: Path, requests: list[tuple[str, dict]]) -> dict:
    """A worker's reference.json with ids from `requests` (by position) and absolute file paths."""
    data = json.loads((directory / "reference.json").read_text(encoding="utf-8"))
    for rec, (rid, _) in zip(data["results"], requests):
        rec["id"] = rid
        for name_key, path_key in (("pixel_values_file", "pixel_values_path"), ("pixel_values_videos_file", "pixel_values_videos_path"),
                                   ("rotary_file", "rotary_path")):
            if rec.get(name_key):
                rec[path_key] = str(directory / rec[name_key])
    return data


@dataclass
class _Shard:
    requests: list[tuple[str, dict]]
    key: str | None
    out: Path | None = None
    process: subprocess.Popen | None = None
    data: dict | None = None  # set when finished (or found in the cache)
    started: float = 0.0


_LIVE: set["ReferenceJob"] = set()  # jobs whose processes or folders may still exist


def stop_all() -> None:
    """Stop every reference job of this process and remove its folders (the harness's backstop on a
    stop signal: interrupts.unwinding_on_signals(cleanup=stop_all))."""
    for job in list(_LIVE):
        job.stop_and_remove()


class ReferenceJob:
    """Reference worker processes for one dtype, running in the background."""

    def __init__(self, dtype: str, shards: list[_Shard], cache_dir: Path | None, timeout: float | None):
        self.dtype = dtype
        self.shards = shards
        self.cache_dir = cache_dir
        self.timeout = timeout
        self.t0 = time.perf_counter()
        _LIVE.add(self)

    def wait(self) -> ReferenceRun:
        """Block until every shard finished; raises UsageProblem if the reference could not run."""
        for shard in self.shards:
            if shard.data is not None:
                continue
            left = None if self.timeout is None else max(1.0, self.timeout - (time.perf_counter() - shard.started))
            try:
                code = shard.process.wait(timeout=left)
            except subprocess.TimeoutExpired:
                self.stop()
                raise UsageProblem(f"reference process ({self.dtype}) did not finish within {self.timeout} s") from None
            if code != 0:
                self.stop()
                stderr = (shard.out / "stderr.txt").read_text(encoding="utf-8", errors="replace").strip()
                lines = [ln for ln in stderr.splitlines() if ln.startswith("reference failed:")]
                detail = lines[-1] if lines else (stderr.splitlines() or ["(no output)"])[-1]
                raise UsageProblem(f"{detail.removeprefix('reference failed: ')} (reference process, {self.dtype}, exit {code})")
            directory = shard.out
            if self.cache_dir is not None:
                dest = Path(self.cache_dir) / shard.key
                dest.parent.mkdir(parents=True, exist_ok=True)
                if not dest.exists():  # complete or absent for a reader: copied aside, then renamed
                    with critical():  # a signal mid-copy must not leave the partial copy in the cache
                        partial = Path(tempfile.mkdtemp(prefix=f".{shard.key}-", dir=dest.parent))
                        try:
                            shutil.copytree(shard.out, partial, dirs_exist_ok=True)
                            partial.rename(dest)
                        except BaseException:  # another process got there first, or the copy failed
                            shutil.rmtree(partial, ignore_errors=True)
                            if not dest.exists():
                                raise
                shutil.rmtree(shard.out, ignore_errors=True)
                directory = dest
            shard.data = _read_results(directory, shard.requests)
        cached = all(s.process is None for s in self.shards)
        data = dict(self.shards[0].data)
        data["results"] = [rec for s in self.shards for rec in s.data["results"]]
        data["build_seconds"] = [s.data.get("build_seconds") for s in self.shards]
        return ReferenceRun(self.dtype, data, 0.0 if cached else time.perf_counter() - self.t0, cached=cached)

    def stop(self) -> None:
        """Kill every worker still running and wait for it, so none outlives the caller."""
        with critical():  # a second signal must not leave the later workers running
            for shard in self.shards:
                if shard.process is not None and shard.process.poll() is None:
                    shard.process.kill()
                    shard.process.wait()

    def stop_and_remove(self) -> None:
        """stop(), then remove_temporary(): the cleanup for a job that will not be read."""
        with critical():
            self.stop()
            self.remove_temporary()
            _LIVE.discard(self)

    def remove_temporary(self) -> None:
        """Delete the worker folders that are not the cache's (call once their files are read)."""
        for shard in self.shards:
            if shard.out is not None:
                shutil.rmtree(shard.out, ignore_errors=True)


def start_reference(
    checkpoint: Path,
    base: Path,
    requests: list[tuple[str, dict]],
    device: str = "cpu",
    dtype: str = "bf16",
    workdir: Path | None = None,
    valen_source: str | None = None,
    threads: int | None = None,
    cache_dir: Path | None = None,
    timeout: float | None = None,
    shards: int = 1,
    started: dict | None = None,
) -> ReferenceJob:
    """Start the reference for `requests` ([(id, wire request)]) in `shards` processes; returns at once.

    started: a dict the job is entered in under its dtype before any process starts, so that a
    caller stopping its jobs on a signal finds this one even when the signal lands between this
    function's return and the caller's own assignment."""
    if dtype not in REFERENCE_DTYPES:
        raise UsageProblem(f"reference dtype {dtype!r} is not one of {REFERENCE_DTYPES}")
    checkpoint, base = Path(checkpoint), Path(base)
    _check_inputs(checkpoint, base)
    shards = max(1, min(shards, len(requests)))
    size = -(-len(requests) // shards)
    parts = [requests[i : i + size] for i in range(0, len(requests), size)]
    job = ReferenceJob(dtype, [], cache_dir, timeout)
    if started is not None:
        started[dtype] = job
    env = isolation.clean_environment()
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    try:
        for part in parts:
            key = cache_key(checkpoint, base, device, dtype, part, valen_source, threads) if cache_dir is not None else None
            shard = _Shard(part, key)
            job.shards.append(shard)  # before its folder exists: a failure below still finds it
            hit = None if key is None else Path(cache_dir) / key
            if hit is not None and (hit / "reference.json").is_file():
                shard.data = _read_results(hit, part)
                continue
            with critical():  # the folder and the process each reach `shard` before a signal can act
                shard.out = Path(tempfile.mkdtemp(prefix=f"valen-parity-ref-{dtype}-", dir=workdir))
                request_list = [{"id": rid, "request": req} for rid, req in part]
                spec = {
                    "checkpoint": str(checkpoint.resolve()), "base": str(base.resolve()), "device": device, "dtype": dtype,
                    "out": str(shard.out), "valen_source": valen_source, "threads": threads, "requests": request_list,
                }
                job_path = shard.out / "job.json"
                job_path.write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
                with open(shard.out / "stderr.txt", "w", encoding="utf-8") as stderr:
                    shard.process = subprocess.Popen(
                        [sys.executable, "-m", "parity.reference_worker", str(job_path)],
                        env=env, cwd=str(REPO_ROOT), stdout=subprocess.DEVNULL, stderr=stderr, text=True,
                    )
            shard.started = time.perf_counter()
    except BaseException:  # a signal (SystemExit) or an error half-way: no process or folder outlives it
        job.stop_and_remove()
        raise
    return job


def wait_for_cached(
    checkpoint: Path,
    base: Path,
    requests: list[tuple[str, dict]],
    device: str,
    dtype: str,
    cache_dir: Path,
    timeout: float,
    threads: int | None = None,
    shards: int = 1,
    valen_source: str | None = None,
) -> ReferenceRun:
    """The results another process is computing with the same arguments (`start_reference` with
    this cache_dir), once they are in the cache; UsageProblem after `timeout` seconds."""
    checkpoint, base = Path(checkpoint), Path(base)
    shards = max(1, min(shards, len(requests)))
    size = -(-len(requests) // shards)
    parts = [requests[i : i + size] for i in range(0, len(requests), size)]
    keys = [cache_key(checkpoint, base, device, dtype, part, valen_source, threads) for part in parts]
    t0 = time.perf_counter()
    while not all((Path(cache_dir) / k / "reference.json").is_file() for k in keys):
        if time.perf_counter() - t0 > timeout:
            raise UsageProblem(f"reference results ({dtype}) did not appear in {cache_dir} within {timeout:.0f} s")
        time.sleep(2.0)
    return start_reference(checkpoint, base, requests, device=device, dtype=dtype, valen_source=valen_source, threads=threads,
                           cache_dir=cache_dir, shards=shards).wait()


def run_reference(checkpoint: Path, base: Path, requests: list[tuple[str, dict]], **options) -> ReferenceRun:
    """`start_reference(...).wait()`: build the reference and run every request."""
    return start_reference(checkpoint, base, requests, **options).wait()
