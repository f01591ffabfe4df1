"""The native check's fixtures: the Rust reader built from native/, and damaged copies of exports.

The reader is `cargo build --release --offline --manifest-path native/Cargo.toml` (crates from
Debian's librust-*-dev packages, `make native-deps`). Without cargo (or without the crate) the
Rust side is skipped with a plain message, unless VALEN_NATIVE_REQUIRED=1 (`make native-check`),
which turns the skip into a failure. Each damage helper changes one thing in a copy of a good
export and re-hashes the changed file in the manifest, so only the check aimed at that thing can
catch it (the flipped byte is the exception: it is meant for the hash check).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from valen_runtime.safetensors_file import SafetensorsFile, write_file

REPO = Path(__file__).resolve().parents[2]
CRATE = REPO / "native" / "Cargo.toml"
BINARY = REPO / "native" / "target" / "release" / "valen-native-check"
BUILD_TIMEOUT_S = 900  # a cold release build of the crate and its Debian crates on 2 cores


def find_cargo() -> str | None:
    found = shutil.which("cargo")
    if found:
        return found
    home = Path.home() / ".cargo" / "bin" / "cargo"  # rustup's default place, often not on PATH
    return str(home) if home.is_file() else None


def _unavailable(reason: str):
    if os.environ.get("VALEN_NATIVE_REQUIRED") == "1":
        pytest.fail(f"native check required but {reason}")
    pytest.skip(f"native check skipped: {reason}")


@pytest.fixture(scope="session")
def native_binary() -> Path:
    """Path of a freshly built valen-native-check; skips when cargo or the crate is missing."""
    cargo = find_cargo()
    if cargo is None:
        _unavailable("cargo not found (install Rust, then `make native-deps native-check`)")
    if not CRATE.is_file():
        _unavailable(f"{CRATE.relative_to(REPO)} not found")
    env = dict(os.environ, PATH=f"{Path(cargo).parent}{os.pathsep}{os.environ.get('PATH', '')}")  # rustc beside cargo
    # Run from native/: cargo looks for .cargo/config.toml (the Debian directory source) from the
    # working directory upwards, not from --manifest-path; from native/ it is found either way.
    build = subprocess.run(
        [cargo, "build", "--release", "--offline", "--manifest-path", str(CRATE)],
        capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, env=env, cwd=CRATE.parent,
    )
    if build.returncode != 0:
        # A build failure is a real failure, not a skip: the crate is part of the product.
        pytest.fail("cargo build of native/ failed (`make native-deps` installs its crates):\n" + build.stderr[-4000:])
    return BINARY


# --- damaging an export -------------------------------------------------------------------------


def load_manifest(export: Path) -> dict:
    return json.loads((export / "valen_export.json").read_text())


def save_manifest(export: Path, manifest: dict) -> None:
    # The exporter's own formatting, so the only change is the one a test makes.
    (export / "valen_export.json").write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def rehash(export: Path, *names: str) -> None:
    """Record the current size and SHA-256 of `names` in the manifest."""
    manifest = load_manifest(export)
    for name in names:
        data = (export / name).read_bytes()
        manifest["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    save_manifest(export, manifest)


def rewrite_tensors(export: Path, file: str, change) -> None:
    """Rewrite safetensors `file` as change({name: tensor}) returns it, then re-hash it."""
    path = export / file
    tensors = dict(SafetensorsFile(path).iter_tensors())
    tensors = change(tensors)
    path.unlink()
    write_file(path, tensors, metadata={"format": "pt"})
    rehash(export, file)


def language_file_of(export: Path, name: str) -> str:
    manifest = load_manifest(export)
    lang = manifest["language"]
    if lang["index"] is None:
        return lang["files"][0]
    return json.loads((export / lang["index"]).read_text())["weight_map"][name]


def flip_byte(export: Path) -> str:
    """One byte in the middle of the vision file's data, manifest untouched: the hash check's case."""
    path = export / "vision.safetensors"
    data = bytearray(path.read_bytes())
    data[len(data) - 100] ^= 0x01
    path.write_bytes(bytes(data))
    return "vision.safetensors"


def drop_lora_b(export: Path) -> str:
    """Remove one lora_B tensor from the adapter (A stays)."""
    victim = "base_model.model.model.language_model.layers.0.mlp.down_proj.lora_B.weight"

    def change(t):
        assert victim in t
        del t[victim]
        return t

    rewrite_tensors(export, "adapter_model.safetensors", change)
    return "down_proj"


def wrong_dtype(export: Path) -> str:
    """One language tensor stored as F32 instead of BF16 (same values, same name and shape)."""
    name = "model.language_model.layers.0.mlp.up_proj.weight"
    rewrite_tensors(export, language_file_of(export, name), lambda t: {**t, name: t[name].float()})
    return "up_proj"


def rename_tensor(export: Path) -> str:
    """One language tensor under a name the table does not have; the index follows the rename."""
    old = "model.language_model.layers.0.post_attention_layernorm.weight"
    new = "model.language_model.layers.0.post_attention_norm.weight"
    file = language_file_of(export, old)

    def change(t):
        t[new] = t.pop(old)
        return t

    rewrite_tensors(export, file, change)
    manifest = load_manifest(export)
    if manifest["language"]["index"]:
        index_path = export / manifest["language"]["index"]
        index = json.loads(index_path.read_text())
        index["weight_map"][new] = index["weight_map"].pop(old)
        index["weight_map"] = dict(sorted(index["weight_map"].items()))
        index_path.write_text(json.dumps(index, indent=2) + "\n")
        rehash(export, manifest["language"]["index"])
    return "post_attention"


def unknown_format(export: Path) -> str:
    manifest = load_manifest(export)
    manifest["format"] = "valen-native/2"
    save_manifest(export, manifest)
    return "valen-native/2"


def wrong_scale(export: Path) -> str:
    """lora.scale no longer alpha / rank (a loader would apply twice the adapter)."""
    manifest = load_manifest(export)
    manifest["lora"]["scale"] = 2 * manifest["lora"]["scale"]
    save_manifest(export, manifest)
    return "scale"


def transposed_lora_a(export: Path) -> str:
    """One LoRA A stored as [in, rank] instead of [rank, in]."""
    name = "base_model.model.model.language_model.layers.0.mlp.gate_proj.lora_A.weight"  # [rank, in] with in != rank
    rewrite_tensors(export, "adapter_model.safetensors", lambda t: {**t, name: t[name].T.contiguous()})
    return "gate_proj"


def fp32_source_off(export: Path) -> str:
    """An FP32 source that no longer rounds to the shipped BF16 value."""
    name = "model.language_model.layers.0.linear_attn.A_log"
    rewrite_tensors(export, "fp32_sources.safetensors", lambda t: {**t, name: t[name] + 1.0})
    return "A_log"


def trained_blocks_off(export: Path) -> str:
    manifest = load_manifest(export)
    manifest["vision"]["trained_blocks"] = [b - 1 for b in manifest["vision"]["trained_blocks"]]
    save_manifest(export, manifest)
    return "trained_blocks"


def nan_in_head(export: Path) -> str:
    def change(t):
        w = t["decision.weight"].clone()
        w[0, 0] = float("nan")
        return {**t, "decision.weight": w}

    rewrite_tensors(export, "valen_head.safetensors", change)
    return "decision.weight"


def extra_file(export: Path) -> str:
    (export / "notes.txt").write_text("not part of the export\n")
    return "notes.txt"


def listed_extra_file(export: Path) -> str:
    """A file that is no part of the format, listed in the manifest with its correct hash."""
    (export / "notes.txt").write_text("not part of the export\n")
    rehash(export, "notes.txt")
    return "notes.txt"


def uppercase_hash(export: Path) -> str:
    manifest = load_manifest(export)
    entry = manifest["files"]["config.json"]
    entry["sha256"] = entry["sha256"].upper()
    save_manifest(export, manifest)
    return "sha256"


# name -> (damage, the LoRA mode of the export it applies to)
DAMAGES = {
    "flipped-byte": (flip_byte, "separate"),
    "missing-lora-b": (drop_lora_b, "separate"),
    "wrong-dtype": (wrong_dtype, "merged"),
    "renamed-tensor": (rename_tensor, "separate"),
    "unknown-format": (unknown_format, "merged"),
    "wrong-scale": (wrong_scale, "separate"),
    "transposed-lora-a": (transposed_lora_a, "separate"),
    "fp32-source-off": (fp32_source_off, "merged"),
    "trained-blocks-off": (trained_blocks_off, "separate"),
    "nan-in-head": (nan_in_head, "merged"),
    "extra-file": (extra_file, "separate"),
    "listed-extra-file": (listed_extra_file, "merged"),
    "uppercase-hash": (uppercase_hash, "merged"),
}


@pytest.fixture(scope="session")
def native_exports(tiny_fixture, tmp_path_factory) -> dict[str, Path]:
    """Fresh exports of the tiny fixture: separate, merged (sharded, the default) and single (no index)."""
    from valen_export.export import export

    root = tmp_path_factory.mktemp("native-exports")
    out = {}
    for name, mode, shard in (("separate", "separate", 2 * 1024**3), ("merged", "merged", 2 * 1024**3), ("single", "separate", 0)):
        out[name] = root / name
        export(tiny_fixture.checkpoint, tiny_fixture.base, out[name], lora_mode=mode, pins_path=tiny_fixture.pins, max_shard_bytes=shard, progress=False)
    return out


@pytest.fixture(scope="session")
def native_vectors(native_exports, tmp_path_factory) -> dict[str, Path]:
    from valen_export.vectors import write_vectors

    root = tmp_path_factory.mktemp("native-vectors")
    out = {}
    for name, export_dir in native_exports.items():
        out[name] = root / f"{name}.json"
        write_vectors(export_dir, out[name])
    return out


@pytest.fixture(scope="session")
def damages() -> dict:
    return DAMAGES
