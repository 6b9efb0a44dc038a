"""Parsing and printing of human sizes ("300MiB") at the API edges; inside, everything is bytes."""

from __future__ import annotations

import re

__all__ = ["parse_bytes", "format_bytes"]

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": 1024**3, "gib": 1024**3,
    "ti": 1024**4, "tib": 1024**4,
}
_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | float | str) -> int:
    """Turn ``300MiB``, ``"1.5 GB"``, ``4096`` into a whole number of bytes.

    Args:
        value: an int/float of bytes, or a string with an SI (kB, MB, GB) or IEC (KiB, MiB, GiB) unit.

    Returns:
        The size in bytes (rounded down).

    Raises:
        ValueError: the value is negative, not finite, or its unit is unknown.
    """
    if isinstance(value, bool):
        raise ValueError(f"size must be a number of bytes or a string like '300MiB', got {value!r}")
    if isinstance(value, (int, float)):
        if not value >= 0 or value == float("inf"):
            raise ValueError(f"size must be a finite, non-negative number of bytes, got {value!r}")
        return int(value)
    if isinstance(value, str):
        m = _RE.match(value)
        if m is None or m.group(2).lower() not in _UNITS:
            raise ValueError(
                f"cannot read size {value!r}: write a number with an optional unit, "
                "e.g. '300MiB', '1.5GB', '65536'")
        return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    raise ValueError(f"size must be a number of bytes or a string like '300MiB', got {type(value).__name__}")


def format_bytes(n: float) -> str:
    """Print a byte count with an IEC unit, e.g. ``format_bytes(3 * 2**20) == '3.0 MiB'``."""
    sign = "-" if n < 0 else ""
    n = abs(float(n))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
