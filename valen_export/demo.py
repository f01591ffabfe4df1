"""`make demo`'s exporter half: tiny fixture -> export (separate and merged LoRA) -> valen-verify
both, and the two demo requests written beside them. The Makefile then answers them with
`valen-run`, the tool a user runs (the exporter never imports the engine).
Usage: python -m valen_export.demo OUTDIR
"""

from __future__ import annotations

import base64
import io
import json
import shutil
import sys
import time
from pathlib import Path

from PIL import Image


def demo_requests() -> list[dict]:
    img = Image.new("RGB", (96, 64), (30, 30, 30))
    for x in range(40, 56):
        for y in range(24, 40):
            img.putpixel((x, y), (250, 250, 250))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    return [
        {
            "model": "valen-preview-0923",
            "state": "The card was charged twice for one order.",
            "questions": {
                "next_step": {"type": "choice", "instructions": "What should support do next?", "criteria": {"refund": "Refund the duplicate charge", "wait": "Wait for the bank to settle"}},
                "duplicate": {"type": "noul", "instructions": "Is this a duplicate charge?"},
                "urgency": {"type": "score", "instructions": "How urgent is this?", "criteria": ["not urgent", "somewhat urgent", "very urgent"]},
            },
        },
        {
            "model": "valen-preview-0923",
            "state": {"image": url},
            "questions": {"square": {"type": "choice", "instructions": "What colour is the square?", "criteria": {"white": "White", "black": "Black"}}},
        },
    ]


def build_exports(out: Path, report=print) -> dict[str, Path]:
    """The demo's artifacts, made afresh under OUT: the tiny fixture (seed 0) and its export in both
    LoRA modes, {mode: export dir}. The README's example outputs are those of OUT/export-separate
    (tests/test_readme.py builds it with this function)."""
    from valen_export.export import export
    from valen_export.fixture import build_fixture

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    t = time.perf_counter()
    fx = build_fixture(out / "fixture", preset="tiny", seed=0)
    report(f"1. fixture   {fx.root}  (tiny Qwen3.5 base + Valen checkpoint.pt, {time.perf_counter() - t:.1f} s)")
    exports = {}
    for mode in ("separate", "merged"):
        t = time.perf_counter()
        exports[mode] = out / f"export-{mode}"
        m = export(fx.checkpoint, fx.base, exports[mode], lora_mode=mode, pins_path=fx.pins, progress=False)
        size = sum(f["size"] for f in m["files"].values())
        report(f"2. export    {exports[mode]}  (lora {mode}: {len(m['files'])} files, {size / 1024:.0f} KiB, {time.perf_counter() - t:.1f} s)")
    return exports


def main(out: Path) -> int:
    from valen_export.verify import verify_export

    exports = build_exports(out)
    for mode, d in exports.items():
        failures = verify_export(d)
        print(f"3. verify    {d.name}: {'ok' if not failures else 'FAILED'}")
        for f in failures:
            print(f"             {f}")
        if failures:
            return 1
    for name, request in zip(("text", "image"), demo_requests()):
        path = out / f"{name}-request.json"
        path.write_text(json.dumps(request, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
        print(f"4. request   {path}  ({name} state)")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "build/demo")))
