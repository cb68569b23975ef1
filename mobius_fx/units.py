"""Parsing and printing of byte sizes and times, shared by tables, CLI and errors."""

from __future__ import annotations

import re

from .errors import MobiusError

__all__ = ["parse_bytes", "fmt_bytes", "fmt_time"]

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}


def parse_bytes(value: int | float | str) -> int:
    """`256MiB`, `24GB`, `1.5 GiB` or a plain number of bytes -> int bytes.

    >>> parse_bytes("256MiB")
    268435456
    """
    if isinstance(value, bool):
        raise MobiusError(f"memory size {value!r} is a bool; give bytes as an int or a string like '24GiB'")
    if isinstance(value, (int, float)):
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise MobiusError(
            f"cannot read the size {value!r}; write a number of bytes or a number with a unit "
            f"such as '256MiB', '24GiB' or '16GB'"
        )
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def fmt_bytes(n: float) -> str:
    """Bytes in the unit a person reads: `1.50 GiB`, `12.0 MiB`, `512 B`."""
    n = float(n)
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def fmt_time(seconds: float) -> str:
    """Seconds as `1.23 s`, `45.6 ms` or `78 us`."""
    s = float(seconds)
    if abs(s) >= 1.0:
        return f"{s:.2f} s"
    if abs(s) >= 1e-3:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e6:.0f} us"
