"""The prefix cache's hit rates per tier and its lower tiers' traffic (metrics.json keys).

``cache.hit_rate.<gpu|cpu|disk|miss>``: shares of the prompt tokens looked up in the
prefix cache (``cache.prefix_query_tokens``), by where they were found: on the device
(any request's blocks, a request's own after a recompute preemption included), loaded
from the CPU tier, loaded from the disk tier, or not found (computed). The four sum to 1.
``cache.prefix_hit_rate`` (other requests' blocks only, any tier) and
``cache.self_hit_tokens`` (a request's own, any tier) split the same hits the other way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from harness.kv.base import KVManager, KVStats
from harness.kv.tiers import LowerTiers
from harness.metrics.collector import StepRow
from harness.metrics.requestlog import RequestLog

SOURCES = ("none", "gpu", "cpu", "disk")


def hit_rates(kv: KVManager, tiers: LowerTiers | None) -> dict[str, float]:
    """``cache.hit_rate.*`` (empty when nothing was looked up: prefix caching off)."""
    return hit_rates_of(kv.stats, tiers.stats.hit_tokens if tiers is not None else [0, 0])


def hit_rates_of(st: KVStats, below: Sequence[int]) -> dict[str, float]:
    """``cache.hit_rate.*`` from the manager's counters and the prompt tokens found in
    each lower tier (cpu, disk): one stack's, or a cluster's summed."""
    q = st.prefix_query_tokens
    if not q:
        return {}
    found = st.prefix_hit_tokens + st.self_hit_tokens
    out = {"cache.hit_rate.gpu": (found - sum(below)) / q,
           "cache.hit_rate.cpu": below[0] / q, "cache.hit_rate.disk": below[1] / q}
    out["cache.hit_rate.miss"] = 1.0 - sum(out.values())
    return out


def tier_metrics(tiers: LowerTiers, steps: Sequence[StepRow], block_bytes: int,
                 transfer_s: float, exposed_s: float) -> dict[str, Any]:
    """Capacity, traffic and time of each lower tier (``cache.tier.*``): ``transfer_s``
    the seconds its transfers took, ``exposed_s`` those the steps paid (overlapped
    transfers show only where they outlast a step's own work)."""
    s = tiers.stats
    m: dict[str, Any] = {}
    for i, t in enumerate(tiers.tiers):
        name = t.name
        col = "cpu_tier_blocks" if name == "cpu" else "disk_tier_blocks"
        m.update({
            f"cache.tier.{name}.capacity_blocks": t.num_blocks,
            f"cache.tier.{name}.capacity_bytes": t.num_blocks * block_bytes,
            f"cache.tier.{name}.peak_blocks": max((getattr(r, col) for r in steps),
                                                  default=0),
            f"cache.tier.{name}.blocks_down": s.blocks_down[i],
            f"cache.tier.{name}.blocks_up": s.blocks_up[i],
            f"cache.tier.{name}.bytes_down": s.blocks_down[i] * block_bytes,
            f"cache.tier.{name}.bytes_up": s.blocks_up[i] * block_bytes,
        })
    m["cache.tier.dropped_blocks"] = s.dropped_blocks
    if len(tiers.tiers) > 1:  # the disk tier's faults, each block dropped (executor=model)
        m["cache.tier.disk.write_failures"] = s.disk_write_failures
        m["cache.tier.disk.damaged_blocks"] = s.disk_damaged
    m["cache.tier.transfer_s"] = transfer_s
    m["cache.tier.exposed_s"] = exposed_s
    return m


def ttft_by_source(rows: RequestLog) -> dict[str, Any]:
    """TTFT percentiles of finished requests, split by where their prefix came from
    (requests.csv's ``prefix_source``), and how many requests each holds."""
    m: dict[str, Any] = {}
    done = rows.matches("status", "finished")
    ttft = rows.values("ttft_ms")
    for src in SOURCES:
        xs = ttft[done & rows.matches("prefix_source", src) & ~np.isnan(ttft)]
        m[f"requests.by_source.{src}"] = len(xs)
        if len(xs):
            m[f"latency.ttft_ms.by_source.{src}.p50"] = float(np.percentile(xs, 50))
            m[f"latency.ttft_ms.by_source.{src}.p99"] = float(np.percentile(xs, 99))
    return m
