"""One compiled decoder layer of the fast path's one-pass layout at the 2B shapes, random weights:
its kernels (profile_fast.kernel_profile: count, summed time, the largest by name) and its median time, for
working on the layer functions without building the 2b fixture. Not a test.

    python benchmarks/layer_bench.py [--case a c] [--lora separate merged] [--layer gdn attention] [--out layer.json]

Cases are one-pass layouts shaped like the latency requests: (a) a 256-row prefix and seven
continuations (843 rows), (c) a 2048-row prefix and 14 continuations (3408 rows). The weights are
random at the scale of the released ones (std 0.02; LoRA B non-zero so its product is computed
as in the real adapter). On the CPU (a smoke run) the delta rule is the torch one and nothing is
compiled unless --compile is given.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from profile_fast import kernel_profile  # noqa: E402
from valen_runtime.config import TextConfig  # noqa: E402
from valen_runtime.fast.layers import compile_layer_fns, gather_weights, make_layer_fns  # noqa: E402
from valen_runtime.layouts.common import upload  # noqa: E402
from valen_runtime.layouts.one_pass import one_pass_mask, packed_indices  # noqa: E402
from valen_runtime.qwen35 import DecoderLayer, LoRALinear, TextRotaryEmbedding, attach_lora  # noqa: E402

CASES = {
    "a": (256, [113, 84, 80, 78, 77, 76, 79]),
    "c": (2048, [123, 108, 86, 92, 88, 84, 143, 98, 80, 78, 79, 79, 130, 92]),
}
RANK = 32


def random_layer(cfg: TextConfig, kind: str, lora: str, device: str, seed: int) -> DecoderLayer:
    """A decoder layer of `kind` with random bf16 weights and, for lora="separate", a random FP32
    rank-32 adapter on every projection (the merged export carries none)."""
    gen = torch.Generator().manual_seed(seed)
    layer = DecoderLayer(cfg, cfg.layer_types.index(kind))
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=gen) * 2.0)
            elif p.ndim == 1:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    layer = layer.to(device=device, dtype=torch.bfloat16)
    if lora == "separate":
        adapter = {}
        for name, m in layer.named_modules():
            if isinstance(m, LoRALinear):
                adapter[f"{name}.lora_A.weight"] = torch.randn(RANK, m.in_features, generator=gen) * 0.02
                adapter[f"{name}.lora_B.weight"] = torch.randn(m.out_features, RANK, generator=gen) * 0.02
        attach_lora(layer, {k: v.to(device) for k, v in adapter.items()}, scale=2.0)
    return layer


def layer_call(cfg: TextConfig, fns, kind: str, weights, case: str, device: str, seed: int):
    """A zero-argument call of the layer's one-pass function on random rows of `case`'s layout."""
    cut, lengths = CASES[case]
    K = cfg.linear_conv_kernel_dim
    layout = upload(packed_indices([(cut, lengths)], K), torch.device(device))
    R = cut + sum(lengths)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, R, cfg.hidden_size, generator=gen).to(device=device, dtype=torch.bfloat16)
    if kind == "linear_attention":
        state = torch.zeros(1, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim, device=device)
        return lambda: fns.gdn_one_pass(x, state, layout.conv_taps, layout.prefix_rows, layout.prefix_cu_seqlens,
                                        layout.prefix_chunk_indices, layout.cu_seqlens, layout.chunk_indices,
                                        layout.initial_state_index, weights)
    positions = torch.arange(R, device=device).view(1, 1, -1).expand(3, 1, -1)
    cos, sin = TextRotaryEmbedding(cfg).to(device)(x, positions)
    mask = one_pass_mask(layout, x.dtype, x.device)  # the tree mask the runtime builds
    return lambda: fns.attention_one_pass(x, cos, sin, mask, layout.attention_rows, layout.attention_slots, weights)


def measure(call, device: str, iters: int) -> dict:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(3):  # compile, autotune, warm
        call()
    sync()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        call()
        sync()
        times.append((time.perf_counter() - t) * 1e3)
    result = {"median_ms": statistics.median(times)}
    if device == "cuda":
        result.update(kernel_profile(call)[0])
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", nargs="+", default=["a", "c"], choices=sorted(CASES))
    ap.add_argument("--lora", nargs="+", default=["separate", "merged"], choices=["separate", "merged"])
    ap.add_argument("--layer", nargs="+", default=["gdn", "attention"], choices=["gdn", "attention"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--compile", action="store_true", help="torch.compile on the CPU too (always on CUDA)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--config", type=Path, default=HERE.parent / "manifests" / "qwen3.5-2b.config.json")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    cfg, _, _ = TextConfig.from_dict(json.loads(args.config.read_text())["text_config"])
    fns = make_layer_fns(cfg, "fla" if args.device == "cuda" else "torch")
    if args.device == "cuda" or args.compile:
        fns = compile_layer_fns(fns)
    results = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__, "runs": {}}
    with torch.no_grad():
        for lora in args.lora:
            for layer in args.layer:
                kind = "linear_attention" if layer == "gdn" else "full_attention"
                weights = gather_weights(random_layer(cfg, kind, lora, args.device, seed=0))
                for case in args.case:
                    r = measure(layer_call(cfg, fns, kind, weights, case, args.device, seed=1), args.device, args.iters)
                    results["runs"][f"{layer} {lora} ({case})"] = r
                    print(f"{layer} {lora} ({case}): median {r['median_ms']:.3f} ms"
                          + (f"; {r['kernels']} kernels summing {r['kernel_time_ms']:.3f} ms" if "kernels" in r else ""), flush=True)
                    for t in r.get("top", [])[:6]:
                        print(f"    {t['total_us']:8.1f} us {t['count']:3d} x  {t['name'][:110]}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
