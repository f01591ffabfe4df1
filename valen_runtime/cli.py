"""`valen-run`: answer one request (file or stdin) from an export directory and print the response JSON.

The request is read and checked by the wire contract (wire.py) before the export is loaded: at
most 8 MiB + 1 byte is ever read, from a file or from stdin. The response is the body valen-serve
sends for the same request. Every file of the export is re-hashed against its manifest before
anything is loaded, as valen-serve does (`--verify size` or `none` opts out). The engine options
and their per-device defaults are valen-serve's (cli_options.py): on CUDA the compiled fast path
with CUDA graphs, so one request pays the compile (`--no-compile --no-cuda-graphs` skips it).
Expected failures (bad request, bad export) print one line to stderr and exit 2.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from . import compile_cache as compile_cache_module
from .cli_options import compile_cache_option, engine_options, resolve, temperature_options, threads_option
from .errors import ValenError


@click.command(name="valen-run")
@click.option("--export", "export_dir", required=True, type=click.Path(path_type=Path), help="A valen-export output directory.")
@engine_options
@temperature_options
@click.option("--verify", type=click.Choice(["full", "size", "none"]), default="full", show_default=True,
              help="Before loading: re-hash every file against the manifest (full, as valen-serve and valen-verify do), "
                   "check only the sizes (size: skips a few seconds of hashing on a 2B export, and misses damage that keeps a file's size), or neither (none).")
@threads_option()
@compile_cache_option
@click.option("--timings", is_flag=True, help="Print prepare/model seconds to stderr.")
@click.option("--verbose", is_flag=True, help="Print the resolved options (one JSON line) to stderr before loading.")
@click.argument("request", type=click.Path(allow_dash=True, path_type=str))
def main(export_dir, device, dtype, mode, kernels, graphs, compile_, temperature, calibration, verify, threads, compile_cache, timings, verbose,
         request) -> None:
    """Run Valen on REQUEST (a JSON file, or - for stdin) and print the response JSON.

    \b
    Example:
      echo '{"model": "valen-preview-0923", "state": "The card was charged twice.",
             "questions": {"q": {"type": "choice", "instructions": "What next?",
                                 "criteria": {"refund": "Refund it", "wait": "Wait"}}}}' \\
        | valen-run --export build/demo/export-separate -
    """
    import torch

    from .engine import Engine
    from .wire import decode_request, encode_response, read_request_source, response_body

    try:
        options = resolve(device, dtype, mode, kernels, graphs, compile_, temperature, calibration)
        req = decode_request(read_request_source(request))
        if verbose:
            click.echo(json.dumps({"options": options.describe(), "verify": verify, "threads": threads}), err=True)
        if threads is not None:
            torch.set_num_threads(threads)
        if compile_cache_module.compiles(options):
            compile_cache_module.use(compile_cache_module.resolve_dir(compile_cache))
        engine = Engine.load(export_dir, options, verify=verify)
        result = engine.run(req)
    except (ValenError, ValueError, OSError) as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    click.echo(encode_response(response_body(result.response)).decode("utf-8"))
    if timings:
        click.echo(json.dumps({k: round(v, 6) for k, v in result.timings.items()}), err=True)


if __name__ == "__main__":
    main()
