"""Per-step and per-request measurements, taken from the allocator and the clock.

Rows are appended as the run goes; :func:`harness.metrics.summary.summarize` turns them
into DESIGN.md's metrics.json keys at the end.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from harness.backends.costs import StepReads
from harness.kv.base import KVManager, KVUsage
from harness.metrics.api_server import ApiServer
from harness.metrics.requestlog import RequestLog
from harness.metrics.rows import StepRow
from harness.metrics.steplog import StepLog
from harness.sched.scheduler import Scheduler
from harness.sched.sequence import SequenceGroup
from harness.sched.step import StepRecord, StepUpdate

__all__ = ["MetricsCollector", "RequestTimes", "StepRow", "request_row"]


@dataclass(slots=True)
class RequestTimes:
    arrival: float
    first_scheduled: float | None = None
    # An array of doubles, not a list: no float object per token (a run holds ~10^5 of
    # them at a time; the lane's are taken from the step clock in slices).
    token_times: array[float] = field(default_factory=lambda: array("d"))
    finished: float | None = None
    last_token_step: int = -1  # index into MetricsCollector.token_t of its last token
    # A decode-lane member (harness/roofline/fastpath) since this index of token_t: its tokens
    # come every step from there and are added to token_times when it leaves; -1: not one.
    lane_from: int = -1
    row: int = -1  # its place in MetricsCollector.rows (reserved on arrival)
    # A served engine's front-end seconds (the what-if's: harness.roofline.engines),
    # added to its TTFT and end-to-end latency.
    frontend_s: float = 0.0


class MetricsCollector:
    """Collects rows; knows the byte size of a slot to report bytes. It only reads: the
    KV manager and the scheduler keep their own counters and the ledger.

    A request's times and group are held while it runs; when it finishes, its
    requests.csv row is made (:func:`request_row`) and both are let go, so a run of a
    million requests does not hold a million prompts. What outlives them: the rows, the
    output ids (unless ``keep_outputs`` is off) and the inter-token latencies of the whole
    run as a count per step (:meth:`itl_ms`), from which every ITL percentile is exact."""

    def __init__(self, kv: KVManager, scheduler: Scheduler, bytes_per_slot: int,
                 keep_outputs: bool = True) -> None:
        self.kv = kv
        self.scheduler = scheduler
        self.bytes_per_slot = bytes_per_slot
        self._keep_outputs = keep_outputs
        # Front-end seconds of a request by its prompt tokens (a served what-if's: set by
        # harness.roofline.run); None: none.
        self.frontend: Callable[[int], float] | None = None
        # A served what-if's API server as a serial stage (harness.metrics.api_server: set
        # by harness.roofline.run); None: none. Its queue adds to the front-end seconds
        # and delays when clients get tokens.
        self.api: ApiServer | None = None
        self.steps = StepLog()  # one row per step, as columns
        self.requests: dict[int, RequestTimes] = {}  # running or waiting
        self.groups: dict[int, SequenceGroup] = {}  # running or waiting (or rejected)
        # requests.csv rows in arrival order, as columns; a request's is filled when it
        # finishes or is rejected, the others' at the end (harness.metrics.summary).
        self.rows = RequestLog(outputs=keep_outputs)
        self._outputs: dict[int, list[int]] = {}
        # Arrival and finish times of each finished request (peak concurrency).
        self.span_start, self.span_end = array("d"), array("d")
        # The clock of each step that made tokens; ITLs as the number of requests whose
        # consecutive tokens came in steps k-1 and k (``itl_next[k]``), and the rest
        # (tokens further apart: a preemption, a prompt-only step in between) as values.
        self.token_t = array("d")
        self.itl_next = array("q")
        self.itl_other = array("d")

    @property
    def keep_outputs(self) -> bool:
        return self._keep_outputs

    @keep_outputs.setter
    def keep_outputs(self, keep: bool) -> None:
        # Set before the run (RunConfig.records.output_ids): whether rows have output_ids.
        assert not self.rows, "keep_outputs is set before the first request arrives"
        self._keep_outputs = keep
        self.rows = RequestLog(outputs=keep)

    def outputs(self) -> dict[int, list[int]]:
        """Request id -> its output ids, for every request that got a sequence (none
        without ``keep_outputs``)."""
        if not self.keep_outputs:
            return {}
        out = dict(self._outputs)
        out.update({rid: g.output_ids for rid, g in self.groups.items() if g.seqs})
        return out

    def on_arrival(self, group: SequenceGroup, now: float) -> None:
        t = self.requests[group.request_id] = RequestTimes(arrival=now, row=self.rows.reserve())
        if self.frontend is not None:
            t.frontend_s = self.frontend(len(group.prompt_ids))
        if self.api is not None:
            t.frontend_s += self.api.wait_s(group.request_id)
        self.groups[group.request_id] = group

    def on_tokens(self, rec: StepRecord, upd: StepUpdate, sampled_groups: list[SequenceGroup],
                  now: float) -> None:
        reqs = self.requests
        for s in rec.seqs:
            t = reqs[s.seq.group.request_id]
            if t.first_scheduled is None:
                t.first_scheduled = now
        k = len(self.token_t)
        self.token_t.append(now)
        # Decode-lane members each got a token here and in the step before.
        self.itl_next.append(rec.lane_n)
        # One token event per group per step: for n > 1 the samples advance together.
        seen: set[int] = set()
        for g in sampled_groups:
            rid = g.request_id
            if rid not in seen:
                seen.add(rid)
                t = reqs[rid]
                t.token_times.append(now)
                if t.last_token_step == k - 1:
                    self.itl_next[k] += 1
                elif t.last_token_step >= 0:
                    self.itl_other.append((now - self.token_t[t.last_token_step]) * 1e3)
                t.last_token_step = k
        if self.api is not None:  # before the rows of the requests this step finished
            self.api.on_step(now, len(seen) + rec.lane_n)
        self._finished(upd.finished, now)
        for rid in upd.lane_joined:
            reqs[rid].lane_from = k + 1

    def _finished(self, groups: list[SequenceGroup], now: float) -> None:
        """``groups`` finished at ``now`` (their last token's step is recorded): their
        rows made and their times let go."""
        for g in groups:
            if self.requests[g.request_id].lane_from >= 0:
                self.lane_leave(g.request_id)
            t = self._let_go(g, finished=now)
            self.span_start.append(t.arrival)
            self.span_end.append(now)

    def lane_leave(self, rid: int) -> None:
        """Request ``rid`` leaves the decode lane: its token times since it joined (one
        per step up to the latest) become its own."""
        t = self.requests[rid]
        end = len(self.token_t)
        if end > t.lane_from:
            t.token_times.extend(self.token_t[t.lane_from:end])
            t.last_token_step = end - 1
        t.lane_from = -1

    def on_rejected(self, group: SequenceGroup) -> None:
        """A request that will never run (rejected on arrival, or stuck): its row now,
        and it is let go."""
        self._let_go(group)

    def _let_go(self, g: SequenceGroup, finished: float | None = None) -> RequestTimes:
        """Make ``g``'s row (its outputs kept if asked) and drop its group and times."""
        rid = g.request_id
        t = self.requests.pop(rid)
        t.finished = finished
        self.rows.fill(t.row, request_row(rid, g, t, self.kv.block_size,
                                          self.bytes_per_slot, self.keep_outputs, self.api))
        del self.groups[rid]
        if self.keep_outputs and g.seqs:
            self._outputs[rid] = g.output_ids
        return t

    def itl_ms(self) -> tuple[np.ndarray, np.ndarray]:
        """Every inter-token latency of the run (ms) as (values, counts): the same
        multiset as each request's consecutive token-time differences, in (b - a) * 1e3,
        without holding one number per token."""
        # Copies: a view would pin the arrays, which must still grow.
        t = np.array(self.token_t, dtype=np.float64)
        n = np.array(self.itl_next, dtype=np.int64)
        k = np.flatnonzero(n[1:]) + 1 if len(n) > 1 else np.zeros(0, dtype=np.int64)
        vals = np.concatenate([(t[k] - t[k - 1]) * 1e3,
                               np.array(self.itl_other, dtype=np.float64)])
        counts = np.concatenate([n[k], np.ones(len(self.itl_other), dtype=np.int64)])
        return vals, counts

    def on_step(self, rec: StepRecord, upd: StepUpdate, t_start: float, t_end: float,
                forward_s: float, run_start: float, reads: StepReads | None = None) -> None:
        """``rec.usage``: the KV usage while the step's forward ran (the ledger integrates
        the same state, so summing rows reproduces its reserved and used slot-steps);
        ``upd``: what the scheduler's update did after it."""
        u = rec.usage
        assert u is not None, "a step that ran records its usage (Scheduler.schedule)"
        self._row(StepFacts(
            rec.step, t_start, t_end, forward_s, prefill_tokens=rec.num_prefill_tokens,
            decode_tokens=rec.num_decode_tokens, num_seqs=rec.num_seqs, usage=u,
            reads=reads if reads is not None else StepReads(),
            external_slots=upd.external_slots, preempted=len(rec.preempted),
            finished=len(upd.finished), tier_ops=len(rec.tier_ops)), run_start)

    def on_lane_tokens(self, n: int, finished: list[SequenceGroup], now: float) -> None:
        """:meth:`on_tokens` of a lane step (``LaneScheduler.schedule_lane``: ``n`` decode-lane
        members decoded, nothing else ran; ``finished``: the members it finished): the
        step clock, the members' inter-token latencies, the finished requests' rows."""
        self.token_t.append(now)
        self.itl_next.append(n)
        if self.api is not None:
            self.api.on_step(now, n)
        if finished:
            self._finished(finished, now)

    def on_lane_step(self, step: int, n: int, t_start: float, t_end: float,
                     forward_s: float, run_start: float, reads: StepReads, usage: KVUsage,
                     finished: int) -> None:
        """:meth:`on_step` of a lane step (see :meth:`on_lane_tokens`); ``usage``: what the
        KV manager held for its forward (LaneScheduler.schedule_lane)."""
        self._row(StepFacts(step, t_start, t_end, forward_s, prefill_tokens=0,
                            decode_tokens=n, num_seqs=n, usage=usage, reads=reads,
                            finished=finished), run_start)

    def _row(self, f: StepFacts, run_start: float) -> None:
        """Append one step's row (StepRow's fields, in order, as a tuple:
        StepLog.append_values), from ``f`` and the scheduler's queues now."""
        sch, bps = self.scheduler, self.bytes_per_slot
        step_ms = (f.t_end - f.t_start) * 1e3
        u, r = f.usage, f.reads
        tb = u.tier_blocks
        self.steps.append_values((
            f.step, f.t_end - run_start, step_ms,  # step, time_s, step_ms
            f.forward_s * 1e3, step_ms - f.forward_s * 1e3,  # forward_ms, overhead_ms
            f.prefill_tokens + f.decode_tokens,  # batch_tokens
            f.prefill_tokens, f.decode_tokens, f.num_seqs,  # prefill_tokens .. num_seqs
            sch.num_running_seqs, len(sch.waiting), len(sch.swapped),  # running .. swapped
            u.reserved_slots * bps, u.used_slots * bps,  # reserved_bytes, used_bytes
            u.free_blocks, u.cached_free_blocks,  # free_blocks, cached_free_blocks
            u.shared_blocks, u.logical_blocks,  # shared_blocks, logical_blocks
            u.held_blocks,  # held_blocks
            f.external_slots * bps, f.preempted,  # external_frag_bytes, preempted
            f.finished,  # finished
            r.decode_tokens, r.decode_bytes,  # kv_read_tokens, kv_read_bytes
            r.prefill_pairs,  # prefill_pairs
            tb[0] if tb else 0,  # cpu_tier_blocks
            tb[1] if len(tb) > 1 else 0,  # disk_tier_blocks
            f.tier_ops,  # tier_ops
            "|".join(map(str, u.group_blocks)) if u.group_blocks else "",  # group_blocks
        ))


@dataclass(slots=True)
class StepFacts:
    """What one step's steps.csv row is made of, named (the scheduler's queue lengths are
    read as the row is made): the step, its clock times and forward seconds, its tokens
    and sequences, the KV usage its forward held, its reads, and what its update did."""

    step: int
    t_start: float
    t_end: float
    forward_s: float
    prefill_tokens: int
    decode_tokens: int
    num_seqs: int
    usage: KVUsage
    reads: StepReads
    external_slots: int = 0
    preempted: int = 0
    finished: int = 0
    tier_ops: int = 0


def request_row(rid: int, g: SequenceGroup, t: RequestTimes, block_size: int,
                bytes_per_slot: int, outputs: bool = True,
                api: ApiServer | None = None) -> dict[str, Any]:
    """One request's requests.csv row (latencies in ms, relative to arrival); without
    ``outputs``, no ``output_ids`` column (records.output_ids=false). ``api``: a served
    what-if's API server: TTFT, TPOT and end-to-end time as its client got the tokens
    (itl_ms_max stays the engine's)."""
    # Beam search: the chosen beam's tokens (forks copy their parent's outputs, so a
    # sum over beams would count shared history again). Samples: every sample's.
    out_tokens = (len(g.best_output) if g.best_output is not None
                  else sum(s.num_output_tokens for s in g.seqs))
    tt = t.token_times
    ttft = (tt[0] - t.arrival + t.frontend_s) * 1e3 if tt else None
    # Each (b - a) * 1e3 as Python computes it (IEEE: the same doubles), the mean by
    # numpy's pairwise sum as before: np.diff and ndarray.mean / max are these ufuncs
    # behind Python wrappers that cost more than the sums (once per request).
    tpot = itl_max = None
    if len(tt) > 1:
        a = np.array(tt, dtype=np.float64)
        itls = a[1:] - a[:-1]
        itls *= 1e3
        tpot = float(np.add.reduce(itls)) / len(itls)
        itl_max = float(np.maximum.reduce(itls))
    e2e = (t.finished - t.arrival + t.frontend_s) * 1e3 if t.finished is not None else None
    if api is not None and tt:  # when the client got its first and last tokens
        first = api.lag(tt[0]) * 1e3
        ttft = None if ttft is None else ttft + first
        if tpot is not None:
            tpot += (api.lag(tt[-1]) * 1e3 - first) / (len(tt) - 1)
        if e2e is not None and t.finished is not None:
            e2e += api.lag(t.finished) * 1e3
    best = g.seqs[0] if g.seqs else None
    row = {
        "request_id": rid,
        "status": ("rejected" if g.rejected_reason else
                   "finished" if t.finished is not None else "unfinished"),
        "rejected_reason": g.rejected_reason or "",
        "arrival_s": t.arrival,
        "prompt_tokens": len(g.prompt_ids),
        "output_tokens": out_tokens,
        "num_seqs": len(g.seqs),
        "ttft_ms": ttft,
        "tpot_ms": tpot,
        "itl_ms_max": itl_max,
        "e2e_ms": e2e,
        "prefix_hit_tokens": g.prefix_hit_tokens,
        "prefix_source": g.prefix_source,
        "tier_hit_blocks_cpu": g.tier_hit_blocks[0],
        "tier_hit_blocks_disk": g.tier_hit_blocks[1],
        "preemptions_recompute": g.num_preemptions_recompute,
        "preemptions_swap": g.num_preemptions_swap,
        "recomputed_tokens": g.num_recomputed_tokens,
        "swapped_out_bytes": g.num_swapped_blocks * block_size * bytes_per_slot,
        "finish_reason": best.finish_reason if best else "",
    }
    if outputs:
        row["output_ids"] = ids_text(g.output_ids)
    return row


_ID_TEXT = {i: str(i) for i in range(1 << 16)}  # a vocabulary's ids as text, made once
# Lists this long (and periods this short) take the periodic shortcut of ids_text.
_PERIODIC_MIN, _PERIOD_MAX = 64, 32


def ids_text(ids: list[int]) -> str:
    """``" ".join(map(str, ids))``, 3x faster for ids in [0, 65,536) (every vocabulary of
    ours; the roofline's synthetic ids): a table lookup instead of an int's formatting,
    per token of every request (15% of a decode-lane run's time at 10,000 requests). A
    dict, not a list: any other id (a negative one too) misses it, and is formatted.

    A list that repeats with a short period (the roofline's synthetic outputs repeat
    every 26 tokens) is joined one period and copied: what C's list compare finds, in a
    tenth of the time at ShareGPT's lengths (2% of a decode-lane run at 100,000)."""
    n = len(ids)
    if n >= _PERIODIC_MIN:
        # The period, if any: where the first id comes back (a scan in C).
        try:
            p = ids.index(ids[0], 1, _PERIOD_MAX + 1)
        except ValueError:
            p = 0
        if p and ids[p:] == ids[:-p]:
            q, r = divmod(n, p)
            unit = _join_ids(ids[:p])
            return (unit + " ") * q + _join_ids(ids[:r]) if r else " ".join([unit] * q)
    return _join_ids(ids)


def _join_ids(ids: list[int]) -> str:
    try:
        return " ".join(map(_ID_TEXT.__getitem__, ids))
    except KeyError:
        return " ".join(map(str, ids))
