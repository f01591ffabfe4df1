"""`valen-parity`: does the runtime on an export compute what the pinned Valen reference computes,
as measured against the truth (the reference in fp32)?

Exit status: 0 every check passed, 1 a parity failure (numbers beyond the declared gate, token ids /
usage / rotary tables / decisions differ, one side rejected a request the other accepted), 2 a
usage error (bad paths, unreadable export, no tolerance declared, the reference could not be
built); usage errors print one line, no traceback.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from valen_runtime.cli_options import engine_options, threads_option

from . import cases as cases_mod
from . import generator, harness, runtime_adapter, tolerances
from .errors import UsageProblem
from .interrupts import critical, unwinding_on_signals
from . import reference_run
from .reference_run import start_reference
from .runtime_adapter import EngineOptions


# A --requests file holds at most this many bytes (eight requests at the 8 MiB body limit, or two
# carrying videos at their 24 MiB limit).
MAX_REQUESTS_FILE = 64 * 1024 * 1024


def _read_requests(path: Path) -> list[tuple[str, str, dict]]:
    """One wire request per line, each read and checked as valen-serve reads a body (wire.py):
    never more than 24 MiB + 2 bytes of a line are read (a line over 8 MiB must carry a video, as
    a body must), and the whole file is bounded too."""
    from valen_runtime.errors import RequestError
    from valen_runtime.wire import MAX_VIDEO_BODY, BodyError, decode_request

    out, total = [], 0
    try:
        with open(path, "rb") as handle:
            for n, line in enumerate(iter(lambda: handle.readline(MAX_VIDEO_BODY + 2), b""), 1):
                total += len(line)
                if total > MAX_REQUESTS_FILE:
                    raise UsageProblem(f"{path}: more than {MAX_REQUESTS_FILE} bytes; split the requests over several runs")
                body = line.rstrip(b"\r\n")
                if len(body) > MAX_VIDEO_BODY:
                    raise UsageProblem(f"{path}:{n}: longer than the {MAX_VIDEO_BODY}-byte body limit of a request with a video")
                if not body.strip():
                    continue
                try:
                    req = decode_request(body)
                except BodyError as e:
                    raise UsageProblem(f"{path}:{n}: not a JSON request ({e})") from None
                except RequestError as e:
                    raise UsageProblem(f"{path}:{n}: refused by the wire contract ({e})") from None
                out.append(("requests", f"line{n}", req))
    except OSError as e:
        raise UsageProblem(f"{path}: cannot read ({e.strerror or e})") from None
    if not out:
        raise UsageProblem(f"{path}: holds no request")
    return out


def _check_export_files(export: Path) -> None:
    """Every file the export's manifest lists, re-hashed: a damaged export is refused, not compared."""
    from valen_runtime.errors import ValenError
    from valen_runtime.manifest import Manifest

    try:
        Manifest.load(export).require_files("full")
    except ValenError as e:
        raise UsageProblem(f"{e}; the export does not match its manifest, nothing was compared") from None


def select_gate(tolerances_path: Path, lora: str, options: EngineOptions) -> tolerances.Gate:
    """The declared gate of the combination (exit 2 when the file is bad or has none)."""
    try:
        return tolerances.select(tolerances.load(tolerances_path), lora, options.dtype, options.device, options.mode)
    except tolerances.ToleranceError as e:
        raise UsageProblem(str(e)) from None


def needed_runs(gate: tolerances.Gate, options: EngineOptions) -> dict[str, EngineOptions]:
    """The runtime runs a gate judges: "main", and for a dual check "fp32" (the same options in
    fp32, when the main run is bf16) and "anchor" (the module path, for a merged export)."""
    runs = {"main": options}
    if gate.dual is not None:
        fp32 = runtime_adapter.with_dtype(options, "fp32")
        if fp32 != options:
            runs["fp32"] = fp32
        if gate.dual == "module-path" and runtime_adapter.module_path_options(options) != fp32:
            runs["anchor"] = runtime_adapter.module_path_options(options)
    return runs


def check_device(device: str) -> None:
    import torch

    if device not in ("cpu",) and not device.startswith("cuda"):
        raise UsageProblem(f"--device {device}: expected cpu or cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageProblem(f"--device {device}: CUDA is not available here")


def run(
    export: Path,
    checkpoint: Path,
    base: Path,
    requests: list[tuple[str, str, dict]],
    options: EngineOptions,
    pins: Path | None = None,
    valen_source: str | None = None,
    tolerances_path: Path = tolerances.DEFAULT_PATH,
    threads: int | None = None,
    reference_cache: Path | None = None,
    fp64: bool | None = None,
    reference_shards: int = 1,
) -> dict:
    """One configuration (and its dual run, if its gate has one); returns the report. Raises
    UsageProblem for exit-2 problems. The reference processes run while the runtime does."""
    check_device(options.device)
    for path, opt in ((export, "--export"), (checkpoint, "--checkpoint"), (base, "--base")):
        if not path.is_dir():
            raise UsageProblem(f"{path}: {opt} must be an existing directory")
    manifest, _ = harness.manifest_info(export)
    _check_export_files(export)
    gate = select_gate(tolerances_path, manifest["lora"]["mode"], options)
    pins_data = None
    if pins is not None:
        try:
            pins_data = json.loads(pins.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise UsageProblem(f"{pins}: cannot read the pins file ({getattr(e, 'strerror', None) or e})") from None
    if valen_source is not None:
        from . import valen_source as vs

        try:
            vs.check_checkout(valen_source)
        except vs.ValenSourceError as e:
            raise UsageProblem(str(e)) from None
    if not requests:
        raise UsageProblem("nothing to run: give --case, --generated and/or --requests")
    fp64 = options.device == "cpu" and valen_source is None if fp64 is None else fp64
    dtypes = harness.reference_dtypes(gate, options.device.split(":")[0], fp64)
    ids = [(f"{c}/{n}", r) for c, n, r in requests]
    jobs = {}
    with unwinding_on_signals(cleanup=reference_run.stop_all):  # workers and folders go on a stop signal too
        try:
            for d in dtypes:
                start_reference(checkpoint, base, ids, device=options.device, dtype=d, valen_source=valen_source,
                                threads=threads, cache_dir=reference_cache, shards=reference_shards, started=jobs)
            runs = {role: runtime_adapter.run(export, o, requests, threads=threads) for role, o in needed_runs(gate, options).items()}
            refs = {d: job.wait() for d, job in jobs.items()}
            problems = harness.check_pins(pins_data, manifest, refs["fp32"], base)
            if problems:
                raise UsageProblem("; ".join(problems))
            setup = harness.Setup(export, checkpoint, base, options, valen_source, threads)
            return harness.evaluate(setup, requests, refs, gate, runs["main"], runs.get("fp32"), runs.get("anchor"))
        finally:
            with critical():  # every job is stopped and waited for, whatever signal comes next
                for job in jobs.values():
                    job.stop_and_remove()


def collect_requests(case: str | None, generated: str | None, seed: int, requests_file: Path | None) -> list[tuple[str, str, dict]]:
    todo = []
    if case:
        todo += cases_mod.cases(case)
    if generated:
        todo += generator.SETS[generated](seed)
    if requests_file is not None:
        todo += _read_requests(requests_file)
    return todo


@click.command(name="valen-parity")
@click.option("--export", "export", required=True, type=click.Path(path_type=Path), help="valen-export output directory (the runtime side).")
@click.option("--checkpoint", required=True, type=click.Path(path_type=Path), help="Valen training checkpoint folder (config.json + checkpoint.pt).")
@click.option("--base", required=True, type=click.Path(path_type=Path), help="Qwen3.5 base folder the checkpoint was trained on.")
@click.option("--case", type=click.Choice(list(cases_mod.CASE_NAMES) + ["all"]), default=None, help="Built-in cases to run.")
@click.option("--generated", type=click.Choice(sorted(generator.SETS)), default=None, help="A generated request set: ci (40 questions) or gpu (210).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the generated set.")
@engine_options
@click.option("--requests", "requests_file", type=click.Path(path_type=Path), default=None, help="JSONL file, one wire request per line.")
@click.option("--pins", type=click.Path(path_type=Path), default=None, help="Pins file: checkpoint.pt sha256 and base revision must match it.")
@click.option("--report", "report_path", type=click.Path(path_type=Path), default=None, help="Write the JSON report here.")
@click.option("--valen-source", type=click.Path(path_type=str), default=None, help="A Liuziyu77/Valen checkout at the pinned commit: use its own builder, loader and compiler as the reference.")
@click.option("--tolerances", "tolerances_path", type=click.Path(path_type=Path), default=tolerances.DEFAULT_PATH, show_default=True, help="Declared gates.")
@threads_option("torch threads on both sides (default: torch's, one per core).")
@click.option("--fp64/--no-fp64", default=None, help="Also run the reference in fp64 as the truth of fp32 runs (default: on for the CPU; memory: twice the fp32 reference).")
@click.option("--reference-cache", type=click.Path(path_type=Path), default=None, help="Reuse reference results across runs (keyed by checkpoint/base/requests/dtype/device hashes).")
@click.option("--reference-shards", type=int, default=1, show_default=True, help="Reference processes per dtype (they share the device).")
def main(export, checkpoint, base, case, generated, seed, device, dtype, mode, kernels, graphs, compile_, requests_file, pins, report_path,
         valen_source, tolerances_path, threads, fp64, reference_cache, reference_shards):
    """Compare the runtime on EXPORT with the Valen reference rebuilt from CHECKPOINT + BASE, and both with the truth.

    The engine options are valen-run's and valen-serve's, with their defaults; they set the runtime
    side, and --device is the reference's device too (the reference is always per-branch).

    \b
    Example:
      valen-parity --export build/export --checkpoint ckpt --base qwen --generated ci --report r.json
    """
    try:
        if device is not None:
            check_device(device)
        options = runtime_adapter.runtime_options(device, dtype, mode, kernels, graphs, compile_)
        todo = collect_requests(case, generated, seed, requests_file)
        report = run(export, checkpoint, base, todo, options, pins, valen_source, tolerances_path, threads, reference_cache, fp64, reference_shards)
    except UsageProblem as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    from .report import table

    click.echo(table(report))
    if report_path is not None:
        try:
            report_path.parent.mkdir(parents=True, exist_ok=True)
            report_path.write_text(json.dumps(report, indent=1, ensure_ascii=False, allow_nan=True) + "\n", encoding="utf-8")
        except OSError as e:
            click.echo(f"error: {report_path}: cannot write the report ({e.strerror or e})", err=True)
            sys.exit(2)
    sys.exit(0 if report["verdict"] == "pass" else 1)


if __name__ == "__main__":
    main()
