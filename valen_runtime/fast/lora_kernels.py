"""The FP32 LoRA of a fused projection as two Triton kernels (CUDA; Triton's interpreter in CPU tests).

`projections.project` computes base + B(A(x)) with torch: x.float(), one A GEMM, a batched B GEMM,
an fp32 delta of the projection's full width written out, then one add and cast. At Valen's row
counts those are cuBLAS's CUDA-core fp32 kernels with few thread blocks (the outputs are only
n*r = 32..128 wide) plus a round trip of an fp32 [rows, N] tensor. Here:

1. `_lora_a_kernel`: h_s = x[:, K_s] @ A[:, K_s]^T over S slices of K (split-K: S times the
   thread blocks), x read in its own dtype and widened in registers -> partials [S, M, n*r] fp32,
   summed in a fixed order (deterministic, no atomics).
2. `_lora_b_add_kernel`: out = cast(base + h_m @ B^T) per [BM, BN] tile of the output, where m is
   each column's member (a tile on a member boundary runs each member with the other's B rows
   zeroed, which adds exact zeros) -> the projection's output, in base's dtype.

Both stay IEEE fp32 (`input_precision="ieee"`: FMA on CUDA cores, no TF32): only the order of the
fp32 sums differs from cuBLAS's, as it differs between cuBLAS kernels. The kernels are built on
first use, so a process that sets TRITON_INTERPRET=1 first (the CPU tests) gets the interpreter.
"""

from __future__ import annotations

import functools
import os

import torch

A_BLOCK_M, A_BLOCK_K = 32, 32  # split-K A kernel tile: rows x K step (the n*r columns are one block)
B_BLOCK_M, B_BLOCK_N = 64, 64  # B-and-add kernel tile of the output
A_TARGET_PROGRAMS = 264  # two waves of an H200's 132 SMs: enough thread blocks to fill it
A_MIN_SLICE = 256  # K per split no shorter than this (8 steps of A_BLOCK_K)


try:  # CUDA builds of torch ship Triton; a CPU-only install may not (then only lora_impl="torch" runs)
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None


def triton_available() -> bool:
    return triton is not None


def _lora_a_kernel(x_ptr, a_ptr, partial_ptr, M, K, R, k_per_split, stride_xm, stride_ar,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    # x [M, K] (any float dtype), A [R, K] fp32 -> partial[split] [M, R] fp32 over K slice `split`
    pid_m, split = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ranks = tl.arange(0, BLOCK_R)
    k_start = split * k_per_split
    acc = tl.full((BLOCK_M, BLOCK_R), 0.0, tl.float32)
    for k_off in range(0, k_per_split, BLOCK_K):
        ks = k_start + k_off + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)
        a = tl.load(a_ptr + ranks[:, None] * stride_ar + ks[None, :], mask=(ranks[:, None] < R) & (ks[None, :] < K), other=0.0)
        acc = tl.dot(x.to(tl.float32), tl.trans(a), acc, input_precision="ieee")
    out = partial_ptr + split * M * R + rows[:, None] * R + ranks[None, :]
    tl.store(out, acc, mask=(rows[:, None] < M) & (ranks[None, :] < R))


def _lora_b_add_kernel(base_ptr, h_ptr, b_ptr, member_ptr, out_ptr, M, N, R, stride_base, stride_out,
                       RANK: tl.constexpr, BLOCK_RANK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       ROUND_BF16: tl.constexpr):
    # base [M, N], h [M, R] fp32 (member j's A(x) in columns j*RANK..), B [N, RANK] fp32 (scale folded),
    # member [N] int32 -> out [M, N] = cast(base + sum_r h[:, member*RANK + r] * B[:, r])
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ranks = tl.arange(0, BLOCK_RANK)
    row_ok, col_ok, rank_ok = rows < M, cols < N, ranks < RANK
    members = tl.load(member_ptr + cols, mask=col_ok, other=-1)
    first = tl.load(member_ptr + pid_n * BLOCK_N)
    end = pid_n * BLOCK_N + BLOCK_N  # tl.where, not tl.minimum: builtins only, so the interpreter can run it in-process
    last = tl.load(member_ptr + tl.where(end < N, end, N) - 1)
    b = tl.load(b_ptr + cols[:, None] * RANK + ranks[None, :], mask=col_ok[:, None] & rank_ok[None, :], other=0.0)
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for member in range(first, last + 1):
        h = tl.load(h_ptr + rows[:, None] * R + member * RANK + ranks[None, :], mask=row_ok[:, None] & rank_ok[None, :], other=0.0)
        b_member = tl.where((members == member)[:, None], b, 0.0)
        acc = tl.dot(h, tl.trans(b_member), acc, input_precision="ieee")
    ok = row_ok[:, None] & col_ok[None, :]
    base = tl.load(base_ptr + rows[:, None] * stride_base + cols[None, :], mask=ok, other=0.0)
    total = base.to(tl.float32) + acc
    if ROUND_BF16:  # round half to even on the bits (rounding.round_to_bf16), so the cast below is exact everywhere
        bits = total.to(tl.int32, bitcast=True)
        rounded = ((bits + (0x7FFF + ((bits >> 16) & 1))) & -65536).to(tl.float32, bitcast=True)
        total = tl.where(total != total, total, rounded)
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], total.to(out_ptr.dtype.element_ty), mask=ok)


def build_kernels():
    """(A kernel, B-and-add kernel) as Triton kernels, decorated now (so under the interpreter
    when TRITON_INTERPRET=1 is set at this moment)."""
    if triton is None:
        raise RuntimeError("Triton is not importable here: the fast path's LoRA kernels need it (lora_impl='torch' does not)")
    return triton.jit(_lora_a_kernel), triton.jit(_lora_b_add_kernel)


@functools.cache
def _kernels_for(interpret: str):
    return build_kernels()


def _cached_kernels():
    """build_kernels()' pair, once per process (and once more under the interpreter, for tests)."""
    return _kernels_for(os.environ.get("TRITON_INTERPRET", ""))


def split_count(M: int, K: int) -> int:
    """How many K slices the A kernel runs: enough thread blocks for the GPU (A_TARGET_PROGRAMS),
    each slice at least A_MIN_SLICE long; a power of two."""
    tiles = -(-M // A_BLOCK_M)
    splits = 1
    while tiles * splits * 2 <= A_TARGET_PROGRAMS and K // (splits * 2) >= A_MIN_SLICE:
        splits *= 2
    return splits


def lora_add(base: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b_rows: torch.Tensor,
             column_member: torch.Tensor, kernels=None) -> torch.Tensor:
    """base [..., N] (x @ W^T), x [..., K], lora_a [n*r, K] fp32, lora_b_rows [N, r] fp32 (scale folded),
    column_member [N] int32 (each output column's member, ascending) -> cast(base + LoRA(x)) [..., N].
    `kernels`: build_kernels()' pair (default: built once for the process)."""
    a_kernel, b_kernel = kernels or _cached_kernels()
    lead, N, K = base.shape[:-1], base.shape[-1], x.shape[-1]
    x2, base2 = x.reshape(-1, K).contiguous(), base.reshape(-1, N).contiguous()
    M, R, rank = x2.shape[0], lora_a.shape[0], lora_b_rows.shape[1]
    out = torch.empty_like(base2)
    if M == 0:
        return out.reshape(*lead, N)
    splits = split_count(M, K)
    k_per_split = -(-K // (splits * A_BLOCK_K)) * A_BLOCK_K
    partials = torch.empty(splits, M, R, dtype=torch.float32, device=x.device)
    block_r = max(16, 1 << (R - 1).bit_length())
    a_kernel[(-(-M // A_BLOCK_M), splits)](x2, lora_a, partials, M, K, R, k_per_split, x2.stride(0), lora_a.stride(0),
                                           BLOCK_M=A_BLOCK_M, BLOCK_R=block_r, BLOCK_K=A_BLOCK_K)
    h = partials.sum(0) if splits > 1 else partials[0]  # one reduction kernel, no atomics: the same bits every run
    block_rank = max(16, 1 << (rank - 1).bit_length())
    b_kernel[(-(-M // B_BLOCK_M), -(-N // B_BLOCK_N))](base2, h.contiguous(), lora_b_rows, column_member, out, M, N, R,
                                                       base2.stride(0), out.stride(0), RANK=rank, BLOCK_RANK=block_rank,
                                                       BLOCK_M=B_BLOCK_M, BLOCK_N=B_BLOCK_N, ROUND_BF16=base.dtype == torch.bfloat16)
    return out.reshape(*lead, N)


@torch.library.custom_op("valen::lora_add", mutates_args=())
def lora_add_op(base: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b_rows: torch.Tensor,
                column_member: torch.Tensor) -> torch.Tensor:
    """`lora_add` as one opaque op, so a torch.compile'd layer stays one graph around it."""
    return lora_add(base, x, lora_a, lora_b_rows, column_member)


@lora_add_op.register_fake
def _(base, x, lora_a, lora_b_rows, column_member):
    return base.new_empty(base.shape)
