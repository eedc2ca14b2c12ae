"""Range checks for option dataclasses: a value outside its range is the user's mistake,
reported with the key, the value and the valid range (never silently accepted)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

from harness.errors import UserError


def one_of(obj: Any, prefix: str, name: str, choices: Iterable[str]) -> None:
    """``obj.<name>`` is one of ``choices``."""
    v, known = getattr(obj, name), list(choices)
    if v not in known:
        raise UserError(f"unknown {prefix}.{name} {v!r}; known: {', '.join(known)}")


def at_least(obj: Any, prefix: str, minimum: float, *names: str) -> None:
    """Every ``obj.<name>`` is >= ``minimum``."""
    for n in names:
        v = getattr(obj, n)
        if v < minimum:
            raise UserError(f"{prefix}.{n}={v} is out of range: it must be >= {minimum}")


def in_range(obj: Any, prefix: str, name: str, lo: float, hi: float, *,
             lo_open: bool = False) -> None:
    """``lo <= obj.<name> <= hi`` (``lo < ...`` with ``lo_open``)."""
    v = getattr(obj, name)
    ok = (lo < v if lo_open else lo <= v) and v <= hi
    if not ok:
        lo_s = f"({lo}" if lo_open else f"[{lo}"
        raise UserError(f"{prefix}.{name}={v} is out of range: it must be in {lo_s}, {hi}]")


def ordered(obj: Any, prefix: str, low: str, high: str) -> None:
    """``obj.<low> <= obj.<high>``."""
    a, b = getattr(obj, low), getattr(obj, high)
    if a > b:
        raise UserError(f"{prefix}.{low}={a} is larger than {prefix}.{high}={b}: the "
                        f"minimum must not exceed the maximum")


def finite_floats(obj: Any, prefix: str = "") -> None:
    """Every float option in dataclass ``obj`` (and in the dataclasses, lists and dicts
    inside it) is a finite number: NaN or infinity is refused with its key named. (A NaN
    bandwidth passed every ``== 0`` check and stalled a run; an infinite latency wrote
    ``Infinity`` into metrics.json, which is not JSON.)"""
    for f in dataclasses.fields(obj):
        _finite(getattr(obj, f.name), f"{prefix}{f.name}")


def _finite(v: Any, key: str) -> None:
    if isinstance(v, float) and not math.isfinite(v):
        raise UserError(f"{key}={v} is not a finite number: give a number (NaN and "
                        "infinity are refused)")
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        finite_floats(v, f"{key}.")
    elif isinstance(v, list | tuple):
        for i, x in enumerate(v):
            _finite(x, f"{key}[{i}]")
    elif isinstance(v, dict):
        for k, x in v.items():
            _finite(x, f"{key}.{k}")
