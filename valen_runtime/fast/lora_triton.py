"""The separate FP32 LoRA of a fused projection as two Triton kernels, FP32 arithmetic throughout.

`project` (projections.py) computes out = round(base + x A^T B^T s) with cuBLAS: x cast to fp32
(an [M, in] fp32 copy), A's product, a batched B product writing an [M, N] fp32 delta, then an
elementwise add reading it back. At Valen's row counts that traffic, not the FLOPs, is most of
the LoRA's cost. Here:

- `_lora_down`: h = float(x) @ A^T, reading x in its own dtype, split along `in` into S partial
  sums [S, M, n*r] (rank-32 outputs leave too few output tiles to fill the GPU otherwise);
- `_lora_up_add`: out = round(float(base) + h @ B^T) per output tile, summing the S partials as it
  loads h and reading each column block's member from `groups`; the fp32 delta never leaves
  registers.

Products are IEEE fp32 (`input_precision="ieee"`: no TF32), as PEFT computes them; only the order
of the fp32 sums differs from cuBLAS's. The narrow trailing members (GDN's b and a) keep
projections.py's small block-diagonal GEMM. Runs under TRITON_INTERPRET=1 on CPU tensors too,
which is how the CPU tests check the indexing.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU-only install: projections.py keeps its cuBLAS form
    triton = None

BLOCK_M = 64  # rows per tile (both kernels)
BLOCK_R = 32  # A-product output columns per tile: one rank-32 member
BLOCK_K = 32  # the A product's reduction step
MAX_BLOCK_N = 64  # B-product output columns per tile (a power of two dividing Nb, at least 16)
TARGET_PROGRAMS = 264  # two waves of 132 SMs (H100/H200): enough A-product tiles to keep the GPU busy


def available() -> bool:
    return triton is not None


def block_n(rows_per_block: int) -> int:
    """The B product's tile width for Nb-row member blocks: the largest power of two <= MAX_BLOCK_N
    dividing Nb (a tile never straddles two members)."""
    n = MAX_BLOCK_N
    while n > 1 and rows_per_block % n:
        n //= 2
    return n


def supports(lora_b: torch.Tensor, lora_a: torch.Tensor) -> bool:
    """Whether a projection's factors fit the kernels' tiles: rank BLOCK_R, `in` a multiple of
    BLOCK_K, Nb a multiple of 16 (tl.dot's smallest tile; true for every Qwen3.5-2B projection)."""
    return block_n(lora_b.shape[1]) >= 16 and lora_b.shape[2] == BLOCK_R and lora_a.shape[1] % BLOCK_K == 0


def split_k(rows: int, rank_cols: int, k: int) -> int:
    """Partial sums along `in` for the A product: enough programs for about two waves, a power of
    two dividing the number of BLOCK_K steps (every split covers whole steps), at most 16."""
    programs = -(-rows // BLOCK_M) * (rank_cols // BLOCK_R)
    steps = k // BLOCK_K
    s = 1
    while s < 16 and programs * s < TARGET_PROGRAMS and steps % (2 * s) == 0:
        s *= 2
    return s


if triton is not None:

    @triton.jit
    def _lora_down(x_ptr, a_ptr, h_ptr, M, stride_xm, stride_am, stride_hs, stride_hm, steps_per_split,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
        """h[s, m, c] = sum over split s of float(x[m, k]) * a[c, k]; grid (row tiles, column tiles, S)."""
        pid_m, pid_c, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_c * BLOCK_R + tl.arange(0, BLOCK_R)
        ks = pid_s * steps_per_split * BLOCK_K + tl.arange(0, BLOCK_K)
        row_ok = rows[:, None] < M
        x_tile = x_ptr + rows[:, None] * stride_xm + ks[None, :]  # [BM, BK]
        a_tile = a_ptr + cols[None, :] * stride_am + ks[:, None]  # [BK, BR]: A^T
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for _ in range(steps_per_split):
            x = tl.load(x_tile, mask=row_ok, other=0.0).to(tl.float32)
            acc += tl.dot(x, tl.load(a_tile), input_precision="ieee")
            x_tile += BLOCK_K
            a_tile += BLOCK_K
        tl.store(h_ptr + pid_s * stride_hs + rows[:, None] * stride_hm + cols[None, :], acc, mask=row_ok)

    @triton.jit
    def _lora_up_add(base_ptr, h_ptr, b_ptr, groups_ptr, out_ptr, M, S, stride_bm, stride_hs, stride_hm, stride_om, block_rows,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, R: tl.constexpr):
        """out[m, n] = round(float(base[m, n]) + sum_k h[m, g*R + k] * b[n, k]), g = groups[n // block_rows]
        (the member of the column's Nb block), h the sum of its S partials; grid (row tiles, column tiles)."""
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ranks = tl.arange(0, R)
        row_ok = rows[:, None] < M
        member = tl.load(groups_ptr + (pid_n * BLOCK_N) // block_rows)
        h_tile = h_ptr + rows[:, None] * stride_hm + member * R + ranks[None, :]  # [BM, R]
        h = tl.zeros((BLOCK_M, R), dtype=tl.float32)
        for s in range(S):
            h += tl.load(h_tile + s * stride_hs, mask=row_ok, other=0.0)
        b = tl.load(b_ptr + cols[None, :] * R + ranks[:, None])  # [R, BN]: B^T
        delta = tl.dot(h, b, input_precision="ieee")  # [BM, BN] fp32
        base = tl.load(base_ptr + rows[:, None] * stride_bm + cols[None, :], mask=row_ok, other=0.0)
        out = (base.to(tl.float32) + delta).to(base.dtype)
        tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], out, mask=row_ok)


def lora_add(base: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, groups: torch.Tensor,
             lora_b_small: torch.Tensor | None) -> torch.Tensor:
    """base [M, N] (x @ W^T, any float dtype), x [M, in], lora_a [n*r, in] fp32, lora_b [G, Nb, r]
    fp32 (scale folded), groups [G] int32, lora_b_small [N_small, n_small*r] or None ->
    round(float(base) + delta) [M, N] in base's dtype, delta each column's member's B(A(x))."""
    M, K = x.shape
    G, Nb, R = lora_b.shape
    n_wide = G * Nb
    out = torch.empty_like(base)
    if M == 0:
        return out
    S = split_k(M, lora_a.shape[0], K)
    h = torch.empty(S, M, lora_a.shape[0], dtype=torch.float32, device=x.device)
    _lora_down[(triton.cdiv(M, BLOCK_M), lora_a.shape[0] // BLOCK_R, S)](
        x, lora_a, h, M, x.stride(0), lora_a.stride(0), h.stride(0), h.stride(1), K // (BLOCK_K * S),
        BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K,
    )
    bn = block_n(Nb)
    _lora_up_add[(triton.cdiv(M, BLOCK_M), n_wide // bn)](
        base, h, lora_b, groups, out, M, S, base.stride(0), h.stride(0), h.stride(1), out.stride(0), Nb,
        BLOCK_M=BLOCK_M, BLOCK_N=bn, R=R,
    )
    if lora_b_small is not None:  # GDN's b and a: [M, n_small*r] @ [n_small*r, N_small], a few columns
        h_small = h.sum(0)[:, lora_a.shape[0] - lora_b_small.shape[1] :]  # the narrow members' A(x), last in h
        out[:, n_wide:] = (base[:, n_wide:].float() + h_small @ lora_b_small.T).to(base.dtype)
    return out
