"""`valen-verify`: re-hash an export and check it against the native loader's contract.

Checks (docs/export-format.md): every file's size and SHA-256; config.json values the
native `Config::load` requires; the language set (index lists exactly the existing language
shards, BF16 only, exact names and shapes from config.json); the FP32 LoRA file's naming, rank,
dtype, pairing and finiteness; the complete BF16 vision inventory; the FP32 head; the FP32
sources. Returns one line per failure; an empty list means the export is valid.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch

from valen_runtime.errors import WeightsError
from valen_runtime.manifest import Manifest
from valen_runtime.safetensors_file import SafetensorsFile, all_finite

from valen_runtime.errors import ConfigError

from . import tensor_table as table

LORA_HEADER_LIMIT = 8 * 1024 * 1024
LORA_KEY = re.compile("^" + re.escape(table.LORA_KEY_PREFIX) + r"(layers\.\d+\..+)\.lora_([AB])\.weight$")


def check_config(config: dict, where: str) -> list[str]:
    """The native loader's config.json requirements (docs/export-format.md), shape-independent."""
    out = []
    tc = config.get("text_config", config)

    def need(cond, msg):
        if not cond:
            out.append(f"{where}: {msg}")

    need(isinstance(config.get("image_token_id"), int), "root image_token_id must be an integer")
    types = tc.get("layer_types")
    need(isinstance(types, list) and len(types) == tc.get("num_hidden_layers") and all(t in ("full_attention", "linear_attention") for t in types),
         "text_config.layer_types must list full_attention/linear_attention for each of num_hidden_layers")
    need(tc.get("hidden_act") == "silu", f"text_config.hidden_act is {tc.get('hidden_act')!r}, expected 'silu'")
    need(tc.get("attn_output_gate", True) is True, "text_config.attn_output_gate must be true or absent")
    need(tc.get("attention_bias") is not True, "text_config.attention_bias must not be true")
    rope = tc.get("rope_parameters") or {}
    need(rope.get("rope_type", "default") == "default", f"rope_parameters.rope_type is {rope.get('rope_type')!r}, expected 'default'")
    need(tc.get("linear_conv_kernel_dim") == 4, "text_config.linear_conv_kernel_dim must be 4")
    theta = rope.get("rope_theta", tc.get("rope_theta"))
    need(isinstance(theta, (int, float)) and math.isfinite(theta) and theta > 0, "rope_theta must be finite and > 0")
    need(rope.get("mrope_interleaved", True) is not False, "rope_parameters.mrope_interleaved must not be false")
    hd, prf = tc.get("head_dim"), rope.get("partial_rotary_factor", 0.25)
    section = rope.get("mrope_section", [11, 11, 10])
    if isinstance(hd, int):
        need(sum(section) == int(hd * prf) // 2, f"rope_parameters.mrope_section {section} must sum to head_dim*partial_rotary_factor/2 = {int(hd * prf) // 2}")
    mpe = tc.get("max_position_embeddings")
    need(isinstance(mpe, int) and 0 < mpe <= 2**24, "text_config.max_position_embeddings must be in (0, 2^24]")
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "linear_num_key_heads", "linear_num_value_heads"):
        need(isinstance(tc.get(key), int) and tc.get(key) > 0, f"text_config.{key} must be a positive integer")
    need(isinstance(tc.get("rms_norm_eps"), float), "text_config.rms_norm_eps must be a float")
    if not out:
        need(tc["num_attention_heads"] % tc["num_key_value_heads"] == 0, "num_attention_heads must be divisible by num_key_value_heads")
        need(tc["linear_num_value_heads"] % tc["linear_num_key_heads"] == 0, "linear_num_value_heads must be divisible by linear_num_key_heads")
        need(tc["hidden_size"] % 8 == 0, "hidden_size must be divisible by 8")
    vc = config.get("vision_config") or {}
    need(config.get("model_type") == "qwen3_5", f"model_type is {config.get('model_type')!r}, expected 'qwen3_5'")
    need(vc.get("out_hidden_size") == tc.get("hidden_size"), "vision_config.out_hidden_size must equal text_config.hidden_size")
    need(not vc.get("deepstack_visual_indexes"), "vision_config.deepstack_visual_indexes must be empty")
    return out


def _open(path: Path, failures: list[str]) -> SafetensorsFile | None:
    try:
        return SafetensorsFile(path)
    except WeightsError as e:
        failures.append(str(e))
        return None


def _check_values(sf: SafetensorsFile, failures: list[str]) -> dict[str, torch.Tensor]:
    """Read every tensor once; non-finite values are failures. Returns small tensors (<1 MiB) for later checks."""
    small = {}
    for name, t in sf.iter_tensors():
        if not all_finite(t):
            failures.append(f"{sf.path}: tensor {name} holds non-finite values")
        if t.numel() * t.element_size() < 2**20:
            small[name] = t
    return small


def _check_inventory(sf_tensors: dict, expected: dict, dtype: str, where: str, failures: list[str]) -> None:
    missing = sorted(set(expected) - set(sf_tensors))
    unexpected = sorted(set(sf_tensors) - set(expected))
    if missing:
        failures.append(f"{where}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''} ({len(missing)})")
    if unexpected:
        failures.append(f"{where}: unexpected tensors {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''} ({len(unexpected)})")
    for name in sorted(set(expected) & set(sf_tensors)):
        info = sf_tensors[name]
        if tuple(info.shape) != tuple(expected[name]):
            failures.append(f"{where}: {name} has shape {list(info.shape)}, expected {list(expected[name])}")
        if info.dtype != dtype:
            failures.append(f"{where}: {name} is {info.dtype}, expected {dtype}")


def verify_export(export_dir: Path, rehash: bool = True) -> list[str]:
    try:
        m = Manifest.load(export_dir)
    except WeightsError as e:
        return [str(e)]
    failures = m.check_files("full" if rehash else "size")
    if failures:
        return failures  # content checks on mismatched files would only repeat the problem
    root = m.root
    try:
        config = json.loads(m.path("config.json").read_text())
    except (WeightsError, ValueError) as e:
        return [f"{root / 'config.json'}: {e}"]
    failures += check_config(config, str(root / "config.json"))
    if failures:
        return failures
    try:
        cfg = table.model_config(config)
    except ConfigError as e:
        return [f"{root / 'config.json'}: {e}"]
    lang = m.data["language"]

    # Language set, as the native Weights::load selects it.
    index_name = lang.get("index")
    lang_files = list(lang.get("files") or [])
    if index_name:
        index = json.loads(m.path(index_name).read_text())
        wm = index.get("weight_map") or {}
        if sorted(set(wm.values())) != sorted(lang_files):
            failures.append(f"{root / index_name}: weight_map files {sorted(set(wm.values()))} differ from the language files {sorted(lang_files)}")
    else:
        wm = None
        if lang_files != ["model.safetensors"]:
            failures.append(f"{root / 'valen_export.json'}: without an index the language file must be model.safetensors, got {lang_files}")
    lang_infos = {}
    lang_small = {}
    for fname in lang_files:
        sf = _open(m.path(fname), failures)
        if sf is None:
            continue
        for name, info in sf.tensors.items():
            if wm is not None and wm.get(name) != fname:
                failures.append(f"{sf.path}: tensor {name} is not mapped to this file by {index_name}")
            if name in lang_infos:
                failures.append(f"{sf.path}: duplicate tensor {name}")
            lang_infos[name] = info
        lang_small.update(_check_values(sf, failures))
    if wm is not None:
        for name in sorted(set(wm) - set(lang_infos)):
            failures.append(f"{root / index_name}: maps {name} to a file that does not hold it")
    expected_lang = {table.LANGUAGE_PREFIX + n: s for n, s in table.expand(table.LANGUAGE, cfg).items()}
    _check_inventory(lang_infos, expected_lang, table.LANGUAGE.dtype, "language files", failures)

    # LoRA (separate mode).
    lora = m.data["lora"]
    linears = table.lora_targets(cfg)
    if lora.get("mode") == "separate":
        path = m.path(lora["file"])
        sf = _open(path, failures)
        if sf is not None:
            if sf.data_start - 8 > LORA_HEADER_LIMIT:
                failures.append(f"{path}: header exceeds 8 MiB")
            pairs: dict[str, dict] = {}
            for name, info in sf.tensors.items():
                mt = LORA_KEY.match(name)
                if not mt:
                    failures.append(f"{path}: key {name} does not follow {table.LORA_KEY_PREFIX}layers.{{i}}.{{module}}.lora_{{A,B}}.weight")
                    continue
                module = mt.group(1)
                if module not in linears:
                    failures.append(f"{path}: {name}: unsupported LoRA target {module}")
                    continue
                if info.dtype != table.LORA_DTYPE or len(info.shape) != 2:
                    failures.append(f"{path}: {name} must be 2-D {table.LORA_DTYPE}, got {info.dtype} {list(info.shape)}")
                    continue
                pairs.setdefault(module, {})[mt.group(2)] = info.shape
            for module, ab in sorted(pairs.items()):
                if set(ab) != {"A", "B"}:
                    failures.append(f"{path}: {module} has lora_{''.join(sorted(ab))} without its pair")
                    continue
                out_f, in_f = linears[module]
                ra, rb = ab["A"][0], ab["B"][1]
                if ra != rb or not 1 <= ra <= table.LORA_RANK_LIMIT or ra != lora.get("rank"):
                    failures.append(f"{path}: {module} rank A {ra} / B {rb} must match each other, lie in 1..{table.LORA_RANK_LIMIT} and equal the manifest rank {lora.get('rank')}")
                if tuple(ab["A"]) != (ra, in_f) or tuple(ab["B"]) != (out_f, rb):
                    failures.append(f"{path}: {module} shapes A {list(ab['A'])} B {list(ab['B'])}, expected A [{ra}, {in_f}] B [{out_f}, {rb}]")
            if len(pairs) != lora.get("pairs"):
                failures.append(f"{path}: {len(pairs)} LoRA pairs, manifest says {lora.get('pairs')}")
            scale = lora.get("scale")
            if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
                failures.append(f"{root / 'valen_export.json'}: lora.scale must be finite and > 0")
            _check_values(sf, failures)
    elif lora.get("mode") != "merged":
        failures.append(f"{root / 'valen_export.json'}: lora.mode is {lora.get('mode')!r}, expected separate or merged")

    # Vision: the complete inventory, BF16.
    vpath = m.path(m.data["vision"]["file"])
    sf = _open(vpath, failures)
    if sf is not None:
        expected_vision = {table.VISION_PREFIX + n: s for n, s in table.expand(table.VISION, cfg).items()}
        _check_inventory(sf.tensors, expected_vision, table.VISION.dtype, str(vpath), failures)
        _check_values(sf, failures)

    # Head: FP32 [projection_dim, hidden].
    head = m.data["head"]
    hpath = m.path(head["file"])
    sf = _open(hpath, failures)
    if sf is not None:
        expected_head = table.expand(table.HEAD, cfg, table.symbols_for(cfg, projection_dim=head["projection_dim"]))
        _check_inventory(sf.tensors, expected_head, table.HEAD.dtype, str(hpath), failures)
        _check_values(sf, failures)

    # FP32 sources must round to exactly the BF16 values shipped in the language files.
    fp = m.data.get("fp32_sources") or {}
    if fp.get("file"):
        fpath = m.path(fp["file"])
        sf = _open(fpath, failures)
        if sf is not None:
            for name, t in sf.iter_tensors():
                if name not in lang_infos or sf.tensors[name].dtype != "F32":
                    failures.append(f"{fpath}: {name} must be an F32 copy of a language tensor")
                elif name in lang_small and not torch.equal(t.to(torch.bfloat16), lang_small[name]):
                    failures.append(f"{fpath}: {name} does not round to the shipped BF16 value")
    return failures
