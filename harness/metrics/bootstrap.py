"""Seeded bootstrap 95% intervals, so two backends whose intervals overlap are not called
different on the strength of a few samples.

Percentile bootstrap: resample the observations with replacement ``resamples`` times,
take the statistic of each resample, report the 2.5th and 97.5th percentiles. With
``block`` > 1 whole runs of ``block`` consecutive observations are resampled together (a
moving-block bootstrap): per-token losses of one text are correlated, and resampling
them one by one would give intervals that are too narrow.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

Stat = Callable[[np.ndarray], float]


def _mean(x: np.ndarray) -> float:
    return float(np.mean(x))


def bootstrap_ci(values: Sequence[float] | np.ndarray, stat: Stat | None = None, *,
                 resamples: int = 1000, seed: int = 0, level: float = 0.95,
                 block: int = 1) -> tuple[float, float]:
    """(low, high) of the ``level`` percentile interval of ``stat`` (default: the mean).

    ``values`` may be 2-D (rows are observations: paired columns resampled together, e.g.
    a backend's and the reference's loss on the same token); ``stat`` then gets the
    resampled rows. One observation, or none, gives a zero-width interval at the
    statistic (nan for none)."""
    x = np.asarray(values, dtype=float)
    f = stat or _mean
    n = len(x)
    if n == 0:
        return float("nan"), float("nan")
    point = f(x)
    if n == 1:
        return point, point
    rng = np.random.default_rng(seed)
    b = max(1, min(block, n))
    starts_max = n - b + 1
    per = -(-n // b)  # blocks per resample (ceil), trimmed to n observations
    stats = np.empty(resamples)
    for i in range(resamples):
        starts = rng.integers(0, starts_max, size=per)
        idx = (starts[:, None] + np.arange(b)[None, :]).ravel()[:n]
        stats[i] = f(x[idx])
    alpha = (1.0 - level) / 2.0
    low, high = np.quantile(stats, [alpha, 1.0 - alpha])
    return float(low), float(high)


def ci_keys(prefix: str, values: Sequence[float] | np.ndarray, stat: Stat | None = None,
            *, seed: int = 0, block: int = 1) -> dict[str, float]:
    """``{prefix}_ci95_low`` / ``{prefix}_ci95_high`` for metrics.json."""
    low, high = bootstrap_ci(values, stat, seed=seed, block=block)
    return {f"{prefix}_ci95_low": low, f"{prefix}_ci95_high": high}
