"""Time the pinned reference path (transformers 5.4.0 + PEFT unmerged, eager, one forward per branch).

Runs in its own process with flash-linear-attention & co. blocked (latency.py starts it with a
cleaned environment). Per request: prompt building (processor, image preprocessing) + every
branch's full forward + head. Writes {name: {times_s: [...], logits: [[...], ...]}} as JSON.
`--requests FILE` times the requests of a JSON file ({name: request}) instead of
bench_requests.py's (video_latency.py writes one). A video is decoded as the pinned environment
did, by torchvision 0.21's `read_video` (parity/video_reader.py, installed as the parity
reference worker installs it).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from parity.isolation import install_blocker

install_blocker()

from parity import video_reader  # noqa: E402

video_reader.install()

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_requests import benchmark_requests  # noqa: E402

from parity.prompt import ReferencePromptBuilder  # noqa: E402
from parity.reference import build_reference, environment, question_logits  # noqa: E402


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main(checkpoint: str, base: str, out: str, iters: int, warmup: int, device: str = "cuda", dtype: str = "bf16",
         requests: str | None = None) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    model, config, processor = build_reference(Path(checkpoint), Path(base), device=device, dtype=dtype)
    builder = ReferencePromptBuilder(processor, max_length=config.get("max_length", 8192), media_kwargs=config.get("media_kwargs") or {})
    results = {"environment": environment(device, dtype)}
    with tempfile.TemporaryDirectory() as media:
        wire = json.loads(Path(requests).read_text()) if requests else benchmark_requests()
        for name, req in wire.items():
            times, logits = [], None
            for i in range(warmup + iters):
                sync(device)
                t = time.perf_counter()
                prompt = builder.build(req, Path(media))
                logits = question_logits(model, builder, prompt, device)
                sync(device)
                if i >= warmup:
                    times.append(time.perf_counter() - t)
            results[name] = {"times_s": times, "logits": [lg.tolist() for lg in logits]}
            print(f"reference {name}: median {sorted(times)[len(times) // 2] * 1e3:.1f} ms", file=sys.stderr, flush=True)
    Path(out).write_text(json.dumps(results))


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--base", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="cuda")
    p.add_argument("--requests", help="a JSON file {name: request} to time instead of bench_requests.py's")
    a = p.parse_args()
    main(a.checkpoint, a.base, a.out, a.iters, a.warmup, device=a.device, requests=a.requests)
