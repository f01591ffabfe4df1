"""How many CUDA-graph keys the benchmark requests' varied-length variants fall on, with and
without shape buckets (valen_runtime.layouts), and what the buckets cost in rows. Host only, no model.

Each kind (a)-(d) of bench_requests.py is taken in `--variants` lengths (serve_load.new_shape:
words added to the first question and its first candidate), compiled by the export's own
tokenizer and image processor, and planned as the CUDA default plans it (one-pass, or rows for a
state under 64 tokens). Reported per kind: distinct keys bucketed and not (the same layout
unpadded), and the rows a bucketed plan sweeps against the unbucketed plan's (median and p95 of
the ratio).

    python benchmarks/shape_keys.py --export build/export-2b-separate [--variants 899] [--out keys.json]
    python benchmarks/shape_keys.py --work build/bench            # builds the tiny preset's exports there

--serve-order N also replays the first N requests of `serve_load.py --new-shapes` (its mix, in its
order) through the graph policy (`layouts.graph_plan`: a captured shape that holds a request
serves it, else its first use captures one with headroom) and reports the graphs captured (each
a slow request: warm-up run and capture), the rows the served plans sweep against their own, and
the host time per request of its own plan and of graph_plan on it (median and p99, ms).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_requests import benchmark_requests  # noqa: E402
from serve_load import new_shape  # noqa: E402


def rows_swept(plan) -> int:
    """Rows a plan runs through the layers: prefixes + continuations, or N rows of L."""
    shape = plan.shape
    if plan.kind == "one-pass":
        return shape.cut + shape.T
    if plan.kind == "rows":
        return shape.N * shape.L
    return shape.cut + shape.N * shape.L


def unbucketed(compiled, config, plan) -> tuple[tuple, int]:
    """(key, rows) of the same layout without buckets: one-pass with its rows rounded to 8 (keyed
    by its shape, which holds no per-sequence length), or a short state's branches as rows of its
    state + longest suffix rounded to 8 (keyed by branches, length, candidates, image tokens)."""
    from valen_runtime.layouts import one_pass

    if plan.kind == "one-pass":
        plain = one_pass.build([compiled], config, buckets=False)
        return plain.key, rows_swept(plain)
    branches = [br for q in compiled.questions for br in q.branches]
    P = len(compiled.state.input_ids)
    L = -(-(P + max(len(br.suffix_ids) for br in branches)) // 8) * 8
    C = sum(len(br.candidate_positions) for br in branches)
    return ("rows", len(branches), L, C, sum(compiled.state.mm_token_type_ids)), len(branches) * L


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--export", type=Path, help="an export folder (its tokenizer and processor are used)")
    ap.add_argument("--work", type=Path, default=Path("build/bench"), help="where to build the tiny preset's exports without --export")
    ap.add_argument("--variants", type=int, default=899, help="lengths per kind (serve_load.new_shape)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--serve-order", type=int, default=0, metavar="N", help="replay serve_load's first N --new-shapes requests through the graph policy")
    ap.add_argument("--serve-batches", type=int, default=0, metavar="N",
                    help="the same N requests in batches of 5 to 8, in a shuffled order (valen-serve --max-batch 8 under load)")
    args = ap.parse_args()

    from valen_runtime.config import ModelConfig
    from valen_runtime.layouts import choose
    from valen_runtime.request import Compiler

    export = args.export
    if export is None:
        from artifacts import fixture_and_exports

        export = fixture_and_exports(args.work, "tiny")[1]["separate"]
    config = ModelConfig.from_dict(json.loads((export / "config.json").read_text()))
    prompt = json.loads((export / "valen_export.json").read_text())["prompt"]
    compiler = Compiler.from_dir(export, max_length=prompt["max_length"], media_kwargs=prompt.get("media_kwargs") or {})
    report = {"export": str(export), "variants": args.variants, "kinds": {}}
    for name, request in benchmark_requests().items():
        keys, plain_keys, growth = set(), set(), []
        for i in range(args.variants):
            compiled = compiler.compile(new_shape(request, i))
            plan = choose(compiled, config, "one-pass")
            keys.add(plan.key)
            plain_key, plain_rows = unbucketed(compiled, config, plan)
            plain_keys.add(plain_key)
            growth.append(rows_swept(plan) / plain_rows)
        growth.sort()
        entry = {"layout": plan.kind, "keys": len(keys), "keys_without_buckets": len(plain_keys),
                 "rows_growth_median": round(statistics.median(growth) - 1, 4), "rows_growth_p95": round(growth[int(0.95 * (len(growth) - 1))] - 1, 4)}
        report["kinds"][name] = entry
        print(f"{name}: {entry}", flush=True)
    if args.serve_order:
        report["serve_order"] = serve_order(compiler, config, args.serve_order)
        print(f"serve order: {report['serve_order']}", flush=True)
    if args.serve_batches:
        report["serve_batches"] = serve_batches(compiler, config, args.serve_batches)
        print(f"serve batches: {report['serve_batches']}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


def serve_order(compiler, config, n: int) -> dict:
    """serve_load's --new-shapes requests 0..n-1 (its default mix, in order) through `graph_plan`."""
    from serve_load import KINDS, parse_mix

    from valen_runtime.layouts import LAYOUTS, choose, graph_plan

    requests, schedule = benchmark_requests(), parse_mix("text:3,image:1")
    captured, captures, growth = [], {}, {}
    plan_ms, policy_ms, inputs_ms = {}, {}, {}  # host time per request: its own plan's shape, graph_plan on it, the served plan's tensors
    for i in range(n):
        kind = schedule[i % len(schedule)]
        compiled = [compiler.compile(new_shape(requests[KINDS[kind]], i))]
        t0 = time.perf_counter()
        plan = choose(compiled[0], config, "one-pass")
        t1 = time.perf_counter()
        served = graph_plan(compiled, config, plan, captured)
        t2 = time.perf_counter()
        served.inputs  # the served plan's tensors, built on first use (as the engine's upload does)
        t3 = time.perf_counter()
        plan_ms.setdefault(kind, []).append((t1 - t0) * 1e3)
        policy_ms.setdefault(kind, []).append((t2 - t1) * 1e3)
        inputs_ms.setdefault(kind, []).append((t3 - t2) * 1e3)
        if served.key not in captured:
            captured.append(served.key)
            captures[kind] = captures.get(kind, 0) + 1
        layout = LAYOUTS[served.kind]
        growth.setdefault(kind, []).append(layout.rows_swept(served.shape) / layout.rows_swept(plan.shape))

    def p50_p99(values: dict) -> dict:
        return {k: [round(statistics.median(v), 4), round(sorted(v)[int(0.99 * (len(v) - 1))], 4)] for k, v in values.items()}

    return {"requests": n, "graphs_captured": captures,
            "rows_growth_mean": {k: round(statistics.mean(v) - 1, 4) for k, v in growth.items()},
            "plan_ms_p50_p99": p50_p99(plan_ms), "graph_plan_ms_p50_p99": p50_p99(policy_ms), "inputs_ms_p50_p99": p50_p99(inputs_ms)}


def serve_batches(compiler, config, n: int, sizes=(5, 6, 6, 7, 7, 8, 8)) -> dict:
    """serve_load's --new-shapes requests 0..n-1 in a shuffled order (seed 0: a closed loop's
    arrivals interleave), taken in batches of `sizes` in turn, each batch's combined plan through
    `graph_plan` with the engine's policy for batches (captured on first use): how many batches
    replayed a captured graph and how many captured one, and the host time of each batch's plan
    (its shape, graph_plan, the served plan's tensors). The graph cache's bound (64) is applied to
    these keys alone; not modelled: the engine's wait for an image size to recur before capturing
    a plan with it, and the single requests' and vision towers' graphs sharing the cache, so a
    server replays somewhat fewer batches than this."""
    import random

    from serve_load import KINDS, parse_mix

    from valen_runtime.layouts import graph_plan, one_pass

    requests, schedule = benchmark_requests(), parse_mix("text:3,image:1")
    order = list(range(n))
    random.Random(0).shuffle(order)
    compiled = {i: compiler.compile(new_shape(requests[KINDS[schedule[i % len(schedule)]]], i)) for i in order}
    captured, replays, captures, host_ms, start, k = [], 0, 0, [], 0, 0
    while start < n:
        batch = [compiled[i] for i in order[start : start + sizes[k % len(sizes)]]]
        start, k = start + len(batch), k + 1
        t0 = time.perf_counter()
        served = graph_plan(batch, config, one_pass.build(batch, config), captured)
        served.inputs
        host_ms.append((time.perf_counter() - t0) * 1e3)
        if served.key in captured:
            replays += 1
            captured.remove(served.key)
        else:
            captures += 1
            captured = captured[-63:]
        captured.append(served.key)  # most recently used last, as the graph cache keeps them
    host_ms.sort()
    return {"requests": n, "batches": k, "replayed": replays, "captured": captures,
            "host_ms_p50_p99": [round(statistics.median(host_ms), 4), round(host_ms[int(0.99 * (len(host_ms) - 1))], 4)]}


if __name__ == "__main__":
    main()
