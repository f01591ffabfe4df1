"""`valen-parity`: does the runtime on an export compute what the pinned Valen reference computes?

Exit status: 0 every check passed, 1 a parity failure (numbers beyond the declared tolerance,
token ids / usage / decisions differ, one side rejected a request the other accepted), 2 a usage
error (bad paths, unreadable export, no tolerance declared, the reference could not be built);
usage errors print one line, no traceback.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import sys
import threading
from pathlib import Path

import click

from . import cases as cases_mod
from . import harness, tolerances


# A --requests file holds at most this many bytes (eight requests at the 8 MiB body limit).
MAX_REQUESTS_FILE = 64 * 1024 * 1024


def _read_requests(path: Path) -> list[tuple[str, str, dict]]:
    """One wire request per line, each read and checked as valen-serve reads a body (wire.py):
    never more than 8 MiB + 2 bytes of a line are read, and the whole file is bounded too."""
    from valen_runtime.errors import RequestError
    from valen_runtime.wire import MAX_BODY, BodyError, decode_request

    out, total = [], 0
    try:
        with open(path, "rb") as handle:
            for n, line in enumerate(iter(lambda: handle.readline(MAX_BODY + 2), b""), 1):
                total += len(line)
                if total > MAX_REQUESTS_FILE:
                    raise harness.UsageProblem(f"{path}: more than {MAX_REQUESTS_FILE} bytes; split the requests over several runs")
                body = line.rstrip(b"\r\n")
                if len(body) > MAX_BODY:
                    raise harness.UsageProblem(f"{path}:{n}: longer than the {MAX_BODY}-byte body limit")
                if not body.strip():
                    continue
                try:
                    req = decode_request(body)
                except BodyError as e:
                    raise harness.UsageProblem(f"{path}:{n}: not a JSON request ({e})") from None
                except RequestError as e:
                    raise harness.UsageProblem(f"{path}:{n}: refused by the wire contract ({e})") from None
                out.append(("requests", f"line{n}", req))
    except OSError as e:
        raise harness.UsageProblem(f"{path}: cannot read ({e.strerror or e})") from None
    if not out:
        raise harness.UsageProblem(f"{path}: holds no request")
    return out


def _check_export_files(export: Path) -> None:
    """Every file the export's manifest lists, re-hashed: a damaged export is refused, not compared."""
    from valen_runtime.errors import ValenError
    from valen_runtime.manifest import Manifest

    try:
        Manifest.load(export).require_files("full")
    except ValenError as e:
        raise harness.UsageProblem(f"{e}; the export does not match its manifest, nothing was compared") from None


def run(
    export: Path,
    checkpoint: Path,
    base: Path,
    case: str | None,
    requests_file: Path | None,
    device: str,
    dtype: str,
    mode: str,
    pins: Path | None,
    valen_source: str | None,
    tolerances_path: Path,
    threads: int | None,
    reference_cache: Path | None,
    kernels: str | None = None,
    graphs: bool | None = None,
    lora_gemm: str | None = None,
    layout: str | None = None,
) -> dict:
    """The whole run; returns the report. Raises harness.UsageProblem for exit-2 problems."""
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise harness.UsageProblem(f"--device {device}: CUDA is not available here")
    if device not in ("cpu",) and not device.startswith("cuda"):
        raise harness.UsageProblem(f"--device {device}: expected cpu or cuda")
    for path, opt in ((export, "--export"), (checkpoint, "--checkpoint"), (base, "--base")):
        if not path.is_dir():
            raise harness.UsageProblem(f"{path}: {opt} must be an existing directory")
    manifest, manifest_sha = harness.manifest_info(export)
    _check_export_files(export)
    try:
        entries = tolerances.load(tolerances_path)
        tol = tolerances.select(entries, manifest["lora"]["mode"], dtype, device, mode)
    except tolerances.ToleranceError as e:
        raise harness.UsageProblem(str(e)) from None
    pins_data = None
    if pins is not None:
        try:
            pins_data = json.loads(pins.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise harness.UsageProblem(f"{pins}: cannot read the pins file ({getattr(e, 'strerror', None) or e})") from None
    if valen_source is not None:
        from . import valen_source as vs

        try:
            vs.check_checkout(valen_source)
        except vs.ValenSourceError as e:
            raise harness.UsageProblem(str(e)) from None
    todo = []
    if case:
        todo += cases_mod.cases(case)
    if requests_file is not None:
        todo += _read_requests(requests_file)
    if not todo:
        raise harness.UsageProblem("nothing to run: give --case and/or --requests")
    with _signals_unwind():  # so the reference's temporary folder is removed on SIGTERM / SIGHUP too
        ref = harness.run_reference(
            checkpoint, base, [(f"{c}/{n}", r) for c, n, r in todo], device=device, dtype=dtype,
            valen_source=valen_source, threads=threads, cache_dir=reference_cache,
        )
        previous = torch.get_num_threads()
        try:
            problems = harness.check_pins(pins_data, manifest, ref, base)
            if problems:
                raise harness.UsageProblem("; ".join(problems))
            setup = harness.Setup(export, checkpoint, base, device, dtype, mode, valen_source, threads, kernels, graphs, lora_gemm, layout)
            if threads:
                torch.set_num_threads(threads)
            return harness.evaluate(setup, todo, ref, tol, manifest, manifest_sha)
        finally:
            torch.set_num_threads(previous)
            if not ref.cached:  # the reference's temporary folder (a cache hit is the cache's own folder)
                shutil.rmtree(ref.out_dir, ignore_errors=True)


@contextlib.contextmanager
def _signals_unwind():
    """SIGTERM and SIGHUP raise SystemExit(128 + signal) inside, where they still have their default
    action and this is the main thread; the previous handlers come back afterwards."""
    def unwind(signum, frame):
        raise SystemExit(128 + signum)

    taken = []
    if threading.current_thread() is threading.main_thread():
        taken = [sig for sig in (signal.SIGTERM, signal.SIGHUP) if signal.getsignal(sig) is signal.SIG_DFL]
    for sig in taken:
        signal.signal(sig, unwind)
    try:
        yield
    finally:
        for sig in taken:
            signal.signal(sig, signal.SIG_DFL)


@click.command(name="valen-parity")
@click.option("--export", "export", required=True, type=click.Path(path_type=Path), help="valen-export output directory (the runtime side).")
@click.option("--checkpoint", required=True, type=click.Path(path_type=Path), help="Valen training checkpoint folder (config.json + checkpoint.pt).")
@click.option("--base", required=True, type=click.Path(path_type=Path), help="Qwen3.5 base folder the checkpoint was trained on.")
@click.option("--case", type=click.Choice(list(cases_mod.CASE_NAMES) + ["all"]), default=None, help="Built-in cases to run.")
@click.option("--requests", "requests_file", type=click.Path(path_type=Path), default=None, help="JSONL file, one wire request per line.")
@click.option("--device", default="cpu", show_default=True, help="cpu or cuda (both sides).")
@click.option("--dtype", type=click.Choice(["bf16", "fp32"]), default="bf16", show_default=True)
@click.option("--mode", type=click.Choice(["per-branch", "shared-prefix"]), default=None, help="Runtime execution mode (default: shared-prefix on CUDA, the runtime's default there; per-branch on the CPU). The reference is always per-branch.")
@click.option("--pins", type=click.Path(path_type=Path), default=None, help="Pins file: checkpoint.pt sha256 and base revision must match it.")
@click.option("--report", "report_path", type=click.Path(path_type=Path), default=None, help="Write the JSON report here.")
@click.option("--valen-source", type=click.Path(path_type=str), default=None, help="A Liuziyu77/Valen checkout at the pinned commit: use its own builder, loader and compiler as the reference.")
@click.option("--tolerances", "tolerances_path", type=click.Path(path_type=Path), default=tolerances.DEFAULT_PATH, show_default=True, help="Declared tolerances.")
@click.option("--threads", type=int, default=None, help="torch threads on both sides (default: torch's default).")
@click.option("--kernels", type=click.Choice(["torch", "fast"]), default=None, help="Runtime kernels at the model's seams (default: the engine's choice: fast for CUDA shared-prefix, else torch).")
@click.option("--cuda-graphs/--no-cuda-graphs", "graphs", default=None, help="Runtime CUDA-graph replay (default: the engine's choice: on for CUDA shared-prefix).")
@click.option("--lora-gemm", type=click.Choice(["fp32", "bf16x3"]), default=None, help="How the fast path runs a separate FP32 LoRA (default fp32; bf16x3: exact bf16 splits on tensor cores, bf16 only).")
@click.option("--layout", type=click.Choice(["batch", "packed", "one-pass"]), default=None, help="Shared-prefix layout (default: the engine's choice, one-pass on CUDA with flash-linear-attention, else batch). batch: a right-padded batch of branches after a prefix pass; packed: the branches varlen in one row; one-pass: the prefix in that same row.")
@click.option("--reference-cache", type=click.Path(path_type=Path), default=None, help="Reuse reference results across runs (keyed by checkpoint/base/requests/dtype/device hashes).")
def main(export, checkpoint, base, case, requests_file, device, dtype, mode, pins, report_path, valen_source, tolerances_path, threads, kernels, graphs, lora_gemm, layout, reference_cache):
    """Compare the runtime on EXPORT with the Valen reference rebuilt from CHECKPOINT + BASE.

    \b
    Example:
      valen-parity --export build/export --checkpoint ckpt --base qwen --case all --dtype fp32 --report r.json
    """
    try:
        if mode is None:
            mode = "shared-prefix" if str(device).startswith("cuda") else "per-branch"
        report = run(export, checkpoint, base, case, requests_file, device, dtype, mode, pins, valen_source, tolerances_path, threads, reference_cache, kernels, graphs, lora_gemm, layout)
    except harness.UsageProblem as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    click.echo(harness.table(report))
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
