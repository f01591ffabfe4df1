"""lora_triton's kernels against an fp64 evaluation of the LoRA, next to projections.project (the
cuBLAS form they replace), both under the same a-priori fp32 bound. On the CPU the kernels run in
Triton's interpreter (TRITON_INTERPRET=1, in a child process: the flag is read when the kernels
are defined); on CUDA they run compiled (gpu-marked)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton", reason="Triton is a dependency of torch's CUDA builds; the CPU wheel may lack it")

U32 = 2.0**-24  # unit round-off of fp32
U16 = 2.0**-8  # of bf16

# (member output sizes, in, rows): several wide members with narrow trailing ones (GDN's in_proj
# shape), one member (down_proj's), rows that do not fill the last 64-row tile, an `in` long
# enough that the A product is split into partial sums, and the tiny fixture's in_proj (32-row blocks).
SHAPES = [([192, 128, 16, 16], 256, 70), ([128], 96, 5), ([64, 64], 512, 130), ([96, 32, 2, 2], 64, 67)]


def gamma(n: int) -> float:
    return n * U32 / (1 - n * U32)


def _members(sizes: list[int], d_in: int, gen: torch.Generator, device: str, dtype: torch.dtype):
    """LoRALinear projections of one input, rank-32 FP32 adapters at PEFT's scale 2."""
    from valen_runtime.qwen35 import LoRALinear, attach_lora

    parent, adapter = torch.nn.Module(), {}
    for i, n in enumerate(sizes):
        setattr(parent, f"m{i}", LoRALinear(d_in, n))
        getattr(parent, f"m{i}").weight.data = (torch.randn(n, d_in, generator=gen) / d_in**0.5).to(dtype)
        adapter[f"m{i}.lora_A.weight"] = torch.randn(32, d_in, generator=gen) / d_in**0.5
        adapter[f"m{i}.lora_B.weight"] = torch.randn(n, 32, generator=gen) / 32**0.5
    attach_lora(parent, adapter, 2.0)
    return [getattr(parent, f"m{i}").to(device) for i in range(len(sizes))]


def check(device: str) -> list[str]:
    """Every shape, fp32 and bf16 activations: both forms within the bound of the fp64 LoRA."""
    from valen_runtime.fast import lora_triton
    from valen_runtime.fast.projections import fuse, project

    lines = []
    gen = torch.Generator().manual_seed(11)
    for sizes, d_in, rows in SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            members = _members(sizes, d_in, gen, device, dtype)
            torch_form = fuse(members)
            triton_form = fuse(members, lora_kernel="triton")
            assert triton_form.lora_groups is not None, "the test shapes must fit the kernels' tiles"
            x = torch.randn(rows, d_in, generator=gen).to(device=device, dtype=dtype)
            base = torch.nn.functional.linear(x, torch_form.weight)  # the base GEMM both forms share
            x64 = x.double()
            a64 = torch.cat([m.lora_A.weight.double() for m in members])  # [n*r, in]
            b64 = torch.cat([m.lora_B.weight.double() * m.lora_scale for m in members])  # [N, r]
            member_of = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))  # [N]
            h, h_abs = x64 @ a64.T, x64.abs() @ a64.abs().T  # [rows, n*r]
            cols = (member_of[:, None] * 32 + torch.arange(32)).to(device)  # [N, r]: each column's A rows
            delta = (h[:, cols] * b64[None]).sum(-1)  # [rows, N]
            terms = (h_abs[:, cols] * b64.abs()[None]).sum(-1)
            exact = base.double() + delta
            # A product: |fl(h) - h| <= gamma_in |x||A|; B product of r terms adds gamma_r (|h| + that);
            # the fp32 add rounds once more; the cast to the activation dtype once more.
            fp32_bound = (gamma(d_in) + gamma(32) + gamma(d_in) * gamma(32)) * terms + U32 * (exact.abs() + terms)
            for name, got in (("cuBLAS form", project(x, torch_form)), ("triton", project(x, triton_form))):
                # The cast: round to nearest (u = 2^-8); Triton's interpreter truncates fp32 to bf16
                # (numpy has no bf16), a full ulp; compiled Triton rounds to nearest even.
                cast = U16 * (2 if name == "triton" and os.environ.get("TRITON_INTERPRET") == "1" else 1)
                bound = fp32_bound if dtype == torch.float32 else fp32_bound + cast * (exact.abs() + fp32_bound)
                err = (got.double() - exact).abs()
                worst = (err / bound).max().item()
                lines.append(f"{name} {sizes} in={d_in} rows={rows} {dtype}: split {lora_triton.split_k(rows, a64.shape[0], d_in)}, "
                             f"worst error / bound {worst:.3f}")
                assert worst <= 1.0, lines[-1]
    return lines


def test_kernels_in_the_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), *sys.path]))
    done = subprocess.run([sys.executable, "-c", "import test_lora_triton as t; print('\\n'.join(t.check('cpu')))"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("worst error") == 2 * 2 * len(SHAPES), done.stdout


def test_split_k_covers_the_reduction_in_whole_steps():
    from valen_runtime.fast.lora_triton import BLOCK_K, split_k

    for rows, cols, k in [(1, 32, 2048), (59, 128, 2048), (2377, 128, 2048), (2377, 32, 6144), (64, 96, 96)]:
        s = split_k(rows, cols, k)
        assert 1 <= s <= 16 and (k // BLOCK_K) % s == 0
    assert split_k(8000, 128, 2048) == 1  # 125 x 4 tiles already fill two waves
    assert split_k(2377, 128, 2048) == 2  # 38 x 4 tiles: one wave, doubled
    assert split_k(59, 128, 2048) == 16  # 1 x 4 tiles: split as far as allowed


@pytest.mark.gpu
def test_kernels_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    for line in check("cuda"):
        print(line)
