"""Regenerate the tables of docs/export-format.md from the exporter's table and the manifest schema.

    python -m valen_export.format_doc            # rewrite the generated regions in place
    python -m valen_export.format_doc --check    # exit 1 when the doc differs from the table

A generated region sits between `<!-- generated:NAME -->` and `<!-- end generated:NAME -->`;
everything outside the markers is hand-written and left alone. tests/valen_export/test_format_doc.py
runs the check, so the doc cannot drift from `tensor_table` or `manifests/valen-native-1.schema.json`.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from . import tensor_table as table

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "export-format.md"
SCHEMA = ROOT / "manifests" / "valen-native-1.schema.json"
EXAMPLE_CONFIG = ROOT / "manifests" / "qwen3.5-2b.config.json"  # the Qwen3.5-2B config as far as it is known
REGION = re.compile(r"(<!-- generated:(?P<name>[a-z0-9-]+) -->\n)(?P<body>.*?)(<!-- end generated:(?P=name) -->)", re.S)


def _code(x: str) -> str:
    return f"`{x}`"


def _shape(row: table.Row) -> str:
    return "[" + ", ".join(row.shape) + "]"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


_SCOPE_TEXT = {
    table.MODEL: "once",
    table.EVERY_LAYER: "every layer `i`",
    table.LINEAR_ATTENTION: "layers `i` with `text.layer_types[i]` = `linear_attention`",
    table.FULL_ATTENTION: "layers `i` with `text.layer_types[i]` = `full_attention`",
    table.EVERY_BLOCK: "every block `b` in 0 .. `vision.depth`-1",
}


def symbols() -> str:
    rows = [[_code(n), _code(f)] for n, f in table.DERIVED.items()]
    rows += [[_code(n), m] for n, m in table.MANIFEST_SYMBOLS.items()]
    return _table(["Name", "Value"], rows)


def language() -> str:
    rows = [
        [_code(table.LANGUAGE_PREFIX + r.name), _SCOPE_TEXT[r.scope], _code(_shape(r)), table.LANGUAGE.dtype, r.base_dtype, "yes" if r.lora_target else ""]
        for r in table.LANGUAGE.rows
    ]
    return _table(["Name", "Present for", "Shape", "Dtype", "Dtype in the base", "LoRA target"], rows)


def _per_scope_counts(rows, scope_kinds) -> dict[str, int]:
    return {kind: sum(1 for r in rows if r.scope in (kind, table.EVERY_LAYER)) for kind in scope_kinds}


def counts() -> str:
    kinds = (table.LINEAR_ATTENTION, table.FULL_ATTENTION)
    per = _per_scope_counts(table.LANGUAGE.rows, kinds)
    once = sum(1 for r in table.LANGUAGE.rows if r.scope == table.MODEL)
    pairs = _per_scope_counts([r for r in table.LANGUAGE.rows if r.lora_target], kinds)
    block = sum(1 for r in table.VISION.rows if r.scope == table.EVERY_BLOCK)
    v_once = sum(1 for r in table.VISION.rows if r.scope == table.MODEL)
    cfg = table.model_config(json.loads(EXAMPLE_CONFIG.read_text()))
    n_lin = cfg.text_config.layer_types.count(table.LINEAR_ATTENTION)
    n_full = cfg.text_config.layer_types.count(table.FULL_ATTENTION)
    depth = cfg.vision_config.depth
    rows = [
        ["language tensors", f"{once} + {per[kinds[0]]} × L_lin + {per[kinds[1]]} × L_full", str(len(table.expand(table.LANGUAGE, cfg)))],
        ["LoRA pairs (`lora.pairs`)", f"{pairs[kinds[0]]} × L_lin + {pairs[kinds[1]]} × L_full", str(len(table.lora_targets(cfg)))],
        ["adapter tensors (separate mode)", "2 × pairs", str(2 * len(table.lora_targets(cfg)))],
        ["vision tensors", f"{v_once} + {block} × `vision.depth`", str(len(table.expand(table.VISION, cfg)))],
        ["head tensors", str(len(table.HEAD.rows)), str(len(table.HEAD.rows))],
    ]
    note = (
        f"L_lin / L_full = number of `linear_attention` / `full_attention` entries in `text.layer_types`. "
        f"Qwen3.5-2B: L_lin = {n_lin}, L_full = {n_full}, `vision.depth` = {depth}.\n\n"
    )
    return note + _table(["What", "Count", "Qwen3.5-2B"], rows)


def lora() -> str:
    rows = []
    for kind in (table.LINEAR_ATTENTION, table.FULL_ATTENTION):
        for r in table.LANGUAGE.rows:
            if r.lora_target and r.scope in (kind, table.EVERY_LAYER):
                module = r.name.split("{i}.", 1)[1][: -len(".weight")]
                out_f, in_f = r.shape
                key = table.LORA_KEY_PREFIX + "layers.{i}." + module
                rows.append([_code(kind), _code(module), _code(table.LORA_A.format(module=key)), _code(f"[rank, {in_f}]"), _code(table.LORA_B.format(module=key)), _code(f"[{out_f}, rank]")])
    return _table(["Layer type", "Module", "A name", "A shape", "B name", "B shape"], rows)


def vision() -> str:
    rows = [
        [_code(table.VISION_PREFIX + r.name), _SCOPE_TEXT[r.scope], _code(_shape(r)), table.VISION.dtype, {"trained blocks": "when `b` is in `vision.trained_blocks`", "merger": "when `vision.trained_merger`"}.get(r.overlay, "never")]
        for r in table.VISION.rows
    ]
    return _table(["Name", "Present for", "Shape", "Dtype", "Value from the checkpoint"], rows)


def head() -> str:
    rows = [[_code(r.name), _code(_shape(r)), table.HEAD.dtype] for r in table.HEAD.rows]
    return _table(["Name (no prefix)", "Shape", "Dtype"], rows)


def files() -> str:
    rows = [[_code(f), "yes" if f in table.REQUIRED_COPIED_FILES else "when the base has it"] for f in table.COPIED_FILES]
    return _table(["Copied file", "Always present"], rows)


def _type_text(spec: dict) -> str:
    if "const" in spec:
        return "`" + json.dumps(spec["const"]) + "`"
    if "enum" in spec:
        return " or ".join("`" + json.dumps(v) + "`" for v in spec["enum"])
    if "$ref" in spec:
        return {"#/$defs/sha256": "string (64 lowercase hex)", "#/$defs/file_name": "string (file name)", "#/$defs/head_tensor": "object `{shape: [int, int], dtype: \"F32\"}`"}[spec["$ref"]]
    kinds = spec.get("type")
    kinds = kinds if isinstance(kinds, list) else [kinds]
    text = " or ".join(k for k in kinds if k)
    if spec.get("type") == "array" and "items" in spec:
        text = "array of " + _type_text(spec["items"])
    limits = []
    for key, sym in (("minimum", "≥"), ("exclusiveMinimum", ">"), ("maximum", "≤")):
        if key in spec:
            limits.append(f"{sym} {spec[key]}")
    return text + (f" ({', '.join(limits)})" if limits else "")


def manifest() -> str:
    schema = json.loads(SCHEMA.read_text())
    rows: list[list[str]] = []

    def walk(spec: dict, path: str, required: bool) -> None:
        desc = spec.get("description", "")
        rows.append([_code(path), _type_text(spec), "yes" if required else "no", desc])
        if spec.get("type") == "object" and "properties" in spec:
            for name, sub in spec["properties"].items():
                walk(sub, f"{path}.{name}" if path else name, name in spec.get("required", []))
        extra = spec.get("additionalProperties")
        if isinstance(extra, dict) and "properties" in extra:
            for name, sub in extra["properties"].items():
                walk(sub, f"{path}.<name>.{name}", name in extra.get("required", []))
        if spec.get("type") == "array" and isinstance(spec.get("items"), dict) and "properties" in spec["items"]:
            for name, sub in spec["items"]["properties"].items():
                walk(sub, f"{path}[].{name}", name in spec["items"].get("required", []))

    for name, sub in schema["properties"].items():
        walk(sub, name, name in schema["required"])
    for r in rows:
        r[3] = r[3].replace("|", "\\|")
    return _table(["Field", "Type", "Required", "Meaning"], rows)


RENDERERS = {
    "symbols": symbols,
    "language": language,
    "counts": counts,
    "lora": lora,
    "vision": vision,
    "head": head,
    "files": files,
    "manifest": manifest,
}


def render(text: str) -> str:
    """`text` with every generated region replaced by its current rendering."""
    seen = set()

    def sub(m: re.Match) -> str:
        name = m.group("name")
        if name not in RENDERERS:
            raise ValueError(f"docs/export-format.md: unknown generated region {name!r}")
        seen.add(name)
        return m.group(1) + RENDERERS[name]() + m.group(4)

    out = REGION.sub(sub, text)
    missing = sorted(set(RENDERERS) - seen)
    if missing:
        raise ValueError(f"docs/export-format.md: generated regions {missing} are missing")
    return out


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    check = "--check" in args
    text = DOC.read_text()
    try:
        new = render(text)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if check:
        if new != text:
            print(f"{DOC}: generated tables differ from valen_export/tensor_table.py or the schema; run python -m valen_export.format_doc", file=sys.stderr)
            return 1
        print(f"{DOC}: generated tables are current")
        return 0
    if new != text:
        DOC.write_text(new)
        print(f"rewrote the generated tables of {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
