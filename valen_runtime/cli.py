"""`valen-run`: answer one request (file or stdin) from an export directory and print the response JSON.

The request is read and checked by the wire contract (wire.py) before the export is loaded: at
most 8 MiB + 1 byte is ever read, from a file or from stdin. The response is the body valen-serve
sends for the same request. Every file of the export is re-hashed against its manifest before
anything is loaded, as valen-serve does (`--verify size` or `none` opts out). Expected failures
(bad request, bad export) print one line to stderr and exit 2.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from .errors import ValenError


@click.command(name="valen-run")
@click.option("--export", "export_dir", required=True, type=click.Path(path_type=Path), help="A valen-export output directory.")
@click.option("--device", default=None, help="cpu or cuda (default: cuda when available).")
@click.option("--dtype", type=click.Choice(["bf16", "fp32"]), default="bf16", show_default=True, help="Compute dtype (the reference runs bf16).")
@click.option("--mode", type=click.Choice(["per-branch", "shared-prefix"]), default=None, help="Execution mode (default: shared-prefix on CUDA, per-branch on CPU).")
@click.option("--temperature", type=float, default=None, help="Softmax temperature (default 1.0).")
@click.option("--calibration", type=click.Path(path_type=Path), default=None, help="Calibration JSON with a scalar 'temperature'.")
@click.option("--verify", type=click.Choice(["full", "size", "none"]), default="full", show_default=True,
              help="Before loading: re-hash every file against the manifest (full, as valen-serve and valen-verify do), "
                   "check only the sizes (size: skips a few seconds of hashing on a 2B export, and misses damage that keeps a file's size), or neither (none).")
@click.option("--compile/--no-compile", "compile_", default=False, show_default=True,
              help="torch.compile the CUDA fast path (off here: one request per process cannot repay about a minute of compiling; a long-lived Engine compiles by default).")
@click.option("--cuda-graphs/--no-cuda-graphs", "graphs", default=False, show_default=True,
              help="Capture CUDA graphs (off here: they pay off from the second request of a shape on).")
@click.option("--timings", is_flag=True, help="Print prepare/model seconds to stderr.")
@click.argument("request", type=click.Path(allow_dash=True, path_type=str))
def main(export_dir, device, dtype, mode, temperature, calibration, verify, compile_, graphs, timings, request) -> None:
    """Run Valen on REQUEST (a JSON file, or - for stdin) and print the response JSON.

    \b
    Example:
      echo '{"model": "valen-preview-0923", "state": "The card was charged twice.",
             "questions": {"q": {"type": "choice", "instructions": "What next?",
                                 "criteria": {"refund": "Refund it", "wait": "Wait"}}}}' \\
        | valen-run --export build/demo/export-separate -
    """
    from .answers import load_temperature
    from .engine import Engine
    from .options import EngineOptions
    from .wire import decode_request, encode_response, read_request_source, response_body

    try:
        if temperature is not None and calibration is not None:
            raise ValenError("--temperature and --calibration are mutually exclusive")
        temp = load_temperature(calibration) if calibration is not None else (1.0 if temperature is None else temperature)
        req = decode_request(read_request_source(request))
        options = EngineOptions(device=device, dtype=dtype, mode=mode, compile=compile_, graphs=graphs)
        engine = Engine.load(export_dir, options, verify=verify, temperature=temp)
        result = engine.run(req)
    except (ValenError, ValueError, OSError) as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    click.echo(encode_response(response_body(result.response)).decode("utf-8"))
    if timings:
        click.echo(json.dumps({k: round(v, 6) for k, v in result.timings.items()}), err=True)


if __name__ == "__main__":
    main()
