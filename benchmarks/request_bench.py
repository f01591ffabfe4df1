"""Host-side request compile time: everything `Engine.prepare` does on the host before the GPU
works (JSON checks, base64, image decode and resize, chat template, tokenizer, prompt layout, and
the host part of handing the images over), per phase. Not a test.

    python benchmarks/request_bench.py --export EXPORT [--iters 40] [--device cpu|cuda] [--png pillow] [--out request.json]
    python benchmarks/request_bench.py --decoders [--iters 40] [--out decoders.json]

Point it at any export (the tiny fixture's is enough: the tokenizer and the image settings are
the released ones). Runs `Compiler.compile` with a vision callback, as `Engine.prepare` does:
with --device cuda the callback is the engine's `pixel_values_on("cuda")` (the uint8 upload and
the queued patchify; the vision tower itself is left out); on the CPU it copies each image once
(the host's share of that upload: a copy of the pageable bytes into the driver's staging buffer).

Each request is timed in the compiler's three decode modes: "auto" (the default: the pool where
there is work to overlap, see `Compiler._worth_a_thread`), "threaded" (images always decode on a
pool thread while the calling thread tokenizes) and "serial" (everything on the calling thread).
`--png pillow` decodes every PNG with Pillow, as an install without the fast-png extra (pyspng)
does. Reports medians: warm (question-piece cache filled), cold (a fresh compiler per
request), and per phase (`valen_runtime.request.PHASES`; decode-thread phases are that thread's
time, overlapped with the calling thread's where the pool decoded).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from bench_requests import benchmark_requests, png_data_url, text_of  # noqa: E402

MODES = {"auto": None, "threaded": True, "serial": False}


def host_requests() -> dict[str, dict]:
    """The latency benchmark's requests, plus one where the decode threads have the most to do:
    four different 448² images (the message-list limit) and a 700-word text."""
    requests = dict(benchmark_requests())
    content = [{"type": "image", "image": png_data_url(448, 448, seed=seed)} for seed in range(4)]
    content.append({"type": "text", "text": text_of(700)})
    requests["e_4images448_text700"] = {
        "model": "valen-preview-0923",
        "state": {"messages": [{"role": "user", "content": content}]},
        "questions": requests["a_image448_7branch"]["questions"],
    }
    return requests


def _median_ms(fn, iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def _idat(png: bytes) -> bytes:
    """The concatenated zlib stream of a PNG's IDAT chunks."""
    pos, parts = 8, []
    while pos < len(png):
        length = int.from_bytes(png[pos : pos + 4], "big")
        if png[pos + 4 : pos + 8] == b"IDAT":
            parts.append(png[pos + 8 : pos + 8 + length])
        pos += 12 + length
    return b"".join(parts)


def decoder_comparison(iters: int) -> dict:
    """PNG decode options on this machine, per test image: Pillow as the runtime calls it, Pillow
    with one read for the whole stream, zlib's inflate alone (what any decoder of this file must
    do, on one core), and where installed torchvision.io.decode_png (libpng) and pyspng
    (libspng), each checked against Pillow's pixels."""
    import base64
    import io
    import zlib

    import numpy as np
    from PIL import Image

    from bench_requests import png_data_url

    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:1024, 0:1024]
    photo_like = np.stack([(x * 3) % 256, (y * 5) % 256, (x ^ y) % 256], -1) + rng.integers(0, 8, (1024, 1024, 3))
    buffer = io.BytesIO()
    Image.fromarray(photo_like.clip(0, 255).astype(np.uint8)).save(buffer, "PNG")
    images = {
        "a_448_synthetic": base64.b64decode(png_data_url(448, 448).split(",", 1)[1]),
        "d_1024_synthetic": base64.b64decode(png_data_url(1024, 1024).split(",", 1)[1]),
        "1024_noisy": buffer.getvalue(),
    }
    try:
        import torch
        import torchvision.io

        torchvision_version = _version("torchvision")
    except ImportError:
        torchvision_version = None
    try:
        import pyspng

        pyspng_version = _version("pyspng")
    except ImportError:
        pyspng_version = None
    results = {"torchvision": torchvision_version, "pyspng": pyspng_version, "images": {}}
    for name, png in images.items():
        def pillow(block=None):
            image = Image.open(io.BytesIO(png))
            if block:
                image.decodermaxblock = block
            image.load()
            return image

        idat = _idat(png)
        row_bytes = len(zlib.decompress(idat)) // pillow().size[1]
        filters = sorted({zlib.decompress(idat)[i * row_bytes] for i in range(pillow().size[1])})
        entry = {
            "png_bytes": len(png),
            "row_filters": filters,
            "pillow_ms": _median_ms(pillow, iters),
            "pillow_one_read_ms": _median_ms(lambda: pillow(len(png) + 1), iters),
            "zlib_inflate_ms": _median_ms(lambda: zlib.decompress(idat), iters),
        }
        if torchvision_version:
            encoded = torch.frombuffer(bytearray(png), dtype=torch.uint8)
            decoded = torchvision.io.decode_png(encoded)
            expected = torch.from_numpy(np.array(pillow().convert("RGB"))).permute(2, 0, 1)
            entry["torchvision_decode_png_ms"] = _median_ms(lambda: torchvision.io.decode_png(encoded), iters)
            entry["torchvision_equals_pillow"] = bool(torch.equal(decoded, expected))
        if pyspng_version:
            entry["pyspng_ms"] = _median_ms(lambda: pyspng.load(png, "RGB"), iters)
            entry["pyspng_equals_pillow"] = bool(np.array_equal(pyspng.load(png, "RGB"), np.array(pillow().convert("RGB"))))
        results["images"][name] = entry
        print(name, json.dumps(entry), flush=True)
    return results


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "absent"


def image_handover(device: str):
    """The vision callback's host work: the real upload on CUDA, its stand-in (one copy) on the CPU."""
    import torch

    if device == "cuda":
        return lambda images: images.pixel_values_on("cuda")
    return lambda images: [torch.empty_like(image).copy_(image) for image in images.images]


def time_request(compiler_factory, request: dict, callback, iters: int, settle=lambda: None) -> dict:
    """Warm and cold medians (ms) of one request, and the warm median of every phase.
    settle: run after each timed compile, untimed (on CUDA: wait for the queued copies)."""
    warm = compiler_factory()
    for _ in range(3):
        warm.compile(request, callback)
        settle()
    totals, phases = [], []
    for _ in range(iters):
        timings: dict[str, float] = {}
        started = time.perf_counter()
        warm.compile(request, callback, timings)
        totals.append(time.perf_counter() - started)
        phases.append(timings)
        settle()
    cold = []
    for _ in range(max(3, iters // 4)):
        fresh = compiler_factory()
        started = time.perf_counter()
        fresh.compile(request, callback)
        cold.append(time.perf_counter() - started)
        settle()
    names = sorted({name for entry in phases for name in entry})
    return {
        "warm_median_ms": statistics.median(totals) * 1e3,
        "cold_median_ms": statistics.median(cold) * 1e3,
        "phases_median_ms": {name: statistics.median(entry.get(name, 0.0) for entry in phases) * 1e3 for name in names},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--export", type=Path)
    ap.add_argument("--decoders", action="store_true", help="compare PNG decoders instead (no export needed)")
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--png", choices=("libspng", "pillow"), default="libspng",
                    help="libspng: plain PNGs through pyspng where installed (the default); pillow: every PNG through Pillow")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    import torch
    from PIL import features

    import valen_runtime.image

    if args.png == "pillow":
        valen_runtime.image.pyspng = None

    from valen_runtime.request import PHASES, Compiler

    torch.set_num_threads(1)
    if args.decoders:
        report = {"cpus": os.cpu_count(), "pillow": _version("pillow"), **decoder_comparison(args.iters)}
        if args.out:
            args.out.write_text(json.dumps(report, indent=1))
        return
    if args.export is None:
        ap.error("--export is required (or --decoders)")
    if args.device == "cuda":
        torch.zeros(1, device="cuda")  # the CUDA context, outside the timings
    report = {
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "device": args.device,
        "iters": args.iters,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "pillow": _version("pillow"),
            "pillow_zlib": features.version("zlib"),
            "pillow_zlib_ng": features.version("zlib_ng") if features.check("zlib_ng") else None,
            "tokenizers": _version("tokenizers"),
            "pyspng": _version("pyspng") if valen_runtime.image.pyspng is not None else None,
        },
        "load_average_at_start": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "phase_order": list(PHASES),
        "requests": {},
    }
    callback = image_handover(args.device)
    settle = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    for name, request in host_requests().items():
        report["requests"][name] = entry = {}
        for mode, in_thread in MODES.items():
            result = time_request(lambda: Compiler.from_dir(args.export, decode_in_thread=in_thread), request, callback, args.iters, settle)
            entry[mode] = result
            phases = ", ".join(f"{p} {result['phases_median_ms'][p]:.2f}" for p in PHASES if p in result["phases_median_ms"])
            print(f"{name} [{mode}]: warm {result['warm_median_ms']:.2f} ms, cold {result['cold_median_ms']:.2f} ms ({phases})", flush=True)
    report["load_average_at_end"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
