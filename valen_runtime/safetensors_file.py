"""A small, strict safetensors reader and a streaming writer.

Why not only the `safetensors` package: the reader validates the header before trusting it
(size bounds, offsets inside the file, no overlaps or gaps, known dtypes, shapes that match the
byte counts, no duplicate keys) and reads one tensor at a time with plain file reads, so peak
memory stays at one tensor; the writer streams tensors in a fixed order so the same inputs give
byte-identical files. The format is the public one: 8-byte little-endian header length, a JSON
header `{name: {dtype, shape, data_offsets}}` (+ optional `__metadata__` of strings), data.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterable

import torch

from .errors import WeightsError

# Header above this is refused: the native loader caps it at 8 MiB for the adapter file and a
# 2B language shard needs well under 100 KiB.
MAX_HEADER_BYTES = 16 * 1024 * 1024

DTYPES: dict[str, torch.dtype] = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors dtype name, e.g. "BF16"
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def reject_duplicate_keys(pairs):
    """json.loads object_pairs_hook: a repeated key is an error (ValueError), never last-wins."""
    seen = {}
    for k, v in pairs:
        if k in seen:
            raise ValueError(f"duplicate key {k!r}")
        seen[k] = v
    return seen


def _reject_constant(name):
    raise ValueError(f"non-standard JSON constant {name}")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class SafetensorsFile:
    """Parsed header of one safetensors file; tensors are read on demand."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            st = self.path.stat()
            if not stat.S_ISREG(st.st_mode):
                raise WeightsError(f"{self.path}: not a regular file")
            size = st.st_size
            with open(self.path, "rb") as f:
                raw_len = f.read(8)
                if len(raw_len) < 8:
                    raise WeightsError(f"{self.path}: truncated safetensors file (no header length)")
                (header_len,) = struct.unpack("<Q", raw_len)
                if header_len > MAX_HEADER_BYTES:
                    raise WeightsError(
                        f"{self.path}: safetensors header of {header_len} bytes exceeds the {MAX_HEADER_BYTES}-byte limit"
                    )
                if 8 + header_len > size:
                    raise WeightsError(f"{self.path}: safetensors header length {header_len} points past the end of the file")
                raw = f.read(header_len)
        except OSError as e:
            raise WeightsError(f"{self.path}: cannot read ({e.strerror or e})") from None
        try:
            header = json.loads(raw.decode("utf-8"), object_pairs_hook=reject_duplicate_keys, parse_constant=_reject_constant)
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            detail = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise WeightsError(f"{self.path}: malformed safetensors header ({detail})") from None
        if not isinstance(header, dict):
            raise WeightsError(f"{self.path}: safetensors header is not a JSON object")
        metadata = header.pop("__metadata__", None)
        if metadata is not None and (
            not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
        ):
            raise WeightsError(f"{self.path}: safetensors __metadata__ must map strings to strings")
        self.metadata = metadata or {}
        data_start = 8 + header_len
        data_len = size - data_start
        infos: dict[str, TensorInfo] = {}
        for name, entry in header.items():
            infos[name] = self._parse_entry(name, entry, data_start, data_len)
        # Offsets must tile the data area exactly: no overlaps (aliasing) and no trailing bytes.
        spans = sorted((i.start, i.end, i.name) for i in infos.values())
        cursor = data_start
        for start, end, name in spans:
            if start != cursor and not (start == end == cursor):
                what = "overlaps another tensor" if start < cursor else "leaves a gap before it"
                raise WeightsError(f"{self.path}: tensor {name!r} {what} (offset {start - data_start})")
            cursor = max(cursor, end)
        if cursor != size:
            raise WeightsError(f"{self.path}: {size - cursor} bytes after the last tensor (expected none)")
        self.tensors = infos
        self.data_start = data_start

    def _parse_entry(self, name: str, entry, data_start: int, data_len: int) -> TensorInfo:
        where = f"{self.path}: tensor {name!r}"
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise WeightsError(f"{where}: header entry must have exactly dtype, shape, data_offsets")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not name:
            raise WeightsError(f"{self.path}: empty tensor name in the header")
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise WeightsError(f"{where}: unsupported dtype {dtype!r}")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise WeightsError(f"{where}: shape must be a list of non-negative integers, got {shape!r}")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(_is_int(o) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data_len
        ):
            raise WeightsError(f"{where}: data_offsets {offsets!r} point outside the file's data ({data_len} bytes)")
        numel = 1
        for d in shape:
            numel *= d
        itemsize = torch.empty((), dtype=DTYPES[dtype]).element_size()
        if numel * itemsize != offsets[1] - offsets[0]:
            raise WeightsError(f"{where}: shape {shape} of {dtype} needs {numel * itemsize} bytes, offsets give {offsets[1] - offsets[0]}")
        return TensorInfo(name, dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1])

    def names(self) -> list[str]:
        return sorted(self.tensors)

    def read(self, name: str, f: BinaryIO | None = None) -> torch.Tensor:
        """Read one tensor into fresh CPU memory (no mmap kept alive)."""
        info = self.tensors[name]
        buf = bytearray(info.nbytes)
        if f is None:
            with open(self.path, "rb") as fh:
                fh.seek(info.start)
                got = fh.readinto(buf)
        else:
            f.seek(info.start)
            got = f.readinto(buf)
        if got != info.nbytes:
            raise WeightsError(f"{self.path}: tensor {name!r} is truncated ({got} of {info.nbytes} bytes)")
        if info.nbytes == 0:
            return torch.empty(info.shape, dtype=DTYPES[info.dtype])
        return torch.frombuffer(buf, dtype=DTYPES[info.dtype]).reshape(info.shape)

    def iter_tensors(self, names: Iterable[str] | None = None):
        """Yield (name, tensor) in the given (default: sorted) order, reading one at a time."""
        with open(self.path, "rb") as f:
            for name in names if names is not None else self.names():
                yield name, self.read(name, f)


def header_for(tensors: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str] | None) -> tuple[bytes, list[int]]:
    """Serialise the header for tensors written in the given order; returns (bytes, offsets)."""
    header: dict = {}
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise ValueError("safetensors metadata must map str to str")
        header["__metadata__"] = dict(sorted(metadata.items()))
    offset = 0
    offsets = []
    for name, dtype, shape in tensors:
        if name in header:
            raise ValueError(f"duplicate tensor name {name!r}")
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offsets.append(offset)
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # pad so the data area starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw, offsets


class StreamingWriter:
    """Write a safetensors file tensor by tensor, hashing as it goes.

    The caller declares every (name, dtype, shape) up front, then calls `write(name, tensor)` (or
    `write_blocks` with row blocks) in exactly that order. `close()` returns (sha256 hex, size).
    """

    def __init__(self, path: str | os.PathLike, plan: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata=None):
        self.path = Path(path)
        self.plan = list(plan)
        self._next = 0
        self._hash = hashlib.sha256()
        self._size = 0
        header, _ = header_for(self.plan, metadata)
        self._f = open(self.path, "xb")
        self._emit(header)

    def _emit(self, data) -> None:
        self._f.write(data)
        self._hash.update(data)
        self._size += len(data)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        self.write_blocks(name, tensor.dtype, tuple(tensor.shape), [tensor])

    def write_blocks(self, name: str, dtype: torch.dtype, shape: tuple[int, ...], blocks) -> None:
        """Write the next planned tensor from consecutive blocks along its first dimension, so that
        a tensor never has to exist whole in memory (the 2b fixture's 1 GiB embedding)."""
        exp_name, exp_dtype, exp_shape = self.plan[self._next]
        if name != exp_name or dtype != exp_dtype or tuple(shape) != tuple(exp_shape):
            raise ValueError(f"{self.path.name}: expected {exp_name} {exp_dtype} {list(exp_shape)} next, got {name} {dtype} {list(shape)}")
        want_rows = exp_shape[0] if len(exp_shape) else 1  # a scalar is one block of one "row"
        rows = 0
        for block in blocks:
            if block.dtype != exp_dtype or (block.dim() == 0) != (len(exp_shape) == 0) or tuple(block.shape[1:]) != tuple(exp_shape[1:]):
                raise ValueError(f"{self.path.name}: {name}: block {block.dtype} {list(block.shape)} does not fit {exp_dtype} {list(exp_shape)}")
            rows += block.shape[0] if block.dim() else 1
            if rows > want_rows:  # before writing: a surplus row would shift every later tensor
                raise ValueError(f"{self.path.name}: {name}: blocks hold more than the {want_rows} rows planned")
            t = block.detach().to("cpu").contiguous()
            if t.numel():
                self._emit(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        if rows != want_rows:
            raise ValueError(f"{self.path.name}: {name}: blocks hold {rows} rows, expected {want_rows}")
        self._next += 1

    def close(self) -> tuple[str, int]:
        if self._next != len(self.plan):
            missing = [n for n, _, _ in self.plan[self._next :]]
            self._f.close()
            raise ValueError(f"{self.path.name}: {len(missing)} planned tensors were not written, first {missing[0]}")
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        return self._hash.hexdigest(), self._size

    def abort(self) -> None:
        """Close without flushing errors: the caller is already handling a failure (e.g. a full disk)."""
        if not self._f.closed:
            try:
                self._f.close()
            except OSError:
                pass


def write_file(path, tensors: dict[str, torch.Tensor], metadata=None) -> tuple[str, int]:
    """Write a small dict of tensors (sorted by name); returns (sha256, size)."""
    names = sorted(tensors)
    w = StreamingWriter(path, [(n, tensors[n].dtype, tuple(tensors[n].shape)) for n in names], metadata)
    try:
        for n in names:
            w.write(n, tensors[n])
    except BaseException:
        w.abort()
        raise
    return w.close()


# Exponent field of each float format: all ones means inf or NaN.
_EXPONENT_MASKS = {torch.bfloat16: (torch.int16, 0x7F80), torch.float16: (torch.int16, 0x7C00), torch.float32: (torch.int32, 0x7F800000)}


def all_finite(t: torch.Tensor, chunk: int = 1 << 24) -> bool:
    """True when no element is NaN or infinite.

    Checked on the exponent bits in slices, so temporaries stay small and it runs at integer
    speed (torch.isfinite on a 1 GB bf16 tensor allocates several GB and takes seconds on a CPU).
    """
    if not t.is_floating_point():
        return True
    flat = t.reshape(-1)
    if flat.dtype not in _EXPONENT_MASKS:
        return bool(torch.isfinite(flat).all())
    int_dtype, mask = _EXPONENT_MASKS[flat.dtype]
    bits = flat.view(int_dtype)
    for start in range(0, bits.numel(), chunk):
        part = bits[start : start + chunk]
        if bool(((part & mask) == mask).any()):
            return False
    return True


def sha256_file(path: str | os.PathLike, chunk: int = 8 * 1024 * 1024, on_bytes=None) -> str:
    """Hex SHA-256 of a file, read in chunks; on_bytes(n) is called after each chunk (progress)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk)
            if not block:
                break
            h.update(block)
            if on_bytes is not None:
                on_bytes(len(block))
    return h.hexdigest()
