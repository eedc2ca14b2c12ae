"""DESIGN.md's metrics.json keys, computed from what the run recorded."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from harness.kv.base import KVStats
from harness.kv.ledger import LedgerTotals
from harness.metrics.collector import MetricsCollector, StepRow, request_row
from harness.metrics.goodput import peak_concurrency
from harness.metrics.requestlog import RequestLog
from harness.metrics.steplog import StepLog


def _pct(xs: np.ndarray, q: float) -> float | None:
    return float(np.percentile(xs, q)) if len(xs) else None


def column(steps: Sequence[StepRow], name: str) -> np.ndarray:
    """One field over ``steps`` as an array: a StepLog's column without making a row
    object per step (8 bytes a step, not a Python number each)."""
    if isinstance(steps, StepLog):
        return steps.column(name)
    return np.array([getattr(s, name) for s in steps])


def total(a: np.ndarray) -> Any:
    """The sum of ``a`` left to right, as Python's sum() of its items adds (a pairwise
    np.sum rounds differently), as a Python number (0 when empty)."""
    return np.cumsum(a)[-1].item() if len(a) else 0


def peak(a: np.ndarray) -> Any:
    return a.max().item() if len(a) else 0


def kv_read_bytes_per_token(steps: Sequence[StepRow]) -> float | None:
    """Mean cache bytes a decode query read over ``steps`` (None: no decode ran)."""
    queries = total(column(steps, "decode_tokens"))
    return total(column(steps, "kv_read_bytes")) / queries if queries else None


def waste_split(tot: LedgerTotals) -> dict[str, float]:
    """The ledger's slot-steps as shares of what was reserved or free-but-unusable:
    ``waste_pct`` and its parts, ``reservation_pct``, ``internal_frag_pct`` and
    ``external_frag_pct`` (0 each when nothing was held)."""
    denom = tot.reserved + tot.external
    if not denom:
        return dict.fromkeys(("waste_pct", "reservation_pct", "internal_frag_pct",
                              "external_frag_pct"), 0.0)
    return {"waste_pct": 100.0 * (1 - tot.used / denom),
            "reservation_pct": 100.0 * tot.reservation / denom,
            "internal_frag_pct": 100.0 * tot.internal / denom,
            "external_frag_pct": 100.0 * tot.external / denom}


def request_rows(col: MetricsCollector) -> RequestLog:
    """The rows of requests.csv, in arrival order: a finished or rejected request's as
    made then, the others' (still running or waiting) filled in from what they hold now
    (again on each call: the same values while nothing runs)."""
    bs, bps = col.kv.block_size, col.bytes_per_slot
    for rid, t in col.requests.items():
        col.rows.fill(t.row, request_row(rid, col.groups[rid], t, bs, bps, col.keep_outputs,
                                         col.api))
    return col.rows


def _finished(rows: RequestLog, name: str, done: np.ndarray) -> np.ndarray:
    """A real column over the finished rows, without the ones that have none."""
    v = rows.values(name)[done]
    return v[~np.isnan(v)]


def weighted_percentile(values: np.ndarray, counts: np.ndarray, q: float) -> float | None:
    """``np.percentile(np.repeat(values, counts), q)`` (linear interpolation, numpy's own
    arithmetic) without the repeat: the two order statistics around rank q/100 (n - 1)
    found by cumulative counts."""
    keep = counts > 0
    values, counts = values[keep], counts[keep]
    if not len(values):
        return None
    order = np.argsort(values, kind="stable")
    v, c = values[order], np.cumsum(counts[order])
    n = int(c[-1])
    virtual = np.float64(q) / 100 * (n - 1)
    lo = int(np.floor(virtual))
    hi = min(lo + 1, n - 1)
    a, b = v[np.searchsorted(c, lo, side="right")], v[np.searchsorted(c, hi, side="right")]
    gamma = virtual - lo
    diff = b - a  # numpy's _lerp: from the nearer end
    return float(b - diff * (1 - gamma) if gamma >= 0.5 else a + diff * gamma)


@dataclass
class Records:
    """What the summary reads of a run: one engine's (:func:`records_of`), or a
    cluster's replicas' together (harness.cluster.records)."""

    rows: RequestLog
    steps: Sequence[StepRow]
    itl: tuple[np.ndarray, np.ndarray]  # every inter-token latency (ms) as (values, counts)
    ledger: LedgerTotals
    stats: KVStats
    preemptions_recompute: int
    preemptions_swap: int
    recomputed_tokens: int
    span_start: Sequence[float] | np.ndarray  # finished requests' arrivals and finishes (s)
    span_end: Sequence[float] | np.ndarray
    block_size: int
    bytes_per_slot: int


def records_of(col: MetricsCollector) -> Records:
    """One engine's records (its unfinished requests' rows filled in from what they hold)."""
    sch = col.scheduler
    return Records(request_rows(col), col.steps, col.itl_ms(), col.kv.ledger.totals,
                   col.kv.stats, sch.preemptions_recompute, sch.preemptions_swap,
                   sch.recomputed_tokens, col.span_start, col.span_end, col.kv.block_size,
                   col.bytes_per_slot)


def summarize(r: Records, run_info: dict[str, Any], kv_budget_bytes: int,
              token_capacity: int, wall_s: float) -> dict[str, Any]:
    """The flat, dotted summary (metrics.json) of ``r`` (:func:`records_of`, after the
    ledger is finished)."""
    reqs = r.rows
    done = reqs.matches("status", "finished")
    n_done = int(done.sum())
    out_tokens = int(reqs.values("output_tokens")[done].sum())
    prompt_tokens = int(reqs.values("prompt_tokens")[done].sum())
    ttft, e2e, tpot = (_finished(reqs, k, done) for k in ("ttft_ms", "e2e_ms", "tpot_ms"))
    itl_v, itl_n = r.itl
    tot = r.ledger
    st = r.stats
    steps = r.steps
    # One column at a time (a million-request run has millions of steps, maybe spilled
    # to disk: harness.metrics.steplog), each let go once its figures are taken.
    logical = column(steps, "logical_blocks")
    saved = logical - column(steps, "held_blocks")
    logical_total = total(logical)
    del logical
    step_total, overhead = total(column(steps, "step_ms")), column(steps, "overhead_ms")
    m: dict[str, Any] = {f"run.{k}": v for k, v in run_info.items()}
    m.update({
        "throughput.output_tokens_per_s": out_tokens / wall_s if wall_s else 0.0,
        "throughput.total_tokens_per_s": (out_tokens + prompt_tokens) / wall_s if wall_s else 0.0,
        "throughput.requests_per_s": n_done / wall_s if wall_s else 0.0,
        "latency.ttft_ms.p50": _pct(ttft, 50), "latency.ttft_ms.p90": _pct(ttft, 90),
        "latency.ttft_ms.p99": _pct(ttft, 99),
        "latency.itl_ms.p50": weighted_percentile(itl_v, itl_n, 50),
        "latency.itl_ms.p90": weighted_percentile(itl_v, itl_n, 90),
        "latency.itl_ms.p99": weighted_percentile(itl_v, itl_n, 99),
        "latency.e2e_ms.p50": _pct(e2e, 50), "latency.e2e_ms.p99": _pct(e2e, 99),
        "latency.tpot_ms.p50": _pct(tpot, 50), "latency.tpot_ms.p99": _pct(tpot, 99),
        "memory.kv_budget_bytes": kv_budget_bytes,
        "memory.token_capacity": token_capacity,
        "memory.peak_reserved_bytes": peak(column(steps, "reserved_bytes")),
        "memory.peak_used_bytes": peak(column(steps, "used_bytes")),
        # Time-averaged over steps, as the ledger integrates them (harness.kv.ledger).
        **{f"memory.{k}": v for k, v in waste_split(tot).items()},
        "memory.max_running_seqs": peak(column(steps, "running")),
        # The backend's declared reads (harness.backends.costs), the same under both
        # executors: cache bytes one decode query read, K/V with scales and metadata.
        "attention.kv_read_bytes_per_token": kv_read_bytes_per_token(steps),
        # Hits on blocks other requests computed, over every prompt token looked up. A
        # request re-finding its own blocks after a recompute preemption is not a prefix
        # hit (it rises with memory pressure): cache.self_hit_tokens counts those.
        "cache.prefix_hit_rate": (st.prefix_hit_tokens / st.prefix_query_tokens
                                  if st.prefix_query_tokens else 0.0),
        "cache.prefill_tokens_computed": total(column(steps, "prefill_tokens")),
        "cache.prefill_tokens_saved": st.prefix_hit_tokens + st.self_hit_tokens,
        "cache.self_hit_tokens": st.self_hit_tokens,
        "cache.cow_copies": st.cow_copies,
        # Blocks the live tables would hold without sharing, minus blocks held.
        "cache.blocks_saved_by_sharing": float(np.mean(saved)) if len(saved) else 0.0,
        "cache.blocks_saved_by_sharing_peak": peak(saved),
        "cache.sharing_saved_pct": (100.0 * total(saved) / logical_total
                                    if logical_total else 0.0),
        "cache.evicted_tokens": st.evicted_tokens,
        # Prompt blocks computed again because the pool evicted their content within the
        # run (harness/kv/eviction.py): the cost of the eviction order's choices.
        "cache.regret_blocks": st.regret_blocks,
        "cache.regret_tokens": st.regret_tokens,
        "sched.steps": len(steps),
        "sched.preemptions_recompute": r.preemptions_recompute,
        "sched.preemptions_swap": r.preemptions_swap,
        "sched.recomputed_tokens": r.recomputed_tokens,
        "sched.swapped_bytes": st.swapped_out_blocks * r.block_size * r.bytes_per_slot,
        "requests.finished": n_done,
        "requests.rejected": int(reqs.matches("status", "rejected").sum()),
        # Requests in flight (arrived, not finished: waiting, running or swapped) at once.
        "requests.peak_concurrency": peak_concurrency(r.span_start, r.span_end),
        "engine.step_ms_mean": float(np.mean(column(steps, "step_ms"))) if steps else 0.0,
        "engine.overhead_ms_mean": float(np.mean(overhead)) if steps else 0.0,
        "engine.overhead_pct": (100.0 * total(overhead) / step_total)
        if steps else 0.0,
        "engine.wall_s": wall_s,
    })
    return m
