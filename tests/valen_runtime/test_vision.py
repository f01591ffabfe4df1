"""valen_runtime.vision against transformers 5.4.0's Qwen3_5VisionModel (eager) on a tiny random tower.

Same ops in the same order on the same machine, so the expected difference is zero in fp32 and bf16.
"""

import pytest
import torch

import transformers  # noqa: E402  (pinned: a hard requirement, never a skip)

from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration  # noqa: E402

from valen_runtime.config import ModelConfig  # noqa: E402
from valen_runtime.vision import VisionModel  # noqa: E402

VISION_PREFIX = "model.visual."


# Tiny tensors: one thread is faster and immune to oversubscribed CI cores (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny_hf_config() -> Qwen3_5Config:
    text = dict(
        vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=1, layer_types=["full_attention"],
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_num_key_heads=1, linear_num_value_heads=1,
        linear_key_head_dim=8, linear_value_head_dim=8, max_position_embeddings=256,
        rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                             mrope_section=[1, 1, 0], mrope_interleaved=True),
    )
    # 64 position embeddings = an 8 x 8 table; images below are both smaller and larger than it.
    vision = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16,
                  temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=48, num_position_embeddings=64)
    return Qwen3_5Config(text_config=text, vision_config=vision, image_token_id=12, video_token_id=13,
                         vision_start_token_id=9, vision_end_token_id=10)


def build_pair(dtype):
    hf_cfg = tiny_hf_config()
    hf = Qwen3_5ForConditionalGeneration._from_config(hf_cfg, dtype=dtype, attn_implementation="eager").eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in hf.model.visual.named_parameters():  # every weight, bias and norm random
            scale = p.shape[-1] ** -0.5 if p.ndim >= 2 and "pos_embed" not in name else 0.3
            base = 1.0 if name.endswith("norm1.weight") or name.endswith("norm2.weight") or name.endswith("norm.weight") else 0.0
            p.copy_((base + scale * torch.randn(p.shape, generator=gen)).to(dtype))
    cfg = ModelConfig.from_dict(hf_cfg.to_dict())
    with torch.device("meta"):
        vm = VisionModel(cfg.vision_config)
    sd = {k[len(VISION_PREFIX):]: v.clone() for k, v in hf.state_dict().items() if k.startswith(VISION_PREFIX)}
    vm.load_state_dict(sd, strict=True, assign=True)
    return hf, vm.eval()


GRIDS = {
    "one square image": [[1, 4, 4]],
    "non-square, larger than the table": [[1, 6, 20]],
    "three images incl. two frames": [[1, 10, 6], [2, 2, 4], [1, 12, 12]],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(GRIDS))
@torch.no_grad()
def test_vision_tower_matches_hf_bitwise(dtype, name):
    hf, vm = build_pair(dtype)
    grid = torch.tensor(GRIDS[name])
    n_patches = int(grid.prod(-1).sum())
    gen = torch.Generator().manual_seed(1)
    pixels = torch.randn(n_patches, 3 * 2 * 16 * 16, generator=gen)  # fp32, as the processor returns
    ref = torch.cat(hf.model.get_image_features(pixels, grid).pooler_output)
    out = vm(pixels, grid)
    assert out.shape == (n_patches // 4, 48) and out.dtype == dtype
    diff = (ref.float() - out.float()).abs().max().item()
    print(f"vision {dtype} {name}: max |diff| {diff:.3g}, ref absmax {ref.abs().max().item():.3g}")
    assert diff == 0.0  # tolerance 0: same ops, same order


def test_state_dict_names_are_hf_names():
    hf, vm = build_pair(torch.float32)
    hf_sd = {k[len(VISION_PREFIX):]: v for k, v in hf.state_dict().items() if k.startswith(VISION_PREFIX)}
    assert {k: v.shape for k, v in vm.state_dict().items()} == {k: v.shape for k, v in hf_sd.items()}


@torch.no_grad()
def test_bf16_position_interpolation_rounds_weights_like_540():
    """5.4.0 rounds the bilinear weights to bf16 and sums in bf16; fp32 weights give other numbers."""
    _, vm = build_pair(torch.bfloat16)
    grids = [(1, 6, 10)]
    pe = vm.position_embeddings(grids)
    assert pe.dtype == torch.bfloat16 and pe.shape == (60, 32)
    # The 5.9+ way: fp32 weights, products and sum, one cast at the end.
    vm32 = VisionModel(vm.config)
    vm32.load_state_dict({k: v.float() for k, v in vm.state_dict().items()})
    assert not torch.equal(pe, vm32.position_embeddings(grids).to(torch.bfloat16))


@torch.no_grad()
def test_encode_on_grid_tables_equals_forward():
    """forward = grid_tables (host work) + encode (capturable); the split changes nothing."""
    from valen_runtime.vision import frame_lengths, grid_list

    _, vm = build_pair(torch.bfloat16)
    grid = torch.tensor(GRIDS["three images incl. two frames"])
    n = int(grid.prod(-1).sum())
    pixels = torch.randn(n, 3 * 2 * 16 * 16, generator=torch.Generator().manual_seed(2))
    grids = grid_list(grid)
    assert torch.equal(vm.encode(pixels, *vm.grid_tables(grids), frame_lengths(grids)), vm(pixels, grid))


VIDEO_GRIDS = {
    "one pair": [[1, 4, 6]],
    "three pairs": [[3, 4, 4]],
    "ten pairs, larger than the table": [[10, 4, 12]],
    "two videos": [[2, 6, 4], [3, 2, 2]],
}


@pytest.mark.parametrize("name", list(VIDEO_GRIDS))
@torch.no_grad()
def test_video_grids_match_hf_get_video_features_fp32_bitwise(name):
    """t > 1: position table and 2-D rotary repeated per frame pair, attention within each pair."""
    hf, vm = build_pair(torch.float32)
    grid = torch.tensor(VIDEO_GRIDS[name])
    n_patches = int(grid.prod(-1).sum())
    pixels = torch.randn(n_patches, 3 * 2 * 16 * 16, generator=torch.Generator().manual_seed(3))
    ref = torch.cat(hf.model.get_video_features(pixels, grid).pooler_output)
    out = vm(pixels, grid)
    assert out.shape == ref.shape == (n_patches // 4, 48)
    assert torch.equal(out, ref)


@torch.no_grad()
def test_video_frame_pairs_do_not_see_each_other():
    """Changing the pixels of pair 2 of a 3-pair video changes only pair 2's output tokens."""
    _, vm = build_pair(torch.float32)
    grid = torch.tensor([[3, 4, 4]])
    pixels = torch.randn(48, 3 * 2 * 16 * 16, generator=torch.Generator().manual_seed(4))
    changed = pixels.clone()
    changed[16:32] += 1.0  # the second pair's 16 patches
    out, out2 = vm(pixels, grid), vm(changed, grid)  # [12, 48]: 4 merged tokens per pair
    assert torch.equal(out[:4], out2[:4]) and torch.equal(out[8:], out2[8:])
    assert not torch.equal(out[4:8], out2[4:8])
