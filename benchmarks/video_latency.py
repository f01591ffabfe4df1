"""Video states on one GPU: host decoding, device time, end to end, the reference, decode memory.

Builds the `2b` preset (Qwen3.5-2B shapes, random weights) and its exports unless they exist (as
latency.py does), encodes H.264 MP4 clips at 30 fps (valen_export/clips.py; kept under
WORK/video-clips), and measures per request, in ONE run:
- host: the video's decode and preprocessing, step by step (`probe_video`, `plan_video`,
  `decode_frames`, `patchify_video`; medians of --host-iters);
- device: the vision tower over the video and the text stack + head, each CUDA-synchronised,
  on the engine's own calls (the graphs the end-to-end runs captured are replayed);
- end to end: `Engine.run` on the parsed request (wire checks, base64, both decode passes,
  preprocessing, tokenizer, vision, text, head, answers), CUDA-synchronised, median and p90, in
  the engine's default configuration for the device (on CUDA: shared prefix, fast kernels,
  compiled, CUDA graphs);
- the reference: pinned transformers 5.4.0 processor + model + PEFT unmerged, eager, one forward
  per branch, in its own process with flash-linear-attention blocked and torchvision 0.21's
  `read_video` as its decoder (benchmarks/reference_latency.py --requests), and the speed-up;
- token counts per clip (frames, sampled frames, resized size, grid, video tokens, state,
  logical and compute tokens);
- the peak memory of decoding a clip at the limits (60 s of 1280x720 at 30 fps, a low bitrate so
  it fits 16 MiB) with `load_video` in a fresh process: ru_maxrss minus the process's own before.

    python benchmarks/video_latency.py --work /tmp/bench --out video.json
    python benchmarks/video_latency.py --work /tmp/vb --out v.json --device cpu --preset tiny \
        --only v3s_320 --iters 2 --warmup 1 --ref-iters 1 --host-iters 2 --skip-decode-peak    # a CPU smoke run

Not a test. Results: docs/benchmarks.md, "Video".
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from artifacts import fixture_and_exports  # noqa: E402
from bench_requests import text_of  # noqa: E402
from latency import COMPUTE_PER_TOKEN_S, VISION_PER_PATCH_S, WEIGHT_READ_S, probs, stats, sync, time_engine  # noqa: E402

REFERENCE = "reference (transformers 5.4.0, eager, per branch)"
FPS = 30
# name: (seconds, width, height, questions); every clip H.264 in MP4 at FPS.
CHOICE4 = {"next": {"type": "choice", "instructions": "Which move is best?",
                    "criteria": {"up": "Move up", "down": "Move down", "left": "Move left", "right": "Move right"}}}
MIXED = {
    **CHOICE4,
    "blocked": {"type": "noul", "instructions": "Is the player blocked?"},
    "progress": {"type": "score", "instructions": "How close is the puzzle to solved?",
                 "criteria": ["not at all", "a little", "half way", "almost", "solved"]},
}
CLIPS = {
    "v3s_320x240_choice4": (3, 320, 240, CHOICE4),
    "v3s_640x360_choice4": (3, 640, 360, CHOICE4),
    "v10s_320x240_choice4": (10, 320, 240, CHOICE4),
    "v10s_640x360_choice4": (10, 640, 360, CHOICE4),
    "v10s_640x360_7branch": (10, 640, 360, MIXED),
}
# The clips' content: clips.py's moving ramp with a little noise, encoded at 0.1 bit per pixel
# (230 kbit/s at 320x240, 690 kbit/s at 640x360: web video's usual rates; the decode's cost
# grows with the bitrate).
CLIP_NOISE = 16
BITS_PER_PIXEL = 0.1
# The memory case: the longest clip the limits allow (valen_runtime.video: 60 s, 1,048,576 px per
# frame, 16 MiB) at the largest standard frame size under them, at a bitrate that fits 16 MiB.
CAP_CLIP = {"seconds": 60, "width": 1280, "height": 720, "bitrate": "1500k"}


def clip_bytes(work: Path, seconds: int, width: int, height: int) -> bytes:
    """An H.264 MP4 clip at BITS_PER_PIXEL (encoded once, then read from WORK/video-clips)."""
    from valen_export.clips import encode_clip

    rate = f"{round(width * height * FPS * BITS_PER_PIXEL / 1000)}k"
    path = work / "video-clips" / f"{seconds}s-{width}x{height}-{rate}.mp4"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        data = encode_clip("mp4", "libx264", FPS, seconds * FPS, width, height, noise=CLIP_NOISE, preset="ultrafast",
                           b=rate, maxrate=rate, bufsize=f"{2 * int(rate[:-1])}k")
        path.with_suffix(".tmp").write_bytes(data)
        path.with_suffix(".tmp").replace(path)
    return path.read_bytes()


def cap_clip(work: Path) -> Path:
    """CAP_CLIP as a file: 16 frames of clips.py's ramp, cycled (clips.encode_clip holds every frame
    in memory at once, 5 GB at this size), at a capped bitrate."""
    import av

    from valen_export.clips import frames_array

    c = CAP_CLIP
    path = work / "video-clips" / f"cap-{c['seconds']}s-{c['width']}x{c['height']}.mp4"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    pool = frames_array(16, c["height"], c["width"], noise=2)
    tmp = path.with_suffix(".tmp")
    with av.open(str(tmp), mode="w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=FPS)
        stream.width, stream.height, stream.pix_fmt = c["width"], c["height"], "yuv420p"
        stream.options = {"preset": "ultrafast", "b": c["bitrate"], "maxrate": c["bitrate"], "bufsize": "3000k"}
        for i in range(c["seconds"] * FPS):
            for packet in stream.encode(av.VideoFrame.from_ndarray(pool[i % len(pool)], format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    tmp.replace(path)
    return path


def video_request(data: bytes, questions: dict, with_text: bool) -> dict:
    """A request whose state is the clip (as `state.video`) or the clip and a line of text (as messages)."""
    url = "data:video/mp4;base64," + base64.b64encode(data).decode("ascii")
    if not with_text:
        return {"model": "valen-preview-0923", "state": {"video": url}, "questions": questions}
    content = [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": text_of(20)}]
    return {"model": "valen-preview-0923", "state": {"messages": [{"role": "user", "content": content}]}, "questions": questions}


def host_steps(data: bytes, config, iters: int) -> dict:
    """Medians (ms) of the host's video steps, each timed alone, in the order a request runs them."""
    from valen_runtime.video import decode_frames, patchify_video, plan_video, probe_video

    times: dict[str, list[float]] = {"probe": [], "plan": [], "decode": [], "patchify": []}
    for _ in range(iters):
        t0 = time.perf_counter()
        probe = probe_video(data, "mp4", "state.video")
        t1 = time.perf_counter()
        plan = plan_video(probe.frame_count, probe.fps, probe.height, probe.width, config)
        t2 = time.perf_counter()
        frames = decode_frames(data, probe, plan, "state.video")
        t3 = time.perf_counter()
        patchify_video(frames, config)
        t4 = time.perf_counter()
        for key, value in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            times[key].append(value)
    out = {f"{key}_ms": statistics.median(value) * 1e3 for key, value in times.items()}
    out["total_ms"] = sum(out.values())
    return out


def clip_shape(data: bytes, config) -> dict:
    from valen_runtime.video import plan_video, probe_video

    probe = probe_video(data, "mp4", "state.video")
    plan = plan_video(probe.frame_count, probe.fps, probe.height, probe.width, config)
    return {
        "bytes": len(data), "frames": probe.frame_count, "fps": probe.fps, "size": [probe.width, probe.height],
        "sampled_frames": len(plan.indices), "resized": [plan.width, plan.height], "grid_thw": list(plan.grid_thw),
        "patches": plan.grid_thw[0] * plan.grid_thw[1] * plan.grid_thw[2], "video_tokens": plan.video_tokens,
        "timestamps": plan.stamp_texts(),
    }


def device_times(engine, request: dict, iters: int, device: str) -> dict:
    """The vision tower and the text stack + head of one prepared request, each CUDA-synchronised,
    on the engine's own calls: `vision_features` on the inputs the compiler handed it, and `execute`."""
    seen = []
    real = engine.vision_features
    engine.vision_features = lambda inputs: seen.append(inputs) or real(inputs)
    try:
        compiled, features = engine.prepare(request)
    finally:
        del engine.vision_features  # the instance attribute; the method shows through again
    if not seen:
        return {"error": "the engine's compile did not hand the video to Engine.vision_features"}
    vision, text = [], []
    with torch.no_grad():
        for _ in range(iters):
            sync()
            t0 = time.perf_counter()
            features = engine.vision_features(seen[-1])
            sync()
            t1 = time.perf_counter()
            engine.execute(compiled, features)
            sync()
            text.append(time.perf_counter() - t1)
            vision.append(t1 - t0)
    out = {"vision_ms": statistics.median(vision) * 1e3, "text_and_head_ms": statistics.median(text) * 1e3}
    out["device_ms"] = out["vision_ms"] + out["text_and_head_ms"]
    if device != "cuda":
        out["note"] = "CPU: no device, these are the same calls on the host"
    return out


def floor_ms(logical_tokens: int, patches: int) -> float:
    """latency.py's floor: every logical token once, the vision tower once (per patch, as for images)."""
    return (max(WEIGHT_READ_S, logical_tokens * COMPUTE_PER_TOKEN_S) + patches * VISION_PER_PATCH_S) * 1e3


# ---------------------------------------------------------------- decode memory at the limits


def decode_peak_child(path: str, config_path: str, media_kwargs: str) -> None:
    """In a fresh process: load_video of the file; prints JSON with ru_maxrss before and after."""
    import av  # noqa: F401  (imported before the baseline, as in a running server)

    from valen_runtime.video import VideoConfig, load_video

    config = VideoConfig.from_file(Path(config_path), json.loads(media_kwargs))
    data = Path(path).read_bytes()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    t = time.perf_counter()
    video = load_video(data, "mp4", "state.video", config)
    seconds = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({
        "baseline_mib": before / 1024, "peak_mib": after / 1024, "peak_minus_baseline_mib": (after - before) / 1024,
        "load_video_s": seconds, "pixel_values_mib": video.pixel_values.numel() * 4 / 2**20,
        "grid_thw": list(video.grid_thw), "video_tokens": video.plan.video_tokens,
        "sampled_frames": len(video.plan.indices), "resized": [video.plan.width, video.plan.height],
    }))


def decode_peak(work: Path, config_path: Path, media_kwargs: dict, max_length: int) -> dict:
    from valen_runtime.video import MAX_VIDEO_BYTES

    t = time.perf_counter()
    path = cap_clip(work)
    size = path.stat().st_size
    made = time.perf_counter() - t
    row = {"clip": {**CAP_CLIP, "fps": FPS, "codec": "h264", "bytes": size}, "encode_s": made}
    if size > MAX_VIDEO_BYTES:
        row["error"] = f"the clip is {size} bytes, over the {MAX_VIDEO_BYTES}-byte limit: lower CAP_CLIP's bitrate"
        return row
    child = subprocess.run([sys.executable, __file__, "--decode-peak-child", str(path), str(config_path), json.dumps(media_kwargs)],
                           capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                               [str(HERE.parent)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])))
    if child.returncode != 0:
        row["error"] = f"exit {child.returncode}: {child.stderr.strip().splitlines()[-1:]}"
        return row
    row.update(json.loads(child.stdout.strip().splitlines()[-1]))
    row["over_max_length"] = row["video_tokens"] > max_length  # a request holding it would be refused
    return row


# ---------------------------------------------------------------- main


def run_reference(args, fx_dir: Path, requests: dict) -> dict:
    from parity.isolation import clean_environment

    req_file = args.work / "video-requests.json"
    req_file.write_text(json.dumps(requests))
    ref_out = args.work / "video-reference.json"
    cmd = [sys.executable, str(HERE / "reference_latency.py"), "--checkpoint", str(fx_dir / "checkpoint"), "--base", str(fx_dir / "base"),
           "--out", str(ref_out), "--iters", str(args.ref_iters), "--warmup", "1", "--device", args.device, "--requests", str(req_file)]
    env = clean_environment()
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    t = time.perf_counter()
    subprocess.run(cmd, check=True, env=env)
    print(f"reference done in {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
    return json.loads(ref_out.read_text())


def main() -> None:
    if sys.argv[1:2] == ["--decode-peak-child"]:  # decode_peak's fresh process
        decode_peak_child(*sys.argv[2:5])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/valen-bench"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--host-iters", type=int, default=5, help="runs of the host steps per clip")
    ap.add_argument("--ref-iters", type=int, default=3)
    ap.add_argument("--skip-reference", action="store_true")
    ap.add_argument("--skip-decode-peak", action="store_true", help="no 60 s clip at the limits")
    ap.add_argument("--only", action="append", default=[], metavar="TEXT", help="keep only requests whose name contains TEXT (repeatable)")
    ap.add_argument("--lora", choices=["separate", "merged"], default="separate")
    ap.add_argument("--preset", choices=["2b", "tiny"], default="2b", help="tiny: a CPU smoke run of this script")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)

    import av

    from valen_runtime.engine import Engine
    from valen_runtime.manifest import Manifest
    from valen_runtime.options import EngineOptions
    from valen_runtime.video import VideoConfig

    fx_dir, exports = fixture_and_exports(args.work, args.preset)
    export = exports[args.lora]
    prompt = Manifest.load(export).data["prompt"]
    config_path = export / "video_preprocessor_config.json"
    config = VideoConfig.from_file(config_path, prompt.get("media_kwargs") or {})

    t = time.perf_counter()
    clips = {name: clip_bytes(args.work, s, w, h) for name, (s, w, h, _) in CLIPS.items()
             if not args.only or any(o in name for o in args.only)}
    # The first request of each size carries the clip alone, the others a line of text beside it.
    requests = {name: video_request(data, CLIPS[name][3], with_text=not name.startswith("v3s_320"))
                for name, data in clips.items()}
    print(f"clips ready in {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)

    report = {
        "hardware": torch.cuda.get_device_name(0) if args.device == "cuda" else platform.processor() or "cpu",
        "preset": args.preset, "lora": args.lora,
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "av": av.__version__,
                     "libavcodec": ".".join(map(str, av.library_versions.get("libavcodec", ())))},
        "iters": args.iters, "warmup": args.warmup, "ref_iters": args.ref_iters, "host_iters": args.host_iters,
        "video_config": {"fps": config.fps, "min_frames": config.min_frames, "max_frames": config.max_frames,
                         "min_pixels": config.min_pixels, "max_pixels": config.max_pixels},
        "max_length": prompt["max_length"],
        "requests": {},
    }
    ref = {}
    if not args.skip_reference:
        ref = run_reference(args, fx_dir, requests)
        report["reference_environment"] = ref.pop("environment")

    # The engine's default configuration on CUDA; on the CPU the same layout without compile and graphs.
    options = EngineOptions(device=args.device, dtype="bf16") if args.device.startswith("cuda") else \
        EngineOptions(device=args.device, dtype="bf16", mode="shared-prefix", kernels="fast")
    t = time.perf_counter()
    engine = Engine.load(export, options)
    report["engine"] = options.describe()
    report["kernels"] = engine.kernels
    print(f"engine ready in {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)

    for name, req in requests.items():
        row = {"clip": clip_shape(clips[name], config)}
        row["host"] = host_steps(clips[name], config, args.host_iters)
        if name in ref:
            row[REFERENCE] = stats(ref[name]["times_s"])
        if args.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        try:
            times, result = time_engine(engine, req, args.iters, args.warmup)
        except Exception as e:  # record, don't hide: a failing request is a result too
            row["runtime"] = {"error": f"{type(e).__name__}: {e}"}
            print(f"{name}: ERROR {e}", file=sys.stderr, flush=True)
            report["requests"][name] = row
            args.out.write_text(json.dumps(report, indent=2))
            continue
        entry = stats(times)
        entry["prepare_ms"] = result.timings["prepare_s"] * 1e3  # last run: parsing, both decode passes, preprocessing, tokenizer
        if args.device.startswith("cuda"):
            entry["peak_gpu_gib"] = torch.cuda.max_memory_allocated() / 2**30
        compiled = result.compiled
        if engine.mode == "shared-prefix":
            entry["layout"] = engine.plan(compiled).kind
        entry.update(device_times(engine, req, args.iters, args.device))
        if name in ref:
            rp, fp = probs(ref[name]["logits"]), probs(result.logits)
            entry["max_abs_dp_vs_reference"] = max(abs(a - b) for x, y in zip(rp, fp) for a, b in zip(x, y))
            entry["decisions_agree"] = [max(range(len(x)), key=x.__getitem__) == max(range(len(y)), key=y.__getitem__) for x, y in zip(rp, fp)]
            entry["speedup_vs_reference"] = row[REFERENCE]["median_ms"] / entry["median_ms"]
        row["runtime"] = entry
        row["state_tokens"] = len(compiled.state.input_ids)
        row["branches"] = sum(len(q.branches) for q in compiled.questions)
        row["logical_tokens"] = compiled.logical_tokens
        row["compute_tokens"] = compiled.compute_tokens
        row["floor_ms"] = floor_ms(compiled.logical_tokens, row["clip"]["patches"])
        row["runtime"]["ratio_to_floor"] = entry["median_ms"] / row["floor_ms"]
        report["requests"][name] = row
        args.out.write_text(json.dumps(report, indent=2))  # after every request: a timeout keeps what was measured
        print(f"{name}: median {entry['median_ms']:.2f} ms (p90 {entry['p90_ms']:.2f}); host {row['host']['total_ms']:.1f} ms; "
              f"device {entry.get('device_ms', float('nan')):.2f} ms; {row['clip']['video_tokens']} video tokens"
              + (f"; reference {row[REFERENCE]['median_ms']:.1f} ms, {entry['speedup_vs_reference']:.1f}x" if name in ref else ""),
              file=sys.stderr, flush=True)

    if not args.skip_decode_peak:
        peak = decode_peak(args.work, config_path, prompt.get("media_kwargs") or {}, prompt["max_length"])
        report["decode_peak"] = peak
        print(f"decode peak: {peak.get('peak_minus_baseline_mib', float('nan')):.0f} MiB over the baseline "
              f"{peak.get('error', '')}", file=sys.stderr, flush=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
