"""The parity gate: `python -m parity.gate OUTDIR` (`make parity-gate`; `--device cuda` on a GPU).

1. Builds the synthetic fixture (`--preset tiny`, or `2b` for the Qwen3.5-2B shapes) and both
   exports under OUTDIR, or reuses them from `--work`.
2. Takes the generated request set (`--set ci`: 43 questions, the CPU default; `gpu`: 213; each
   ends with the video group; `video`: the video group alone, 3 questions).
3. Starts the reference processes once for the whole set (bf16, the fp32 truth, and fp64 on the
   CPU), in the background, while this process runs the runtime: each runtime configuration once,
   reused by every gate that needs it (a bf16 configuration's dual run is the fp32 run of the same
   options).
4. Judges every configuration by its declared gate (`manifests/tolerances.json`):
   CPU: both LoRA modes x fp32/bf16 x per-branch, shared-prefix (PyTorch kernels) and
   shared-prefix on the fast path (valen_runtime.fast, eager; the engine plans the one-pass
   layout, what CUDA runs by default);
   CUDA: both LoRA modes in the engine's default configuration (shared-prefix, fast path, CUDA
   graphs) in bf16, with its fp32 dual run.
5. With `--controls`, runs every negative control (`parity.controls`) in every configuration
   that runs the code it damages, on a few requests that exercise it; each must FAIL.

Reports: OUTDIR/reports/<configuration>.json (controls under reports/controls/), a summary in
OUTDIR/summary.json and on stdout. Exit 0 when every configuration passes and every control
fails; 1 otherwise (also when `--budget` ran out before everything ran); 2 on a usage error.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from . import compare, generator, harness, reference_run, runtime_adapter, tolerances
from . import controls as controls_mod
from .cli import check_device, needed_runs, select_gate
from .errors import UsageProblem
from .interrupts import critical, unwinding_on_signals
from .reference_run import start_reference, wait_for_cached
from .report import table
from .runtime_adapter import EngineOptions, runtime_options


@dataclass(frozen=True)
class Config:
    lora: str
    options: EngineOptions

    @property
    def name(self) -> str:
        o = self.options  # resolved EngineOptions: the kernels are named where there is a choice
        parts = [self.lora, o.dtype, o.mode] + ([o.kernels] if o.mode == "shared-prefix" or o.kernels != "torch" else [])
        if o.device.startswith("cuda") and o.mode == "shared-prefix" and not o.graphs:
            parts.append("no-graphs")
        if o.temperature != 1.0:
            parts.append(f"t{o.temperature:g}")
        return "-".join(parts)


# A calibrated temperature, as the Preview's calibration file carries one: at 1 dividing,
# multiplying and ignoring it agree, so the gate also judges one configuration away from 1.
GATE_TEMPERATURE = 0.7


def configurations(device: str, kernels: str | None = None, graphs: bool | None = None) -> list[Config]:
    """The gate's configurations."""
    out = []
    for lora in ("separate", "merged"):
        if device == "cpu":
            for dtype in ("bf16", "fp32"):
                out += [Config(lora, runtime_options("cpu", dtype, "per-branch")),
                        Config(lora, runtime_options("cpu", dtype, "shared-prefix", kernels="torch")),
                        # The fast path's code (fused layers run eagerly) in CUDA's default one-pass
                        # layout (the engine plans it for the fast path on the CPU).
                        Config(lora, runtime_options("cpu", dtype, "shared-prefix", kernels="fast"))]
            if lora == "separate":
                out.append(Config(lora, runtime_options("cpu", "bf16", "shared-prefix", kernels="fast", temperature=GATE_TEMPERATURE)))
        else:
            out.append(Config(lora, runtime_options(device, "bf16", "shared-prefix", kernels=kernels, graphs=graphs)))
    if device != "cpu":  # the merged dual check's anchor runs anyway: judge it against the truth too
        out.append(Config("merged", runtime_adapter.module_path_options(runtime_options(device))))
    return out


class Deadline:
    def __init__(self, seconds: float | None):
        self.t0 = time.perf_counter()
        self.seconds = seconds

    def left(self) -> float | None:
        return None if self.seconds is None else self.seconds - (time.perf_counter() - self.t0)

    def expired(self, need: float = 0.0) -> bool:
        left = self.left()
        return left is not None and left < need


def _control_subsets(requests: list, limit: int) -> dict[str, list | None]:
    """Each control's requests (up to `limit`), or None where no request of the set exercises it."""
    subsets = {}
    for control in controls_mod.CONTROLS:
        try:
            subsets[control.name] = controls_mod.subset(control, requests, limit)
        except ValueError:
            subsets[control.name] = None
    return subsets


def _say(*parts) -> None:
    print(*parts, flush=True)


def build_inputs(out: Path, work: Path | None, preset: str) -> tuple:
    """(fixture, {lora: export dir}); under `work` only what is missing is built."""
    from valen_export.export import export
    from valen_export.fixture import Fixture, build_fixture

    root = work if work is not None else out
    fx_dir = root / f"fixture-{preset}"
    if (fx_dir / "pins.json").exists():
        fx = Fixture.at(fx_dir)
    else:
        fx = build_fixture(fx_dir, preset=preset, seed=0)
    exports = {}
    for lora in ("separate", "merged"):
        exports[lora] = root / f"export-{preset}-{lora}"
        if not (exports[lora] / "valen_export.json").exists():
            export(fx.checkpoint, fx.base, exports[lora], lora_mode=lora, pins_path=fx.pins, progress=False)
    return fx, exports


def _free_device_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def evaluate_config(config: Config, export: Path, fx, requests, refs, gate, runs: dict, threads) -> dict:
    """`runs`: {(lora, options): RuntimeRun} holding every run `needed_runs` names for this config."""
    setup = harness.Setup(export, fx.checkpoint, fx.base, config.options, threads=threads)
    roles = {role: runs[(config.lora, o)] for role, o in needed_runs(gate, config.options).items()}
    return harness.evaluate(setup, requests, refs, gate, roles["main"], roles.get("fp32"), roles.get("anchor"))


def run_config(config: Config, export: Path, fx, requests, refs, gate, threads, fail_fast: bool = False, fp32_gate=None) -> dict:
    """Every run the gate of `config` needs, on `requests`, and its report. With fail_fast (and
    `fp32_gate`, the entry of the same combination in fp32), a configuration with a dual check goes
    cheapest first and stops at the first failing part, whose report it returns: its fp32 run
    against the references under `fp32_gate`, then against the module-path anchor (merged), then
    the main run with everything."""
    roles = needed_runs(gate, config.options)
    runs = {}
    if fail_fast and "fp32" in roles:
        bf16_err = compare.bf16_error(refs, [f"{c}/{n}" for c, n, _ in requests])
        fp32_run = runtime_adapter.run(export, roles["fp32"], requests, threads=threads)
        setup = harness.Setup(export, fx.checkpoint, fx.base, roles["fp32"], threads=threads)
        def anchored():
            anchor = runs[(config.lora, roles["anchor"])] = runtime_adapter.run(export, roles["anchor"], requests, threads=threads)
            return {"bf16": refs["bf16"], "fp32": harness.AnchorRun(refs["fp32"], anchor)}

        steps = [(fp32_gate, lambda: {d: r for d, r in refs.items() if d != "fp64"}, "the fp32 run under its own entry")]
        if "anchor" in roles:
            steps.append((gate.dual_gate, anchored, "the fp32 run against the module path"))
        for step_gate, step_refs, what in steps:
            report = harness.judge_run(setup, requests, step_refs(), step_gate, fp32_run, bf16_err)
            if report["verdict"] == "fail":
                report["note"] = f"fail-fast: {what} already failed; the later parts did not run"
                return report
        runs[(config.lora, roles["fp32"])] = fp32_run
    for options in roles.values():
        if (config.lora, options) not in runs:
            runs[(config.lora, options)] = runtime_adapter.run(export, options, requests, threads=threads)
    return evaluate_config(config, export, fx, requests, refs, gate, runs, threads)


def run_control(control, config: Config, export: Path, fx, requests, refs, gate, threads, fail_fast: bool, fp32_gate=None) -> dict:
    """The gate of `config` with `control` applied (`export`: the damaged copy for an export
    control), on `requests`; expected verdict: fail. Every run loads a fresh engine (fresh CUDA
    graphs); torch.compile's cache re-checks its guards, which a patched global function fails."""
    with control.applied():
        return run_config(config, export, fx, requests, refs, gate, threads, fail_fast, fp32_gate)


def _errors(report: dict) -> str:
    e = report["summary"]["errors"]
    col = lambda k: "-" if not e[k] else f"{e[k]['max']:.2e}"  # noqa: E731
    return f"ref-vs-truth {col('reference_vs_truth')}  rt-vs-truth {col('runtime_vs_truth')}  rt-vs-ref {col('runtime_vs_reference')}"


def _first_problem(report: dict) -> str:
    for e in report["requests"]:
        for p in e["problems"]:
            return f"{e['case']}/{e['name']}: {p}"
        for q in e["questions"]:
            for p in q.get("problems", []):
                return f"{e['case']}/{e['name']} {q['qid']}: {p}"
    for p in report["distribution"].get("problems", []):
        return p
    if report.get("dual") is not None and report["dual"]["verdict"] == "fail":
        return "dual: " + _first_problem(report["dual"])
    return "-"


def _write(path: Path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m parity.gate", description=__doc__.splitlines()[0])
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--device", default="cpu", help="cpu (the CI gate) or cuda")
    ap.add_argument("--preset", choices=["tiny", "2b"], default="tiny", help="fixture shapes (default tiny)")
    ap.add_argument("--work", type=Path, default=None, help="reuse (or build once) the fixture and exports here instead of OUTDIR")
    ap.add_argument("--set", dest="request_set", choices=sorted(generator.SETS), default=None, help="generated request set (default: ci on the CPU, gpu on CUDA)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lora", choices=["separate", "merged"], default=None, help="only this export's configurations and controls (default: both)")
    ap.add_argument("--tolerances", type=Path, default=tolerances.DEFAULT_PATH)
    ap.add_argument("--threads", type=int, default=None, help="torch threads on both sides (default: 1 on the CPU, torch's default on CUDA)")
    ap.add_argument("--kernels", choices=runtime_adapter.KERNELS, default=None, help="CUDA: runtime kernels (default: the engine's choice)")
    ap.add_argument("--no-cuda-graphs", action="store_true", help="CUDA: turn the runtime's CUDA-graph replay off")
    ap.add_argument("--no-fp64", action="store_true", help="CPU: skip the fp64 reference (the truth columns of fp32 runs)")
    ap.add_argument("--controls", action="store_true", help="also run every negative control (each must fail)")
    ap.add_argument("--only-controls", action="store_true", help="run the negative controls only (no positive configurations)")
    ap.add_argument("--control-requests", type=int, default=4, help="requests per control run (default 4)")
    ap.add_argument("--fail-fast", action="store_true", help="controls: stop each at its first failing part, fp32 first (always on CUDA, where each damaged compiled path costs a compile)")
    ap.add_argument("--reference-cache", type=Path, default=None, help="reference results cache (default OUTDIR/reference-cache)")
    ap.add_argument("--reference-shards", type=int, default=1, help="reference processes per dtype (default 1)")
    ap.add_argument("--wait-for-references", type=float, default=None, metavar="SECONDS",
                    help="start no reference process: wait up to SECONDS for another gate process (same arguments, same cache) to fill the cache")
    ap.add_argument("--budget", type=float, default=None, help="seconds; work not started in time is skipped (and the gate fails)")
    args = ap.parse_args(argv)

    deadline = Deadline(args.budget)
    device = args.device.split(":")[0]
    threads = args.threads if args.threads is not None else (1 if device == "cpu" else None)
    out = args.outdir
    if out.exists():
        shutil.rmtree(out)
    (out / "reports").mkdir(parents=True)
    cache = args.reference_cache or out / "reference-cache"
    try:
        check_device(args.device)
        fx, exports = build_inputs(out, args.work, args.preset)
        _say(f"fixture ({args.preset}) and exports ready at {time.perf_counter() - deadline.t0:.1f} s")
        requests = generator.SETS[args.request_set or ("ci" if device == "cpu" else "gpu")](args.seed)
        control_subsets = _control_subsets(requests, args.control_requests) if args.controls or args.only_controls else {}
        if args.only_controls:  # the references are needed for the controls' requests only
            used = {(c, n) for subset in control_subsets.values() if subset for c, n, _ in subset}
            requests = [(c, n, r) for c, n, r in requests if (c, n) in used]
        n_questions = sum(len(r["questions"]) for *_, r in requests)
        every = configurations(args.device, args.kernels, False if args.no_cuda_graphs else None)
        every = [c for c in every if args.lora in (None, c.lora)]
        configs = [] if args.only_controls else every
        # Controls run in the configurations the device gates by default (on CUDA not the anchor's).
        control_configs = [c for c in every if device == "cpu" or c.options.dtype == "bf16"]
        gates = {c: select_gate(args.tolerances, c.lora, c.options) for c in every}
        fp32_gates = {c: select_gate(args.tolerances, c.lora, runtime_adapter.with_dtype(c.options, "fp32")) for c in every}
        # Every dtype any gate of the device needs, so that gate processes of either export share one cache.
        all_configs = configurations(args.device, args.kernels, False if args.no_cuda_graphs else None)
        dtypes = sorted({d for c in all_configs for d in harness.reference_dtypes(select_gate(args.tolerances, c.lora, c.options), device, not args.no_fp64)})
        ids = [(f"{c}/{n}", r) for c, n, r in requests]
        jobs = {}
        if args.wait_for_references is None:
            try:
                for d in dtypes:
                    start_reference(fx.checkpoint, fx.base, ids, device=args.device, dtype=d, threads=threads,
                                    cache_dir=cache, shards=args.reference_shards, started=jobs)
            except BaseException:  # the dtypes already started must not outlive a failure to start the next
                with critical():
                    for job in jobs.values():
                        job.stop_and_remove()
                raise
        _say(f"{len(requests)} requests, {n_questions} questions; references {', '.join(dtypes)}: "
             + ("started" if jobs else "awaited in the cache") + f" ({args.reference_shards} process(es) each)")
        summary = {"configurations": {}, "controls": {}, "skipped": [], "requests": len(requests), "questions": n_questions}
        failed = []
        try:
            runs = {}
            for c in configs:  # each runtime run once, shared by every configuration that judges it
                for key in [(c.lora, o) for o in needed_runs(gates[c], c.options).values()]:
                    if key in runs:
                        continue
                    if deadline.expired(30):
                        summary["skipped"].append(f"runtime {key[0]} {runtime_adapter.label(key[1])}")
                        continue
                    t1 = time.perf_counter()
                    runs[key] = runtime_adapter.run(exports[key[0]], key[1], requests, threads=threads)
                    _free_device_memory()
                    _say(f"runtime {key[0]} {runtime_adapter.label(key[1])}: {len(requests)} requests in {time.perf_counter() - t1:.1f} s")
            refs = {}
            for d in dtypes:
                left = deadline.left()
                if d in jobs:
                    jobs[d].timeout = left
                    refs[d] = jobs[d].wait()
                else:
                    refs[d] = wait_for_cached(fx.checkpoint, fx.base, ids, args.device, d, cache, left if left is not None else args.wait_for_references,
                                              threads=threads, shards=args.reference_shards)
                _say(f"reference {d}: {refs[d].seconds:.1f} s{' (cached)' if refs[d].cached else ''} at {time.perf_counter() - deadline.t0:.1f} s")
        finally:
            with critical():  # every worker stopped and waited for, whatever signal comes next
                for job in jobs.values():
                    job.stop_and_remove()
        for export in exports.values():
            problems = harness.check_pins(json.loads(fx.pins.read_text()), harness.manifest_info(export)[0], refs["fp32"], fx.base)
            if problems:
                raise UsageProblem("; ".join(problems))

        for c in configs:
            needed = [(c.lora, o) for o in needed_runs(gates[c], c.options).values()]
            if any(k not in runs for k in needed):
                summary["configurations"][c.name] = {"verdict": "skipped"}
                failed.append(c.name)
                continue
            report = evaluate_config(c, exports[c.lora], fx, requests, refs, gates[c], runs, threads)
            _write(out / "reports" / f"{c.name}.json", report)
            summary["configurations"][c.name] = {"verdict": report["verdict"], "summary": report["summary"], "bounds": report["bounds"],
                                                 "distribution": report["distribution"], "dual_note": report.get("dual_note"),
                                                 "dual": None if report["dual"] is None else {"verdict": report["dual"]["verdict"], "summary": report["dual"]["summary"], "bounds": report["dual"]["bounds"]}}
            if report["verdict"] != "pass":
                failed.append(c.name)
                _say(table(report))
            else:
                _say(f"PASS {c.name}: {_errors(report)}; bound {report['bounds']['per_option']:.2e}"
                     + ("" if report["dual"] is None else f"; dual PASS ({report['dual']['bounds']['judged']}) {report['dual']['summary']['max_judged_error']:.2e} <= {report['dual']['bounds']['per_option']:.2e}"))
        del runs
        _free_device_memory()

        if args.controls or args.only_controls:
            for control in controls_mod.CONTROLS:
                subset = control_subsets[control.name]
                if subset is None:  # a set without such a request (--set video) cannot show that the gate catches it
                    _say(f"control {control.name}: not run, no request in the set exercises it")
                    failed.append(f"control {control.name} (no request in the set exercises it)")
                    continue
                for c in control_configs:
                    if not control.exercised_by(c.lora, c.options):
                        continue
                    label = f"{control.name} / {c.name}"
                    if deadline.expired(40):
                        summary["skipped"].append(f"control {label}")
                        failed.append(f"control {label} (skipped)")
                        continue
                    export = exports[c.lora]
                    if control.damages_export:
                        export = exports[c.lora].parent / f"control-{control.name}-{c.lora}"  # beside it: hard links
                        controls_mod.perturb_lora_element(exports[c.lora], export)
                    t1 = time.perf_counter()
                    report = run_control(control, c, export, fx, subset, refs, gates[c], threads, fail_fast=args.fail_fast or device != "cpu", fp32_gate=fp32_gates[c])
                    _free_device_memory()
                    if control.damages_export:
                        shutil.rmtree(export, ignore_errors=True)
                    _write(out / "reports" / "controls" / f"{control.name}-{c.name}.json", report)
                    ok = report["verdict"] == "fail"
                    summary["controls"][label] = {"verdict": report["verdict"], "expected": "fail", "first_problem": _first_problem(report), "note": report.get("note")}
                    _say(f"control {label}: gate {report['verdict'].upper()} ({'as expected' if ok else 'NOT CAUGHT'}; "
                         f"{_first_problem(report)[:160]}) [{time.perf_counter() - t1:.1f} s]")
                    if not ok:
                        failed.append(f"control {label}")
    except UsageProblem as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    total = time.perf_counter() - deadline.t0
    summary["seconds"] = total
    summary["failed"] = failed
    (out / "summary.json").write_text(json.dumps(summary, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    if failed:
        print(f"parity gate FAILED: {', '.join(failed)} ({total:.1f} s); reports in {out / 'reports'}", file=sys.stderr)
        return 1
    print(f"parity gate passed: {len(configs)} configurations, {n_questions} questions"
          + (f", {len(summary['controls'])} control runs failed as they must" if summary["controls"] else "") + f" ({total:.1f} s)")
    return 0


if __name__ == "__main__":
    with unwinding_on_signals(cleanup=reference_run.stop_all):  # a stop signal stops the reference workers before the gate exits
        code = main()
    sys.exit(code)
