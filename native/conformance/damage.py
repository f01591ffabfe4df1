#!/usr/bin/env python3
"""Writes a damaged copy of a valen-native/1 export for valen-native-check to refuse.

    damage.py CASE SRC_EXPORT DST_DIR

Every case but `flipped-byte` re-hashes the manifest's `files`, so only the damage itself
(not a stale SHA-256) can make the checker refuse. Standard library only.
"""
import hashlib
import json
import shutil
import struct
import sys
from pathlib import Path

MANIFEST = "valen_export.json"


def read_st(path):
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + n])
    meta = header.pop("__metadata__", None)
    body = data[8 + n :]
    tensors = {}
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        tensors[name] = (entry["dtype"], entry["shape"], body[begin:end])
    return meta, tensors


def write_st(path, meta, tensors, header_text=None):
    header, body = {}, b""
    if meta is not None:
        header["__metadata__"] = meta
    for name in sorted(tensors):
        dtype, shape, raw = tensors[name]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(body), len(body) + len(raw)]}
        body += raw
    text = (header_text or json.dumps(header, separators=(",", ":"))).encode()
    text += b" " * (-(8 + len(text)) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + body)


def rehash(export):
    manifest = json.loads((export / MANIFEST).read_text())
    for name in manifest["files"]:
        data = (export / name).read_bytes()
        manifest["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    (export / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def edit_manifest(export, edit):
    manifest = json.loads((export / MANIFEST).read_text())
    edit(manifest)
    (export / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def language_file(export):
    return export / json.loads((export / MANIFEST).read_text())["language"]["files"][0]


def flipped_byte(export):
    path = export / "vision.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01  # in the last tensor's data: the header stays valid
    path.write_bytes(bytes(data))
    return False  # no rehash: the SHA-256 must catch it


def missing_lora_b(export):
    path = export / "adapter_model.safetensors"
    meta, tensors = read_st(path)
    victim = sorted(n for n in tensors if n.endswith(".lora_B.weight"))[0]
    del tensors[victim]
    write_st(path, meta, tensors)


def wrong_dtype(export):
    path = language_file(export)
    meta, tensors = read_st(path)
    name = "model.language_model.norm.weight"
    _, shape, raw = tensors[name]
    widened = b"".join(b"\0\0" + raw[i : i + 2] for i in range(0, len(raw), 2))  # BF16 -> F32 exactly
    tensors[name] = ("F32", shape, widened)
    write_st(path, meta, tensors)


def renamed_tensor(export):
    path = export / "vision.safetensors"
    meta, tensors = read_st(path)
    tensors["model.visual.blocks.0.norm_1.weight"] = tensors.pop("model.visual.blocks.0.norm1.weight")
    write_st(path, meta, tensors)


def unknown_format(export):
    edit_manifest(export, lambda m: m.update(format="valen-native/2"))


def non_finite(export):
    path = export / "valen_head.safetensors"
    meta, tensors = read_st(path)
    dtype, shape, raw = tensors["decision.weight"]
    tensors["decision.weight"] = (dtype, shape, struct.pack("<f", float("nan")) + raw[4:])
    write_st(path, meta, tensors)


def extra_file(export):
    (export / "notes.txt").write_text("not part of the export\n")


def wrong_scale(export):
    edit_manifest(export, lambda m: m["lora"].update(scale=m["lora"]["scale"] * 1.5))


def wrong_trained_blocks(export):
    edit_manifest(export, lambda m: m["vision"].update(trained_blocks=[0, 1]))


def repeated_key(export):
    path = export / "valen_head.safetensors"
    meta, tensors = read_st(path)
    entries = []
    offset = 0
    for name in sorted(tensors):
        dtype, shape, raw = tensors[name]
        entries.append(f'"{name}":{{"dtype":"{dtype}","shape":{json.dumps(shape)},"data_offsets":[{offset},{offset + len(raw)}]}}')
        offset += len(raw)
    entries.append(entries[-1])  # the last tensor twice
    text = '{"__metadata__":{"format":"pt"},' + ",".join(entries) + "}"
    write_st(path, meta, tensors, header_text=text)


def fp32_source_mismatch(export):
    path = export / "fp32_sources.safetensors"
    meta, tensors = read_st(path)
    name = sorted(tensors)[0]
    dtype, shape, raw = tensors[name]
    value = struct.unpack("<f", raw[:4])[0]
    tensors[name] = (dtype, shape, struct.pack("<f", value * 1.5 + 1.0) + raw[4:])
    write_st(path, meta, tensors)


def wrong_shape(export):
    path = export / "valen_head.safetensors"
    meta, tensors = read_st(path)
    dtype, shape, raw = tensors["candidate.weight"]
    tensors["candidate.weight"] = (dtype, [shape[1], shape[0]], raw)  # transposed header
    write_st(path, meta, tensors)


def transposed_lora_a(export):
    path = export / "adapter_model.safetensors"
    meta, tensors = read_st(path)
    name = sorted(n for n in tensors if n.endswith("mlp.gate_proj.lora_A.weight"))[0]
    dtype, shape, raw = tensors[name]
    tensors[name] = (dtype, shape[::-1], raw)
    write_st(path, meta, tensors)


def listed_extra_file(export):
    (export / "notes.txt").write_text("not part of the export\n")
    edit_manifest(export, lambda m: m["files"].update({"notes.txt": {"sha256": "0" * 64, "size": 0}}))


def uppercase_hash(export):
    rehash(export)
    edit_manifest(export, lambda m: m["files"]["config.json"].update(sha256=m["files"]["config.json"]["sha256"].upper()))
    return False


CASES = {
    "flipped-byte": flipped_byte,
    "missing-lora-b": missing_lora_b,
    "wrong-dtype": wrong_dtype,
    "renamed-tensor": renamed_tensor,
    "unknown-format": unknown_format,
    "non-finite": non_finite,
    "extra-file": extra_file,
    "wrong-scale": wrong_scale,
    "wrong-trained-blocks": wrong_trained_blocks,
    "repeated-key": repeated_key,
    "fp32-source-mismatch": fp32_source_mismatch,
    "wrong-shape": wrong_shape,
    "transposed-lora-a": transposed_lora_a,
    "listed-extra-file": listed_extra_file,
    "uppercase-hash": uppercase_hash,
}


def main(argv):
    if len(argv) != 4 or argv[1] not in CASES:
        sys.exit(f"usage: damage.py {{{','.join(CASES)}}} SRC_EXPORT DST_DIR")
    case, src, dst = argv[1], Path(argv[2]), Path(argv[3])
    shutil.copytree(src, dst)
    if CASES[case](dst) is not False:
        rehash(dst)


if __name__ == "__main__":
    main(sys.argv)
