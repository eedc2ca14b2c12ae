"""Arrival processes and think times: when the requests of a synthetic workload arrive.

Every synthetic workload's config derives from :class:`ArrivalOptions`, so one set of
options (``rate``, ``arrival``, ``burstiness``) shapes the arrivals of all of them:

- ``all_at_once``: every request at t = 0 (also what any process gives at ``rate = 0``,
  as vLLM's ``--request-rate inf``);
- ``poisson``: exponential gaps of mean 1/rate;
- ``gamma``: gamma-distributed gaps with shape ``burstiness`` and scale
  1 / (rate * burstiness), vLLM's definition: the mean gap stays 1/rate, the coefficient
  of variation of the gaps is 1/sqrt(burstiness); burstiness 1 is Poisson, < 1 burstier
  (clumps of requests, then lulls), > 1 more regular;
- ``constant``: a gap of exactly 1/rate.

The first request arrives one gap after the start (not at 0), for every process.
Draws come from the workload's seeded ``random.Random``, so the same seed gives the
same times.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from harness.errors import UserError
from harness.validate import one_of
from harness.workloads.base import WorkloadOptions

ARRIVALS = ("poisson", "gamma", "constant", "all_at_once")
THINK_TIMES = ("constant", "exponential", "lognormal")


@dataclass
class ArrivalOptions(WorkloadOptions):
    """The arrival options every synthetic workload shares (the one place for their
    defaults): all at once unless a rate is given."""

    rate: float = 0.0  # requests per second; 0: all at once, whatever the process
    arrival: str = "poisson"  # poisson | gamma | constant | all_at_once
    burstiness: float = 1.0  # gamma's shape: 1 = Poisson, < 1 burstier, > 1 more regular

    def __post_init__(self) -> None:
        check_arrivals(self)


def check_arrivals(opts: ArrivalOptions) -> None:
    """The arrival options are valid, or a UserError saying which and why."""
    one_of(opts, "workload", "arrival", ARRIVALS)
    if not opts.burstiness > 0:
        raise UserError(f"workload.burstiness must be > 0 (1 = Poisson, < 1 burstier), "
                        f"got {opts.burstiness}")
    if not (math.isfinite(opts.rate) and opts.rate >= 0):
        raise UserError(f"workload.rate={opts.rate} is out of range: requests per second, "
                        ">= 0 and finite (0: all at once)")


def gap(rng: random.Random, arrival: str, rate: float, burstiness: float) -> float:
    """One inter-arrival gap in seconds (``rate`` > 0)."""
    if arrival == "poisson":
        return rng.expovariate(rate)
    if arrival == "gamma":
        return rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    if arrival == "constant":
        return 1.0 / rate
    raise ValueError(f"no gaps for arrival {arrival!r}")


def arrival_times(n: int, opts: ArrivalOptions, rng: random.Random) -> list[float]:
    """``n`` arrival times in seconds from the run's start, non-decreasing."""
    if opts.rate == 0 or opts.arrival == "all_at_once":
        return [0.0] * n
    t, out = 0.0, []
    for _ in range(n):
        t += gap(rng, opts.arrival, opts.rate, opts.burstiness)
        out.append(t)
    return out


def think_time(rng: random.Random, dist: str, mean_s: float, cv: float) -> float:
    """One think time in seconds: ``constant`` (exactly the mean), ``exponential`` (of that
    mean), or ``lognormal`` (that mean, coefficient of variation ``cv``: a long tail of
    users who read slowly or come back later)."""
    if mean_s <= 0:
        return 0.0
    if dist == "constant":
        return mean_s
    if dist == "exponential":
        return rng.expovariate(1.0 / mean_s)
    if dist == "lognormal":
        sigma2 = math.log(1 + cv * cv)
        return rng.lognormvariate(math.log(mean_s) - sigma2 / 2, math.sqrt(sigma2))
    raise UserError(f"unknown workload.think_time_dist {dist!r}; known: "
                    f"{', '.join(THINK_TIMES)}")
