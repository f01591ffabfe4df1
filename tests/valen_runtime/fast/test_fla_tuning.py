"""fla_tuning: which tuned folder FLA is pointed at, when it is left to autotune, and that the shipped
folders are in FLA's config format (FLA reading what dump wrote, and the shipped folder, is a gpu
test below)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest

from valen_runtime.fast import fla_tuning


def _tuned_folder(root, gpu="NVIDIA H100 80GB HBM3", fla_core="0.6.0"):
    folder = root / fla_tuning.gpu_folder_name(gpu)
    folder.mkdir(parents=True)
    (folder / fla_tuning.MANIFEST).write_text(json.dumps({"gpu": gpu, "fla_core": fla_core}))
    return folder


def test_gpu_folder_names_are_flas_own():
    # FLA's sanitize_gpu_name: every run of non-alphanumerics becomes one "_", none at either end
    assert fla_tuning.gpu_folder_name("NVIDIA H100 80GB HBM3") == "NVIDIA_H100_80GB_HBM3"
    assert fla_tuning.gpu_folder_name(" NVIDIA H200 (MIG 1g.18gb) ") == "NVIDIA_H200_MIG_1g_18gb"
    assert fla_tuning.gpu_folder_name("---") == "unknown_gpu"


def test_the_tuned_folder_is_used_only_with_its_own_fla_version(tmp_path):
    folder = _tuned_folder(tmp_path)
    assert fla_tuning.shipped_dir("NVIDIA H100 80GB HBM3", "0.6.0", tmp_path) == folder
    assert fla_tuning.shipped_dir("NVIDIA H100 80GB HBM3", "0.6.1", tmp_path) is None
    assert fla_tuning.shipped_dir("NVIDIA H100 80GB HBM3", None, tmp_path) is None
    assert fla_tuning.shipped_dir("NVIDIA A100-SXM4-80GB", "0.6.0", tmp_path) is None
    (folder / fla_tuning.MANIFEST).write_text("{not json")
    assert fla_tuning.shipped_dir("NVIDIA H100 80GB HBM3", "0.6.0", tmp_path) is None


def test_flas_environment_is_set_for_a_tuned_gpu_and_left_alone_otherwise(tmp_path, monkeypatch):
    folder = _tuned_folder(tmp_path)
    for name in [m for m in list(sys.modules) if m.startswith("fla.")]:
        monkeypatch.delitem(sys.modules, name)
    environ = {}
    assert fla_tuning.use_shipped_configs("NVIDIA H100 80GB HBM3", "0.6.0", environ, tmp_path) == "tuned for NVIDIA_H100_80GB_HBM3"
    assert environ == {"FLA_CONFIG_DIR": str(folder), "FLA_CACHE_MODE": "fuzzy"}
    environ = {}
    assert fla_tuning.use_shipped_configs("NVIDIA L4", "0.6.0", environ, tmp_path) == "autotuned" and environ == {}
    for users_own in ({"FLA_CACHE_MODE": "disabled"}, {"FLA_CONFIG_DIR": "/somewhere"}):
        environ = dict(users_own)
        assert fla_tuning.use_shipped_configs("NVIDIA H100 80GB HBM3", "0.6.0", environ, tmp_path) == "FLA_CONFIG_DIR/FLA_CACHE_MODE as set"
        assert environ == users_own


def test_fla_imported_before_the_runtime_is_left_to_autotune(tmp_path, monkeypatch):
    _tuned_folder(tmp_path)
    monkeypatch.setitem(sys.modules, "fla.ops.utils.cache", object())
    environ = {}
    assert fla_tuning.use_shipped_configs("NVIDIA H100 80GB HBM3", "0.6.0", environ, tmp_path).startswith("autotuned")
    assert environ == {}


@pytest.mark.parametrize("folder", sorted(p for p in fla_tuning.CONFIGS.glob("*") if p.is_dir()) or [None])
def test_shipped_folders_are_in_flas_config_format(folder):
    if folder is None:
        pytest.skip("no tuned folders shipped")
    manifest = json.loads((folder / fla_tuning.MANIFEST).read_text())
    assert fla_tuning.gpu_folder_name(manifest["gpu"]) == folder.name and manifest["fla_core"]
    kernels = {p.stem: json.loads(p.read_text()) for p in folder.glob("*.json") if p.name != fla_tuning.MANIFEST}
    assert kernels and set(kernels) == set(manifest["kernels"])
    for name, data in kernels.items():
        assert data["kernel_name"] == name and len(data["autotune_entries"]) == manifest["kernels"][name]
        for key_hash, entry in data["autotune_entries"].items():
            config = entry["config"]
            assert isinstance(entry["autotune_key"], list) and isinstance(config["kwargs"], dict)
            # FLA's AutotuneKey.key_hash: md5 of the key's compact, key-sorted JSON
            assert key_hash == hashlib.md5(json.dumps(entry["autotune_key"], separators=(",", ":"), sort_keys=True).encode()).hexdigest()
            assert config["num_warps"] in (1, 2, 4, 8, 16, 32) and config["num_stages"] >= 1
            assert config["num_ctas"] >= 1 and "maxnreg" in config  # FLA reads both unconditionally


# valen-serve's warmup on an eager fast-path engine (FLA's calls are the same compiled or not: their
# keys are dtypes, flags and sizes), then which FLA kernels had their candidates timed
# (fla_tuning.kernels_configured); with a folder argument, the choices are dumped there.
_WARMUP_AND_REPORT = """
import json, sys
from pathlib import Path
import torch
from valen_runtime.engine import Engine
from valen_runtime.fast import fla_tuning
from valen_runtime.options import EngineOptions
from valen_runtime.serve.warmup import warmup_requests
engine = Engine.load(sys.argv[1], EngineOptions(compile=False, graphs=False))
for request in warmup_requests(True):
    engine.run(request)
benchmarked = fla_tuning.kernels_configured()
if len(sys.argv) > 2:
    fla_tuning.dump(Path(sys.argv[2]), torch.cuda.get_device_name())
print(json.dumps({"gated_delta": engine.kernels["gated_delta"], "benchmarked": benchmarked}))
"""


@pytest.mark.gpu
def test_dumped_and_shipped_folders_leave_the_serve_warmup_nothing_to_time(tiny_export, tmp_path):
    """Each run a fresh process with an empty Triton cache: (1) FLA's lookup off, the warmup times
    every kernel's candidates (the control) and dump writes the choices; (2) FLA pointed at that
    folder in its strict mode (exact keys): FLA's own reader finds every call's choice, nothing is
    timed; (3) where this GPU has a shipped folder, the runtime's default (fuzzy) finds every
    call's choice in it too, though its entries were tuned at the 2B shapes."""
    import torch

    from valen_runtime.fast.kernels import fla_version

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")

    def warmup(name: str, *extra: str, **fla_env) -> dict:
        env = {k: v for k, v in os.environ.items() if k not in ("FLA_CACHE_MODE", "FLA_CONFIG_DIR")}
        env.update(fla_env, TRITON_CACHE_DIR=str(tmp_path / name))
        done = subprocess.run([sys.executable, "-c", _WARMUP_AND_REPORT, str(tiny_export["separate"]), *extra], env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    dumped = tmp_path / "dumped"
    control = warmup("autotuned", str(dumped), FLA_CACHE_MODE="disabled")
    assert control["gated_delta"].endswith("as set") and control["benchmarked"], control
    assert all(control["benchmarked"].values()), control
    assert set(json.loads((dumped / fla_tuning.MANIFEST).read_text())["kernels"]) == set(control["benchmarked"])
    strict = warmup("strict", FLA_CACHE_MODE="strict", FLA_CONFIG_DIR=str(dumped))
    assert set(strict["benchmarked"]) == set(control["benchmarked"]) and not any(strict["benchmarked"].values()), strict
    folder = fla_tuning.shipped_dir(torch.cuda.get_device_name(), fla_version())
    if folder is None:
        return  # no shipped folder for this GPU: (3) has nothing to check
    shipped = warmup("shipped")
    assert shipped["gated_delta"].endswith(f"tuned for {folder.name}")
    assert set(shipped["benchmarked"]) == set(control["benchmarked"]) and not any(shipped["benchmarked"].values()), shipped
