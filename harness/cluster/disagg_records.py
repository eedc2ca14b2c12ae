"""A disaggregated cluster's records and metrics (``cluster.mode=disaggregated``).

One requests.csv row per request: the decode side's (its TTFT from the request's arrival,
its tokens), with the prefill side's prompt figures (prefix hits, their tier), or the
prefill side's own row for a request that ended there. Columns of its own: the replicas
it went through, its TTFT split and its transfer. The split adds up to the TTFT:

- ``frontend_ms``: a served engine's front end (HTTP, templating, tokenization:
  ``roofline.served``, the engine profile's ``request_s + prompt_token_s x prompt``), which
  a served TTFT includes and no engine step does; 0 offline;
- ``prefill_queue_ms``: arrival to the start of the prefill step that first computed it;
- ``prefill_ms``: that start to the end of the step that finished its prompt;
- ``transfer_ms``: the transfer's time past the later of the prefill's end and the
  decode side's reservation (what layer-wise streaming hides behind the prefill is not
  in it; a wait for the prefill replica's link is);
- ``decode_queue_ms``: the rest: a wait for room on the decode side after the prefill,
  then its queue and the step that made the first token.

Metrics of its own: ``latency.ttft_ms.<part>.p50/p99`` over finished requests;
``cluster.transfer_*`` (bytes and blocks moved, the decode side's hits that were not,
the link's time per request); per pool ``cluster.<pool>.*`` (replicas, GPUs, busy share
of its replicas' time, peak KV held over its budget, load imbalance); ``cluster.gpus``.
The prefix cache's figures (``cache.prefix_hit_rate``, ``cache.hit_rate.*``) are the
prefill pool's: the decode side's lookups are the handoff's bookkeeping, its hits are
``cluster.transfer_skipped_blocks``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from harness.cluster.disagg import DisaggCluster, Handoff
from harness.cluster.records import summarize_cluster
from harness.metrics.requestlog import RequestLog
from harness.metrics.steplog import StepLog
from harness.metrics.summary import column, request_rows

SPLIT = ("frontend", "prefill_queue", "prefill", "transfer", "decode_queue")
# The prompt's own figures, the prefill side's (the decode side's are its handoff's).
PROMPT_COLUMNS = ("prefix_hit_tokens", "prefix_source", "tier_hit_blocks_cpu",
                  "tier_hit_blocks_disk")


def merged_rows(c: DisaggCluster, outputs: bool) -> RequestLog:
    """One row per request in arrival order (module docstring), with its columns."""
    out = RequestLog(outputs)
    logs = {r.number: request_rows(r.stack.collector) for r in c.replicas}
    extra: dict[str, list[Any]] = {k: [] for k in (
        "replica", "prefill_replica", "decode_replica", *(f"{k}_ms" for k in SPLIT),
        "transfer_bytes", "transfer_blocks", "decode_hit_blocks")}
    for h in c.handoffs:
        prow = logs[h.p.number].row(h.p_row)
        if h.d_row >= 0:
            row = logs[h.d.number].row(h.d_row)
            row.update({k: prow[k] for k in PROMPT_COLUMNS})
        else:
            row = prow
        out.fill(out.reserve(), row)
        extra["replica"].append(h.d.number if h.d_row >= 0 else h.p.number)
        extra["prefill_replica"].append(h.p.index)
        extra["decode_replica"].append(h.d.index if not h.ended else None)
        side = h.d if h.d_row >= 0 else h.p
        front = side.stack.collector.frontend  # what the row's TTFT added for it
        front_ms = front(int(row["prompt_tokens"])) * 1e3 if front is not None else 0.0
        for k, v in zip(SPLIT, split_ms(h, row.get("ttft_ms"), front_ms)):
            extra[f"{k}_ms"].append(v)
        moved = h.sent is not None
        extra["transfer_bytes"].append(h.moved_bytes if moved else None)
        extra["transfer_blocks"].append(h.moved_blocks if moved else None)
        extra["decode_hit_blocks"].append(h.hit_blocks if moved else None)
    for name, col in extra.items():
        out.add_column(name, col)
    return out


def split_ms(h: Handoff, ttft_ms: float | None,
             frontend_ms: float = 0.0) -> tuple[float | None, ...]:
    """``h``'s TTFT split (ms; module docstring), or Nones where it has no first token;
    ``frontend_ms``: the served front end's part of ``ttft_ms``."""
    if ttft_ms is None or ttft_ms != ttft_ms or h.prefill_start is None \
            or h.prefill_end is None:
        return (None,) * len(SPLIT)
    queue = (h.prefill_start - h.arrival) * 1e3
    prefill = (h.prefill_end - h.prefill_start) * 1e3
    transfer = 0.0
    if h.landed is not None and h.reserved is not None:
        transfer = (h.landed - max(h.prefill_end, h.reserved)) * 1e3
    return (frontend_ms, queue, prefill, transfer,
            ttft_ms - frontend_ms - queue - prefill - transfer)


def _pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


def summarize_disaggregated(
        c: DisaggCluster, run_info: dict[str, Any], wall_s: float, outputs: bool,
        gpus: tuple[int, int]) -> tuple[dict[str, Any], RequestLog, StepLog, list[int]]:
    """metrics.json's keys, the rows, the merged steps and each step's replica number;
    ``gpus``: GPUs per replica of the prefill and of the decode pool."""
    n_p = len(c.prefill)
    rows = merged_rows(c, outputs)
    sizes = [(r.stack.sizing.kv_budget_bytes, r.stack.sizing.num_slots) for r in c.replicas]
    m, rows, steps, which = summarize_cluster(
        c, run_info, sizes, wall_s, outputs, rows=rows, prompt_replicas=range(n_p),
        request_replicas=range(n_p, len(c.replicas)))
    for i in range(n_p, len(c.replicas)):  # the handoff's lookups, not prompts'
        m[f"replica.{i}.cache.prefix_hit_rate"] = None
    # How evenly each pool's load fell (a mean over both pools mixes unlike replicas).
    m.pop("cluster.load_imbalance", None)
    m.pop("cluster.routed_imbalance", None)
    done = rows.matches("status", "finished")
    for k in SPLIT:
        v = [x for x, ok in zip(rows.column(f"{k}_ms"), done) if ok and x is not None]
        m[f"latency.ttft_ms.{k}.p50"], m[f"latency.ttft_ms.{k}.p99"] = _pct(v, 50), _pct(v, 99)
    moved = [h for h in c.handoffs if h.sent is not None]
    link_ms = [h.link_s * 1e3 for h in moved]
    m.update({
        "cluster.mode": "disaggregated",
        "cluster.transfer_requests": len(moved),
        "cluster.transfer_bytes": sum(h.moved_bytes for h in moved),
        "cluster.transfer_bytes_per_request": (float(np.mean([h.moved_bytes for h in moved]))
                                               if moved else None),
        "cluster.transfer_blocks": sum(h.moved_blocks for h in moved),
        "cluster.transfer_skipped_blocks": sum(h.hit_blocks for h in moved),
        # Reservations let go before their requests were admitted (the decode side's
        # waiting head needed the room: what was evicted of them is computed there).
        "cluster.transfer_spilled": sum(h.spilled for h in moved),
        "cluster.transfer_time_ms.mean": float(np.mean(link_ms)) if link_ms else None,
        "cluster.transfer_time_ms.p50": _pct(link_ms, 50),
        "cluster.transfer_time_ms.p99": _pct(link_ms, 99),
        "cluster.link": c.link.name,
        "cluster.link_gbs": c.link.bandwidth / 1e9,
        "cluster.link_latency_us": c.link.latency * 1e6,
        "cluster.link_source": c.link.source,
        "cluster.gpus": n_p * gpus[0] + len(c.decode) * gpus[1],
    })
    w = np.asarray(which, dtype=np.int64)
    step_ms = column(steps, "step_ms")
    reserved = column(steps, "reserved_bytes")
    for side, pool, per in (("prefill", c.prefill, gpus[0]), ("decode", c.decode, gpus[1])):
        busy, peak, routed = [], [], []
        for r in pool:
            mine = w == r.number
            busy.append(float(step_ms[mine].sum()) / 1e3 / wall_s if wall_s else 0.0)
            budget = r.stack.sizing.kv_budget_bytes
            peak.append(float(reserved[mine].max()) / budget if mine.any() and budget else 0.0)
            routed.append(r.routed)
        mean_busy, mean_routed = float(np.mean(busy)), float(np.mean(routed))
        m.update({
            f"cluster.{side}.replicas": len(pool),
            f"cluster.{side}.gpus": len(pool) * per,
            # Share of the run its replicas spent stepping (1: never idle).
            f"cluster.{side}.utilization": mean_busy,
            f"cluster.{side}.kv_peak_share": max(peak),
            f"cluster.{side}.load_imbalance": max(busy) / mean_busy if mean_busy else 1.0,
            f"cluster.{side}.routed_imbalance": (max(routed) / mean_routed if mean_routed
                                                 else 1.0),
        })
    return m, rows, steps, which


def goodput_per_gpu(m: dict[str, Any]) -> dict[str, Any]:
    """``cluster.goodput_rps_per_gpu`` from the run's goodput (after the SLO metrics)."""
    g, n = m.get("latency.goodput_rps"), m.get("cluster.gpus")
    return {} if g is None or not n else {"cluster.goodput_rps_per_gpu": g / n}
