"""The summary of one configuration's repeats: speed with its noise, the rest stated once.

Speed metrics (throughput, latency, goodput, the engine's step times: whatever the clock
decides) vary from repeat to repeat on a shared machine; each is summarized as the median
over the repeats with a seeded 95% bootstrap interval of that median (resampling whole
repeats). Every other metric (memory, cache hits, preemptions, quality with its own
intervals) is decided by the schedule and the tokens; it is stated once when the repeats
agree, and listed in ``varied`` (its median kept) when they do not: with arrivals at
fixed times on the wall clock, batching follows the machine's speed and such a metric may
legitimately vary; with every arrival at t=0 a difference is a non-determinism to report.

A ratio between two configurations is computed from paired repeats (repeat k of one with
repeat k of the other: a sweep interleaves them, so a pair ran close in time).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from harness.metrics.bootstrap import bootstrap_ci

# What the clock decides. ``requests.meeting_slo`` counts requests within latency targets.
SPEED_PREFIXES = ("throughput.", "latency.", "engine.")
SPEED_KEYS = frozenset({"requests.meeting_slo"})
# Keys that describe the run, not its result: they differ between repeats by design.
PER_REPEAT_KEYS = frozenset({"run.started_at"})
CI_LOW, CI_HIGH = "_ci95_low", "_ci95_high"


def is_speed(key: str) -> bool:
    """Whether ``key`` is decided by the clock (a speed metric) rather than the schedule."""
    return (key.startswith(SPEED_PREFIXES) and not key.endswith((CI_LOW, CI_HIGH))) \
        or key in SPEED_KEYS


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v)


def _median(x: np.ndarray) -> float:
    return float(np.median(x))


def median_ci(values: Sequence[float], seed: int = 0) -> tuple[float, float, float]:
    """(median, low, high): the median of ``values`` and its 95% percentile-bootstrap
    interval over whole repeats (one value: a zero-width interval)."""
    x = np.asarray(values, dtype=float)
    low, high = bootstrap_ci(x, _median, seed=seed)
    return float(np.median(x)), low, high


def _same(values: list[Any]) -> bool:
    first = values[0]
    nums = [_number(v) for v in values]
    if all(n is not None for n in nums):
        a = [n for n in nums if n is not None]
        if any(math.isnan(v) for v in a):
            return all(math.isnan(v) for v in a)
        return max(a) - min(a) <= 1e-9 * max(1.0, max(abs(v) for v in a))
    return all(v == first for v in values)


@dataclass
class RepeatSummary:
    """``metrics``: one metrics.json-like mapping (medians; ``<key>_ci95_low`` /
    ``_ci95_high`` beside every speed metric; ``repeats.n``); ``varied``: non-speed keys
    whose repeats disagree; ``repeats``: which repeat indices it summarizes."""

    metrics: dict[str, Any]
    varied: list[str] = field(default_factory=list)
    repeats: list[int] = field(default_factory=list)


def summarize_repeats(runs: Sequence[dict[str, Any]], indices: Sequence[int] | None = None,
                      seed: int = 0) -> RepeatSummary:
    """The summary of ``runs`` (each a finished repeat's metrics.json), in the order of
    ``indices`` (their repeat numbers; default 0..n-1). Keys missing from some repeat are
    left out (a run of another version); an empty list is a ValueError."""
    if not runs:
        raise ValueError("no finished repeat to summarize")
    idx = list(indices) if indices is not None else list(range(len(runs)))
    keys = [k for k in runs[0] if all(k in r for r in runs[1:])]
    out: dict[str, Any] = {}
    varied: list[str] = []
    for k in keys:
        values = [r[k] for r in runs]
        nums = [_number(v) for v in values]
        numeric = all(n is not None for n in nums)
        if is_speed(k) and numeric:
            med, low, high = median_ci([n for n in nums if n is not None], seed)
            out[k], out[k + CI_LOW], out[k + CI_HIGH] = med, low, high
            continue
        if k.endswith((CI_LOW, CI_HIGH)) and is_speed(k.rsplit("_ci95_", 1)[0]):
            continue  # a speed key's own interval: replaced by the repeats' one above
        if k in PER_REPEAT_KEYS or _same(values):
            out[k] = values[0]
            continue
        varied.append(k)
        out[k] = float(np.median([n for n in nums if n is not None])) if numeric \
            else values[0]
    out["repeats.n"] = len(runs)
    return RepeatSummary(out, varied, idx)


def paired_ratio(num: dict[int, float], den: dict[int, float],
                 seed: int = 0) -> tuple[float, float, float] | None:
    """(median, low, high) of ``num[k] / den[k]`` over the repeats ``k`` both have (a
    sweep ran each pair close in time); None when they share none or a denominator is 0."""
    pairs = sorted(set(num) & set(den))
    if not pairs or any(den[k] == 0 for k in pairs):
        return None
    return median_ci([num[k] / den[k] for k in pairs], seed)
