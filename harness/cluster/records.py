"""A cluster run's records and metrics: the replicas' requests and steps as one run's
(requests.csv in arrival order, steps.csv in time order, each row with its ``replica``),
the run's usual metrics over all of them, and per replica and cluster keys.

Cluster-wide figures sum the replicas: the ledger's slot-steps (memory waste), the prefix
cache's counters (hit rate), the KV budget and token capacity; latency percentiles are
over every request; ``memory.peak_*_bytes`` and ``memory.max_running_seqs`` are the
largest sums over the replicas at any moment (each replica's value held between its
steps). Per replica (``replica.<i>.*``): requests routed, hit rate, TTFT / TPOT
percentiles, goodput under the run's SLOs (:func:`replica_goodput`), mean running
sequences. ``cluster.*``: load
imbalance (max over mean of the replicas' time-averaged running sequences: 1 is even)
and the same for requests routed.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import numpy as np

from harness.cluster.driver import Replica
from harness.kv.base import KVStats
from harness.kv.ledger import LedgerTotals
from harness.metrics.requestlog import RequestLog
from harness.metrics.rows import StepRow
from harness.metrics.steplog import StepLog
from harness.metrics.summary import Records, column, records_of, summarize
from harness.metrics.tiers import hit_rates_of

# What each replica reports of its own summary, under replica.<i>.
REPLICA_KEYS = ("cache.prefix_hit_rate", "latency.ttft_ms.p50", "latency.ttft_ms.p99",
                "latency.tpot_ms.p50", "latency.tpot_ms.p99", "requests.finished",
                "requests.rejected", "throughput.output_tokens_per_s", "memory.waste_pct",
                "sched.preemptions_recompute", "sched.steps", "cache.blocks_saved_by_sharing")


class ClusterView(Protocol):
    """What the records read of a cluster (colocated or disaggregated)."""

    @property
    def replicas(self) -> Sequence[Replica]: ...

    @property
    def routes(self) -> list[tuple[int, int]]:
        """(replica, row in its request log) per request, in arrival order."""
        ...


def _sum_fields(objs: Sequence[Any], cls: Any) -> Any:
    """A dataclass of ``cls`` whose every field is the sum of ``objs``' (counters)."""
    out = cls()
    for f in dataclasses.fields(cls):
        setattr(out, f.name, sum(getattr(o, f.name) for o in objs))
    return out


def merged_steps(cluster: ClusterView) -> tuple[StepLog, list[int]]:
    """Every replica's steps in the order they ended (time, then replica), and the
    replica of each."""
    def rows(i: int, log: Sequence[StepRow]) -> Iterator[tuple[float, int, int, StepRow]]:
        for k, row in enumerate(log):
            yield row.time_s, i, k, row

    out, which = StepLog(), []
    logs = [r.stack.collector.steps for r in cluster.replicas]
    for _, i, _, row in heapq.merge(*(rows(i, log) for i, log in enumerate(logs))):
        out.append(row)
        which.append(i)
    return out, which


def merged_rows(cluster: ClusterView, parts: Sequence[RequestLog], outputs: bool) -> RequestLog:
    """The replicas' request rows in the order the requests arrived, with ``replica``."""
    out = RequestLog(outputs)
    for i, k in cluster.routes:
        out.fill(out.reserve(), parts[i].row(k))
    out.add_column("replica", [i for i, _ in cluster.routes])
    return out


def cluster_peak(values: np.ndarray, which: np.ndarray, n: int) -> Any:
    """The largest sum over replicas of a per-step value, each replica's held from one of
    its steps to its next (``values`` and ``which`` in merged step order)."""
    if not len(values):
        return 0
    delta = np.zeros(len(values), dtype=values.dtype)
    for i in range(n):
        m = which == i
        delta[m] = np.diff(values[m], prepend=values.dtype.type(0))
    return np.cumsum(delta).max().item()


# The prefix cache's counters of a prompt's lookup (a disaggregated cluster takes them
# from the prefill pool alone: the decode side's lookups are the handoff's bookkeeping).
PROMPT_STATS = ("prefix_query_tokens", "prefix_hit_tokens", "self_hit_tokens",
                "regret_blocks", "regret_tokens")


def summarize_cluster(
        cluster: ClusterView, run_info: dict[str, Any], sizes: Sequence[tuple[int, int]],
        wall_s: float, outputs: bool, rows: RequestLog | None = None,
        prompt_replicas: Sequence[int] | None = None,
        request_replicas: Sequence[int] | None = None,
) -> tuple[dict[str, Any], RequestLog, StepLog, list[int]]:
    """metrics.json's keys for the cluster, the merged request rows and steps, and each
    step's replica. ``sizes``: each replica's KV budget bytes and token capacity.
    A disaggregated cluster gives its own ``rows`` (one per request, merged from both
    sides), the replicas whose prefix lookups are the prompts' (``prompt_replicas``: the
    prefill pool) and those whose finished requests are the run's (``request_replicas``:
    the decode pool); None: every replica."""
    reps = cluster.replicas
    n = len(reps)
    parts = [records_of(r.stack.collector) for r in reps]
    if rows is None:
        rows = merged_rows(cluster, [p.rows for p in parts], outputs)
    steps, which = merged_steps(cluster)
    itl_v = np.concatenate([p.itl[0] for p in parts])
    itl_n = np.concatenate([p.itl[1] for p in parts])
    stats = _sum_fields([p.stats for p in parts], KVStats)
    prompt = range(n) if prompt_replicas is None else prompt_replicas
    for f in PROMPT_STATS:
        setattr(stats, f, sum(getattr(parts[i].stats, f) for i in prompt))
    ends = [parts[i] for i in (range(n) if request_replicas is None else request_replicas)]
    merged = Records(
        rows, steps, (itl_v, itl_n), _sum_fields([p.ledger for p in parts], LedgerTotals),
        stats, sum(p.preemptions_recompute for p in parts),
        sum(p.preemptions_swap for p in parts), sum(p.recomputed_tokens for p in parts),
        np.concatenate([np.asarray(p.span_start, dtype=np.float64) for p in ends]),
        np.concatenate([np.asarray(p.span_end, dtype=np.float64) for p in ends]),
        parts[0].block_size, parts[0].bytes_per_slot)
    m = summarize(merged, run_info, sum(b for b, _ in sizes), sum(c for _, c in sizes), wall_s)
    w = np.asarray(which, dtype=np.int64)
    for key, col in (("memory.peak_reserved_bytes", "reserved_bytes"),
                     ("memory.peak_used_bytes", "used_bytes"),
                     ("memory.max_running_seqs", "running")):
        m[key] = cluster_peak(column(steps, col), w, n)
    # Blocks saved by sharing, the cluster's as the memory keys are: its peak the largest
    # sum over replicas at one moment, its mean the sum of the replicas' means (a mean
    # over the merged steps was one replica's on average: it halved as replicas doubled
    # while sharing_saved_pct, a ratio of totals, held; issue #55).
    saved = column(steps, "logical_blocks") - column(steps, "held_blocks")
    m["cache.blocks_saved_by_sharing_peak"] = cluster_peak(saved, w, n)
    m["cache.blocks_saved_by_sharing"] = float(sum(
        saved[w == i].mean() for i in range(n) if (w == i).any()))
    below = [0, 0]
    for r in (reps[i] for i in prompt):
        if r.stack.tiers is not None:
            below = [a + b for a, b in zip(below, r.stack.tiers.stats.hit_tokens)]
    m.update(hit_rates_of(stats, below))

    # Per replica, and how evenly the load fell.
    running_mean = []
    for i, (r, p) in enumerate(zip(reps, parts)):
        own = summarize(p, {}, *sizes[i], wall_s)
        m.update({f"replica.{i}.{k}": own[k] for k in REPLICA_KEYS})
        m[f"replica.{i}.requests_routed"] = r.routed
        busy = column(p.steps, "running") * column(p.steps, "step_ms") / 1e3
        running_mean.append(float(busy.sum()) / wall_s if wall_s else 0.0)
        m[f"replica.{i}.running_mean"] = running_mean[-1]
    routed = [r.routed for r in reps]
    mean_run, mean_routed = float(np.mean(running_mean)), float(np.mean(routed))
    m["cluster.replicas"] = n
    m["cluster.load_imbalance"] = max(running_mean) / mean_run if mean_run else 1.0
    m["cluster.routed_imbalance"] = max(routed) / mean_routed if mean_routed else 1.0
    return m, rows, steps, which


def replica_goodput(rows: RequestLog, n: int, wall_s: float) -> dict[str, Any]:
    """``replica.<i>.latency.goodput_rps`` and ``.slo_attainment`` from the merged rows'
    ``meets_slo`` (harness.metrics.goodput, after the quality floor's agreement); empty
    when no SLO is set."""
    if "meets_slo" not in rows.columns():
        return {}
    ok = np.array(rows.column("meets_slo"), dtype=bool)
    rep = np.array(rows.column("replica"), dtype=np.int64)
    m: dict[str, Any] = {}
    for i in range(n):
        mine = rep == i
        met = int(ok[mine].sum())
        # A replica the router sent nothing: no figure (null, as its latencies), not a 0
        # that reads as every request missing its target.
        idle = not mine.any()
        m[f"replica.{i}.latency.goodput_rps"] = None if idle else \
            met / wall_s if wall_s > 0 else 0.0
        m[f"replica.{i}.latency.slo_attainment"] = None if idle else met / int(mine.sum())
    return m
