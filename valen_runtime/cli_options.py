"""The engine options every front door (valen-run, valen-serve, valen-parity) takes, declared once.

Each defaults to None, which EngineOptions (options.py) resolves for the device: the same command
line runs the same configuration from every front door (on CUDA the fast path, compiled and
replayed from CUDA graphs; on the CPU the reference's per-branch shape).
"""

from __future__ import annotations

from pathlib import Path

import click

from .compile_cache import ENV_VAR as COMPILE_CACHE_ENV_VAR, default_dir as default_compile_cache_dir
from .options import DTYPES, KERNELS, MODES, EngineOptions

ENGINE_OPTION_NAMES = ("device", "dtype", "mode", "kernels", "graphs", "compile_")

_ENGINE_OPTIONS = (
    click.option("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available, else cpu)."),
    click.option("--dtype", type=click.Choice(DTYPES), default=EngineOptions.dtype, show_default=True,
                 help="Compute dtype (the reference runs bf16)."),
    click.option("--mode", type=click.Choice(MODES), default=None,
                 help="Execution mode (default: shared-prefix on CUDA, per-branch on the CPU)."),
    click.option("--kernels", type=click.Choice(KERNELS), default=None,
                 help="The reference modules (torch) or the fast path (fast) (default: fast for shared-prefix on CUDA, else torch)."),
    click.option("--cuda-graphs/--no-cuda-graphs", "graphs", default=None,
                 help="Replay each request shape from a CUDA graph (default: on for shared-prefix on CUDA)."),
    click.option("--compile/--no-compile", "compile_", default=None,
                 help="torch.compile the fast path (default: on for the fast path on CUDA; the first request of a process then compiles for about a minute)."),
)


def engine_options(command):
    """Adds --device, --dtype, --mode, --kernels, --cuda-graphs and --compile to a click command;
    its function receives them as device, dtype, mode, kernels, graphs, compile_ (see resolve)."""
    for option in reversed(_ENGINE_OPTIONS):
        command = option(command)
    return command


def resolve(device, dtype, mode, kernels, graphs, compile_, temperature=None, calibration=None) -> EngineOptions:
    """The EngineOptions of the command line, the temperature included (--temperature, or the
    --calibration file's, else 1.0: EngineOptions resolves it); raises ValueError or ValenError
    (one line) for an impossible combination or an unreadable calibration file."""
    return EngineOptions(device=device, dtype=dtype, mode=mode, kernels=kernels, graphs=graphs, compile=compile_,
                         temperature=temperature, calibration=None if calibration is None else str(calibration))


def temperature_options(command):
    """Adds --temperature and --calibration (mutually exclusive; see answers.load_temperature)."""
    command = click.option("--calibration", type=click.Path(path_type=Path), default=None,
                           help="Calibration JSON with a scalar 'temperature'.")(command)
    return click.option("--temperature", type=float, default=None, help="Softmax temperature (default 1.0).")(command)


def threads_option(help: str = "torch CPU threads (default: torch's, one per core); 1 keeps a busy shared machine from stalling the model's parallel loops."):
    return click.option("--threads", type=click.IntRange(1, None), default=None, help=help)


def compile_cache_option(command):
    """Adds --compile-cache (see compile_cache.py); its function receives compile_cache (a str or None)."""
    return click.option(
        "--compile-cache", "compile_cache", default=None, metavar="DIR|none",
        help=f"Keep torch.compile's Inductor and Triton caches (and Triton's autotuning results) in DIR, so a restart "
             f"reuses what an earlier process compiled; 'none' turns it off (default: ${COMPILE_CACHE_ENV_VAR}, else {default_compile_cache_dir()}).")(command)
