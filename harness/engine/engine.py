"""The engine loop: schedule -> cache ops -> forward -> sample -> update -> metrics."""

from __future__ import annotations

import heapq
from collections.abc import Callable

import torch

from harness.backends.base import KVBackend
from harness.engine.beam import advance_beams
from harness.engine.executor import Executor, ModelExecutor
from harness.engine.sampler import Sampler
from harness.metrics.collector import MetricsCollector
from harness.model.llama import LlamaModel
from harness.sched.scheduler import Scheduler
from harness.sched.sequence import Sequence, SequenceGroup
from harness.sched.step import NewToken, StepOutcome
from harness.workloads.base import FollowsRejections, Request, Workload

ProgressFn = Callable[[int, int, float], None]  # (requests done, total known, tokens/s)


class Engine:
    """Runs one workload to completion on one model, backend and scheduler."""

    def __init__(self, model: LlamaModel | None, backend: KVBackend, scheduler: Scheduler,
                 sampler: Sampler, metrics: MetricsCollector, device: torch.device,
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

    def run(self, workload: Workload, progress: ProgressFn | None = None) -> float:
        """Serve every request of ``workload``; returns the wall time in seconds.

        Arrival times are honoured on the wall clock: a request is handed to the scheduler
        only once it has arrived, and an idle engine sleeps until the next arrival.
        """
        sch, col = self.scheduler, self.metrics
        clock = self.executor.clock  # the wall clock, or the roofline's modelled time
        start = clock.now()
        pending: list[tuple[float, int, Request]] = []
        for r in workload.initial_requests():
            heapq.heappush(pending, (r.arrival_s, r.request_id, r))
        total, done, out_tokens, idle = len(pending), 0, 0, 0
        carry_s = 0.0  # bookkeeping after the last row was taken, charged to the next
        while pending or sch.has_unfinished:
            now = clock.now() - start
            while pending and pending[0][0] <= now:
                arrival, _, req = heapq.heappop(pending)
                g = req.to_group(arrival)
                col.on_arrival(g, arrival)
                if not sch.add(g):
                    done += 1
                    total += self._follow_up(workload, g, pending, now, rejected=True)
            if not sch.has_unfinished:
                if pending:
                    clock.sleep(pending[0][0] - (clock.now() - start))
                continue
            t0 = clock.now()
            rec = sch.schedule()
            self.executor.apply_cache_ops(rec)
            if rec.is_empty:
                for stuck in rec.rejected:  # can never be admitted: the run goes on
                    done += 1
                    total += self._follow_up(workload, stuck, pending,
                                             clock.now() - start, rejected=True)
                idle += 1
                # An invariant, not a user error: something runs yet nothing is schedulable.
                assert idle < 10_000, f"no progress: running={sch.running} waiting={sch.waiting}"
                continue
            idle = 0
            out = self.executor.forward(rec)
            forward_s = out.forward_s
            sch.end_forward()
            outcome = self._sample(out.logits, [s.seq for s in out.samplers])
            outcome.scores = self.executor.take_scores()
            upd = sch.update(rec, outcome)
            t_tok = clock.now()
            col.on_tokens(rec, upd, [s.seq.group for s in out.samplers], t_tok - start)
            out_tokens += len(out.samplers)
            for g in upd.finished:
                done += 1
                self.sampler.forget(g)
                total += self._follow_up(workload, g, pending, t_tok - start)
            # The row's own bookkeeping is charged to the next step: no step's overhead
            # leaves out the collector (it once hid 2.7 ms per step at 4096 sequences).
            t_end = clock.now()
            col.on_step(rec, upd, t0 - carry_s, t_end, forward_s, start, out.reads)
            carry_s = clock.now() - t_end
            if progress is not None:
                progress(done, total, out_tokens / max(t_end - start, 1e-9))
        return clock.now() - start

    @staticmethod
    def _follow_up(workload: Workload, group: SequenceGroup,
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

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> StepOutcome:
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
        if owners:
            toks = self.sampler.sample(logits[rows], owners, samples)
            out.tokens += [NewToken(s, t, fork=k is not None)
                           for s, t, k in zip(owners, toks, samples)]
        for g, brows, bseqs in beams.values():
            # All live beams advance together. After a recompute preemption the beams'
            # prefills may end in different steps: keep each row until the last arrives.
            pending = self._beam_rows.setdefault(g.request_id, {})
            for r, seq in zip(brows, bseqs):
                pending[seq.seq_id] = logits[r]
            live = g.live_seqs
            if all(q.seq_id in pending for q in live):
                beam_logits = torch.stack([pending[q.seq_id] for q in live])
                del self._beam_rows[g.request_id]
                advance_beams(g, live, beam_logits, self.scheduler.eos_token_ids,
                              self.scheduler.cfg.max_model_len, out)
        return out
