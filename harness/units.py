"""Parsing sizes like ``64MiB`` (the way users write KV budgets)."""

from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6,
          "mib": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12,
          "tib": 2**40}


def parse_bytes(value: int | float | str) -> int:
    """``64MiB`` -> 67108864; plain numbers are bytes. Raises ValueError with the forms."""
    if isinstance(value, int | float):
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", value)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {value!r} as a size; write e.g. 67108864, 64MiB, "
                         "1.5GiB or 512KB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.2f}{unit}"
        n /= 1024
    return f"{n:.2f}GiB"
