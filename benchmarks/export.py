"""Export cost on this machine (issue #2): wall time, peak RSS, and the ratio to a plain copy.

Builds the `2b` preset if missing, then in child processes (so each peak RSS is its own):
1. `valen-export` (separate LoRA), 2. `valen-export` (merged LoRA), 3. a baseline that reads
every input byte the export reads (checkpoint.pt + base weights), hashes it, and writes the same
number of bytes the export writes. Ratio = export time / baseline time. Not a test.

    python benchmarks/export.py --work /tmp/valen-export-bench --out export-bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def run_child(code: str) -> dict:
    """Run python code in a child; return its wall time and peak RSS (ru_maxrss of the child)."""
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        raise SystemExit(f"child failed:\n{proc.stderr[-2000:]}")
    # Each child reports its own VmHWM (peak RSS of its address space; ru_maxrss would carry the
    # forking parent's peak over).
    child = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"wall_s": wall, "peak_rss_gib": child["peak_rss_kib"] / 2**20, **{k: v for k, v in child.items() if k != "peak_rss_kib"}}


EXPORT = """
import json, sys
from pathlib import Path
from valen_export.export import export
fx = Path({fx!r})
m = export(fx / "checkpoint", fx / "base", Path({out!r}), lora_mode={mode!r}, pins_path=fx / "pins.json", progress=False)
print(json.dumps({{"bytes_written": sum(f["size"] for f in m["files"].values()), "peak_rss_kib": int([l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1])}}))
"""

BASELINE = """
import hashlib, json, os
from pathlib import Path
fx = Path({fx!r})
inputs = [fx / "checkpoint" / "checkpoint.pt"] + sorted((fx / "base").glob("*.safetensors"))
chunk = 8 * 1024 * 1024
read = 0
for p in inputs:  # read + hash every input byte once (the exporter hashes them all too)
    h = hashlib.sha256()
    with open(p, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b); read += len(b)
target = {written}
block = os.urandom(chunk)
with open({out!r}, "wb") as f:  # write + hash as many bytes as the export wrote
    h = hashlib.sha256(); left = target
    while left > 0:
        b = block[: min(chunk, left)]; f.write(b); h.update(b); left -= len(b)
    f.flush(); os.fsync(f.fileno())
print(json.dumps({{"bytes_read": read, "bytes_written": target, "peak_rss_kib": int([l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1])}}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description="export benchmark")
    ap.add_argument("--work", type=Path, default=Path("/tmp/valen-export-bench"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--preset", choices=["2b", "tiny"], default="2b")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    fx = args.work / f"fixture-{args.preset}"
    if not (fx / "pins.json").exists():
        from valen_export.fixture import build_fixture

        t = time.perf_counter()
        build_fixture(fx, preset=args.preset, seed=0)
        print(f"fixture built in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    results = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}, "preset": args.preset}
    import torch

    results["machine"]["torch"] = torch.__version__
    for mode in ("separate", "merged"):
        out = args.work / f"export-{mode}"
        shutil.rmtree(out, ignore_errors=True)
        results[mode] = run_child(EXPORT.format(fx=str(fx), out=str(out), mode=mode))
        print(f"export {mode}: {results[mode]}", file=sys.stderr)
    base_out = args.work / "baseline.bin"
    results["baseline"] = run_child(BASELINE.format(fx=str(fx), out=str(base_out), written=results["separate"]["bytes_written"]))
    base_out.unlink()
    for mode in ("separate", "merged"):
        results[mode]["ratio_to_baseline"] = results[mode]["wall_s"] / results["baseline"]["wall_s"]
    args.out.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
