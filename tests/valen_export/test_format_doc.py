"""docs/export-format.md's generated tables equal what the exporter's table and the schema render."""

from __future__ import annotations

import json

import pytest

from valen_export import format_doc, inventory
from valen_export import tensor_table as table


def test_doc_tables_are_current():
    text = format_doc.DOC.read_text()
    assert format_doc.render(text) == text, "run: python -m valen_export.format_doc"


def test_a_table_change_shows_in_the_doc(monkeypatch):
    text = format_doc.DOC.read_text()
    changed = table.Group(table.HEAD.key, table.HEAD.prefix, "BF16", table.HEAD.rows)
    monkeypatch.setattr(table, "HEAD", changed)
    assert format_doc.render(text) != text
    assert format_doc.main(["--check"]) == 1


def test_a_missing_region_is_an_error():
    text = format_doc.DOC.read_text().replace("<!-- generated:head -->", "")
    with pytest.raises(ValueError, match="head"):
        format_doc.render(text)


def test_counts_of_the_2b_config_are_the_released_inventory():
    # 320 language / 186 LoRA pairs / 297 vision tensors: the Qwen3.5-2B numbers, counted by hand
    # from the layer recipe (18 GDN layers x 14 + 6 attention layers x 11 + 2; 18 x 8 + 6 x 7; 9 + 24 x 12).
    config = json.loads(format_doc.EXAMPLE_CONFIG.read_text())
    assert len(inventory.language_shapes(config)) == 18 * 14 + 6 * 11 + 2 == 320
    assert len(inventory.linear_shapes(config)) == 18 * 8 + 6 * 7 == 186
    assert len(inventory.vision_shapes(config)) == 9 + 24 * 12 == 297
    shapes = inventory.language_shapes(config)
    assert shapes["layers.0.linear_attn.in_proj_qkv.weight"] == (6144, 2048)
    assert shapes["layers.3.self_attn.q_proj.weight"] == (4096, 2048)
    assert shapes["layers.0.linear_attn.conv1d.weight"] == (6144, 1, 4)
