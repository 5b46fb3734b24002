"""Byte sizes as people read them: the one formatter every layer and command prints with."""

from __future__ import annotations

__all__ = ["MIB", "format_bytes"]

#: Bytes in a mebibyte, the unit of every table and figure memfit writes.
MIB = 2**20


def format_bytes(n: float, *, sign: bool = False) -> str:
    """``n`` bytes in binary units (``"1.50 MiB"``), as allocator statistics are usually read.

    ``sign=True`` prefixes ``+`` to non-negative values (a change in memory, such as ``end_bytes``).
    """
    prefix = "-" if n < 0 else ("+" if sign else "")
    value = abs(float(n))
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{prefix}{value:.0f} {unit}" if unit == "B" else f"{prefix}{value:.2f} {unit}"
        value /= 1024
    return f"{prefix}{value:.2f} TiB"
