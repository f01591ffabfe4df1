"""`valen-verify`: the Python reader of docs/export-format.md; every refusal of its section 13.

Checks, in order: the manifest (format, the JSON Schema `manifests/valen-native-1.schema.json`,
the fields loaders read); every file's size and SHA-256 and the directory holding nothing else;
the config.json values the native loader requires; the language set (file naming, index, BF16,
exact names and shapes from the tensor table, counts); the FP32 adapter (naming, targets, rank,
orientation, pairs, scale); the complete BF16 vision inventory and its overlay record; the FP32
head and its logit scale; the FP32 sources; finite values everywhere. Returns one line per
failure; an empty list means the export conforms.
"""

from __future__ import annotations

import json
import math
import re
from functools import lru_cache
from pathlib import Path

import jsonschema
import torch

from valen_runtime.errors import ConfigError, WeightsError
from valen_runtime.manifest import MANIFEST_NAME, Manifest, read_json_object
from valen_runtime.safetensors_file import SafetensorsFile, all_finite

from . import tensor_table as table

SCHEMA_PATH = Path(__file__).resolve().parent.parent / "manifests" / "valen-native-1.schema.json"
LORA_HEADER_LIMIT = 8 * 1024 * 1024
LORA_KEY = re.compile("^" + re.escape(table.LORA_KEY_PREFIX) + r"(layers\.\d+\..+)\.lora_([AB])\.weight$")


@lru_cache(maxsize=1)
def _validator() -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(json.loads(SCHEMA_PATH.read_text()))


def schema_problems(manifest: dict) -> list[str]:
    """One line per place `manifest` breaks the valen-native/1 JSON Schema (`field.path: message`)."""
    out = []
    for err in sorted(_validator().iter_errors(manifest), key=lambda e: list(map(str, e.absolute_path))):
        where = ".".join(str(p) for p in err.absolute_path) or "(root)"
        out.append(f"{where}: {err.message}")
    return out


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_config(config: dict, where: str) -> list[str]:
    """The native loader's config.json requirements (docs/export-format.md), shape-independent."""
    out = []
    if not isinstance(config.get("text_config"), dict) or not isinstance(config.get("vision_config"), dict):
        return [f"{where}: text_config and vision_config must be objects"]
    tc = config["text_config"]

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
    rope = tc.get("rope_parameters")
    if rope is not None and not isinstance(rope, dict):
        need(False, "text_config.rope_parameters must be an object when present")
    rope = rope if isinstance(rope, dict) else {}
    need(rope.get("rope_type", "default") == "default", f"rope_parameters.rope_type is {rope.get('rope_type')!r}, expected 'default'")
    need(tc.get("linear_conv_kernel_dim") == 4, "text_config.linear_conv_kernel_dim must be 4")
    theta = rope.get("rope_theta", tc.get("rope_theta"))
    need(_is_number(theta) and math.isfinite(theta) and theta > 0, "rope_theta must be finite and > 0")
    need(rope.get("mrope_interleaved", True) is not False, "rope_parameters.mrope_interleaved must not be false")
    hd, prf = tc.get("head_dim"), rope.get("partial_rotary_factor", tc.get("partial_rotary_factor", 0.25))
    section = rope.get("mrope_section", [11, 11, 10])
    if not (isinstance(section, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in section)):
        need(False, f"rope_parameters.mrope_section {section!r} must be a list of integers")
    elif isinstance(hd, int) and _is_number(prf) and math.isfinite(prf):
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
    vc = config["vision_config"]
    need(vc.get("rope_parameters") is None or isinstance(vc["rope_parameters"], dict), "vision_config.rope_parameters must be an object when present")
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


def _language_files_problem(lang: dict) -> str | None:
    files, index = lang.get("files"), lang.get("index")
    if index is None:
        return None if files == [table.SINGLE_LANGUAGE_FILE] else f"without an index language.files must be [{table.SINGLE_LANGUAGE_FILE!r}], got {files}"
    expected = [table.LANGUAGE_SHARD.format(k=k + 1, n=len(files)) for k in range(len(files))]
    if index != table.INDEX_FILE or files != expected:
        return f"language.index must be {table.INDEX_FILE!r} and language.files {expected}, got {index!r} and {files}"
    return None


def _check_language(m: Manifest, cfg, failures: list[str]) -> tuple[dict, dict]:
    """The language set as the native loader selects it; returns (infos, small tensors) by name."""
    root, lang = m.root, m.data["language"]
    problem = _language_files_problem(lang)
    if problem:
        failures.append(f"{root / MANIFEST_NAME}: {problem}")
    index_name = lang.get("index")
    lang_files = list(lang.get("files") or [])
    wm = None
    if index_name:
        index = json.loads(m.path(index_name).read_text())
        wm = index.get("weight_map") or {}
        if sorted(set(wm.values())) != sorted(lang_files):
            failures.append(f"{root / index_name}: weight_map files {sorted(set(wm.values()))} differ from the language files {sorted(lang_files)}")
    infos: dict = {}
    small: dict = {}
    for fname in lang_files:
        sf = _open(m.path(fname), failures)
        if sf is None:
            continue
        for name, info in sf.tensors.items():
            if wm is not None and wm.get(name) != fname:
                failures.append(f"{sf.path}: tensor {name} is not mapped to this file by {index_name}")
            if name in infos:
                failures.append(f"{sf.path}: duplicate tensor {name}")
            infos[name] = info
        small.update(_check_values(sf, failures))
    if wm is not None:
        for name in sorted(set(wm) - set(infos)):
            failures.append(f"{root / index_name}: maps {name} to a file that does not hold it")
    expected = {table.LANGUAGE_PREFIX + n: s for n, s in table.expand(table.LANGUAGE, cfg).items()}
    _check_inventory(infos, expected, table.LANGUAGE.dtype, "language files", failures)
    if lang.get("tensors") != len(expected):
        failures.append(f"{root / MANIFEST_NAME}: language.tensors is {lang.get('tensors')!r}, config.json implies {len(expected)}")
    return infos, small


def _check_lora(m: Manifest, cfg, failures: list[str]) -> None:
    root, lora = m.root, m.data["lora"]
    where = root / MANIFEST_NAME
    targets = table.lora_targets(cfg)
    if lora.get("pairs") != len(targets):
        failures.append(f"{where}: lora.pairs is {lora.get('pairs')!r}, config.json implies {len(targets)} targets")
    rank, alpha, scale = lora.get("rank"), lora.get("alpha"), lora.get("scale")
    numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (rank, alpha, scale))
    if not numbers or not math.isfinite(scale) or scale <= 0 or not rank or scale != alpha / rank:
        failures.append(f"{where}: lora.scale must be finite, > 0 and equal lora.alpha / lora.rank ({alpha!r} / {rank!r}), got {scale!r}")
    if lora.get("mode") == "merged":
        if lora.get("file") is not None:
            failures.append(f"{where}: lora.file must be null in merged mode, got {lora.get('file')!r}")
        return
    if lora.get("mode") != "separate":
        failures.append(f"{where}: lora.mode is {lora.get('mode')!r}, expected separate or merged")
        return
    path = m.path(lora["file"])
    sf = _open(path, failures)
    if sf is None:
        return
    if sf.data_start - 8 > LORA_HEADER_LIMIT:
        failures.append(f"{path}: header exceeds 8 MiB")
    pairs: dict[str, dict] = {}
    for name, info in sf.tensors.items():
        mt = LORA_KEY.match(name)
        if not mt:
            failures.append(f"{path}: key {name} does not follow {table.LORA_KEY_PREFIX}layers.{{i}}.{{module}}.lora_{{A,B}}.weight")
            continue
        module = mt.group(1)
        if module not in targets:
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
        out_f, in_f = targets[module]
        ra, rb = ab["A"][0], ab["B"][1]
        if ra != rb or not 1 <= ra <= table.LORA_RANK_LIMIT or ra != rank:
            failures.append(f"{path}: {module} rank A {ra} / B {rb} must match each other, lie in 1..{table.LORA_RANK_LIMIT} and equal the manifest rank {rank}")
        if tuple(ab["A"]) != (ra, in_f) or tuple(ab["B"]) != (out_f, rb):
            failures.append(f"{path}: {module} shapes A {list(ab['A'])} B {list(ab['B'])}, expected A [{ra}, {in_f}] B [{out_f}, {rb}]")
    complete = sum(1 for ab in pairs.values() if set(ab) == {"A", "B"})
    if complete != len(targets):
        missing = sorted(set(targets) - set(pairs))
        failures.append(f"{path}: {complete} complete LoRA pairs, config.json implies {len(targets)}" + (f"; no pair for {missing[:3]}" if missing else ""))
    _check_values(sf, failures)


def _check_vision(m: Manifest, cfg, failures: list[str]) -> None:
    vision = m.data["vision"]
    where = m.root / MANIFEST_NAME
    vpath = m.path(vision["file"])
    expected = {table.VISION_PREFIX + n: s for n, s in table.expand(table.VISION, cfg).items()}
    sf = _open(vpath, failures)
    if sf is not None:
        _check_inventory(sf.tensors, expected, table.VISION.dtype, str(vpath), failures)
        _check_values(sf, failures)
    if vision.get("tensors") != len(expected):
        failures.append(f"{where}: vision.tensors is {vision.get('tensors')!r}, config.json implies {len(expected)}")
    depth = cfg.vision_config.depth
    blocks = vision.get("trained_blocks")
    if not isinstance(blocks, list) or blocks != list(range(depth - len(blocks), depth)):
        failures.append(f"{where}: vision.trained_blocks must be the last N block indices ascending, ending at depth-1 = {depth - 1}, got {blocks!r}")


def _check_head(m: Manifest, cfg, failures: list[str]) -> None:
    head = m.data["head"]
    where = m.root / MANIFEST_NAME
    hpath = m.path(head["file"])
    p = head["projection_dim"]
    expected = table.expand(table.HEAD, cfg, table.symbols_for(cfg, projection_dim=p))
    sf = _open(hpath, failures)
    if sf is not None:
        _check_inventory(sf.tensors, expected, table.HEAD.dtype, str(hpath), failures)
        _check_values(sf, failures)
        listed = {n: {"shape": list(i.shape), "dtype": i.dtype} for n, i in sf.tensors.items()}
        if head.get("tensors") != listed:
            failures.append(f"{where}: head.tensors {head.get('tensors')!r} does not describe {hpath.name} {listed!r}")
    scale = head.get("logit_scale")
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not abs(scale * math.sqrt(p) - 1) <= 1e-12:
        failures.append(f"{where}: head.logit_scale must be projection_dim ** -0.5 = {p ** -0.5!r}, got {scale!r}")


def _check_fp32_sources(m: Manifest, lang_infos: dict, lang_small: dict, failures: list[str]) -> None:
    """FP32 originals: F32 copies of language tensors that round to exactly the shipped BF16 values."""
    fp = m.data["fp32_sources"]
    where = m.root / MANIFEST_NAME
    names = fp.get("tensors") or []
    if (fp.get("file") is None) != (not names):
        failures.append(f"{where}: fp32_sources.file must be null exactly when fp32_sources.tensors is empty")
    if not fp.get("file"):
        return
    fpath = m.path(fp["file"])
    sf = _open(fpath, failures)
    if sf is None:
        return
    if sorted(sf.tensors) != names:
        failures.append(f"{where}: fp32_sources.tensors does not list the tensors of {fpath.name} in sorted order")
    _check_values(sf, failures)
    for name, t in sf.iter_tensors():
        info = sf.tensors[name]
        lang = lang_infos.get(name)
        if lang is None or info.dtype != "F32" or tuple(info.shape) != tuple(lang.shape):
            failures.append(f"{fpath}: {name} must be an F32 copy of a language tensor with the same shape")
        elif name in lang_small and not torch.equal(t.to(torch.bfloat16), lang_small[name]):
            failures.append(f"{fpath}: {name} does not round to the shipped BF16 value")


def _check_file_set(m: Manifest) -> list[str]:
    """`files` lists exactly the files the sections name, the required copies, and optional copies."""
    d = m.data
    named = set(d["language"]["files"]) | {table.VISION_FILE, table.HEAD_FILE} | set(table.REQUIRED_COPIED_FILES)
    for optional_file in (d["language"]["index"], d["lora"]["file"], d["fp32_sources"]["file"]):
        if optional_file is not None:
            named.add(optional_file)
    where = m.root / MANIFEST_NAME
    out = [f"{where}: files does not list {name!r}" for name in sorted(named - set(m.files))]
    out += [f"{where}: files lists {name!r}, which is not a file of this export" for name in sorted(set(m.files) - named - set(table.COPIED_FILES))]
    return out


def _extra_entries(root: Path) -> list[str]:
    """Directories in the export (files and symlinks are the manifest check's business)."""
    return [f"{p}: a directory; an export is one flat directory" for p in sorted(root.iterdir()) if p.is_dir() and not p.is_symlink()]


def verify_export(export_dir: Path, rehash: bool = True, on_bytes=None) -> list[str]:
    """Failure lines (empty when the export conforms); on_bytes(n) reports hashing progress."""
    try:
        m = Manifest.load(export_dir)
    except WeightsError as e:
        return [str(e)]
    root = m.root
    failures = [f"{root / MANIFEST_NAME}: {p}" for p in schema_problems(m.data)]
    if failures:
        return failures  # the checks below read the fields the schema holds in place
    failures += _check_file_set(m) + m.check_files("full" if rehash else "size", on_bytes=on_bytes) + _extra_entries(root)
    if failures:
        return failures  # content checks on files that do not match would only repeat the problem
    try:
        config = read_json_object(m.path("config.json"), "config.json")
    except WeightsError as e:
        return [str(e)]
    failures += check_config(config, str(root / "config.json"))
    if failures:
        return failures
    try:
        cfg = table.model_config(config)
    except ConfigError as e:
        return [f"{root / 'config.json'}: {e}"]
    lang_infos, lang_small = _check_language(m, cfg, failures)
    _check_lora(m, cfg, failures)
    _check_vision(m, cfg, failures)
    _check_head(m, cfg, failures)
    _check_fp32_sources(m, lang_infos, lang_small, failures)
    return failures
