"""The shape ladder every bucketed layout pads to, and its padding rules.

Sizes that vary with the questions' lengths are rounded up to rungs of `bucket` (pads read by no
real row), so requests that differ a little share one shape key, and so one CUDA graph. The rows
layout pads branches and head rows (`pad_head_rows`); the one-pass layout pads sequences
(`pad_sequences`), token tables and head rows. The batch layout has no ladder (multiples of 8).
"""

from __future__ import annotations

import torch

from .common import CHUNK


def bucket(n: int) -> int:
    """The smallest rung >= n of a ladder with 8 rungs per doubling: every count up to 16, then
    multiples of 2 up to 32, of 4 up to 64, and so on (at most 12.5 % above n)."""
    if n <= 16:
        return n
    step = 1 << ((n - 1).bit_length() - 4)
    return -(-n // step) * step


def chunks(length: int) -> int:
    """64-token delta-rule chunks of a sequence of `length` rows."""
    return -(-length // CHUNK)


def pad_sequences(lengths: list[int], prefix_rows: int = 0) -> list[int]:
    """Lengths of pad sequences (at least one) that bring the packed continuations `lengths` to
    rungs of `bucket` at once in sequences, in 64-token chunks and in rows counted with the
    `prefix_rows` before them (the whole sweep's rows, which its cost follows). Always at least
    one, even for a plan on its rungs already: that plan then shares its key with its neighbours
    (measured: 8 keys instead of 6 over the 899 variants of (a) when such plans went unpadded).

    k sequences of c chunks in all hold between 64 (c - k) + k and 64 c rows, so the search takes
    the lowest row rung, then the lowest chunk and sequence rungs that fit it. Each chunk the
    chunk rung adds beyond the pad sequences' own costs 64 rows, so many continuations shorter
    than a chunk can grow by more than the row rung's 12.5 % (up to ≈ 35 % seen for 40
    continuations of 20 rows and one of 70). Should nothing fit within the rungs searched, one
    pad sequence rounds the rows up to a multiple of 8 (a shape of its own, still correct)."""
    rows, sequences, n_chunks = sum(lengths), len(lengths), sum(chunks(n) for n in lengths)
    T = bucket(prefix_rows + rows + 1)
    for _ in range(64):
        r = T - prefix_rows - rows
        NT = bucket(n_chunks + chunks(r))
        for _ in range(8):
            c = NT - n_chunks
            n = bucket(sequences + 1)
            while n - sequences <= min(r, c):
                k = n - sequences
                if c <= k + (r - k) // CHUNK:
                    return _pad_lengths(r, k, c)
                n = bucket(n + 1)
            NT = bucket(NT + 1)
        T = bucket(T + 1)
    return [8 - rows % 8]


def fit_sequences(lengths: list[int], rows: int, sequences: int, n_chunks: int) -> list[int] | None:
    """Pad sequences that bring the packed continuations `lengths` to exactly `rows` rows,
    `sequences` sequences and `n_chunks` 64-token chunks (a captured graph's sizes), or None when
    no such pads exist: at least one pad sequence, each at least one row, and k of them with c
    chunks in all hold between 64 (c - k) + k and 64 c rows."""
    r, k, c = rows - sum(lengths), sequences - len(lengths), n_chunks - sum(chunks(n) for n in lengths)
    if k < 1 or k > c or not CHUNK * (c - k) + k <= r <= CHUNK * c:
        return None
    return _pad_lengths(r, k, c)


def _pad_lengths(rows: int, k: int, n_chunks: int) -> list[int]:
    """k lengths summing to `rows` whose 64-token chunks sum to `n_chunks` (k <= n_chunks,
    64 (n_chunks - k) + k <= rows <= 64 n_chunks): the first takes the extra chunks."""
    capacity = [CHUNK * (n_chunks - k + 1)] + [CHUNK] * (k - 1)
    lengths = [CHUNK * (n_chunks - k) + 1] + [1] * (k - 1)
    left = rows - sum(lengths)
    for i in range(k):
        more = min(left, capacity[i] - lengths[i])
        lengths[i] += more
        left -= more
    assert left == 0 and sum(chunks(n) for n in lengths) == n_chunks, (rows, k, n_chunks)
    return lengths


def pad_head_rows(head_index: torch.Tensor, C: int, N: int, into: tuple[int, int] | None = None) -> tuple[torch.Tensor, int, int]:
    """`common.head_rows`' [candidates (C) | decisions (N) | branch of each candidate (C)] with C
    and N brought to rungs of `bucket` (or to `into`'s (C', N'), at least C and N): pad candidates
    read row 0 against branch 0 and pad decisions row 0; their logits follow the real C and are
    dropped. -> (head index, C', N')."""
    Cb, Nb = into if into is not None else (bucket(C), bucket(N))
    assert Cb >= C and Nb >= N, (C, N, into)
    zeros = head_index.new_zeros
    padded = torch.cat([head_index[:C], zeros(Cb - C), head_index[C : C + N], zeros(Nb - N), head_index[C + N :], zeros(Cb - C)])
    return padded, Cb, Nb
