"""The cluster's event loop: N replicas (each a whole stack: scheduler, KV manager,
executor, collector, clock) behind one router, under one arrival stream.

Each replica keeps its own clock: the roofline's modelled time, or under executor=model a
:class:`~harness.cluster.clock.ReplicaClock` that runs only while the replica steps, so
replicas stepped in turn in this one process do not add up their times. The loop takes the
earliest event: the next arrival, routed when it is due no later than every busy
replica's next step (an idle replica's clock first moves up to it), or else one step of
the busy replica whose clock is earliest (ties: the lower index). A request arriving while
a replica's step runs is seen by it, as by one engine, when that step ends. A finished
request's follow-ups (a conversation's next turn) arrive on the shared stream from the
finishing replica's time, and are routed again: where prefix-aware routing pays.

One replica under ``round_robin`` steps exactly as :meth:`Engine.run` does (tested: the
same records).
"""

from __future__ import annotations

import contextlib
import heapq
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from harness.cluster.clock import ReplicaClock
from harness.cluster.router import Router, cached_prefix_tokens
from harness.engine.engine import Arrivals, Counts, Engine, ProgressFn
from harness.sched.sequence import SequenceGroup
from harness.stack import Stack
from harness.workloads.base import Request, Workload


class Replica:
    """One replica: its stack, its clock's start, and what was routed to it."""

    def __init__(self, index: int, stack: Stack) -> None:
        self._index = index
        self.stack = stack
        self.engine = stack.engine
        self.clock = stack.engine.executor.clock
        self.start = self.clock.now()
        self.routed = 0  # requests routed here
        self.idle = 0  # steps in a row with nothing schedulable

    @property
    def index(self) -> int:
        return self._index

    def now(self) -> float:
        """Seconds since the run's start on this replica's clock."""
        return self.clock.now() - self.start

    def in_flight(self) -> int:
        sch = self.stack.scheduler
        return len(sch.running) + len(sch.waiting) + len(sch.swapped)

    def queued(self) -> int:
        sch = self.stack.scheduler
        return len(sch.waiting) + len(sch.swapped)

    def kv_utilization(self) -> float:
        u = self.stack.kv.usage()
        return u.reserved_slots / u.total_slots if u.total_slots else 0.0

    def load_blocks(self) -> int:
        sch, kv = self.stack.scheduler, self.stack.kv
        bs = kv.block_size
        held = kv.usage().reserved_slots // bs
        # A waiting request preempted by recompute has its outputs to compute again too.
        queued = sum(-(-(len(g.seqs[0].token_ids) if g.seqs else len(g.prompt_ids)) // bs)
                     for q in (sch.waiting, sch.swapped) for g in q)
        return held + queued

    @property
    def block_size(self) -> int:
        return self.stack.kv.block_size

    def cached_prefix_tokens(self, group: SequenceGroup) -> int:
        return cached_prefix_tokens(self.stack.kv, group)

    @contextlib.contextmanager
    def working(self) -> Iterator[None]:
        """The replica's own work: its measured clock (executor=model) runs meanwhile."""
        clock = self.clock
        if not isinstance(clock, ReplicaClock):
            yield
            return
        clock.resume()
        try:
            yield
        finally:
            clock.pause()


def serve(replicas: Sequence[Replica],
          loop: Callable[[Workload, Arrivals, list[Any], ProgressFn | None], None],
          workload: Workload, progress: ProgressFn | None) -> float:
    """Run a cluster's ``loop`` over ``workload`` (its arrivals built as reached: no clock
    runs between), every replica's decode lane left at the end, or as stopped when the
    loop raises (an interrupt included); returns the latest replica clock."""
    pending: list[Any] = []
    arrivals = Arrivals(pending, workload)
    try:
        loop(workload, arrivals, pending, progress)
    except BaseException:
        for r in replicas:
            r.engine.leave_lane(stopped=True)
        raise
    for r in replicas:
        r.engine.leave_lane()
    return max(r.now() for r in replicas)


class Cluster:
    """Replicas behind a router; :meth:`run` serves a workload over all of them."""

    def __init__(self, stacks: list[Stack], router: Router) -> None:
        self.replicas = [Replica(i, st) for i, st in enumerate(stacks)]
        self.router = router
        # (replica, row in its request log) per request, in the order they arrived: the
        # cluster's requests.csv order (harness.cluster.records).
        self.routes: list[tuple[int, int]] = []

    def run(self, workload: Workload, progress: ProgressFn | None = None) -> float:
        """Serve every request of ``workload``; returns the seconds until the last
        replica finished (the latest replica clock)."""
        return serve(self.replicas, self._loop, workload, progress)

    def _loop(self, workload: Workload, arrivals: Arrivals,
              pending: list[tuple[float, int, Request]], progress: ProgressFn | None) -> None:
        counts = Counts(arrivals.total)
        finished = Engine.finisher(workload, pending, counts)
        reps = self.replicas
        # The busy replicas (unfinished work) by (clock, index), so that finding the next
        # to step costs log(busy) instead of a scan of every replica (issue #55: at 100,000
        # replicas each step scanned them all, and the run crawled). A busy replica has one
        # entry whose time is at most its clock's: its clock moves only when it steps
        # (popped, then pushed again) or, under executor=model, while it receives a request
        # (its entry then lags, and is refreshed when it reaches the top).
        busy: list[tuple[float, int]] = []
        queued = [False] * len(reps)
        latest = max(r.now() for r in reps)  # the latest clock, for the progress rate
        while True:
            while busy and busy[0][0] != (t := reps[busy[0][1]].now()):
                heapq.heapreplace(busy, (t, busy[0][1]))  # a lagging entry: refreshed
            t_step = busy[0][0] if busy else math.inf
            if arrivals and arrivals.next_time() <= t_step:
                t = arrivals.next_time()
                req = arrivals.pop_until(t)
                assert req is not None
                g = req[1].to_group(req[0])
                r = reps[self.router.route(g, reps)]
                while r.now() < t:  # an idle replica waits for the arrival (as one engine)
                    r.clock.sleep(t - r.now())
                with r.working():
                    r.engine.receive(g, r.now(), workload, pending, counts)
                r.routed += 1
                self.routes.append((r.index, len(r.stack.collector.rows) - 1))
                latest = max(latest, r.now())
                if not queued[r.index] and r.stack.scheduler.has_unfinished:
                    queued[r.index] = True
                    heapq.heappush(busy, (r.now(), r.index))
                continue
            if not busy:
                return  # nothing to arrive, nothing unfinished
            nxt = reps[heapq.heappop(busy)[1]]
            with nxt.working():
                ran = nxt.engine.step(nxt.start, workload, pending, counts, finished)
            nxt.idle = 0 if ran else nxt.idle + 1
            # An invariant, not a user error: something runs yet nothing is schedulable.
            assert nxt.idle < 10_000, f"replica {nxt.index}: no progress"
            latest = max(latest, nxt.now())
            if nxt.stack.scheduler.has_unfinished:
                heapq.heappush(busy, (nxt.now(), nxt.index))
            else:
                queued[nxt.index] = False
            if ran and progress is not None:
                progress(counts.done, counts.total, counts.out_tokens / max(latest, 1e-9))
