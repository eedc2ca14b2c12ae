"""The engine loop: schedule -> cache ops -> forward -> sample -> update -> metrics."""

from __future__ import annotations

import contextlib
import heapq
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from harness.backends.base import KVBackend
from harness.engine.beam import advance_beams
from harness.engine.executor import (
    Executor,
    LaneExecutor,
    LaneScheduling,
    ModelExecutor,
    StepOutput,
    WallClock,
)
from harness.engine.sampler import TokenSampler
from harness.metrics.collector import MetricsCollector
from harness.model.llama import LlamaModel
from harness.sched.scheduler import Scheduler
from harness.sched.sequence import Sequence, SequenceGroup
from harness.sched.step import NewToken, StepOutcome
from harness.workloads.base import FollowsRejections, Request, StreamsRequests, Workload

ProgressFn = Callable[[int, int, float], None]  # (requests done, total known, tokens/s)


class Engine:
    """Runs one workload to completion on one model, backend and scheduler."""

    def __init__(self, model: LlamaModel | None, backend: KVBackend, scheduler: Scheduler,
                 sampler: TokenSampler, metrics: MetricsCollector, device: torch.device,
                 executor: Executor | None = None) -> None:
        """``executor``: what runs each step's forward and keeps the clock (default: the
        real forward of ``model`` on the wall clock; harness.engine.executor)."""
        self.model = model
        self.backend = backend
        self.scheduler = scheduler
        self.sampler = sampler
        self.metrics = metrics
        self.device = device
        self._beam_rows: dict[int, dict[int, torch.Tensor]] = {}  # beam logits held back
        if executor is None:
            assert model is not None, "the model executor needs a model"
            executor = ModelExecutor(model, backend, device)
        executor.bind(scheduler.kv)
        self.executor = executor
        self._carry_s = 0.0  # bookkeeping after the last row was taken, charged to the next

    def run(self, workload: Workload, progress: ProgressFn | None = None) -> float:
        """Serve every request of ``workload``; returns the wall time in seconds.

        Arrival times are honoured on the wall clock: a request is handed to the scheduler
        only once it has arrived, and an idle engine sleeps until the next arrival.
        """
        clock = self.executor.clock  # the wall clock, or the roofline's modelled time
        start = clock.now()
        # Requests not yet arrived, by (arrival, request id): follow-ups in a heap, and a
        # streamed workload's initial requests (StreamsRequests) taken from its iterator
        # one at a time, in the same order, as if they had all been in the heap. Only on
        # a modelled clock: on the wall clock, building a request (its prompt's text)
        # between steps would delay the next step and show in the latencies.
        pending: list[tuple[float, int, Request]] = []
        api = self.metrics.api  # a served what-if's API server retimes the arrivals
        arrivals = Arrivals(pending, workload, stream=not isinstance(clock, WallClock),
                            retime=api.retime if api is not None else None)
        try:
            self._loop(workload, arrivals, pending, start, progress)
        except BaseException:
            self.leave_lane(stopped=True)
            raise
        self.leave_lane()
        return clock.now() - start

    def leave_lane(self, stopped: bool = False) -> None:
        """At the end of a run: the roofline's decode-lane members' sequences and token
        times brought up to date (the lane is empty when every request finished).
        ``stopped`` (Ctrl-C, a failure): for the partial records, if they can be; the
        original error is what is raised, not one from here."""
        sch = self.scheduler
        if not isinstance(sch, LaneScheduling):
            return
        if stopped:
            with contextlib.suppress(Exception):
                self._left_lane(sch.leave_lane())
        else:
            self._left_lane(sch.leave_lane())

    def _left_lane(self, rids: list[int]) -> None:
        """Requests that left the roofline's decode lane: the collector brings their
        token times up to date."""
        for rid in rids:
            self.metrics.lane_leave(rid)

    @classmethod
    def finisher(cls, workload: Workload, pending: list[tuple[float, int, Request]],
                 counts: Counts) -> Callable[[SequenceGroup, float], None]:
        """What :meth:`step` calls for each request that finished: it is counted done,
        and what the workload sends after it (a conversation's next turn) is queued."""
        def finished(g: SequenceGroup, now: float) -> None:
            counts.done += 1
            counts.total += cls.follow_up(workload, g, pending, now)
        return finished

    def _loop(self, workload: Workload, arrivals: Arrivals,
              pending: list[tuple[float, int, Request]], start: float,
              progress: ProgressFn | None) -> None:
        sch, clock = self.scheduler, self.executor.clock
        counts = Counts(arrivals.total)
        finished = self.finisher(workload, pending, counts)
        # The roofline's lane steps (LaneScheduling.lane_step_ready): whole steps of decode-lane
        # members only, without the per-step records (issue #24).
        lane_ex = self.executor if isinstance(self.executor, LaneExecutor) else None
        lane_sch = sch if isinstance(sch, LaneScheduling) else None
        lanes = lane_ex is not None and lane_sch is not None
        idle = 0
        while arrivals or sch.has_unfinished:
            now = clock.now() - start
            while (req := arrivals.pop_until(now)) is not None:
                self.receive(req[1].to_group(req[0]), now, workload, pending, counts)
            if not sch.has_unfinished:
                if arrivals:
                    clock.sleep(arrivals.next_time() - (clock.now() - start))
                continue
            if lanes and lane_sch is not None and lane_sch.lane_step_ready():
                assert lane_ex is not None
                self.lane_step(lane_ex, lane_sch, start, counts, finished)
                ran = True
            else:
                ran = self.step(start, workload, pending, counts, finished)
            idle = 0 if ran else idle + 1
            # An invariant, not a user error: something runs yet nothing is schedulable.
            assert idle < 10_000, f"no progress: running={sch.running} waiting={sch.waiting}"
            if ran and progress is not None:
                progress(counts.done, counts.total,
                         counts.out_tokens / max(clock.now() - start, 1e-9))

    def receive(self, g: SequenceGroup, now: float, workload: Workload,
                pending: list[tuple[float, int, Request]], counts: Counts) -> None:
        """Request ``g`` (its ``arrival_time`` and ``now``: seconds from the run's start),
        handed to the scheduler; one it can never run is rejected here (its follow-ups
        queued from ``now``)."""
        self.metrics.on_arrival(g, g.arrival_time)
        if not self.scheduler.add(g):
            counts.done += 1
            counts.total += self.follow_up(workload, g, pending, now, rejected=True)
            self.metrics.on_rejected(g)

    def step(self, start: float, workload: Workload, pending: list[tuple[float, int, Request]],
             counts: Counts, finished: Callable[[SequenceGroup, float], None]) -> bool:
        """One step of the engine: schedule -> cache ops -> forward -> sample -> update ->
        metrics. ``finished(group, now)`` is called for each request that finished (its
        follow-ups), before the step's row is taken. False: nothing was schedulable (a
        request that can never be admitted is rejected then)."""
        sch, col, clock = self.scheduler, self.metrics, self.executor.clock
        t0 = clock.now()
        rec = sch.schedule()
        if rec.lane_left:  # preempted out of the roofline's decode lane
            self._left_lane(rec.lane_left)
        self.executor.apply_cache_ops(rec)
        if rec.is_empty:
            for stuck in rec.rejected:  # can never be admitted: the run goes on
                counts.done += 1
                counts.total += self.follow_up(workload, stuck, pending,
                                                clock.now() - start, rejected=True)
                col.on_rejected(stuck)
            return False
        out = self.executor.forward(rec)
        sch.end_forward()
        outcome = self._sample(out, [s.seq for s in out.samplers])
        forward_s = out.forward_seconds()  # (CUDA events: ready once the tokens are read)
        outcome.scores = self.executor.take_scores()
        upd = sch.update(rec, outcome)
        t_tok = clock.now()
        col.on_tokens(rec, upd, [s.seq.group for s in out.samplers], t_tok - start)
        counts.out_tokens += len(out.samplers) + rec.lane_n
        for g in upd.finished:
            self.sampler.forget(g)
            finished(g, t_tok - start)
        # The row's own bookkeeping is charged to the next step: no step's overhead
        # leaves out the collector (it once hid 2.7 ms per step at 4096 sequences).
        t_end = clock.now()
        col.on_step(rec, upd, t0 - self._carry_s, t_end, forward_s, start, out.reads)
        for g in upd.finished:
            # Its row, outputs and follow-ups are made: drop its sequences, which
            # point back at it (a cycle only a full collection would free, rare in a
            # long run: the decode lane's peak RSS was 34% higher for want of it).
            g.seqs.clear()
        self._carry_s = clock.now() - t_end
        return True

    def lane_step(self, ex: LaneExecutor, sch: LaneScheduling, start: float, counts: Counts,
                  finished: Callable[[SequenceGroup, float], None]) -> None:
        """:meth:`step` of a step ``LaneScheduling.lane_step_ready`` found: the same
        scheduling, clock, tokens, finishes and row, without a StepRecord, an output to
        sample or tokens to apply (the lane's are summed). ``ex``: this engine's executor
        (a protocol's isinstance check costs 40 us: it is made once a run)."""
        col = self.metrics
        clock = ex.clock
        t0 = clock.now()
        step, sums, usage = sch.schedule_lane()
        forward_s, reads = ex.forward_lane(sums.n, sums)
        self.scheduler.end_forward()
        done = sch.finish_lane()
        t_tok = clock.now()
        col.on_lane_tokens(sums.n, done, t_tok - start)
        counts.out_tokens += sums.n
        for g in done:
            self.sampler.forget(g)
            finished(g, t_tok - start)
        t_end = clock.now()
        col.on_lane_step(step, sums.n, t0 - self._carry_s, t_end, forward_s, start, reads,
                         usage, len(done))
        for g in done:
            g.seqs.clear()  # (as step() does)
        self._carry_s = clock.now() - t_end

    @staticmethod
    def follow_up(workload: Workload, group: SequenceGroup,
                   pending: list[tuple[float, int, Request]], now: float,
                   rejected: bool = False) -> int:
        """Queue what the workload sends after ``group`` finished (or was rejected, for a
        workload that follows rejections); returns how many requests that added."""
        if rejected:
            reqs = workload.on_rejected(group) if isinstance(workload, FollowsRejections) \
                else []
        else:
            reqs = workload.on_finished(group)
        for r in reqs:
            arrival = now + r.arrival_s
            if r.earliest_s is not None:  # a trace's own time for a later turn
                arrival = max(arrival, r.earliest_s)
            heapq.heappush(pending, (arrival, r.request_id, r))
        return len(reqs)

    def _sample(self, step: StepOutput, seqs: list[Sequence]) -> StepOutcome:
        """The step's outcome from its logits: the next token per sampling sequence. A
        request with n > 1 forks its samples right after its prompt (each fork shares the
        prompt's blocks and draws its own token); a beam search request advances all its
        beams together (harness.engine.beam). Nothing is changed here: the scheduler's
        ``update`` applies the outcome."""
        out = StepOutcome()
        rows: list[int] = []
        owners: list[Sequence] = []
        samples: list[int | None] = []
        beams: dict[int, tuple[SequenceGroup, list[int], list[Sequence]]] = {}
        for i, seq in enumerate(seqs):
            g = seq.group
            if g.params.use_beam_search:
                entry = beams.setdefault(g.request_id, (g, [], []))
                entry[1].append(i)
                entry[2].append(seq)
                continue
            rows.append(i)
            owners.append(seq)
            samples.append(None)
            if g.params.n > 1 and len(g.seqs) == 1:
                for k in range(1, g.params.n):  # sample k: the k-th fork, made by update
                    rows.append(i)
                    owners.append(seq)
                    samples.append(k)
        ids = step.one_hot
        if owners:
            if ids is not None and all(q.group.params.temperature <= 0 for q in owners):
                toks = [ids[r] for r in rows]  # a one-hot row's argmax is its id
            else:
                toks = self.sampler.sample(step.dense_logits()[rows], owners, samples)
            out.tokens += [NewToken(s, t, fork=k is not None)
                           for s, t, k in zip(owners, toks, samples)]
        for g, brows, bseqs in beams.values():
            # All live beams advance together. After a recompute preemption the beams'
            # prefills may end in different steps: keep each row until the last arrives.
            pending = self._beam_rows.setdefault(g.request_id, {})
            for r, seq in zip(brows, bseqs):
                pending[seq.seq_id] = step.dense_logits()[r]
            live = g.live_seqs
            if all(q.seq_id in pending for q in live):
                beam_logits = torch.stack([pending[q.seq_id] for q in live])
                del self._beam_rows[g.request_id]
                advance_beams(g, live, beam_logits, self.scheduler.eos_token_ids,
                              self.scheduler.cfg.max_model_len, out)
        return out


@dataclass
class Counts:
    """Requests known and done, and tokens made, for the progress line."""

    total: int
    done: int = 0
    out_tokens: int = 0


class Arrivals:
    """The requests yet to arrive: the ``pending`` heap of (arrival, request id, request)
    that follow-ups are pushed to, merged with a streamed workload's iterator (whose
    requests come in that same order), so that the engine takes them exactly as it would
    from one heap holding them all, without holding them all."""

    def __init__(self, pending: list[tuple[float, int, Request]], workload: Workload,
                 stream: bool = True,
                 retime: Callable[[Iterable[Request]], Iterator[Request]] | None = None
                 ) -> None:
        """``retime``: what the initial requests pass through first, in arrival order
        (harness.metrics.api_server: a served what-if's API server, which keeps the
        order); follow-ups do not."""
        self.pending = pending
        self._stream: Iterator[Request] | None = None
        self._head: Request | None = None
        if stream and isinstance(workload, StreamsRequests):
            self._stream = workload.stream_requests()
            if retime is not None:
                self._stream = retime(self._stream)
            self._head = next(self._stream, None)
            self.total = workload.num_initial
        else:
            initial: Iterable[Request] = workload.initial_requests()
            if retime is not None:
                initial = retime(sorted(initial, key=lambda r: (r.arrival_s, r.request_id)))
            for r in initial:
                heapq.heappush(pending, (r.arrival_s, r.request_id, r))
            self.total = len(pending)

    def __bool__(self) -> bool:
        return bool(self.pending) or self._head is not None

    def next_time(self) -> float:
        h, p = self._head, self.pending
        if h is None:
            return p[0][0]
        return min(h.arrival_s, p[0][0]) if p else h.arrival_s

    def pop_until(self, now: float) -> tuple[float, Request] | None:
        """The next request arrived by ``now`` (None: none has)."""
        h, p = self._head, self.pending
        if h is not None and h.arrival_s <= now and (
                not p or (h.arrival_s, h.request_id) < p[0][:2]):
            assert self._stream is not None
            nxt = next(self._stream, None)
            if nxt is not None and (nxt.arrival_s, nxt.request_id) < (h.arrival_s,
                                                                       h.request_id):
                raise AssertionError(f"stream_requests out of order: request "
                                     f"{nxt.request_id} at {nxt.arrival_s} s after "
                                     f"{h.request_id} at {h.arrival_s} s")
            self._head = nxt
            return h.arrival_s, h
        if p and p[0][0] <= now:
            arrival, _, req = heapq.heappop(p)
            return arrival, req
        return None
