"""A disaggregated cluster's event loop (``cluster.mode=disaggregated``): a prefill pool
and a decode pool, each replica a whole stack on its own clock, each pool behind its own
router, and each request's KV blocks moved between them over the link.

A request's way through (times on the replicas' clocks, seconds from the run's start):

1. it arrives; the prefill router places it on a prefill replica, the decode router on a
   decode replica, both at once (as vLLM's P/D proxy, llm-d's scheduler and Dynamo's
   router choose both before the prefill runs);
2. the prefill replica runs it with ``max_tokens=1`` (its prompt, then one token that is
   dropped: the decode side makes the first token the user sees, after the transfer, as
   with vLLM's NIXL connector); its full blocks stay held there (handoff.hold);
3. the decode replica reserves its blocks (handoff.reserve): its own prefix cache's hits
   are kept and not moved, fresh blocks taken for the rest, when it has the room; with
   ``cluster.transfer=whole`` from the prefill's end on, with ``layerwise`` from the
   request's arrival on (each layer's blocks move as the prefill computes them, which
   needs the room first, as SGLang's and Mooncake's decode side preallocates);
4. the moved blocks cross the link: the backend's bytes per block (fp8, kivi move fewer)
   over ``min(tp)`` of the pools' GPUs' links, one transfer after another on a prefill
   replica's links. ``whole``: from the later of the prefill's end and the reservation,
   for ``latency + bytes / bandwidth``; ``layerwise``: from the later of the prefill's
   start and the reservation, ending no earlier than one layer's share after the
   prefill's end. Under ``executor=model`` the blocks are copied in this process and the
   copy's wall time is the transfer's. Nothing of this is charged to either side's steps:
   the decode side goes on stepping while blocks are on their way;
5. the request lands: the prefill side lets its blocks go, the decode replica receives
   the request (its arrival time is still the request's: TTFT counts from there), admits
   it when its scheduler does, finding the reserved blocks as prefix hits, computes the
   prompt's last partial block and generates. The reservation is let go once the
   request holds the blocks.

The loop takes the earliest event: a transfer landing, a finished prefill ready for the
decode side's room, an arrival, each no later than every busy replica's next step; or
else one step of the busy replica whose clock is earliest (the colocated driver's rule).
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import itertools
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from harness.cluster.driver import Replica, serve
from harness.cluster.handoff import Reservation, full_blocks, hold, movable_manager, reserve
from harness.cluster.link import Link
from harness.cluster.router import Router
from harness.engine.engine import Arrivals, Counts, Engine, ProgressFn
from harness.kv.paged import PagedKVManager
from harness.sched.sequence import SequenceGroup
from harness.stack import Stack
from harness.workloads.base import Request, Workload

Pending = list[tuple[float, int, Request]]


class PoolReplica(Replica):
    """A replica of one pool: ``index`` in its pool (what the pool's router returns),
    ``number`` across the cluster (the records' ``replica``), and, on the decode side,
    the requests routed here that have not landed (``incoming``: its router counts them
    as in flight and queued)."""

    def __init__(self, index: int, stack: Stack, number: int, pool: str) -> None:
        super().__init__(index, stack)
        self.number = number
        self.pool = pool
        self.incoming = 0
        kv = movable_manager(stack.kv)
        assert kv is not None, "harness.cluster.pools refuses a stack it cannot move"
        self.kv: PagedKVManager = kv
        self._ids = itertools.count(-2, -1)  # a handoff's sequences (the router's probe: -1)

    def in_flight(self) -> int:
        return super().in_flight() + self.incoming

    def queued(self) -> int:
        return super().queued() + self.incoming

    def seq_id(self) -> int:
        return next(self._ids)


@dataclass(eq=False)
class Handoff:
    """One request's way from its prefill replica ``p`` to its decode replica ``d``: the
    group each runs, the times it passed each stage, the blocks held and reserved."""

    group: SequenceGroup  # the request as the decode side runs it
    prefill_group: SequenceGroup  # ... and as the prefill side does (max_tokens=1)
    p: PoolReplica
    d: PoolReplica
    arrival: float
    order: int  # arrival order: the records' row order, and ties in the event heaps
    p_row: int = -1  # its row in each side's request log (-1: none there)
    d_row: int = -1
    refused: str | None = None  # the decode side can never take it: no transfer
    prefill_start: float | None = None
    prefill_end: float | None = None
    reserved: float | None = None
    sent: float | None = None  # the transfer's start
    landed: float | None = None
    link_s: float = 0.0  # the link's time for its bytes (latency + bytes / bandwidth)
    moved_bytes: int = 0
    hit_blocks: int = 0  # found on the decode side (device or its tiers): not moved
    moved_blocks: int = 0
    held: Reservation | None = None  # the prefill side's blocks, until landed
    slot: Reservation | None = None  # the decode side's, until the request holds them
    ended: bool = False  # ended on the prefill side (rejected there)
    spilled: bool = False  # its reservation let go before its admission (the head's room)


def prefill_group(g: SequenceGroup) -> SequenceGroup:
    """``g`` as the prefill side runs it: its prompt and one token (one sample, no beams:
    the decode side forks and searches)."""
    params = dataclasses.replace(g.params, max_tokens=1, n=1, use_beam_search=False,
                                 stop_after=None)
    return SequenceGroup(g.request_id, list(g.prompt_ids), params,
                         arrival_time=g.arrival_time, priority=g.priority,
                         extra_key=g.extra_key, rejected_reason=g.rejected_reason)


_RAW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def copy_blocks(src: Stack, dst: Stack, src_blocks: list[int], dst_blocks: list[int]
                ) -> float:
    """The real engine's transfer: each of ``src``'s block tensors' rows ``src_blocks``
    into ``dst``'s rows ``dst_blocks``; returns the copy's wall seconds."""
    if not src_blocks:
        return 0.0
    a, b = src.backend.block_tensors(), dst.backend.block_tensors()
    assert a is not None and b is not None and len(a) == len(b)
    t0 = time.perf_counter()
    si = torch.tensor(src_blocks, dtype=torch.long, device=a[0].device)
    di = torch.tensor(dst_blocks, dtype=torch.long, device=b[0].device)
    for s, d in zip(a, b):
        # As raw bytes of the element's width: index_copy has no fp8 kernel on the CPU.
        raw = _RAW[s.element_size()]
        d.view(raw).index_copy_(0, di, s.view(raw).index_select(0, si).to(d.device))
    if b[0].is_cuda:
        torch.cuda.synchronize(b[0].device)
    return time.perf_counter() - t0


class DisaggCluster:
    """A prefill pool and a decode pool behind their routers, joined by ``link``;
    :meth:`run` serves a workload over both. ``measured``: the real engine (the blocks
    are copied, the copy's time is the transfer's) instead of the link's model."""

    def __init__(self, prefill: list[Stack], decode: list[Stack],
                 routers: tuple[Router, Router], link: Link, layerwise: bool,
                 tp: tuple[int, int], measured: bool = False) -> None:
        self.prefill = [PoolReplica(i, st, i, "prefill") for i, st in enumerate(prefill)]
        n = len(prefill)
        self.decode = [PoolReplica(i, st, n + i, "decode") for i, st in enumerate(decode)]
        self.replicas: list[PoolReplica] = [*self.prefill, *self.decode]
        self.routers = routers
        self.link = link
        self.layerwise = layerwise
        self.lanes = min(tp)  # links in parallel per transfer
        self.measured = measured
        self.handoffs: list[Handoff] = []  # in arrival order
        self._landing: list[tuple[float, int, Handoff]] = []
        self._ready: list[tuple[float, int, Handoff]] = []  # whole: prefilled, wants room
        self._room: list[deque[Handoff]] = [deque() for _ in self.decode]
        self._landed: list[list[Handoff]] = [[] for _ in self.decode]
        self._unstarted: list[deque[Handoff]] = [deque() for _ in self.prefill]
        self._prefilling: list[dict[int, Handoff]] = [{} for _ in self.prefill]
        self._link_free = [0.0] * len(self.prefill)
        self._step_t0 = 0.0

    @property
    def routes(self) -> list[tuple[int, int]]:
        """(replica, row in its request log) per request in arrival order: the decode
        side's row, or the prefill side's for a request that ended there."""
        return [(h.d.number, h.d_row) if h.d_row >= 0 else (h.p.number, h.p_row)
                for h in self.handoffs]

    def run(self, workload: Workload, progress: ProgressFn | None = None) -> float:
        """Serve every request of ``workload``; returns the seconds until the last
        replica finished (the latest replica clock)."""
        return serve(self.replicas, self._loop, workload, progress)

    def _loop(self, workload: Workload, arrivals: Arrivals, pending: Pending,
              progress: ProgressFn | None) -> None:
        counts = Counts(arrivals.total)
        done = Engine.finisher(workload, pending, counts)  # a request ends on the decode side
        prefilled = [self._prefilled_on(p) for p in self.prefill]
        reps = self.replicas
        busy: list[tuple[float, int]] = []  # (clock, number) of replicas with work
        queued = [False] * len(reps)
        # Replicas whose last step ran nothing while blocks of theirs wait on a transfer
        # (a prefill side's held blocks, a decode side's reservations): stepped again once
        # a transfer lands, not in a loop meanwhile (their clocks would not move).
        parked: set[int] = set()
        draining = False  # nothing left to land: parked replicas step as any other
        latest = 0.0

        def wake(r: PoolReplica, t: float | None = None) -> None:
            if r.number in parked:
                parked.discard(r.number)
                if t is not None:
                    self._bring(r, t)
            if not queued[r.number] and r.stack.scheduler.has_unfinished:
                queued[r.number] = True
                heapq.heappush(busy, (r.now(), r.number))

        while True:
            while busy and busy[0][0] != (t := reps[busy[0][1]].now()):
                heapq.heapreplace(busy, (t, busy[0][1]))  # a lagging entry: refreshed
            t_step = busy[0][0] if busy else math.inf
            t_land = self._landing[0][0] if self._landing else math.inf
            t_ready = self._ready[0][0] if self._ready else math.inf
            t_arr = arrivals.next_time() if arrivals else math.inf
            t = min(t_land, t_ready, t_arr)
            if t <= t_step and t < math.inf:
                if t_land == t:
                    h = heapq.heappop(self._landing)[2]
                    self._land(h, workload, pending, counts)
                    wake(h.p, t)
                    wake(h.d, t)
                elif t_ready == t:
                    h = heapq.heappop(self._ready)[2]
                    self._want_room(h, t)
                else:
                    req = arrivals.pop_until(t)
                    assert req is not None
                    h = self._arrive(req[0], req[1], workload, pending, counts)
                    wake(h.p)
                continue
            if not busy:
                if parked:
                    draining = True
                    for i in sorted(parked):
                        wake(reps[i])
                    continue
                self._refuse_stranded()
                if self._landing:
                    continue
                return
            nxt = reps[heapq.heappop(busy)[1]]
            queued[nxt.number] = False
            self._step_t0 = nxt.now()
            fin = prefilled[nxt.index] if nxt.pool == "prefill" else done
            with nxt.working():
                ran = nxt.engine.step(nxt.start, workload, pending, counts, fin)
            nxt.idle = 0 if ran else nxt.idle + 1
            assert nxt.idle < 10_000, f"{nxt.pool} replica {nxt.index}: no progress"
            if nxt.pool == "prefill":
                self._after_prefill_step(nxt, ran)
            else:
                self._after_decode_step(nxt, ran)
            latest = max(latest, nxt.now())
            if not ran and not draining and self._waits_on_transfer(nxt):
                parked.add(nxt.number)
            else:
                wake(nxt)
            if ran and progress is not None:
                progress(counts.done, counts.total, counts.out_tokens / max(latest, 1e-9))

    def _waits_on_transfer(self, r: PoolReplica) -> bool:
        """Whether blocks of ``r`` wait on a transfer: room it lacks may free when one
        lands."""
        return r.stack.scheduler.loans > 0

    @staticmethod
    def _bring(r: PoolReplica, t: float) -> None:
        """An idle replica's clock moves up to ``t`` (a busy one is there already)."""
        while r.now() < t:
            r.clock.sleep(t - r.now())

    # -- stages --------------------------------------------------------------------------
    def _arrive(self, t: float, req: Request, workload: Workload, pending: Pending,
                counts: Counts) -> Handoff:
        g = req.to_group(t)
        gp = prefill_group(g)
        p = self.prefill[self.routers[0].route(gp, self.prefill)]
        d = self.decode[self.routers[1].route(g, self.decode)]
        h = Handoff(g, gp, p, d, t, len(self.handoffs))
        self.handoffs.append(h)
        self._bring(p, t)
        with p.working():
            p.engine.receive(gp, p.now(), workload, pending, counts)
        p.routed += 1
        h.p_row = len(p.stack.collector.rows) - 1
        if gp.rejected_reason:  # the prefill side can never run it: counted there
            h.ended = True
            return h
        d.routed += 1
        d.incoming += 1
        self._unstarted[p.index].append(h)
        self._prefilling[p.index][g.request_id] = h
        h.refused = d.stack.scheduler.refusal(g)
        if self.layerwise and h.refused is None:
            self._want_room(h, t)
        return h

    def _prefilled_on(self, p: PoolReplica) -> Callable[[SequenceGroup, float], None]:
        """What a prefill replica's step calls for each request whose prefill ended."""
        def prefilled(g: SequenceGroup, now: float) -> None:
            h = self._prefilling[p.index].pop(g.request_id)
            if h.prefill_start is None:  # started and ended in this step
                h.prefill_start = self._step_t0
            h.prefill_end = now
            if h.refused is not None:  # nothing to move: the decode side refuses it
                h.landed = now
                heapq.heappush(self._landing, (now, h.order, h))
                return
            h.held = hold(p.kv, g, p.seq_id())
            p.stack.scheduler.loans += 1
            if self.layerwise:
                if h.slot is not None:
                    self._send(h)
            else:
                heapq.heappush(self._ready, (now, h.order, h))
        return prefilled

    def _want_room(self, h: Handoff, t: float) -> None:
        self._bring(h.d, t)
        self._room[h.d.index].append(h)
        self._reserve(h.d)

    def _reserve(self, d: PoolReplica) -> None:
        """Reserve the blocks of the requests waiting for room on ``d``, in order, while
        they fit."""
        q = self._room[d.index]
        bs = d.kv.block_size
        sch = d.stack.scheduler
        # A request preempted there (or swapped out) waits for room first: the room a new
        # reservation would take is what it needs back (the waiting queue's head-of-line
        # order, which a reservation would otherwise jump).
        if len(sch.waiting) + len(sch.swapped) > len(self._landed[d.index]):
            return
        while q:
            h = q[0]
            blocks = full_blocks(h.group, bs)
            if h.held is not None:  # what the prefill side still holds of them
                blocks = min(blocks, h.held.hits)
            r = reserve(d.kv, h.group, d.seq_id(), blocks, sch.loans + 1)
            if r is None:
                return
            q.popleft()
            h.slot, h.reserved = r, d.now()
            h.hit_blocks, h.moved_blocks = r.hits, r.moved
            sch.loans += 1
            if h.prefill_end is not None:
                self._send(h)

    def _send(self, h: Handoff) -> None:
        """Both ends are ready (the prefill ended or streams, the room is reserved): the
        transfer's start and landing."""
        assert h.slot is not None and h.held is not None and h.reserved is not None
        assert h.prefill_start is not None and h.prefill_end is not None
        slot, p = h.slot, h.p
        assert h.held.hits >= slot.hits + slot.moved, "the prefill side lost blocks"
        h.moved_bytes = slot.moved * p.stack.sizing.block_bytes
        if self.measured:
            lo, hi = slot.hits, slot.hits + slot.moved
            h.link_s = copy_blocks(p.stack, h.d.stack, h.held.table[lo:hi],
                                   slot.table[lo:hi])
        else:
            h.link_s = self.link.seconds(h.moved_bytes, self.lanes) if slot.moved else 0.0
        if self.layerwise:
            start = max(h.reserved, h.prefill_start, self._link_free[p.index])
            layers = p.stack.backend.layout.num_layers
            end = max(start + h.link_s, h.prefill_end + h.link_s / layers)
        else:
            start = max(h.reserved, h.prefill_end, self._link_free[p.index])
            end = start + h.link_s
        self._link_free[p.index] = end
        h.sent, h.landed = start, end
        heapq.heappush(self._landing, (end, h.order, h))

    def _land(self, h: Handoff, workload: Workload, pending: Pending, counts: Counts) -> None:
        """The blocks are there: the prefill side lets them go, the decode side receives
        the request."""
        assert h.landed is not None
        if h.held is not None:
            h.held.release()
            h.p.stack.scheduler.loans -= 1
        d = h.d
        self._bring(d, h.landed)
        with d.working():
            d.engine.receive(h.group, d.now(), workload, pending, counts)
        d.incoming -= 1
        h.d_row = len(d.stack.collector.rows) - 1
        if h.slot is not None:
            self._landed[d.index].append(h)
            if h.group.rejected_reason:
                self._settle(d)

    def _after_prefill_step(self, p: PoolReplica, ran: bool) -> None:
        """The requests whose prefill began in this step (from its start on); those the
        step rejected as stuck end there."""
        q = self._unstarted[p.index]
        t0 = self._step_t0

        def started(h: Handoff) -> bool:
            s = h.prefill_group.seqs
            return (h.prefill_end is not None or bool(h.prefill_group.rejected_reason)
                    or (bool(s) and s[0].num_computed > 0))

        if p.stack.scheduler.cfg.policy == "fcfs":  # admitted in arrival order
            while q and started(q[0]):
                h = q.popleft()
                if h.prefill_start is None and not h.prefill_group.rejected_reason:
                    h.prefill_start = t0
        else:
            left: deque[Handoff] = deque()
            for h in q:
                if not started(h):
                    left.append(h)
                elif h.prefill_start is None and not h.prefill_group.rejected_reason:
                    h.prefill_start = t0
            self._unstarted[p.index] = left
        if not ran:  # a stuck head is rejected by a step that ran nothing
            mine = self._prefilling[p.index]
            for rid in [k for k, h in mine.items() if h.prefill_group.rejected_reason]:
                self._end_on_prefill(mine.pop(rid))

    def _end_on_prefill(self, h: Handoff) -> None:
        h.ended = True
        h.d.incoming -= 1
        if h.slot is not None:  # layerwise: its room, reserved on arrival
            h.slot.release()
            h.d.stack.scheduler.loans -= 1
            h.slot = None
            self._reserve(h.d)
        with contextlib.suppress(ValueError):
            self._room[h.d.index].remove(h)

    def _after_decode_step(self, d: PoolReplica, ran: bool) -> None:
        sch = d.stack.scheduler
        # Nothing runs, and the waiting head does not fit beside the reservations of the
        # requests that landed behind it (a request preempted there, readmitted whole):
        # those let their blocks go into the prefix cache, where the head may evict them
        # and they find what is left (computing the rest on the decode side).
        self._settle(d, spill=not ran and not sch.running and not sch.swapped)
        self._reserve(d)

    def _settle(self, d: PoolReplica, spill: bool = False) -> None:
        """Let go of the reservations whose requests hold their blocks now (admitted),
        ended, or were refused on landing; with ``spill``, every landed one's."""
        keep = []
        for h in self._landed[d.index]:
            g = h.group
            if spill or g.rejected_reason or not g.seqs or d.kv.holds(g.seqs[0]):
                assert h.slot is not None
                h.slot.release()
                h.spilled = spill and not (g.rejected_reason or not g.seqs
                                           or d.kv.holds(g.seqs[0]))
                d.stack.scheduler.loans -= 1
            else:
                keep.append(h)
        self._landed[d.index] = keep

    def _refuse_stranded(self) -> None:
        """Nothing runs or arrives, yet requests wait for room on a decode replica (the
        decode side's refusal check lets through a prompt its pool cannot take beside
        nothing): each lands refused, so the run ends with its row."""
        for d in self.decode:
            while self._room[d.index]:
                h = self._room[d.index].popleft()
                h.refused = (f"decode replica {d.index} never had room for its "
                             f"{full_blocks(h.group, d.kv.block_size)} prompt blocks")
                h.group.rejected_reason = h.refused
                t = max(d.now(), h.prefill_end or h.arrival)
                h.landed = t
                heapq.heappush(self._landing, (t, h.order, h))
