#!/usr/bin/env python3
"""Prepare native/target/debian-crates/: the crates Cargo.lock names, from Debian's packaged sources.

    python3 native/offline/debian_crates.py [--from /usr/share/cargo/registry] [--out DIR] [--lock FILE]

`native/offline/debian.toml` (passed with `cargo --config`) points cargo at the result instead of
crates.io. Debian's directory cannot be used as it is: for some crates (cfg-if, cpufeatures,
digest, sha2, typenum in bookworm) its `.cargo-checksum.json` records no crates.io checksum, and
cargo refuses a lock file whose checksum differs from the source's. So each locked crate is copied
and given the lock's checksum where Debian recorded none; a crate Debian does record with another
checksum, or one it lacks, is refused with one line each, and nothing is written.
Standard library only (Python 3.11+), so it runs before the project's virtual environment exists.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
import tomllib
from pathlib import Path

NATIVE = Path(__file__).resolve().parents[1]
DEBIAN_REGISTRY = Path("/usr/share/cargo/registry")
CRATES_IO = "registry+https://github.com/rust-lang/crates.io-index"
SHA256_HEX = re.compile(r"[0-9a-f]{64}")


def locked_crates(lock: Path) -> tuple[list[tuple[str, str, str]], list[str]]:
    """(name, version, checksum) of every crates.io package in `lock`, and the problems found."""
    try:
        packages = tomllib.loads(lock.read_text(encoding="utf-8")).get("package", [])
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        return [], [f"{lock}: cannot read the lock file ({e})"]
    crates, problems = [], []
    for package in packages:
        name, version, source = package.get("name"), package.get("version"), package.get("source")
        if source is None:  # the workspace's own package
            continue
        if source != CRATES_IO:
            problems.append(f"{lock}: {name} {version}: source is {source!r}, expected {CRATES_IO!r}")
            continue
        checksum = package.get("checksum")
        if not isinstance(checksum, str) or not SHA256_HEX.fullmatch(checksum):
            problems.append(f"{lock}: {name} {version}: checksum {checksum!r} is not a SHA-256 in lowercase hex")
            continue
        crates.append((name, version, checksum))
    return crates, problems


def debian_checksums(registry: Path, crates: list[tuple[str, str, str]]) -> tuple[dict[str, dict], list[str]]:
    """The .cargo-checksum.json each crate will carry, keyed by its directory name; and the problems found."""
    out, problems = {}, []
    for name, version, checksum in crates:
        crate_dir = registry / f"{name}-{version}"
        sums_path = crate_dir / ".cargo-checksum.json"
        if not crate_dir.is_dir():
            problems.append(f"{crate_dir}: missing: Cargo.lock needs {name} {version} (`make native-deps` installs it)")
            continue
        try:
            sums = json.loads(sums_path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            problems.append(f"{sums_path}: cannot read it as JSON ({e})")
            continue
        recorded = sums.get("package") if isinstance(sums, dict) else None
        if not isinstance(sums, dict) or not isinstance(sums.get("files", {}), dict):
            problems.append(f"{sums_path}: expected an object with a \"files\" object")
            continue
        if isinstance(recorded, str) and SHA256_HEX.fullmatch(recorded) and recorded != checksum:
            problems.append(f"{sums_path}: package checksum {recorded}, but Cargo.lock has {checksum} for {name} {version}")
            continue
        # Debian writes a placeholder ("Could not get crate checksum") where it had no .crate file.
        out[crate_dir.name] = {"package": checksum, "files": sums.get("files", {})}
    return out, problems


def prepare(registry: Path, out: Path, lock: Path) -> list[str]:
    """Write `out` as a cargo directory source of the locked crates; the problems found (nothing written if any)."""
    if not registry.is_dir():
        return [f"{registry}: not a directory (`make native-deps` installs Debian's crates there)"]
    crates, problems = locked_crates(lock)
    sums, more = debian_checksums(registry, crates)
    problems += more
    if problems:
        return problems
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        for dir_name, crate_sums in sums.items():
            shutil.copytree(registry / dir_name, staging / dir_name)
            (staging / dir_name / ".cargo-checksum.json").write_text(json.dumps(crate_sums), encoding="utf-8")
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="registry", type=Path, default=DEBIAN_REGISTRY, help="Debian's crate sources (default %(default)s)")
    parser.add_argument("--out", type=Path, default=NATIVE / "target" / "debian-crates", help="the directory source to write (default %(default)s)")
    parser.add_argument("--lock", type=Path, default=NATIVE / "Cargo.lock", help="the lock file naming the crates (default %(default)s)")
    args = parser.parse_args(argv)
    problems = prepare(args.registry, args.out, args.lock)
    for line in problems:
        print(f"debian_crates: {line}", file=sys.stderr)
    if problems:
        return 1
    print(f"debian_crates: {len(list(args.out.iterdir()))} crates from {args.registry} in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
