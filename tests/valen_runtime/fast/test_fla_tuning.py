"""fla_tuning: which tuned folder FLA is pointed at, when it is left to autotune, and that the shipped
folders are in FLA's config format (the round trip through FLA itself is a gpu test below)."""

from __future__ import annotations

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
    monkeypatch.setitem(sys.modules, "fla.ops", object())
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
        for entry in data["autotune_entries"].values():
            config = entry["config"]
            assert isinstance(entry["autotune_key"], list) and isinstance(config["kwargs"], dict)
            assert config["num_warps"] in (1, 2, 4, 8, 16, 32) and config["num_stages"] >= 1


@pytest.mark.gpu
def test_flas_own_lookup_reads_back_what_dump_wrote(tmp_path):
    """After FLA has autotuned a call, dump's files give FLA's config-file reader the same choice for
    every key (fla.ops.utils.cache: KernelConfigFile, AutotuneKey)."""
    import torch

    from valen_runtime.fast.kernels import fla_available, fla_chunk_gated_delta_rule

    if not torch.cuda.is_available() or not fla_available():
        pytest.skip("needs CUDA and fla-core")
    from fla.ops.utils.cache import AutotuneKey, KernelConfigFile

    gen = torch.Generator(device="cuda").manual_seed(0)
    B, T, H, D = 2, 96, 4, 128
    q, k, v = (torch.randn(B, T, H, D, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(3))
    g = -torch.rand(B, T, H, device="cuda", generator=gen)
    beta = torch.rand(B, T, H, device="cuda", generator=gen, dtype=torch.bfloat16)
    fla_chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True)
    counts = fla_tuning.dump(tmp_path, torch.cuda.get_device_name())
    tuners = fla_tuning.autotuners()
    assert "recompute_w_u_fwd_kernel" in counts  # defined in several FLA modules: the one that ran is found
    for name in counts:
        read = KernelConfigFile.from_file(tmp_path / f"{name}.json")
        chosen = [item for tuner in tuners[name] for item in tuner.cache.items()]
        assert len({tuple(key) for key, _ in chosen}) == counts[name]
        for key, config in chosen:
            entry = read.lookup_exact(AutotuneKey(autotune_key=tuple(key)))
            assert entry is not None, (name, key)
            assert entry["config"]["kwargs"] == config.kwargs and entry["config"]["num_warps"] == config.num_warps
            assert entry["config"]["num_stages"] == config.num_stages


_WARMUP_AND_REPORT = """
import json, sys
from valen_runtime.engine import Engine
from valen_runtime.fast import fla_tuning
from valen_runtime.options import EngineOptions
from valen_runtime.serve.warmup import warmup_requests
engine = Engine.load(sys.argv[1], EngineOptions(compile=False, graphs=False))
for request in warmup_requests(True):
    engine.run(request)
used = {name: [hasattr(t, "bench_time") for t in tuners if t.cache] for name, tuners in fla_tuning.autotuners().items()}
print(json.dumps({"gated_delta": engine.kernels["gated_delta"], "benchmarked": {n: any(b) for n, b in used.items() if b}}))
"""


@pytest.mark.gpu
def test_with_this_gpus_folder_the_serve_warmup_times_no_candidates(tiny_export, tmp_path):
    """On a GPU with a tuned folder, every FLA kernel valen-serve's warmup calls takes its
    configuration from the folder: none has its candidates timed (Triton's autotuner sets
    bench_time when it does). A fresh process with an empty Triton cache, so nothing was tuned
    before; eager, since FLA's calls are the same compiled or not (their keys: dtypes, flags)."""
    import torch

    from valen_runtime.fast.kernels import fla_version

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    name = torch.cuda.get_device_name()
    folder = fla_tuning.shipped_dir(name, fla_version())
    if folder is None:
        pytest.skip(f"no tuned folder for {name} with fla-core {fla_version()}")

    def warmup(cache: str, **fla_env) -> dict:
        env = {k: v for k, v in os.environ.items() if k not in ("FLA_CACHE_MODE", "FLA_CONFIG_DIR")}
        env.update(fla_env, TRITON_CACHE_DIR=str(tmp_path / cache))
        done = subprocess.run([sys.executable, "-c", _WARMUP_AND_REPORT, str(tiny_export["separate"])], env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    report = warmup("triton-tuned")
    assert report["gated_delta"].endswith(f"tuned for {folder.name}")
    tuned = set(json.loads((folder / fla_tuning.MANIFEST).read_text())["kernels"])
    assert report["benchmarked"] and set(report["benchmarked"]) <= tuned, report
    assert not any(report["benchmarked"].values()), report
    # the control: with FLA's lookup off, the same warmup times every kernel's candidates
    control = warmup("triton-autotuned", FLA_CACHE_MODE="disabled")
    assert control["gated_delta"].endswith("as set") and set(control["benchmarked"]) == set(report["benchmarked"])
    assert all(control["benchmarked"].values()), control
