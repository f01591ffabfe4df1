"""valen-serve under load, on the loopback only: latency percentiles, throughput and memory.

Starts `valen-serve` on 127.0.0.1 (a free port) for an export, then:
1. the first requests after /health is ready, one of each kind (what warmup did not cover shows here);
2. for each concurrency (default 1, 8, 32): closed-loop clients on keep-alive connections (asyncio,
   one thread) send the request mix until --requests answers or --duration seconds, whichever
   comes first; p50 / p99 / mean latency per kind and in all as the client sees it, the same from
   the server's log (total, waiting in the queue, running, and how many requests each ran with),
   requests/s (and its ratio to concurrency 1), status counts; every answer is checked against the
   first answer to the same request: with --max-batch > 1 a request's answer may differ in its last
   bits with its batch-mates (docs/runtime.md), so the distinct variants, the largest probability
   difference between them and any changed decision are reported;
3. memory: --leak-requests more requests (default 10,000) at --leak-concurrency, the server's RSS
   (and on CUDA its GPU memory from nvidia-smi) sampled 20 times, with the slope over the second half;
4. SIGTERM, and the server's exit code.
Every phase is bounded by its request count and its duration, so the whole run is bounded by
--startup-timeout + 3 x --duration + --leak-duration (plus the first requests and the shutdown).

The requests are the latency benchmark's (bench_requests.py): "text" is b_text48_choice2 (a short
text, one choice of two), "image" a_image448_7branch (a 448 x 448 image and text, 7 branches).
With --new-shapes the load and memory phases send each kind in varied lengths instead (a few
words added to a question's instructions and to its first candidate, 899 combinations), as
traffic whose questions differ does: most requests then have a token layout the server has not
run recently, so CUDA-graph capture and the direct path show in the latencies. Their answers are
checked for status only.

    python benchmarks/serve_load.py --export build/fx-export --device cpu --out serve-load.json
    python benchmarks/serve_load.py --export build/gpu-bench/export-2b-separate --device cuda --mix image:1 --concurrency 1,8 --out batched.json
    python benchmarks/serve_load.py --export build/gpu-bench/export-2b-separate --build 2b --device cuda --out serve-load.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_requests import benchmark_requests, text_of  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
KINDS = {"text": "b_text48_choice2", "image": "a_image448_7branch"}


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list: the smallest value with q % of the values at or below it."""
    return sorted_values[max(0, math.ceil(q / 100 * len(sorted_values)) - 1)]


def new_shape(request: dict, i: int) -> dict:
    """Request number i of a kind in varied lengths: k1 words added to the first question's
    instructions and k2 to its first candidate (or to the last question's instructions when it
    has none); (k1, k2) runs through 29 x 31 combinations before repeating."""
    request = json.loads(json.dumps(request))
    k1, k2 = i % 29, (i // 29) % 31
    first = next(iter(request["questions"].values()))
    first["instructions"] += " " + text_of(k1, i) if k1 else ""
    criteria = first.get("criteria")
    if k2 and isinstance(criteria, dict):
        key = next(iter(criteria))
        criteria[key] += " " + text_of(k2, i + 1)
    elif k2 and isinstance(criteria, list):
        criteria[0] += " " + text_of(k2, i + 1)
    elif k2:
        list(request["questions"].values())[-1]["instructions"] += " " + text_of(k2, i + 1)
    return request


def summarize(samples: list[float]) -> dict:
    if not samples:
        return {"n": 0}
    s = sorted(samples)
    return {"n": len(s), "p50_ms": round(percentile(s, 50) * 1e3, 3), "p99_ms": round(percentile(s, 99) * 1e3, 3),
            "mean_ms": round(statistics.fmean(s) * 1e3, 3), "max_ms": round(s[-1] * 1e3, 3)}


def parse_mix(text: str) -> list[str]:
    """"text:3,image:1" -> a repeating schedule of kinds."""
    schedule = []
    for part in text.split(","):
        kind, _, count = part.partition(":")
        if kind not in KINDS:
            raise SystemExit(f"--mix: unknown kind {kind!r} (known: {', '.join(KINDS)})")
        schedule += [kind] * int(count or 1)
    return schedule


class Server:
    """valen-serve in a subprocess; its JSON log lines are collected as they come."""

    def __init__(self, export: Path, device: str, extra: list[str], startup_timeout: float):
        cmd = [sys.executable, "-m", "valen_runtime.serve", "--export", str(export), "--host", "127.0.0.1", "--port", "0",
               "--device", device, *extra]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
        self.t0 = time.perf_counter()
        # stdout joins the log (stderr): what libraries print there (Triton's autotuning lines) is kept too
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: list[dict] = []
        # (ms, queue_ms, run_ms, prepare_ms, model_ms, batch, graph) of answered requests, from the server's log
        self.timings: list[tuple] = []
        self._lock = threading.Lock()
        self.ready = threading.Event()
        threading.Thread(target=self._collect, daemon=True).start()
        if not self.ready.wait(startup_timeout) or self.proc.poll() is not None:
            self.proc.kill()
            tail = "\n".join(json.dumps(line) for line in self.lines[-10:])
            raise SystemExit(f"valen-serve did not become ready within {startup_timeout} s (exit {self.proc.poll()}):\n{tail}")
        self.startup_s = time.perf_counter() - self.t0
        self.info = next(line for line in self.lines if line.get("event") == "ready")
        self.port = self.info["port"]

    def _collect(self) -> None:
        for raw in self.proc.stdout:
            try:
                line = json.loads(raw)
            except ValueError:
                line = {"raw": raw.rstrip()}
            if line.get("event") != "request":  # request lines are kept as three numbers, not dicts
                self.lines.append(line)
            elif line.get("status") == 200:
                with self._lock:
                    self.timings.append((line["ms"], line["queue_ms"], line["run_ms"], line.get("prepare_ms"), line.get("model_ms"),
                                         line.get("batch", 1), line.get("graph")))
            if line.get("event") == "ready":
                self.ready.set()
        self.ready.set()

    def take_timings(self) -> dict:
        """Server-side percentiles (the log's ms, queue_ms, run_ms, and the engine's prepare_ms, its
        batch's host work, and model_ms, its device work queued and awaited) of the requests answered
        since the last call, how many requests each ran with (its sweep's size), and how many
        requests' plans replayed a CUDA graph, captured one or ran directly (with model_ms p50 each)."""
        time.sleep(0.2)  # a request's log line follows its answer
        with self._lock:
            taken, self.timings = self.timings, []
        out = {name: summarize([t[i] / 1e3 for t in taken if t[i] is not None]) for i, name in enumerate(("total", "queue", "run", "prepare", "model"))}
        batches = [t[5] for t in taken]
        out["batch"] = {"mean": round(statistics.fmean(batches), 3), "max": max(batches)} if batches else {}
        runs: dict = {}
        for t in taken:
            if t[6] is not None and t[4] is not None:
                runs.setdefault(t[6], []).append(t[4])
        out["graph"] = {how: {"requests": len(ms), "model_p50_ms": round(statistics.median(ms), 3)} for how, ms in sorted(runs.items())}
        return out

    def memory_mib(self) -> tuple[float, float]:
        """The server's resident set now and its peak so far (VmRSS, VmHWM), in MiB."""
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines() if ":" in line)
        return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024

    def gpu_mib(self) -> float | None:
        if shutil.which("nvidia-smi") is None:
            return None
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True).stdout
        for row in out.splitlines():
            pid, _, used = row.partition(",")
            if pid.strip() == str(self.proc.pid):
                return float(used)
        return None

    def stop(self, timeout: float = 120.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)


class Connection:
    """One keep-alive HTTP/1.1 connection driven by asyncio: many of them cost the load generator
    one thread, so its own scheduling does not inflate what it measures."""

    def __init__(self, port: int):
        self.port = port
        self.reader = self.writer = None

    async def post(self, body: bytes) -> tuple[int, bytes]:
        for attempt in range(2):
            try:
                if self.writer is None:
                    self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
                self.writer.write(b"POST /v1/systemone HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                await self.writer.drain()
                status = int((await self.reader.readline()).split(b" ", 2)[1])
                headers = {}
                while (line := await self.reader.readline()) not in (b"\r\n", b""):
                    name, _, value = line.partition(b":")
                    headers[name.strip().lower()] = value.strip()
                data = await self.reader.readexactly(int(headers[b"content-length"]))
                if headers.get(b"connection", b"").lower() == b"close":
                    self.close()
                return status, data
            except (OSError, ValueError, IndexError, KeyError, asyncio.IncompleteReadError):
                self.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


def answer_probabilities(body: bytes) -> tuple[list[float], list]:
    """Every probability an answer states, flattened (a noul answer states p(true)), and its decisions (choice / score)."""
    probabilities, decisions = [], []
    for answer in json.loads(body)["answers"].values():
        probabilities += list(answer["probabilities"].values()) if "probabilities" in answer else [answer["noul"]]
        decisions.append(answer.get("choice", answer.get("score")))
    return probabilities, decisions


def compare_variants(expected: dict[str, bytes], answers: dict[str, set[bytes]]) -> dict:
    """Per kind: the distinct answers seen, the largest |dp| of any of them from the first answer, and
    how many changed a choice."""
    out = {}
    for kind, seen in answers.items():
        first_p, first_d = answer_probabilities(expected[kind])
        worst, changed = 0.0, 0
        for body in seen - {expected[kind]}:
            p, d = answer_probabilities(body)
            worst = max([worst] + [abs(a - b) for a, b in zip(p, first_p)])
            changed += any(a != b for a, b in zip(d, first_d) if isinstance(a, str))
        out[kind] = {"variants": len(seen | {expected[kind]}), "max_abs_dp_from_first": worst, "changed_choices": changed}
    return out


async def run_phase(port: int, bodies: dict[str, bytes], expected: dict[str, bytes], schedule: list[str], concurrency: int,
                    max_requests: int, max_seconds: float, on_progress=None, vary=None) -> dict:
    """Closed loop: `concurrency` connections, each sends its next request when its last one is answered.
    vary(kind, i) -> body: request i in varied lengths (--new-shapes); their answers are not compared."""
    issued = 0
    latencies: dict[str, list[float]] = {kind: [] for kind in bodies}
    statuses: dict[str, int] = {}
    mismatches = 0
    answers: dict[str, set[bytes]] = {kind: set() for kind in bodies}
    deadline = time.perf_counter() + max_seconds

    async def client() -> None:
        nonlocal issued, mismatches
        connection = Connection(port)
        while time.perf_counter() < deadline and issued < max_requests:
            kind = schedule[issued % len(schedule)]
            body = bodies[kind] if vary is None else vary(kind, issued)
            issued += 1
            t = time.perf_counter()
            try:
                status, data = await connection.post(body)
            except (OSError, ValueError, IndexError, KeyError, asyncio.IncompleteReadError) as exc:
                status, data = f"error:{type(exc).__name__}", b""
            elapsed = time.perf_counter() - t
            statuses[str(status)] = statuses.get(str(status), 0) + 1
            if status == 200:
                latencies[kind].append(elapsed)
                if vary is None:
                    mismatches += data != expected[kind]  # without batching, the same request gets the same bytes
                    answers[kind].add(data)
            if on_progress is not None:
                on_progress(sum(statuses.values()))
        connection.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    answered = sum(len(v) for v in latencies.values())
    return {
        "concurrency": concurrency, "wall_s": round(wall, 3), "answered": answered, "requests_per_s": round(answered / wall, 2),
        "statuses": statuses, "new_shapes": vary is not None,
        "answers_differing_from_the_first": None if vary else mismatches, "answer_variants": None if vary else compare_variants(expected, answers),
        "latency": {"all": summarize([x for v in latencies.values() for x in v]), **{k: summarize(v) for k, v in latencies.items()}},
    }


def build_export(export: Path, preset: str) -> None:
    """The synthetic fixture beside the export (fixture-PRESET) and its separate-LoRA export, when missing."""
    sys.path.insert(0, str(REPO))
    from valen_export.export import export as run_export
    from valen_export.fixture import build_fixture

    fixture = export.parent / f"fixture-{preset}"
    if not (fixture / "pins.json").exists():
        build_fixture(fixture, preset=preset, seed=0)
    run_export(fixture / "checkpoint", fixture / "base", export, lora_mode="separate", pins_path=fixture / "pins.json", progress=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--export", type=Path, required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--build", choices=["tiny", "2b"], default=None, help="build the synthetic fixture and its separate export at --export when missing")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--requests", type=int, default=300, help="answers per concurrency level (at most)")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds per concurrency level (at most)")
    ap.add_argument("--mix", default="text:3,image:1", help="request kinds in the load phases, KIND:COUNT,...")
    ap.add_argument("--new-shapes", action="store_true", help="load and memory phases: every request in varied lengths (see above)")
    ap.add_argument("--leak-requests", type=int, default=10_000)
    ap.add_argument("--leak-concurrency", type=int, default=8)
    ap.add_argument("--leak-duration", type=float, default=1800.0)
    ap.add_argument("--leak-mix", default=None, help="mix for the memory phase (default: --mix)")
    ap.add_argument("--queue-size", type=int, default=64)
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    ap.add_argument("--serve-args", default="", help="more valen-serve options, space separated")
    args = ap.parse_args()
    # Stopped from outside (timeout(1) sends SIGTERM): still stop the server and write what was measured.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))

    if args.build and not (args.export / "valen_export.json").exists():
        t = time.perf_counter()
        build_export(args.export, args.build)
        print(f"built {args.export} in {time.perf_counter() - t:.0f} s", flush=True)
    requests = benchmark_requests()
    bodies = {kind: json.dumps(requests[name], ensure_ascii=False).encode() for kind, name in KINDS.items()}
    schedule, leak_schedule = parse_mix(args.mix), parse_mix(args.leak_mix or args.mix)
    kinds = sorted(set(schedule) | set(leak_schedule))
    bodies = {k: bodies[k] for k in kinds}
    vary = None
    if args.new_shapes:
        vary = lambda kind, i: json.dumps(new_shape(requests[KINDS[kind]], i), ensure_ascii=False).encode()  # noqa: E731

    server = Server(args.export, args.device, ["--queue-size", str(args.queue_size), *args.serve_args.split()], args.startup_timeout)
    print(f"ready after {server.startup_s:.1f} s: {json.dumps(server.info)}", flush=True)
    result = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "server": server.info, "startup_s": round(server.startup_s, 3),
              "mix": args.mix, "leak_mix": args.leak_mix or args.mix, "requests": {k: KINDS[k] for k in kinds}, "new_shapes": args.new_shapes,
              "host": {"cpus": os.cpu_count(), "load_average_at_start": [round(x, 2) for x in os.getloadavg()]}}
    try:
        async def post_once(body: bytes) -> tuple[int, bytes]:
            connection = Connection(server.port)
            try:
                return await connection.post(body)
            finally:
                connection.close()

        first, expected = {}, {}
        for kind in kinds:  # the first request of each kind after ready: warmup should have paid its compile
            t = time.perf_counter()
            status, data = asyncio.run(post_once(bodies[kind]))
            first[kind] = {"status": status, "ms": round((time.perf_counter() - t) * 1e3, 3)}
            if status != 200:
                raise SystemExit(f"{kind}: status {status}: {data[:300]!r}")
            expected[kind] = data
            answer = json.loads(data)
            first[kind]["usage"] = answer["usage"]
        result["first_after_ready"] = first
        server.take_timings()
        print(f"first after ready: {json.dumps(first)}", flush=True)

        result["load"] = []
        for concurrency in [int(c) for c in args.concurrency.split(",")]:
            phase = asyncio.run(run_phase(server.port, bodies, expected, schedule, concurrency, args.requests, args.duration, vary=vary))
            phase["server_side"] = server.take_timings()
            single = next((p for p in result["load"] if p["concurrency"] == 1), None)
            if single is not None and single["requests_per_s"]:
                phase["requests_per_s_vs_concurrency_1"] = round(phase["requests_per_s"] / single["requests_per_s"], 3)
            lat_all = phase["latency"]["all"]
            if lat_all.get("n"):
                phase["p99_over_p50"] = round(lat_all["p99_ms"] / lat_all["p50_ms"], 3)
            result["load"].append(phase)
            lat, srv = phase["latency"]["all"], phase["server_side"]
            print(f"concurrency {concurrency:>3}: {phase['answered']} answered in {phase['wall_s']} s, {phase['requests_per_s']} req/s, "
                  f"p50 {lat.get('p50_ms')} ms, p99 {lat.get('p99_ms')} ms (server: run p50 {srv['run'].get('p50_ms')} ms, "
                  f"queue p99 {srv['queue'].get('p99_ms')} ms, prepare p50 {srv['prepare'].get('p50_ms')} ms, model p50 {srv['model'].get('p50_ms')} ms, "
                  f"batch {srv['batch']}, graph {srv['graph']}), x{phase.get('requests_per_s_vs_concurrency_1', '-')} of "
                  f"concurrency 1, p99/p50 {phase.get('p99_over_p50')}, statuses {phase['statuses']}, answers {phase['answer_variants']}", flush=True)

        samples = []
        every = max(1, args.leak_requests // 20)
        next_mark = [0]

        def sample(done: int, force: bool = False) -> None:
            if done >= next_mark[0] or force:
                next_mark[0] = done + every
                rss, peak = server.memory_mib()
                samples.append({"answered": done, "rss_mib": round(rss, 1), "peak_rss_mib": round(peak, 1), "gpu_mib": server.gpu_mib(),
                                "t_s": round(time.perf_counter() - leak_t0, 2)})

        leak_t0 = time.perf_counter()
        sample(0)
        phase = asyncio.run(run_phase(server.port, bodies, expected, leak_schedule, args.leak_concurrency, args.leak_requests, args.leak_duration, sample,
                                      vary=vary))
        phase["server_side"] = server.take_timings()
        sample(sum(phase["statuses"].values()), force=True)
        half = [s for s in samples if s["answered"] >= samples[-1]["answered"] / 2]
        xs, ys = [s["answered"] for s in half], [s["rss_mib"] for s in half]
        slope = statistics.linear_regression(xs, ys).slope * 1000 if len(set(xs)) > 1 else None
        result["memory"] = {"phase": phase, "samples": samples, "rss_mib_first": samples[0]["rss_mib"], "rss_mib_last": samples[-1]["rss_mib"],
                            "peak_rss_mib_first": samples[0]["peak_rss_mib"], "peak_rss_mib_last": samples[-1]["peak_rss_mib"],
                            "rss_slope_mib_per_1000_second_half": None if slope is None else round(slope, 3)}
        print(f"memory over {phase['answered']} requests ({phase['requests_per_s']} req/s): RSS {samples[0]['rss_mib']} -> {samples[-1]['rss_mib']} MiB, "
              f"peak {samples[0]['peak_rss_mib']} -> {samples[-1]['peak_rss_mib']} MiB, second-half slope "
              f"{result['memory']['rss_slope_mib_per_1000_second_half']} MiB per 1000; statuses {phase['statuses']}", flush=True)
    finally:
        result["host"]["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
        result["exit_code_after_sigterm"] = server.stop()
        result["server_log_tail"] = [line for line in server.lines if line.get("event") != "ready"][-5:]
        # What torch logged (TORCH_LOGS: raw text, or JSON lines from a torch logger), at most 2,000 lines.
        result["server_other_lines"] = [line.get("raw") or line.get("message") for line in server.lines
                                        if "raw" in line or str(line.get("logger", "")).startswith("torch")][:2000]
        # Each warmup step's time: where a cold start's compiling and autotuning go.
        result["warmup_steps"] = [{k: line.get(k) for k in ("done", "total", "step_s", "elapsed_s")}
                                  for line in server.lines if line.get("event") == "warmup"]
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        print(f"exit code after SIGTERM: {result['exit_code_after_sigterm']}; wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
