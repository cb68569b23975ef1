"""Parsing and printing of byte sizes, bandwidths and times, shared by tables, CLI and errors."""

from __future__ import annotations

import math
import numbers
import re
from typing import Any

from mobius_fx.errors import MobiusError

__all__ = ["parse_bytes", "parse_bandwidth", "parse_network", "check_positive", "fmt_bytes", "fmt_time"]

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_AMOUNT = re.compile(r"\s*([+-]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)(/s)?\s*")


def parse_bytes(value: int | float | str, what: str = "size") -> int:
    """`256MiB`, `24GB`, `1.5 GiB` or a plain number of bytes -> int bytes (finite, >= 0).

    `what` names the value in the error message, e.g. "nodes[2] (gpu0): memory".

    >>> parse_bytes("256MiB")
    268435456
    """
    n = _amount(value, what, per_second=False)
    if n < 0:
        raise MobiusError(f"{what} {value!r} is negative; a size is a number of bytes, e.g. 2**30 or '24GiB'")
    return int(value) if isinstance(value, numbers.Integral) else int(n)  # a big int stays exact


def parse_bandwidth(value: int | float | str, what: str = "bandwidth") -> float:
    """Bytes/s (positive, finite) from a number of bytes/s or a string with a unit of
    `parse_bytes` and an optional "/s": `16e9`, `'16GB/s'` and `'16GB'` are all 16 * 10**9
    bytes/s, `'12.5GiB/s'` is 12.5 * 2**30.

    >>> parse_bandwidth("16GB/s")
    16000000000.0
    """
    x = _amount(value, what, per_second=True)
    if x <= 0:
        raise MobiusError(f"{what} {value!r} is not positive; give bytes/s > 0, e.g. 16e9 or '16GB/s'")
    return x


_PREFIX = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
           "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
_RATE = re.compile(r"\s*([+-]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMgGtT]i?)?"
                   r"(bits?|bytes?|b|B)(ps|PS|/s|/sec)?\s*", re.IGNORECASE)
_NETWORK_RULE = ("a number and a unit of bits or bytes per second: a lowercase b or 'bit' is bits, an uppercase B "
                 "or 'byte' is bytes; k, M, G, T are powers of 1000 (Ki, Mi, Gi, Ti of 1024). E.g. '100Gbps' or "
                 "'100Gbit/s' (100 gigabits/s = 12.5 GB/s), '25Gbit/s', '12.5GB/s'")


def parse_network(value: int | float | str, what: str = "network") -> float:
    """A network link's bandwidth in bytes/s (positive, finite), from a number of bytes/s or a
    string that says bits or bytes: `'100Gbps'`, `'100Gb/s'`, `'25Gbit/s'` are gigabits per
    second (/ 8 for bytes), `'12.5GB/s'`, `'12.5GBps'`, `'1.2GiB/s'` bytes. A string without a
    unit, or one that does not say bits or bytes ("100G"), is refused: NICs are sold in bits
    per second, memory in bytes, and the two differ by 8.

    >>> parse_network("100Gbps"), parse_network("12.5GB/s"), parse_network("25Gbit/s")
    (12500000000.0, 12500000000.0, 3125000000.0)
    """
    if isinstance(value, str):
        m = _RATE.fullmatch(value)
        unit = m.group(3) if m else ""
        if m and unit.lower() in ("bit", "bits", "byte", "bytes") or unit in ("b", "B"):
            bits = unit.lower().startswith("bit") or unit == "b"
            if unit == "B" and m.group(4) == "PS":  # "GBPS": all capitals, bits or bytes?
                raise MobiusError(f"{what} {value!r} is ambiguous (all capitals: bits or bytes?); give {_NETWORK_RULE}")
            x = float(m.group(1)) * _PREFIX[(m.group(2) or "").lower()] / (8 if bits else 1)
        else:
            hint = ""
            if re.fullmatch(r"\s*[+-]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?\s*([kKmMgGtT]i?)?\s*", value):
                hint = " (no unit, or no bits or bytes: 100 Gbit/s is 12.5 GB/s, 8x apart)"
            raise MobiusError(f"{what} {value!r} is not a network bandwidth{hint}; give {_NETWORK_RULE}")
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        x = _finite(value)
        if x is None:
            raise MobiusError(f"{what} {value!r} is not finite; give a finite number of bytes/s or {_NETWORK_RULE}")
    else:
        raise MobiusError(f"{what} {value!r} (type {type(value).__name__}) is not a network bandwidth; give a number "
                          f"of bytes/s or {_NETWORK_RULE}")
    if not math.isfinite(x) or x <= 0:
        raise MobiusError(f"{what} {value!r} is not a positive, finite bandwidth; give {_NETWORK_RULE}")
    return x


def check_positive(value: Any, what: str, remedy: str, error: type[MobiusError] = MobiusError) -> float:
    """`value` as a float when it is a positive, finite real number (a bool is not one); else
    `error` saying `what` is `value`, the rule, and `remedy` (what to give instead)."""
    x = _finite(value)
    if x is None or x <= 0:
        raise error(f"{what} is {value!r}{_type_note(value)}; it must be a positive, finite number; {remedy}")
    return x


def _amount(value: Any, what: str, *, per_second: bool) -> float:
    """A real number, or a string of a number and a byte unit (and "/s" when `per_second`), as a finite float."""
    unit = "bytes/s" if per_second else "bytes"
    examples = "16e9, '16GB/s' or '12.5GiB/s'" if per_second else "2**30, '256MiB', '24GiB' or '16GB'"
    m = _AMOUNT.fullmatch(value) if isinstance(value, str) else None
    if m and m.group(2).lower() in _UNITS and (per_second or not m.group(3)):
        x: float | None = float(m.group(1)) * _UNITS[m.group(2).lower()]
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        x = _finite(value)
    else:
        note = "" if isinstance(value, str) else _type_note(value)
        raise MobiusError(f"{what} {value!r}{note} is not a number of {unit}; give a number or a "
                          f"number with a unit, e.g. {examples}")
    if x is None or not math.isfinite(x):
        raise MobiusError(f"{what} {value!r} is not finite (infinite, NaN or beyond the float range); "
                          f"give a finite number of {unit}, e.g. {examples}")
    return x


def _finite(value: Any) -> float | None:
    """`value` as a finite float when it is a real number and not a bool; else None."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        x = float(value)
    except OverflowError:  # an int beyond the float range
        return None
    return x if math.isfinite(x) else None


def _type_note(value: Any) -> str:
    real = isinstance(value, numbers.Real) and not isinstance(value, bool)
    return "" if real else f" (type {type(value).__name__})"


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
