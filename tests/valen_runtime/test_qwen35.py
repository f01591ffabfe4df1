"""valen_runtime.qwen35 against transformers 5.4.0 / peft 0.18.1 on a tiny random Qwen3.5.

Both sides run the same ops in the same order on the same machine, so the expected difference
is zero (bitwise), in fp32 and in bf16; a non-zero difference means an op or its order diverged.
The prefix-cache tests compare two runtime paths whose chunk boundaries and matmul shapes differ,
so they differ by round-off only (tolerances declared at each assert).
"""

import os
import subprocess
import sys

import pytest
import torch

import peft  # noqa: E402  (pinned reference stack: a hard requirement, never a skip)
import transformers  # noqa: E402

from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration  # noqa: E402

from valen_runtime.config import ModelConfig  # noqa: E402
from valen_runtime.errors import WeightsError  # noqa: E402
from valen_runtime.positions import rope_index  # noqa: E402
from valen_runtime.qwen35 import LoRALinear, TextModel, attach_lora  # noqa: E402

LM_PREFIX = "model.language_model."
IMAGE_TOKEN = 12


def tiny_hf_config() -> Qwen3_5Config:
    """4 text layers [L, L, L, F], hidden 64; rotary half 8 split unevenly [4, 3, 1] over T/H/W
    (like 2B's [11, 11, 10], a swap of two sections changes the interleave, so it cannot hide)."""
    text = dict(
        vocab_size=404, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        num_attention_heads=4, num_key_value_heads=1, head_dim=32,
        # 4 value heads over 2 key heads also exercises the q/k repeat_interleave branch.
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, max_position_embeddings=4096, tie_word_embeddings=True, partial_rotary_factor=0.5,
        rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.5,
                             mrope_section=[4, 3, 1], mrope_interleaved=True),
    )
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16,
                  temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=64)
    return Qwen3_5Config(text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN, video_token_id=13,
                         vision_start_token_id=9, vision_end_token_id=10, tie_word_embeddings=True)


def randomise_(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random (norm weights, A_log, dt_bias included) so nothing is trivially 0 or 1."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                value = torch.empty(p.shape).uniform_(1, 16, generator=gen).log()
            elif name.endswith("linear_attn.norm.weight"):  # plain weight, centred on 1
                value = 1 + 0.2 * torch.randn(p.shape, generator=gen)
            elif name.endswith("dt_bias"):
                value = 1 + 0.5 * torch.randn(p.shape, generator=gen)
            elif p.ndim >= 2:
                value = torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5
            else:  # zero-centred (1 + w) norms and biases
                value = 0.2 * torch.randn(p.shape, generator=gen)
            p.copy_(value.to(p.dtype))


def build_pair(dtype: torch.dtype, seed: int = 0):
    """An HF model (eager attention, as the Valen reference) and the runtime model with its weights."""
    hf_cfg = tiny_hf_config()
    hf = Qwen3_5ForConditionalGeneration._from_config(hf_cfg, dtype=dtype, attn_implementation="eager").eval()
    randomise_(hf, seed)
    cfg = ModelConfig.from_dict(hf_cfg.to_dict())
    with torch.device("meta"):
        rt = TextModel(cfg.text_config)
    sd = {k[len(LM_PREFIX):]: v.clone() for k, v in hf.state_dict().items() if k.startswith(LM_PREFIX)}
    rt.load_state_dict(sd, strict=True, assign=True)
    return hf, rt.eval()


def image_prompt(gen: torch.Generator, n_text: int = 150):
    """Random token ids with one 6 x 10 patch-grid image (15 tokens) so M-RoPE axes differ."""
    grid = torch.tensor([[1, 6, 10]])
    n_img = 15
    ids = torch.randint(14, 404, (n_text + n_img,), generator=gen)
    types = torch.zeros_like(ids)
    ids[20:20 + n_img] = IMAGE_TOKEN
    types[20:20 + n_img] = 1
    pos, _ = rope_index(ids, types, grid, spatial_merge_size=2)
    return ids, pos


def report(name: str, ref: torch.Tensor, out: torch.Tensor) -> float:
    diff = (ref.float() - out.float()).abs()
    print(f"{name}: max |diff| {diff.max().item():.3g}, mean {diff.mean().item():.3g}, ref absmax {ref.abs().max().item():.3g}")
    return diff.max().item()


# Tiny tensors: one thread is faster and immune to oversubscribed CI cores (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def test_state_dict_names_are_hf_names():
    hf, rt = build_pair(torch.float32)
    hf_names = {k[len(LM_PREFIX):] for k in hf.state_dict() if k.startswith(LM_PREFIX)}
    assert set(rt.state_dict()) == hf_names
    for name, p in rt.state_dict().items():
        assert p.shape == hf.state_dict()[LM_PREFIX + name].shape, name


def test_2b_names_and_shapes_match_hf_on_meta():
    """The presumed Qwen3.5-2B config: 320 language and 297 vision tensors, same names and shapes."""
    import json
    from pathlib import Path

    from valen_runtime.vision import VisionModel

    path = Path(__file__).resolve().parents[2] / "manifests" / "qwen3.5-2b.config.json"  # tracked
    d = json.loads(path.read_text())
    cfg = ModelConfig.from_dict(d)
    with torch.device("meta"):
        hf = Qwen3_5ForConditionalGeneration(Qwen3_5Config(**d))
        text, vision = TextModel(cfg.text_config), VisionModel(cfg.vision_config)
    for prefix, module, count in ((LM_PREFIX, text, 320), ("model.visual.", vision, 297)):
        want = {k[len(prefix):]: v.shape for k, v in hf.state_dict().items() if k.startswith(prefix)}
        assert {k: v.shape for k, v in module.state_dict().items()} == want and len(want) == count


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_text_model_matches_hf_bitwise(dtype):
    hf, rt = build_pair(dtype)
    gen = torch.Generator().manual_seed(1)
    rows = [image_prompt(gen) for _ in range(2)]  # batch 2, T = 165 (three delta-rule chunks)
    ids = torch.stack([r[0] for r in rows])
    pos = torch.stack([r[1] for r in rows], dim=1)  # [3, B, T]
    embeds = rt.embed(ids)
    assert torch.equal(embeds, hf.model.language_model.embed_tokens(ids))
    ref = hf.model.language_model(inputs_embeds=embeds, position_ids=pos).last_hidden_state
    out = rt(embeds, pos)
    assert out.dtype == dtype and out.shape == ref.shape
    # Tolerance: 0 (same ops, same order, same machine).
    assert report(f"text {dtype}", ref, out) == 0.0


@pytest.mark.filterwarnings("ignore:Could not find a config file")  # peft: no base config on disk
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_peft_lora_matches_runtime_bitwise(dtype):
    hf, rt = build_pair(dtype, seed=2)
    lm = hf.model.language_model
    targets = sorted(n for n, m in lm.named_modules() if isinstance(m, torch.nn.Linear))
    config = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=targets)
    pm = peft.get_peft_model(lm, config)
    gen = torch.Generator().manual_seed(3)
    for name, p in pm.named_parameters():
        if ".lora_" in name:  # lora_B is zero at init: make the adapter do something
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    adapter = peft.get_peft_model_state_dict(pm)  # the saved-file form, without ".default"
    assert {v.dtype for v in adapter.values()} == {torch.float32}
    attach_lora(rt, {k.removeprefix("base_model.model."): v for k, v in adapter.items()}, scale=16 / 8)
    n_lora = sum(isinstance(m, LoRALinear) and m.lora_A is not None for m in rt.modules())
    assert n_lora == len(targets) == 31

    ids, pos = image_prompt(gen, n_text=100)
    embeds = rt.embed(ids[None])
    pos = pos[:, None]
    ref = pm(inputs_embeds=embeds, position_ids=pos).last_hidden_state
    out = rt(embeds, pos)
    assert out.dtype == dtype
    assert report(f"lora {dtype}", ref, out) == 0.0  # tolerance 0, as above
    with pm.disable_adapter():
        base = pm(inputs_embeds=embeds, position_ids=pos).last_hidden_state
    assert (base.float() - ref.float()).abs().max() > 0.05  # the adapter is visible in the output


def test_lora_stays_fp32_on_a_bf16_model():
    _, rt = build_pair(torch.bfloat16)
    proj = rt.layers[0].mlp.down_proj
    a = torch.randn(4, proj.in_features)
    b = torch.randn(proj.out_features, 4)
    attach_lora(rt, {"layers.0.mlp.down_proj.lora_A.weight": a, "layers.0.mlp.down_proj.lora_B.weight": b}, 0.5)
    assert proj.lora_A.weight.dtype == torch.float32 and proj.weight.dtype == torch.bfloat16
    x = torch.randn(3, proj.in_features).to(torch.bfloat16)
    y = proj(x)
    assert y.dtype == torch.bfloat16
    base = x @ proj.weight.T  # the same bf16 GEMM as the module's base projection
    want = (base + (x.float() @ a.T @ b.T) * 0.5).to(torch.bfloat16)
    # PEFT's order adds the fp32 delta to the already-rounded bf16 base output, then rounds again:
    # at most one bf16 rounding (unit 2^-8) of |base| more than `want`, plus each side's final one.
    assert ((y.float() - want.float()).abs() <= 2.0**-8 * (base.float().abs() + 2 * want.float().abs())).all()
    assert set(rt.state_dict()) >= {"layers.0.mlp.down_proj.lora_A.weight", "layers.0.mlp.down_proj.lora_B.weight"}


@pytest.mark.parametrize(
    "adapter, phrase",
    [
        ({"layers.0.mlp.nope.lora_A.weight": torch.zeros(2, 64), "layers.0.mlp.nope.lora_B.weight": torch.zeros(128, 2)}, "match no projection"),
        ({"layers.0.linear_attn.conv1d.lora_A.weight": torch.zeros(2, 4), "layers.0.linear_attn.conv1d.lora_B.weight": torch.zeros(4, 2)}, "match no projection"),
        ({"base_model.model.layers.0.mlp.up_proj.lora_A.weight": torch.zeros(2, 64)}, "match no projection"),
        ({"layers.0.mlp.up_proj.lora_A.default.weight": torch.zeros(2, 64)}, "match no projection"),
        ({"layers.0.mlp.up_proj.lora_A.weight": torch.zeros(2, 64)}, "without both"),
        ({"layers.0.mlp.up_proj.lora_A.weight": torch.zeros(2, 64), "layers.0.mlp.up_proj.lora_B.weight": torch.zeros(64, 2)}, "do not fit"),
        ({"layers.0.mlp.up_proj.lora_A.weight": torch.zeros(2, 64), "layers.0.mlp.up_proj.lora_B.weight": torch.zeros(128, 3)}, "do not fit"),
    ],
)
def test_attach_lora_refuses_bad_adapters(adapter, phrase):
    _, rt = build_pair(torch.float32)
    with pytest.raises(WeightsError, match=phrase):
        attach_lora(rt, adapter, 2.0)
    assert all(m.lora_A is None for m in rt.modules() if isinstance(m, LoRALinear))


# ---- Phase 2: prefix state -----------------------------------------------------------------


# Cached vs one-shot runs compute the same function with other chunk boundaries and matmul
# shapes. fp32: the difference is bounded by the network's own round-off at that input
# (`roundoff_bound`, tests/conftest.py: one stage per layer, the widest reduction). bf16: a
# flipped bf16 rounding propagates, so the bf16 tests assert the cache error stays below the
# same model's bf16-vs-fp32 error instead.


def fp32_bound(roundoff_bound, rt, x, pos) -> float:
    widest = max(rt.config.hidden_size, rt.config.intermediate_size)
    return roundoff_bound(lambda inputs: rt(inputs, pos), x, widest, stages=rt.config.num_hidden_layers)


def _prefix_run(rt, x, pos, prefix):
    cache = rt.new_cache()
    head = rt(x[:, :prefix], pos[..., :prefix], cache)
    tail = rt(x[:, prefix:], pos[..., prefix:], cache)
    assert cache.num_tokens == x.shape[1]
    return head, tail


@pytest.mark.parametrize("prefix, suffix", [(2, 5), (70, 1), (64, 64), (3, 130)])
def test_prefix_then_suffix_matches_one_forward_fp32(prefix, suffix, roundoff_bound):
    _, rt = build_pair(torch.float32, seed=4)
    gen = torch.Generator().manual_seed(prefix * 1000 + suffix)
    T = prefix + suffix
    x = torch.randn(1, T, 64, generator=gen)
    pos = torch.arange(T).view(1, 1, -1).expand(3, 1, -1)
    full = rt(x, pos)
    head, tail = _prefix_run(rt, x, pos, prefix)
    report(f"cache fp32 P={prefix} S={suffix}", full[:, prefix:], tail)
    bound = fp32_bound(roundoff_bound, rt, x, pos)
    assert (head - full[:, :prefix]).abs().max().item() <= bound
    assert (tail - full[:, prefix:]).abs().max().item() <= bound


def test_prefix_then_suffix_bf16_stays_below_bf16_error():
    prefix, suffix = 3, 130
    _, rt16 = build_pair(torch.bfloat16, seed=4)
    _, rt32 = build_pair(torch.float32, seed=4)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(1, prefix + suffix, 64, generator=gen).to(torch.bfloat16)
    pos = torch.arange(prefix + suffix).view(1, 1, -1).expand(3, 1, -1)
    full = rt16(x, pos)[:, prefix:].float()
    fp32 = rt32(x.float(), pos)[:, prefix:]
    _, tail = _prefix_run(rt16, x, pos, prefix)
    cache_err = (tail.float() - full).abs()
    bf16_err = (full - fp32).abs()
    report("cache bf16", full, tail)
    report("bf16 vs fp32", fp32, full)
    assert cache_err.max() <= bf16_err.max()
    assert cache_err.mean() <= 0.5 * bf16_err.mean()


def test_prefix_cut_at_a_chunk_multiple_tracks_hf_in_bf16():
    """With the cut at a multiple of 64 tokens, every delta-rule chunk of the suffix run lines up with
    a chunk of the one-shot run, so only GEMM shapes differ. Observed on this CPU: bitwise equal to
    the HF bf16 forward (a cut at 60 tokens gave max 1.6). Tolerance: one bf16 ulp at absmax ~4."""
    hf, rt = build_pair(torch.bfloat16, seed=4)
    gen = torch.Generator().manual_seed(5)
    prefix, suffix = 64, 37
    x = torch.randn(1, prefix + suffix, 64, generator=gen).to(torch.bfloat16)
    pos = torch.arange(prefix + suffix).view(1, 1, -1).expand(3, 1, -1)
    ref = hf.model.language_model(inputs_embeds=x, position_ids=pos).last_hidden_state[:, prefix:]
    _, tail = _prefix_run(rt, x, pos, prefix)
    assert report("aligned cut bf16 vs HF", ref, tail) <= 0.03125


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_suffixes_continue_from_one_prefix(dtype, roundoff_bound):
    _, rt = build_pair(dtype, seed=4)
    gen = torch.Generator().manual_seed(11)
    prefix, suffix, branches = 45, 30, 2
    shared = torch.randn(1, prefix, 64, generator=gen).to(dtype)
    tails = torch.randn(branches, suffix, 64, generator=gen).to(dtype)
    # Positions continue after an image-like prefix whose positions end below T - 1.
    pos_prefix = torch.arange(prefix).view(1, 1, -1).expand(3, 1, -1).clone()
    pos_prefix[1:, :, 10:20] = 10  # height / width of a flat image run
    pos_tail = torch.arange(prefix, prefix + suffix).view(1, 1, -1).expand(3, branches, -1)

    cache = rt.new_cache()
    rt(shared, pos_prefix, cache)
    batched = rt(tails, pos_tail, cache.expand(branches))
    assert cache.num_tokens == prefix  # expand() made a new cache; the prefix state is untouched
    for i in range(branches):
        x = torch.cat([shared, tails[i : i + 1]], dim=1)
        pos = torch.cat([pos_prefix, pos_tail[:, i : i + 1]], dim=2)
        full = rt(x, pos)[:, prefix:]
        branch = batched[i : i + 1]
        report(f"branch {i} {dtype}", full, branch)
        if dtype == torch.float32:
            bound = fp32_bound(roundoff_bound, rt, x, pos)
            assert (branch - full).abs().max().item() <= bound
        else:
            # Same order of magnitude as the single-row bf16 test above (observed max <= 0.09).
            assert (branch.float() - full.float()).abs().mean() < 0.01
    # The batched run left the shared prefix state untouched.
    fresh = rt.new_cache()
    rt(shared, pos_prefix, fresh)
    assert torch.equal(rt(tails[:1], pos_tail[:, :1], cache), rt(tails[:1], pos_tail[:, :1], fresh))


def test_cache_state_shapes_and_dtypes():
    _, rt = build_pair(torch.bfloat16, seed=4)
    cache = rt.new_cache()
    rt(torch.randn(2, 5, 64).to(torch.bfloat16), torch.arange(5).view(1, 1, -1).expand(3, 2, -1), cache)
    gdn = rt.layers[0].linear_attn
    assert cache.conv_states[0].shape == (2, gdn.conv_dim, gdn.kernel_size - 1)
    assert cache.conv_states[0].dtype == torch.bfloat16
    assert cache.recurrent_states[0].shape == (2, 4, 16, 16)
    assert cache.recurrent_states[0].dtype == torch.float32
    assert cache.keys[3].shape == (2, 1, 5, 32) and cache.values[3].shape == (2, 1, 5, 32)
    assert cache.keys[0] is None and cache.conv_states[3] is None


def test_runtime_modules_import_neither_transformers_nor_peft():
    code = (
        "import sys, valen_runtime.qwen35, valen_runtime.vision, valen_runtime.gated_delta, "
        "valen_runtime.positions, valen_runtime.head, valen_runtime.config\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'peft'))\n"
        "assert not bad, bad\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_attach_lora_on_a_meta_built_model():
    cfg = ModelConfig.from_dict(tiny_hf_config().to_dict())
    with torch.device("meta"):
        rt = TextModel(cfg.text_config)
    a, b = torch.randn(4, 64), torch.randn(128, 4)
    attach_lora(rt, {"layers.1.mlp.up_proj.lora_A.weight": a, "layers.1.mlp.up_proj.lora_B.weight": b}, 2.0)
    proj = rt.layers[1].mlp.up_proj
    assert proj.lora_A.weight.device.type == "cpu" and torch.equal(proj.lora_B.weight, b)
    assert proj.weight.is_meta  # base weights still come from the loader
