"""Reference process: `python -m parity.reference_worker JOB.json`.

Runs in its own interpreter so that nothing the runtime side imported (and no fast kernel) can
leak into the reference. Order matters: the import blocker goes in before torch / transformers are
imported, then TF32 matmul is switched off (PyTorch's default; cuDNN TF32 stays at PyTorch's
default, as in the pinned environment: docs/valen-model.md) and torchvision 0.21's PyAV
`read_video` is installed as `torchvision.io.read_video` (parity/video_reader.py: with torchcodec
blocked, the processor's `load_video` decodes through it, as in the pinned environment), then the
model is built once and every request of the job runs against it.

Job file (JSON): {"checkpoint": dir, "base": dir, "device": "cpu"|"cuda", "dtype": "bf16"|"fp32"|"fp64",
"out": dir, "valen_source": dir|null, "threads": int|null, "requests": [{"id": str, "request": wire request}]}.
Writes OUT/reference.json, one OUT/pixels-<n>.pt per image request (pixel_values, for the
image-preprocessing comparison), one OUT/video-pixels-<n>.pt per video request
(pixel_values_videos) and one OUT/rope-<n>.pt per request: the position ids the
reference's text rotary embedding received for the request's first branch [3, T] and its cos / sin
tables for them, recomputed in fp32 [2, T, R] (for the rotary comparison). Exit 0 when the model
was built (per-request rejections are results), 3 when the reference itself could not be built
(message on stderr, one line).
"""

from __future__ import annotations

import sys

from parity.isolation import install_blocker  # noqa: E402

install_blocker()

import json  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from valen_runtime.safetensors_file import sha256_file  # noqa: E402

torch.backends.cuda.matmul.allow_tf32 = False

from parity import video_reader  # noqa: E402

video_reader.install()


def _model_kernels(model) -> dict:
    """What the live layers run (proves the PyTorch fallback is in use)."""
    fns, norms = set(), set()
    for module in model.modules():
        fn = getattr(module, "chunk_gated_delta_rule", None)
        if fn is not None:
            fns.add(getattr(fn, "__name__", repr(fn)))
            norms.add(type(module.norm).__name__)
    attn = {getattr(m.config, "_attn_implementation", None) for m in model.modules() if hasattr(m, "config") and hasattr(m.config, "_attn_implementation")}
    return {"gated_delta_rule": sorted(fns), "gated_norm": sorted(norms), "attn_implementation": sorted(a for a in attn if a)}


class RotaryCapture:
    """Records the position ids the text rotary embedding is first called with after `reset()`."""

    def __init__(self, model):
        modules = [m for m in model.modules() if type(m).__name__.endswith("TextRotaryEmbedding")]
        if len(modules) != 1:
            raise RuntimeError(f"expected one text rotary embedding in the reference, found {len(modules)}")
        self.module = modules[0]
        self.positions = None
        self.module.register_forward_pre_hook(self._record)

    def _record(self, module, args):
        if self.positions is None:
            self.positions = args[1].detach().clone()  # [3, 1, T]

    def reset(self) -> None:
        self.positions = None

    @torch.no_grad()
    def tables(self) -> dict:
        """{"positions": [3, T] int64, "tables": [2, T, R] fp32 (cos, sin)} on the CPU."""
        pos = self.positions
        probe = torch.zeros(1, dtype=torch.float32, device=pos.device)  # fp32 output whatever the model dtype
        cos, sin = self.module(probe, pos)
        return {"positions": pos[:, 0].cpu(), "tables": torch.stack([cos[0], sin[0]]).float().cpu()}


def run_job(job: dict) -> dict:
    from parity import reference
    from parity.prompt import PromptError, ReferencePromptBuilder

    out = Path(job["out"])
    out.mkdir(parents=True, exist_ok=True)
    device, dtype = job.get("device", "cpu"), job.get("dtype", "bf16")
    if job.get("threads"):
        torch.set_num_threads(int(job["threads"]))
    t0 = time.perf_counter()
    if job.get("valen_source"):
        from parity import valen_source

        adapter = valen_source.ValenSource(job["valen_source"])
        model, config, processor, builder = adapter.build(job["checkpoint"], job["base"], device, dtype)
        logits_fn = adapter.question_logits
        origin = adapter.describe()
    else:
        model, config, processor = reference.build_reference(Path(job["checkpoint"]), Path(job["base"]), device, dtype)
        builder = ReferencePromptBuilder(processor, max_length=config.get("max_length", 8192), media_kwargs=config.get("media_kwargs") or {})
        logits_fn = reference.question_logits
        origin = {"kind": "rebuilt", "what": "parity.reference (docs/valen-model.md, from checkpoint.pt + base)"}
    build_s = time.perf_counter() - t0
    env = reference.environment(device, dtype)
    # The processor must decode videos with the pinned decoder, never with torchcodec.
    if env["kernels"]["is_torchcodec_available"] or env["kernels"]["find_spec"]["torchcodec"]:
        raise reference.ReferenceBuildError("torchcodec is importable in the reference process; the pinned environment decoded videos with PyAV")
    if env["video_decoder"]["read_video"] != f"{video_reader.__name__}.read_video":
        raise reference.ReferenceBuildError(f"torchvision.io.read_video is {env['video_decoder']['read_video']}, not parity.video_reader's")
    env["live_model"] = _model_kernels(model)
    env["image_processor"] = f"{type(processor.image_processor).__module__}.{type(processor.image_processor).__name__}"
    env["image_processor_backend"] = [c.__name__ for c in type(processor.image_processor).__mro__ if "Backend" in c.__name__]
    env["tokenizer_class"] = type(processor.tokenizer).__name__
    env["head_dtype"] = str(model.head.decision.weight.dtype)
    rotary = RotaryCapture(model)

    results = []
    for n, item in enumerate(job["requests"]):
        rec = {"id": item["id"], "ok": False}
        t1 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="valen-parity-media-") as media_dir:
            try:
                prompt = builder.build(item["request"], Path(media_dir))
            except (PromptError, ValueError, KeyError, TypeError, OSError) as e:
                rec["error"] = f"{type(e).__name__}: {e}"
                results.append(rec)
                continue
            rotary.reset()
            logits = logits_fn(model, builder, prompt, device)
        rec["ok"] = True
        rec["prompt"] = prompt.to_json()
        # float(fp32) is exact in a Python float; JSON repr round-trips it exactly.
        rec["logits"] = [[float(x) for x in lg.tolist()] for lg in logits]
        if "pixel_values" in prompt.base:
            name = f"pixels-{n}.pt"
            torch.save(prompt.base["pixel_values"].contiguous(), out / name)
            rec["pixel_values_file"] = name
        if "pixel_values_videos" in prompt.base:
            name = f"video-pixels-{n}.pt"
            torch.save(prompt.base["pixel_values_videos"].contiguous(), out / name)
            rec["pixel_values_videos_file"] = name
        if rotary.positions is not None:
            name = f"rope-{n}.pt"
            torch.save(rotary.tables(), out / name)
            rec["rotary_file"] = name
        rec["seconds"] = time.perf_counter() - t1
        results.append(rec)
    return {
        "origin": origin,
        "environment": env,
        "checkpoint_sha256": sha256_file(Path(job["checkpoint"]) / "checkpoint.pt"),
        "checkpoint_config": {k: config.get(k) for k in ("stage", "lora_rank", "lora_alpha", "projection_dim", "max_length", "media_kwargs", "dtype")},
        "build_seconds": build_s,
        "results": results,
    }


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m parity.reference_worker JOB.json", file=sys.stderr)
        return 2
    job = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    try:
        result = run_job(job)
    except Exception as e:  # the reference could not be built: one line for the parent
        detail = traceback.format_exc(limit=-3).strip().splitlines()
        print(f"reference failed: {type(e).__name__}: {e}", file=sys.stderr)
        print("\n".join(detail), file=sys.stderr)
        return 3
    out = Path(job["out"]) / "reference.json"
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, ensure_ascii=False), encoding="utf-8")
    tmp.rename(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
