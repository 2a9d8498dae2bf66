"""Byte units and how a byte count reads in a line of text (light: no MLX, no session)."""

from __future__ import annotations

GIB = 1 << 30
MIB = 1 << 20
_UNITS = (("GiB", GIB), ("MiB", MIB), ("KiB", 1 << 10))


def bytes_text(nbytes: float) -> str:
    """Bytes with two decimals in the largest unit of which they are at least one: a tiny
    budget reads "1.50 MiB", not "0.00 GiB", and 11 MB "10.49 MiB", not "0.01 GiB"."""
    for unit, size in _UNITS:
        if abs(nbytes) >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{nbytes:g} bytes"
