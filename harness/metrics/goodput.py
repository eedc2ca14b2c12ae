"""Goodput under service-level objectives (DistServe, Zhong et al., OSDI'24).

A request *meets the SLOs* when it finished and every target that is set holds: TTFT
(arrival to first token) <= ``slo.ttft_ms``, TPOT (its mean gap between tokens) <=
``slo.tpot_ms``, end-to-end latency <= ``slo.e2e_ms``, and, with quality on and
``slo.min_agreement`` set, its generation agreement with the exact reference (generated
tokens equal before the first difference, as a share of its output) >= that floor.

- ``latency.goodput_rps``: requests meeting the SLOs per second of the run's wall time
  (vLLM's ``--goodput``, after DistServe);
- ``latency.slo_attainment``: their share of every request that arrived (a rejected or
  unfinished request misses);
- ``requests.meeting_slo``: their count; requests.csv gets ``meets_slo`` per request.

Only runs with at least one target report them. A request with a single output token has
no gap between tokens: it meets any TPOT target.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from harness.errors import UserError
from harness.metrics.requestlog import RequestLog


@dataclass
class SLOConfig:
    """The ``slo`` config section (its Hydra schema): targets, each unset by default."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None
    min_agreement: float | None = None  # share in [0, 1]; needs quality.enabled=true

    def __post_init__(self) -> None:
        for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
            v = getattr(self, key)
            if v is not None and not v > 0:
                raise UserError(f"slo.{key}={v} must be > 0 (milliseconds), or null for none")
        if self.e2e_ms is not None and self.ttft_ms is not None \
                and self.e2e_ms < self.ttft_ms:
            # A request's end-to-end time includes its first token's: no request could
            # meet both (issue #55: accepted, and every request then missed).
            raise UserError(f"slo.e2e_ms={self.e2e_ms} is below slo.ttft_ms={self.ttft_ms}: "
                            "end to end includes the first token; raise slo.e2e_ms or lower "
                            "slo.ttft_ms")
        if self.min_agreement is not None and not 0 <= self.min_agreement <= 1:
            raise UserError(f"slo.min_agreement={self.min_agreement} is a share of a "
                            "request's output: it must be in [0, 1]")

    @property
    def any(self) -> bool:
        """At least one target is set."""
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2e_ms,
                                           self.min_agreement))


def _within(value: float | None, target: float | None) -> bool:
    return target is None or value is None or value <= target


def meets(row: dict[str, Any], slo: SLOConfig) -> bool:
    """Whether one requests.csv row meets every target that is set."""
    if row["status"] != "finished":
        return False
    if row["ttft_ms"] is None or not _within(row["ttft_ms"], slo.ttft_ms):
        return False
    if not (_within(row["tpot_ms"], slo.tpot_ms) and _within(row["e2e_ms"], slo.e2e_ms)):
        return False
    if slo.min_agreement is not None:
        agree = row.get("agree_tokens")
        if agree is None:  # never compared with the reference: cannot be shown to meet it
            return False
        out = row["output_tokens"]
        if out and agree / out < slo.min_agreement:
            return False
    return True


def slo_metrics(rows: RequestLog | list[dict[str, Any]], slo: SLOConfig,
                wall_s: float) -> dict[str, Any]:
    """The goodput keys for ``rows`` (requests.csv rows, with ``agree_tokens`` when the
    quality floor is set); marks each row's ``meets_slo`` (a run's RequestLog gets the
    column). Empty when no target is set."""
    if not slo.any:
        return {}
    ok = [meets(r, slo) for r in rows]
    if isinstance(rows, RequestLog):
        rows.add_column("meets_slo", ok)
    else:
        for r, v in zip(rows, ok, strict=True):
            r["meets_slo"] = v
    met = sum(ok)
    return {
        "latency.goodput_rps": met / wall_s if wall_s > 0 else 0.0,
        "latency.slo_attainment": met / len(rows) if rows else None,  # none: no figure
        "requests.meeting_slo": met,
    }


def check_slo(slo: SLOConfig, quality_enabled: bool, generation_agreement: bool) -> None:
    """A quality floor needs the generation agreement it is measured by."""
    if slo.min_agreement is not None and not (quality_enabled and generation_agreement):
        raise UserError("slo.min_agreement needs quality.enabled=true and "
                        "quality.generation_agreement=true (agreement is measured against "
                        "the reference); set them, or drop slo.min_agreement")


def peak_concurrency(arrivals: Sequence[float] | np.ndarray,
                     finishes: Sequence[float] | np.ndarray) -> int:
    """Most requests in flight at once, given each one's arrival and finish time. A
    request that finishes at the instant another arrives is not counted with it."""
    t = np.concatenate([np.asarray(arrivals, dtype=np.float64),
                        np.asarray(finishes, dtype=np.float64)])
    d = np.concatenate([np.ones(len(arrivals), dtype=np.int64),
                        -np.ones(len(finishes), dtype=np.int64)])
    order = np.lexsort((d, t))  # by time; at equal times -1 before +1: finishes first
    return max(0, int(np.cumsum(d[order]).max())) if len(t) else 0
