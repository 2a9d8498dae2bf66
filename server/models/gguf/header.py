"""The tensor table of a GGUF file (name -> GGML type), read from its header without loading data,
so unsupported tensor types are refused by name before MLX reads them (it would drop or silently
convert some)."""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

# GGML type ids (ggml.h) of the tensor types MLX reads into float or affine-quantized arrays.
SUPPORTED = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 8: "Q8_0"}
OTHER_NAMES = {6: "Q5_0", 7: "Q5_1", 9: "Q8_1", 10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K",
               14: "Q6_K", 15: "Q8_K", 30: "BF16"}
# GGUF metadata value types: fixed sizes by id (8 = string, 9 = array are read specially).
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
MAX_ARRAY_DEPTH = 8  # llama.cpp writes flat arrays; 2,000 levels would exhaust the stack


def type_name(type_id: int) -> str:
    return SUPPORTED.get(type_id) or OTHER_NAMES.get(type_id) or f"type {type_id}"


class _Cursor:
    """Reads little-endian values from a memory-mapped file (fast over 100k-string arrays)."""

    def __init__(self, buf: mmap.mmap):
        self.buf, self.pos = buf, 0

    def u(self, fmt: str) -> int:
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]  # struct.error when truncated
        self.pos += struct.calcsize(fmt)
        return value

    def skip(self, n: int) -> None:
        self.pos += n
        if self.pos > len(self.buf):
            raise ValueError("truncated GGUF header")

    def string(self) -> bytes:
        n = self.u("<Q")
        self.skip(n)
        return bytes(self.buf[self.pos - n: self.pos])


def _skip_value(c: _Cursor, vtype: int, depth: int = 0) -> None:
    if vtype == _STRING:
        c.skip(c.u("<Q"))
    elif vtype == _ARRAY:
        if depth >= MAX_ARRAY_DEPTH:
            raise ValueError(f"metadata arrays nested deeper than {MAX_ARRAY_DEPTH}")
        item, count = c.u("<I"), c.u("<Q")
        if item in _FIXED:
            c.skip(_FIXED[item] * count)
        else:
            for _ in range(count):
                _skip_value(c, item, depth + 1)
    elif vtype in _FIXED:
        c.skip(_FIXED[vtype])
    else:
        raise ValueError(f"unknown metadata value type {vtype}")


def tensor_types(path: Path) -> dict[str, int]:
    """Each tensor's GGML type id, in file order (ValueError on a malformed header)."""
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        try:
            return _read_types(_Cursor(buf))
        except struct.error:
            raise ValueError("truncated GGUF header") from None


def _read_types(c: _Cursor) -> dict[str, int]:
    if c.buf[:4] != b"GGUF":
        raise ValueError("no GGUF magic")
    c.skip(4)
    version = c.u("<I")
    if version < 2:
        raise ValueError(f"GGUF version {version} (needs >= 2)")
    n_tensors, n_kv = c.u("<Q"), c.u("<Q")
    for _ in range(n_kv):
        c.string()
        _skip_value(c, c.u("<I"))
    types = {}
    for _ in range(n_tensors):
        name = c.string().decode("utf-8", "replace")
        c.skip(8 * c.u("<I"))
        types[name] = c.u("<I")
        c.skip(8)  # data offset
    return types
