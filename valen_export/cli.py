"""Command-line entry points: valen-fixture, valen-export, valen-verify.

Thin click wrappers over library functions. Expected failures (ValenError) print one line to
stderr and exit 2; nothing half-written is left behind (the library guarantees that).
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import click

from valen_runtime.errors import ValenError


def _fail(e: Exception) -> None:
    click.echo(f"error: {e}", err=True)
    sys.exit(2)


def _log(msg: str) -> None:
    click.echo(msg, err=True)


def _progress_bar(total: int | None, unit: str, desc: str):
    """A tqdm bar on stderr when it is a terminal, else None (logs and pipes stay quiet)."""
    if not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit=unit, unit_scale=unit == "B", desc=desc, file=sys.stderr)


def _listed_bytes(export_dir: Path) -> int | None:
    """Total size of the files an export's manifest lists (the bar's total), None if unreadable."""
    from valen_runtime.manifest import Manifest

    try:
        return sum(int(rec.get("size") or 0) for rec in Manifest.load(export_dir).files.values())
    except (ValenError, TypeError, ValueError):
        return None


@click.command(name="valen-fixture")
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--preset", type=click.Choice(["tiny", "2b"]), default="tiny", show_default=True, help="tiny: seconds on CPU; 2b: Qwen3.5-2B shapes, random weights (~4.5 GB).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for every random tensor.")
@click.option("--rlcd", is_flag=True, help="Also write an RLCD training_state with decoy reference weights.")
def fixture_command(out: Path, preset: str, seed: int, rlcd: bool) -> None:
    """Write synthetic Valen artifacts with the released layout: OUT/base, OUT/checkpoint, OUT/pins.json.

    \b
    Example:
      valen-fixture build/fx --preset tiny
      valen-export --checkpoint build/fx/checkpoint --base build/fx/base --pins build/fx/pins.json --out build/fx-export
    """
    from .fixture import build_fixture

    # Stage lines always (the 2b preset writes ~4.5 GB for a minute or more); the bar only on a terminal.
    bars = []

    def advance(done: int, total: int) -> None:
        if not bars:
            bars.append(_progress_bar(total, "tensor", "  base weights"))
        bars[0].update(done - bars[0].n)
        if done == total:
            bars[0].close()

    started = time.monotonic()
    try:
        _log(f"valen-fixture: writing the {preset} preset (seed {seed}) to {out}")
        fx = build_fixture(out, preset=preset, seed=seed, rlcd=rlcd, progress=advance if sys.stderr.isatty() else None,
                           log=lambda line: _log(f"  {line}"))
    except (ValenError, FileExistsError, ValueError) as e:
        _fail(e)
    finally:
        for bar in bars:
            bar.close()
    _log(f"valen-fixture: done in {time.monotonic() - started:.0f} s")
    click.echo(f"base:       {fx.base}\ncheckpoint: {fx.checkpoint}\npins:       {fx.pins}")


@click.command(name="valen-export")
@click.option("--checkpoint", "checkpoint_dir", required=True, type=click.Path(path_type=Path), help="Folder with the Valen config.json and checkpoint.pt.")
@click.option("--base", "base_dir", required=True, type=click.Path(path_type=Path), help="Qwen3.5-2B base folder (with valen_manifest.json).")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="New output directory (must not exist or be empty).")
@click.option("--lora", "lora_mode", type=click.Choice(["separate", "merged"]), default="separate", show_default=True, help="Keep the FP32 LoRA in its own file, or merge it into the BF16 weights (FP32 accumulate, one rounding).")
@click.option("--pins", "pins_path", type=click.Path(path_type=Path), default=None, help="Pins file (default: manifests/valen-preview-0923.json).")
@click.option("--max-shard-size", "max_shard_gb", type=float, default=2.0, show_default=True, help="Language shard size in GiB; 0 writes a single model.safetensors without an index.")
@click.option("--progress/--no-progress", default=None, help="Progress bar (default: when stderr is a terminal).")
def export_command(checkpoint_dir, base_dir, out, lora_mode, pins_path, max_shard_gb, progress) -> None:
    """Export Valen-Preview-0923 (checkpoint.pt + base) to native-ready safetensors.

    Verifies the pinned hashes, the base and the exact trainable set before writing anything,
    then writes OUT atomically with a hashed manifest (valen_export.json) written last.
    """
    from .export import export

    if not math.isfinite(max_shard_gb) or max_shard_gb < 0:
        _fail(ValueError(f"--max-shard-size: expected a finite number of GiB >= 0 (0 writes one file without an index), got {max_shard_gb}"))
    try:
        manifest = export(checkpoint_dir, base_dir, out, lora_mode=lora_mode, pins_path=pins_path,
                          max_shard_bytes=int(max_shard_gb * 1024**3), progress=progress, log=_log)
    except ValenError as e:
        _fail(e)
    total = sum(f["size"] for f in manifest["files"].values())
    click.echo(f"exported {out} ({lora_mode}, {len(manifest['files'])} files, {total / 2**20:.1f} MiB); next: valen-verify {out}")


@click.command(name="valen-verify")
@click.argument("export_dir", type=click.Path(path_type=Path))
@click.option("--no-rehash", is_flag=True, help="Check sizes only, not SHA-256 (faster).")
def verify_command(export_dir: Path, no_rehash: bool) -> None:
    """Re-hash an export and check it against the native loader's contract; exit 0 only if all hold."""
    from .verify import verify_export

    bar = None if no_rehash else _progress_bar(_listed_bytes(export_dir), "B", "verify")
    try:
        failures = verify_export(export_dir, rehash=not no_rehash, on_bytes=bar.update if bar is not None else None)
    finally:
        if bar is not None:
            bar.close()
    for line in failures:
        click.echo(f"FAIL {line}", err=True)
    if failures:
        sys.exit(1)
    click.echo(f"ok: {export_dir} satisfies valen-native/1 and the native loader contract")


def fetch_command() -> None:  # replaced by the real command in fetch.py
    from .fetch import main

    main()
