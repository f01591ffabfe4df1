"""valen_runtime.options.EngineOptions: the defaults per device, and every refusal in one line."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from valen_runtime.options import EngineOptions


def test_cpu_defaults_are_the_reference_shape():
    assert EngineOptions(device="cpu").to_json() == {
        "device": "cpu", "dtype": "bf16", "mode": "per-branch", "kernels": "torch", "graphs": False, "compile": False,
    }


def test_cuda_defaults_are_the_compiled_graphed_fast_path():
    # Resolving needs no GPU: only the device name decides the defaults.
    assert EngineOptions(device="cuda").to_json() == {
        "device": "cuda", "dtype": "bf16", "mode": "shared-prefix", "kernels": "fast", "graphs": True, "compile": True,
    }
    assert EngineOptions(device="cuda:1", mode="per-branch").to_json() == {
        "device": "cuda:1", "dtype": "bf16", "mode": "per-branch", "kernels": "torch", "graphs": False, "compile": False,
    }
    assert EngineOptions(device="cuda", kernels="torch").compile is False  # nothing to compile on the reference modules


def test_no_device_means_cuda_when_available():
    assert EngineOptions().device == ("cuda" if torch.cuda.is_available() else "cpu")


def test_explicit_choices_are_kept():
    opts = EngineOptions(device="cpu", dtype="fp32", mode="shared-prefix", kernels="fast", compile=True)
    assert (opts.dtype, opts.mode, opts.kernels, opts.graphs, opts.compile) == ("fp32", "shared-prefix", "fast", False, True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.mode = "per-branch"


@pytest.mark.parametrize(
    "kwargs, phrase",
    [
        (dict(device="mps"), "device 'mps' is not cpu, cuda or cuda:N"),
        (dict(device="cuda:x"), "device 'cuda:x'"),
        (dict(device="cpu", dtype="fp16"), "dtype 'fp16' is not one of bf16, fp32"),
        (dict(device="cpu", mode="batched"), "mode 'batched' is not one of per-branch, shared-prefix"),
        (dict(device="cpu", kernels="triton"), "kernels 'triton' is not one of torch, fast"),
        (dict(device="cpu", mode="shared-prefix", graphs=True), "CUDA graphs need mode='shared-prefix' on a CUDA device"),
        (dict(device="cuda", mode="per-branch", graphs=True), "CUDA graphs need"),
        (dict(device="cpu", compile=True), "compile=True needs kernels='fast'"),
    ],
)
def test_impossible_combinations_are_refused_in_one_line(kwargs, phrase):
    with pytest.raises(ValueError, match=phrase.replace("(", r"\(").replace(")", r"\)")) as e:
        EngineOptions(**kwargs)
    assert "\n" not in str(e.value)
