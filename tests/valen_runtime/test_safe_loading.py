"""Safe loading: every damaged export is refused by the runtime loader (`load_model` raises one
WeightsError line with a key phrase) and by `valen-verify` (exit 1, a FAIL line with the phrase).

Each case damages a private copy of the tiny separate-LoRA export. Where the damage is inside a
file, the manifest's size and SHA-256 for that file are updated, so what is caught is the damage
itself and not merely the hash mismatch.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct

import pytest
from click.testing import CliRunner

from valen_export.cli import verify_command
from valen_runtime.errors import WeightsError
from valen_runtime.safetensors_file import SafetensorsFile, write_file
from valen_runtime.weights import load_model

LANG = "model-00001-of-00001.safetensors"
INDEX = "model.safetensors.index.json"


# -- helpers --------------------------------------------------------------------------------


def manifest(root):
    return json.loads((root / "valen_export.json").read_text())


def save_manifest(root, m):
    (root / "valen_export.json").write_text(json.dumps(m, indent=2))


def relist(root, name):
    """Record a file's current size and SHA-256 in the manifest."""
    m = manifest(root)
    data = (root / name).read_bytes()
    m["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    save_manifest(root, m)


def split(path):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return raw[8 : 8 + n], raw[8 + n :]


def join(header_text: bytes, data: bytes) -> bytes:
    header_text += b" " * (-len(header_text) % 8)
    return struct.pack("<Q", len(header_text)) + header_text + data


def edit_header(root, name, mutate):
    """Re-serialise a file's header after mutate(header_dict), keeping its data bytes."""
    path = root / name
    text, data = split(path)
    header = json.loads(text)
    mutate(header)
    path.write_bytes(join(json.dumps(header).encode(), data))
    relist(root, name)


def edit_tensors(root, name, mutate):
    """Rewrite a file from its tensors after mutate(dict name -> tensor) (a valid safetensors file)."""
    path = root / name
    tensors = {k: v.clone() for k, v in SafetensorsFile(path).iter_tensors()}
    mutate(tensors)
    path.unlink()
    write_file(path, tensors, metadata={"format": "pt"})
    relist(root, name)


def first_float(tensors, startswith=""):
    return next(k for k, v in sorted(tensors.items()) if v.is_floating_point() and k.startswith(startswith) and v.numel() > 1)


# -- damages: each returns (load phrases, verify phrases, verify mode for load) -----------------


def size_mismatch(root, tmp):
    with open(root / "vision.safetensors", "ab") as f:
        f.write(b"\0")
    return ["vision.safetensors", "size", "does not match the manifest"], None, "size"


def hash_mismatch(root, tmp):
    path = root / "valen_head.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # same size, one bit of a float flipped: only a full re-hash sees it
    path.write_bytes(bytes(data))
    return ["valen_head.safetensors", "sha256", "does not match the manifest"], None, "full"


def files_entry_dotdot(root, tmp):
    (tmp / "outside.bin").write_bytes(b"x")
    m = manifest(root)
    m["files"]["../outside.bin"] = {"sha256": hashlib.sha256(b"x").hexdigest(), "size": 1}
    save_manifest(root, m)
    return ["'../outside.bin'", "leaves the export directory"], None, "size"


def files_entry_absolute(root, tmp):
    m = manifest(root)
    m["vision"]["file"] = str(root / "vision.safetensors")
    m["files"][str(root / "vision.safetensors")] = m["files"].pop("vision.safetensors")
    save_manifest(root, m)
    return ["is not a relative file name"], None, "size"


def symlink_out(root, tmp):
    outside = tmp / "vision.safetensors"
    shutil.move(root / "vision.safetensors", outside)
    os.symlink(outside, root / "vision.safetensors")  # same bytes, same hash: only the link is wrong
    return ["vision.safetensors", "is a symlink"], None, "full"


def symlinked_dir(root, tmp):
    (tmp / "elsewhere").mkdir()
    shutil.move(root / "valen_head.safetensors", tmp / "elsewhere" / "valen_head.safetensors")
    os.symlink(tmp / "elsewhere", root / "sub")
    m = manifest(root)
    m["head"]["file"] = "sub/valen_head.safetensors"
    m["files"]["sub/valen_head.safetensors"] = m["files"].pop("valen_head.safetensors")
    save_manifest(root, m)
    return ["sub", "is a symlink"], None, "size"


def index_dotdot(root, tmp):
    def mutate(path):
        idx = json.loads(path.read_text())
        first = sorted(idx["weight_map"])[0]
        idx["weight_map"][first] = "../" + LANG
        path.write_text(json.dumps(idx))

    mutate(root / INDEX)
    relist(root, INDEX)
    return [INDEX, "leaves the export directory"], None, "size"


def index_absolute(root, tmp):
    idx = json.loads((root / INDEX).read_text())
    idx["weight_map"][sorted(idx["weight_map"])[0]] = "/etc/passwd"
    (root / INDEX).write_text(json.dumps(idx))
    relist(root, INDEX)
    return [INDEX, "'/etc/passwd'", "is not a relative file name"], None, "size"


def index_unknown_file(root, tmp):
    idx = json.loads((root / INDEX).read_text())
    idx["weight_map"][sorted(idx["weight_map"])[0]] = "vision.safetensors"
    (root / INDEX).write_text(json.dumps(idx))
    relist(root, INDEX)
    return [INDEX, "not one of the language files"], None, "size"


def language_file_unlisted(root, tmp):
    m = manifest(root)
    m["language"]["files"] = ["../" + LANG]
    save_manifest(root, m)
    return ["language.files entry", "is not a file listed under 'files'"], None, "size"


def header_oversized(root, tmp):
    path = root / "vision.safetensors"
    raw = bytearray(path.read_bytes())
    raw[:8] = struct.pack("<Q", 64 * 1024 * 1024)
    path.write_bytes(bytes(raw))
    relist(root, "vision.safetensors")
    return ["vision.safetensors", "header of 67108864 bytes exceeds"], None, "size"


def header_past_eof(root, tmp):
    path = root / "vision.safetensors"
    raw = bytearray(path.read_bytes())
    raw[:8] = struct.pack("<Q", len(raw))
    path.write_bytes(bytes(raw))
    relist(root, "vision.safetensors")
    return ["vision.safetensors", "points past the end of the file"], None, "size"


def offsets_past_data(root, tmp):
    def mutate(h):
        last = max((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][1])
        h[last]["data_offsets"][1] += 4

    edit_header(root, "vision.safetensors", mutate)
    return ["vision.safetensors", "point outside the file's data"], None, "size"


def overlapping_tensors(root, tmp):
    def mutate(h):
        names = sorted((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][0])
        a, b = h[names[0]], h[names[1]]
        if a["shape"] == b["shape"] and a["dtype"] == b["dtype"]:
            b["data_offsets"] = list(a["data_offsets"])  # two names, one storage

    # the head's two tensors have the same shape and dtype: alias the second onto the first
    edit_header(root, "valen_head.safetensors", mutate)
    return ["valen_head.safetensors", "overlaps another tensor"], None, "size"


def trailing_bytes(root, tmp):
    with open(root / "valen_head.safetensors", "ab") as f:
        f.write(b"\0" * 8)
    relist(root, "valen_head.safetensors")
    return ["valen_head.safetensors", "bytes after the last tensor"], None, "size"


def duplicate_json_key(root, tmp):
    path = root / "valen_head.safetensors"
    text, data = split(path)
    header = json.loads(text)
    name = "decision.weight"
    dup = json.dumps(header)[:-1] + f", {json.dumps(name)}: {json.dumps(header[name])}" + "}"
    path.write_bytes(join(dup.encode(), data))
    relist(root, "valen_head.safetensors")
    return ["valen_head.safetensors", "duplicate key 'decision.weight'"], None, "size"


def duplicate_tensor_across_files(root, tmp):
    """A second language shard that repeats a tensor of the first, listed everywhere it must be."""
    second = "model-00002-of-00002.safetensors"
    sf = SafetensorsFile(root / LANG)
    name = sf.names()[0]
    write_file(root / second, {name: sf.read(name)})
    relist(root, second)
    idx = json.loads((root / INDEX).read_text())
    other = sf.names()[1]
    idx["weight_map"][other] = second  # the index names both files, so it passes the index check
    (root / INDEX).write_text(json.dumps(idx))
    relist(root, INDEX)
    m = manifest(root)
    m["language"]["files"] = [LANG, second]
    save_manifest(root, m)
    return ["duplicate tensor", name], ["duplicate tensor"], "size"


def wrong_dtype(root, tmp):
    edit_tensors(root, "valen_head.safetensors", lambda t: t.update({k: v.half() for k, v in t.items()}))
    return ["valen_head.safetensors", "is F16, expected F32"], None, "size"


def wrong_shape(root, tmp):
    edit_tensors(root, "valen_head.safetensors", lambda t: t.update({"decision.weight": t["decision.weight"][:128].clone()}))
    return ["decision.weight", "has shape [128, 64]"], None, "size"


def nan_vision(root, tmp):
    def mutate(t):
        k = first_float(t, "model.visual.blocks.")
        t[k].view(-1)[3] = float("nan")

    edit_tensors(root, "vision.safetensors", mutate)
    return ["non-finite"], None, "size"


def inf_language(root, tmp):
    def mutate(t):
        k = first_float(t, "model.language_model.layers.")
        t[k].view(-1)[0] = float("inf")

    edit_tensors(root, LANG, mutate)
    return ["non-finite"], None, "size"


def nan_adapter(root, tmp):
    def mutate(t):
        k = first_float(t)
        t[k].view(-1)[0] = float("nan")

    edit_tensors(root, "adapter_model.safetensors", mutate)
    return ["non-finite"], None, "size"


def bad_dtype_type(root, tmp):
    edit_header(root, "valen_head.safetensors", lambda h: h["decision.weight"].update(dtype=["F32"]))
    return ["valen_head.safetensors", "unsupported dtype ['F32']"], None, "size"


def bool_in_shape(root, tmp):
    edit_header(root, "valen_head.safetensors", lambda h: h["decision.weight"].update(shape=[256, 64, True]))
    return ["valen_head.safetensors", "shape must be a list of non-negative integers"], None, "size"


def bad_metadata(root, tmp):
    edit_header(root, "valen_head.safetensors", lambda h: h.update({"__metadata__": {"format": 1}}))
    return ["valen_head.safetensors", "__metadata__ must map strings to strings"], None, "size"


def deeply_nested_header(root, tmp):
    path = root / "valen_head.safetensors"
    path.write_bytes(join(b"[" * 100000 + b"]" * 100000, b""))
    relist(root, "valen_head.safetensors")
    return ["valen_head.safetensors", "malformed safetensors header"], None, "size"


def unlisted_file(root, tmp):
    (root / "extra.bin").write_bytes(b"x")
    return ["extra.bin", "not listed in the manifest"], None, "size"


def missing_file(root, tmp):
    (root / "vision.safetensors").unlink()
    return ["vision.safetensors", "missing (listed in the manifest)"], None, "size"


def fifo_instead_of_file(root, tmp):
    (root / "vision.safetensors").unlink()
    os.mkfifo(root / "vision.safetensors")  # opening it for reading would block forever
    return ["vision.safetensors", "not a regular file"], None, "size"


def manifest_bad_record(root, tmp):
    m = manifest(root)
    m["files"]["vision.safetensors"] = {"size": "262808", "sha256": m["files"]["vision.safetensors"]["sha256"]}
    save_manifest(root, m)
    return ["files['vision.safetensors'] must be"], None, "size"


def manifest_duplicate_key(root, tmp):
    text = (root / "valen_export.json").read_text()
    (root / "valen_export.json").write_text(text.replace('"format": "valen-native/1"', '"format": "valen-native/1", "format": "valen-native/1"', 1))
    return ["valen_export.json", "duplicate key 'format'"], None, "size"


def manifest_missing_field(root, tmp):
    m = manifest(root)
    del m["head"]["projection_dim"]
    save_manifest(root, m)
    return ["head.projection_dim must be a positive integer"], None, "size"


def manifest_symlink(root, tmp):
    shutil.move(root / "valen_export.json", tmp / "valen_export.json")
    os.symlink(tmp / "valen_export.json", root / "valen_export.json")
    return ["valen_export.json", "is a symlink"], None, "size"


CASES = [
    size_mismatch, hash_mismatch, files_entry_dotdot, files_entry_absolute, symlink_out, symlinked_dir,
    index_dotdot, index_absolute, index_unknown_file, language_file_unlisted,
    header_oversized, header_past_eof, offsets_past_data, overlapping_tensors, trailing_bytes,
    duplicate_json_key, duplicate_tensor_across_files, wrong_dtype, wrong_shape,
    nan_vision, inf_language,
    nan_adapter,
    bad_dtype_type, bool_in_shape, bad_metadata, deeply_nested_header,
    unlisted_file, missing_file, fifo_instead_of_file,
    manifest_bad_record, manifest_duplicate_key, manifest_missing_field, manifest_symlink,
]


@pytest.mark.parametrize("damage", CASES, ids=lambda f: f.__name__)
def test_damaged_export_is_refused(damage, tiny_export, tmp_path):
    root = tmp_path / "export"
    shutil.copytree(tiny_export["separate"], root)
    outside = tmp_path / "outside"
    outside.mkdir()
    load_phrases, verify_phrases, verify_mode = damage(root, outside)

    # valen-verify first: it must not consume the damage (it only reads).
    result = CliRunner().invoke(verify_command, [str(root)])
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    fails = [ln for ln in result.output.splitlines() if ln.startswith("FAIL ")]
    assert fails, result.output
    assert any(all(p in ln for p in (verify_phrases or load_phrases)) for ln in fails), fails

    with pytest.raises(WeightsError) as err:
        try:
            load_model(root, verify=verify_mode)
        except WeightsError:
            raise
        except Exception as e:  # anything else is a crash, not a refusal
            raise AssertionError(f"load_model raised {type(e).__name__}: {e}") from e
        else:
            raise AssertionError("load_model accepted the damaged export")
    msg = str(err.value)
    assert "\n" not in msg
    for p in load_phrases:
        assert p in msg, msg


def test_undamaged_copy_loads(tiny_export, tmp_path):
    root = tmp_path / "export"
    shutil.copytree(tiny_export["separate"], root)
    relist(root, "vision.safetensors")  # the helpers' own bookkeeping leaves a valid export valid
    load_model(root, verify="full")
    assert CliRunner().invoke(verify_command, [str(root)]).exit_code == 0
