"""valen_export.fixture: large tensors drawn in row blocks with the values of a whole draw, and
valen-fixture saying what it writes while it writes it."""

from __future__ import annotations

import torch
from click.testing import CliRunner

from valen_export.cli import fixture_command
from valen_export.fixture import _random_blocks, _random_tensor
from valen_runtime.safetensors_file import SafetensorsFile, StreamingWriter

# One tensor of each drawing rule that can be blocked, with rows that do not divide evenly into blocks.
SHAPES = {
    "model.language_model.embed_tokens.weight": (203, 48),
    "model.language_model.layers.0.mlp.down_proj.weight": (131, 40),
    "model.visual.blocks.0.attn.qkv.weight": (77, 17, 3),
}


def test_blocks_hold_the_values_of_one_whole_draw():
    for name, shape in SHAPES.items():
        whole = _random_tensor(name, shape, torch.Generator().manual_seed(5)).to(torch.bfloat16)
        blocks = list(_random_blocks(name, shape, torch.bfloat16, torch.Generator().manual_seed(5), block_elements=1000))
        assert len(blocks) > 2 and all(b.numel() <= 1000 for b in blocks), name
        assert torch.equal(torch.cat(blocks), whole), name


def test_blocked_writes_give_the_same_file(tmp_path):
    name, shape = "model.language_model.embed_tokens.weight", SHAPES["model.language_model.embed_tokens.weight"]
    plan = [(name, torch.bfloat16, shape)]
    whole = StreamingWriter(tmp_path / "whole.safetensors", plan)
    whole.write(name, _random_tensor(name, shape, torch.Generator().manual_seed(1)).to(torch.bfloat16))
    blocked = StreamingWriter(tmp_path / "blocked.safetensors", plan)
    blocked.write_blocks(name, torch.bfloat16, shape, _random_blocks(name, shape, torch.bfloat16, torch.Generator().manual_seed(1), block_elements=500))
    assert whole.close() == blocked.close()
    assert SafetensorsFile(tmp_path / "blocked.safetensors").read(name).shape == shape


def test_blocks_that_miss_rows_are_refused(tmp_path):
    writer = StreamingWriter(tmp_path / "t.safetensors", [("t", torch.float32, (4, 2))])
    try:
        writer.write_blocks("t", torch.float32, (4, 2), [torch.zeros(3, 2)])
    except ValueError as e:
        assert "blocks hold 3 rows, expected 4" in str(e)
    else:
        raise AssertionError("three rows of four were accepted")
    finally:
        writer.abort()


def test_valen_fixture_says_what_it_writes(tmp_path):
    result = CliRunner().invoke(fixture_command, [str(tmp_path / "fx"), "--preset", "tiny"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    stages = [next(i for i, ln in enumerate(lines) if phrase in ln) for phrase in (
        "writing the tiny preset", "base/model.safetensors-00001-of-00001.safetensors: ", "random tensors",
        "checkpoint/checkpoint.pt: ", "trained tensors", "done in", "pins:")]
    assert stages == sorted(stages), lines
