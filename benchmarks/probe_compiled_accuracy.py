"""Where do compiled fused layers lose bf16 accuracy on cached continuations? (docs/parity.md)

Runs the inputs of tests/valen_runtime/test_fast.py::test_fused_layers_match_module_path_cuda
(a 64-token prefix, then 3 x 21 suffix tokens on the expanded cache) through variants of the fused
layers, each measured against the fp32 module path: the module path in bf16, the fused layers
eager, everything compiled, only the GDN or only the attention layers compiled, compiled with the
reference's attention formula instead of SDPA, and compiled with a contiguous (not expanded)
cache; and, to tell a compiled GDN layer that writes a bad cache from one that reads a good cache
badly, the GDN layers compiled for only the prefix or only the continuation. Run 4 (docs/parity.md)
put the whole loss in the compiled GDN layers' continuation; `--only` picks variants by name
(the undecided ones first). Prints one line per variant (mean / max error of the prefix and of the continuation) and
writes them as JSON. A diagnosis tool, not a test.

    python benchmarks/probe_compiled_accuracy.py --out probe.json            # CUDA
    python benchmarks/probe_compiled_accuracy.py --device cpu --out probe.json  # smoke run
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch


def build_export(work: Path) -> Path:
    from valen_export.export import export
    from valen_export.fixture import build_fixture

    fx, out = work / "fixture-tiny", work / "export-tiny-separate"
    if not (fx / "pins.json").exists():
        build_fixture(fx, preset="tiny", seed=0)
    if not (out / "valen_export.json").exists():
        export(fx / "checkpoint", fx / "base", out, lora_mode="separate", pins_path=fx / "pins.json", progress=False)
    return out


def fused_variant(export_dir: Path, device: str, compile_gdn: bool, compile_attention: bool, attention: str,
                  swap_gdn_after_prefix: bool = False):
    """Fused layers with each layer kind compiled or not (enable_fused_layers compiles both or neither).
    swap_gdn_after_prefix: the GDN layers switch between eager and compiled after the prefix (see
    `run`'s `between`). -> (text model, the callable to run between prefix and continuation or None)."""
    from valen_runtime import qwen35
    from valen_runtime.fast import enable_fast_paths, sdpa_attention
    from valen_runtime.fused_layers import compile_layer_fn, make_layer_fns
    from valen_runtime.weights import load_model

    text = load_model(export_dir, device=device, dtype="bf16").text
    enabled = enable_fast_paths(text, dtype=torch.bfloat16, compile=False, fused_attention=attention)
    core = sdpa_attention if attention == "sdpa" else qwen35.eager_attention
    impl = "fla" if str(enabled["gated_delta"]).startswith("fla") else "torch"
    gdn_eager, att, *_ = make_layer_fns(text.config, core, impl)
    gdn_compiled = compile_layer_fn(gdn_eager)
    if compile_attention:
        att = compile_layer_fn(att)

    def assign(gdn):
        for layer in text.layers:
            layer.fused_forward.fn = gdn if layer.layer_type == "linear_attention" else att

    assign(gdn_compiled if compile_gdn else gdn_eager)
    between = (lambda: assign(gdn_eager if compile_gdn else gdn_compiled)) if swap_gdn_after_prefix else None
    return text, between


def positions(batch: int, start: int, n: int, device) -> torch.Tensor:
    """M-RoPE positions [3, batch, n] of text tokens start..start+n."""
    return torch.arange(start, start + n, device=device).view(1, 1, -1).expand(3, batch, -1).contiguous()


def run(model, prefix, tails, device, contiguous_cache: bool = False, between=None):
    w = model.embed_tokens.weight.dtype
    cache = model.new_cache()
    with torch.no_grad():
        head = model(prefix.to(device, w), positions(1, 0, 64, device), cache)
        if between is not None:
            between()
        cont = cache.expand(3).clone() if contiguous_cache else cache.expand(3)
        tail = model(tails.to(device, w), positions(3, 64, 21, device), cont)
    return head.float(), tail.float()


def prefix_caches(truth, export_dir: Path, device: str, prefix: torch.Tensor) -> dict:
    """The cache each prefix pass leaves: the fp32 module path `truth`, eager and compiled fused GDN."""
    caches = {}
    pos = positions(1, 0, prefix.shape[1], device)
    caches["truth"] = truth.new_cache()
    with torch.no_grad():
        truth(prefix.to(device, torch.float32), pos, caches["truth"])
        text, swap = fused_variant(export_dir, device, False, False, "sdpa", swap_gdn_after_prefix=True)
        for name in ("eager", "compiled"):
            caches[name] = text.new_cache()
            text(prefix.to(device, torch.bfloat16), pos, caches[name])
            swap()
    return caches


def cache_errors(caches: dict) -> dict:
    """Per cache entry kind, mean / max |error| against the fp32 truth over the GDN layers."""
    out = {}
    for name in ("eager", "compiled"):
        for kind in ("conv_states", "recurrent_states"):
            errs = [(a.float() - t.float()).abs() for a, t in zip(getattr(caches[name], kind), getattr(caches["truth"], kind)) if t is not None]
            out[f"{name} {kind}"] = {"mean": sum(e.mean().item() for e in errs) / len(errs), "max": max(e.max().item() for e in errs)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--work", type=Path, default=None, help="where the tiny fixture and export go (default: a temporary folder)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--only", action="append", default=[], help="run the variants whose name contains TEXT (repeatable)")
    args = ap.parse_args()
    from valen_runtime.weights import load_model

    work = args.work or Path(tempfile.mkdtemp(prefix="valen-probe-"))
    export_dir = build_export(work)
    gen = torch.Generator().manual_seed(4)
    H = load_model(export_dir, device="cpu", dtype="bf16").text.config.hidden_size
    # As the test: bf16 inputs, the fp32 run sees the same (rounded) values.
    prefix = torch.randn(1, 64, H, generator=gen).to(torch.bfloat16)
    tails = torch.randn(3, 21, H, generator=gen).to(torch.bfloat16)
    truth_model = load_model(export_dir, device=args.device, dtype="fp32").text
    truth = run(truth_model, prefix, tails, args.device)

    def fused(compile_gdn, compile_attention, attention="sdpa", contiguous=False, swap=False):
        return lambda: (*fused_variant(export_dir, args.device, compile_gdn, compile_attention, attention, swap), contiguous)

    variants = {  # the undecided ones first (docs/parity.md, run 4)
        "fused, GDN compiled, contiguous cache": fused(True, False, contiguous=True),
        "fused, GDN compiled for the prefix only": fused(True, False, swap=True),
        "fused, GDN compiled for the continuation only": fused(False, False, swap=True),
        "module path": lambda: (load_model(export_dir, device=args.device, dtype="bf16").text, None, False),
        "fused, eager": fused(False, False),
        "fused, all compiled": fused(True, True),
        "fused, GDN layers compiled": fused(True, False),
        "fused, attention layers compiled": fused(False, True),
        "fused, all compiled, eager attention formula": fused(True, True, "eager"),
    }
    if args.only:
        variants = {k: v for k, v in variants.items() if any(t in k for t in args.only)}
    report = {"device": args.device, "torch": torch.__version__, "variants": {}}
    for name, make in variants.items():
        model, between, contiguous = make()
        got = run(model, prefix, tails, args.device, contiguous_cache=contiguous, between=between)
        row = {}
        for part, g, t in zip(("prefix", "continuation"), got, truth):
            err = (g - t).abs()
            row[part] = {"mean": err.mean().item(), "max": err.max().item()}
        report["variants"][name] = row
        print(f"{name:46s} prefix {row['prefix']['mean']:.4f} / {row['prefix']['max']:.3f}   "
              f"continuation {row['continuation']['mean']:.4f} / {row['continuation']['max']:.3f}", flush=True)
        args.out.write_text(json.dumps(report, indent=2))
    if not args.only or any(t in "prefix cache errors" for t in args.only):
        # Which cache entry does the compiled prefix get wrong? (run 5: the loss follows the compiled prefix)
        report["prefix cache errors"] = cache_errors(prefix_caches(truth_model, export_dir, args.device, prefix))
        for name, e in report["prefix cache errors"].items():
            print(f"prefix cache, {name:30s} {e['mean']:.3g} / {e['max']:.3g}", flush=True)
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
