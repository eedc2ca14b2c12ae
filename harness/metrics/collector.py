"""Per-step and per-request measurements, taken from the allocator and the clock.

Rows are appended as the run goes; :func:`harness.metrics.summary.summarize` turns them
into DESIGN.md's metrics.json keys at the end.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from harness.backends.costs import StepReads
from harness.kv.base import KVManager
from harness.sched.scheduler import Scheduler
from harness.sched.sequence import SequenceGroup
from harness.sched.step import StepRecord, StepUpdate


@dataclass(slots=True)
class StepRow:
    step: int
    time_s: float  # since the run started
    step_ms: float
    forward_ms: float
    overhead_ms: float  # step_ms - forward_ms: scheduling, batching, sampling, bookkeeping
    batch_tokens: int
    prefill_tokens: int
    decode_tokens: int
    num_seqs: int
    running: int
    waiting: int
    swapped: int
    reserved_bytes: int  # held while the step's forward ran (after scheduling)
    used_bytes: int
    free_blocks: int
    cached_free_blocks: int
    shared_blocks: int
    logical_blocks: int
    held_blocks: int
    external_frag_bytes: int
    preempted: int
    finished: int
    # What the step's attention read, as the backend declares it (harness.backends.costs):
    # the decodes' cached tokens and bytes (K/V, scales, metadata), the prefill pairs.
    kv_read_tokens: int = 0
    kv_read_bytes: int = 0
    prefill_pairs: int = 0
    # Blocks held in the prefix cache's lower tiers while the step ran (0 without tiers).
    cpu_tier_blocks: int = 0
    disk_tier_blocks: int = 0
    tier_ops: int = 0  # blocks the step moved between tiers (stores, spills, loads)
    # KV cache groups: blocks each group's tables held, "|"-separated ("" without groups).
    group_blocks: str = ""


@dataclass(slots=True)
class RequestTimes:
    arrival: float
    first_scheduled: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished: float | None = None


class MetricsCollector:
    """Collects rows; knows the byte size of a slot to report bytes. It only reads: the
    KV manager and the scheduler keep their own counters and the ledger."""

    def __init__(self, kv: KVManager, scheduler: Scheduler, bytes_per_slot: int) -> None:
        self.kv = kv
        self.scheduler = scheduler
        self.bytes_per_slot = bytes_per_slot
        self.steps: list[StepRow] = []
        self.requests: dict[int, RequestTimes] = {}
        self.groups: dict[int, SequenceGroup] = {}

    def outputs(self) -> dict[int, list[int]]:
        """Request id -> its output ids, for every request that got a sequence."""
        return {rid: g.output_ids for rid, g in self.groups.items() if g.seqs}

    def on_arrival(self, group: SequenceGroup, now: float) -> None:
        self.requests[group.request_id] = RequestTimes(arrival=now)
        self.groups[group.request_id] = group

    def on_tokens(self, rec: StepRecord, upd: StepUpdate, sampled_groups: list[SequenceGroup],
                  now: float) -> None:
        for s in rec.seqs:
            t = self.requests[s.seq.group.request_id]
            if t.first_scheduled is None:
                t.first_scheduled = now
        # One token event per group per step: for n > 1 the samples advance together.
        seen: set[int] = set()
        for g in sampled_groups:
            if g.request_id not in seen:
                seen.add(g.request_id)
                self.requests[g.request_id].token_times.append(now)
        for g in upd.finished:
            self.requests[g.request_id].finished = now

    def on_step(self, rec: StepRecord, upd: StepUpdate, t_start: float, t_end: float,
                forward_s: float, run_start: float, reads: StepReads | None = None) -> None:
        """``rec.usage``: the KV usage while the step's forward ran (the ledger integrates
        the same state, so summing rows reproduces its reserved and used slot-steps);
        ``upd``: what the scheduler's update did after it."""
        sch, bps = self.scheduler, self.bytes_per_slot
        u = rec.usage
        assert u is not None, "a step that ran records its usage (Scheduler.schedule)"
        r = reads if reads is not None else StepReads()
        step_ms = (t_end - t_start) * 1e3
        self.steps.append(StepRow(
            step=rec.step, time_s=t_end - run_start, step_ms=step_ms,
            forward_ms=forward_s * 1e3, overhead_ms=step_ms - forward_s * 1e3,
            batch_tokens=rec.num_tokens, prefill_tokens=rec.num_prefill_tokens,
            decode_tokens=rec.num_decode_tokens, num_seqs=len(rec.seqs),
            running=sch.num_running_seqs, waiting=len(sch.waiting), swapped=len(sch.swapped),
            reserved_bytes=u.reserved_slots * bps, used_bytes=u.used_slots * bps,
            free_blocks=u.free_blocks, cached_free_blocks=u.cached_free_blocks,
            shared_blocks=u.shared_blocks, logical_blocks=u.logical_blocks,
            held_blocks=u.held_blocks,
            external_frag_bytes=upd.external_slots * bps, preempted=len(rec.preempted),
            finished=len(upd.finished),
            kv_read_tokens=r.decode_tokens, kv_read_bytes=r.decode_bytes,
            prefill_pairs=r.prefill_pairs,
            cpu_tier_blocks=u.tier_blocks[0] if u.tier_blocks else 0,
            disk_tier_blocks=u.tier_blocks[1] if len(u.tier_blocks) > 1 else 0,
            tier_ops=len(rec.tier_ops),
            group_blocks="|".join(map(str, u.group_blocks)),
        ))
