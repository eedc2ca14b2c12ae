"""The scheduler of a roofline run on the fast path: the base scheduler
(harness/sched/scheduler.py) with its decode lane (lane.py) behind the base's hooks.

- :meth:`LaneScheduler._schedule_running`: the pass over the running groups visits only
  the groups stepped one by one and the members whose step takes a new block, and counts
  the members in between (their blocks named in running order among the other groups);
- :meth:`LaneScheduler._preempt`: a member leaves the lane, synced, before it is
  preempted; the requests that left are named in the step record (``lane_left``);
- the update's hooks: members finishing this step are finished where stepping one by one
  would; a window's members are observed where their window gives a block back; who
  decodes from now on joins;
- *lane steps* (:meth:`lane_step_ready`, :meth:`schedule_lane`, :meth:`finish_lane`):
  whole steps of members only, without a StepRecord (``Engine.lane_step``).

:class:`LaneChoice` is what the roofline target passes to ``assemble_stack``: this
scheduler when the run can take the lane, the base one otherwise (and why)."""

from __future__ import annotations

import heapq

from harness.backends.costs import KVCosts
from harness.kv.base import KVManager, KVUsage, StepScores, SwapManager
from harness.kv.contiguous import ContiguousKVManager
from harness.kv.paged import PagedKVManager
from harness.roofline.fastpath.lane import RUN_ORDER, DecodeLane, LaneMember, TokenFn, lane_blocker
from harness.sched.scheduler import RunningPass, Scheduler, SchedulerConfig
from harness.sched.sequence import SeqStatus, Sequence, SequenceGroup
from harness.sched.step import LaneSums, NewToken, StepRecord, StepUpdate


def scheduler_blocker(cfg: SchedulerConfig) -> str | None:
    """Why these scheduler options keep every sequence on the per-step path (None:
    nothing here does)."""
    if cfg.mixing != "mixed":
        return f"scheduler.mixing={cfg.mixing}"
    if cfg.num_scheduler_steps != 1:
        return f"scheduler.num_scheduler_steps={cfg.num_scheduler_steps}"
    if cfg.admission == "reserve":  # its ratio moves every step, lane steps included
        return "scheduler.admission=reserve"
    if cfg.max_num_seqs > cfg.max_num_batched_tokens:
        # Then a decode could be left out of a step for budget, which members never are.
        return "scheduler.max_num_seqs > scheduler.max_num_batched_tokens"
    return None


class LaneScheduler(Scheduler):
    """The base scheduler with a decode lane (see the module docstring). ``kv``: a plain
    paged or contiguous manager (``lane_blocker`` said yes); ``costs``: the backend's
    cost declaration; ``tokens``: the executor's synthetic ids; ``synthetic_ids``: every
    id it can return."""

    def __init__(self, cfg: SchedulerConfig, kv: PagedKVManager | ContiguousKVManager,
                 eos_token_ids: tuple[int, ...], swap: SwapManager | None, costs: KVCosts,
                 tokens: TokenFn, synthetic_ids: range) -> None:
        super().__init__(cfg, kv, eos_token_ids, swap=swap)
        self.lane = DecodeLane(kv, costs, tokens, synthetic_ids, self.eos_token_ids,
                               cfg.max_model_len)
        self._left: list[int] = []  # requests that left since the last record took them
        self.lane.on_leave = self._left.append
        self._n_took = 0  # members of this step that took a block one by one

    # -- the running pass ---------------------------------------------------------------
    def _schedule_running(self, rec: StepRecord, budget: int) -> int:
        lane, running = self.lane, self.running
        L1 = lane.L + 1  # the lane step this one is
        taking = lane.taking(L1)
        if (len(running) == lane.n and len(running) <= budget and lane.paged is not None
                and lane.paged.pool.num_free >= len(taking)):
            # Every running group is a member with a token and its blocks: no loop.
            rec.lane_n = len(running)
            rec.num_decode_tokens += len(running)
            rec.lane_sums = self._lane_all(L1, taking)
            self._n_took = len(taking)
            return budget - len(running)
        # Members decode one token each, in place, summed: the loop visits only the other
        # groups and the members whose step takes or fills a block, and counts the members
        # in between.
        visit = [k for k, g in enumerate(running) if g.lane is None or g.lane.takes_block_at == L1]
        decoding = [True] * len(running)
        pending = len(running)
        for k in visit:
            g = running[k]
            if g.lane is None:
                d = decoding[k] = self._is_decoding(g)
                pending += self._decode_tokens(g) - 1 if d else -1
        run = RunningPass(rec, budget, pending, decoding)
        # Members whose write this step fills their block: named where stepping one by
        # one would, among the other groups (whose prefill chunks name blocks too).
        fills = lane.fills(L1)
        f = v = n_lane = 0
        while run.i < len(self.running):
            i = run.i
            while v < len(visit) and visit[v] < i:
                v += 1
            skip = min(visit[v] if v < len(visit) else len(self.running),
                       len(self.running)) - i
            if skip:
                # As one by one: decodes until the budget is spent (n > 1 groups can hold
                # more sequences than max_num_seqs counts), then the rest wait.
                take = min(skip, run.budget)
                n_lane += take
                run.budget -= take
                run.pending -= take
                run.i += take
                if take < skip:
                    break
                continue
            g = self.running[i]
            while f < len(fills) and fills[f].run_order < g.run_order:
                lane.name_filled(fills[f], L1)
                f += 1
            if g.lane is not None:
                if not self._take_block(run, g, g.lane, L1):
                    break
                n_lane += 1
            elif not self._schedule_group(run):
                break
            run.i += 1
        # Members the loop did not reach (out of token budget) wait for the next step,
        # which the lane cannot express: they leave it, synced, and go one by one.
        for g in self.running[run.i:]:
            if g.lane is not None:
                lane.leave(g.lane)
        for m in fills[f:]:
            lane.name_filled(m, L1)
        rec.lane_n = n_lane
        rec.num_decode_tokens += n_lane
        if n_lane:
            rec.lane_sums = lane.context_sums(L1)
        return run.budget

    def _take_block(self, run: RunningPass, g: SequenceGroup, m: LaneMember, L1: int) -> bool:
        """A member whose step takes a new block: the lane's own path, preempting from the
        back of ``running`` for a free block. False: the pass ends (out of budget, or
        ``g`` was itself preempted)."""
        assert m.takes_block_at == L1
        if run.budget == 0:
            return False
        while not self.lane.take_block(m, L1):
            victim = self.running[-1]
            self._preempt_in_pass(run, victim)
            if victim is g:
                break
        if g.lane is None:  # preempted itself
            return False
        self._n_took += 1
        run.budget -= 1
        run.pending -= 1
        return True

    def _lane_all(self, L1: int, taking: list[LaneMember]) -> LaneSums:
        """Every running group is a member, and lane step ``L1`` has a token for each and
        a free block for each of ``taking``: what the loop of :meth:`_schedule_running`
        would do, the blocks named and taken in running order (naming a held block and
        taking a free one commute), in two passes; returns the members' sums."""
        lane = self.lane
        lane.name_filled_all(lane.fills(L1), L1)
        lane.take_blocks(taking, L1)
        return lane.context_sums(L1)

    def _preempt(self, g: SequenceGroup, rec: StepRecord) -> None:
        if g.lane is not None:
            self.lane.leave(g.lane)
        super()._preempt(g, rec)

    def _scheduled(self, rec: StepRecord) -> None:
        if self._left:
            rec.lane_left = self._left.copy()
            self._left.clear()
        if not rec.is_empty:
            self.lane.scheduled(rec.lane_n, self._n_took)
        self._n_took = 0

    # -- lane steps ----------------------------------------------------------------------
    def lane_step_ready(self) -> bool:
        """Whether the next step is a *lane step*: every running group a decode-lane
        member (paged, no window), a free block for each member that needs one, and
        nothing to swap in or admit (the waiting head is held back by ``max_num_seqs``).
        Such a step changes nothing but the members' sums and blocks, the clocks and the
        members it finishes: :meth:`schedule_lane` and :meth:`finish_lane` then do what
        :meth:`schedule` and :meth:`update` would, without a StepRecord
        (Engine.lane_step)."""
        lane = self.lane
        if lane.paged is None or lane.window is not None or self.swapped:
            return False
        n = len(self.running)
        if n == 0 or n != lane.n or n > self.cfg.max_num_batched_tokens:
            return False
        if lane.blocks_taken_at(lane.L + 1) > lane.paged.pool.num_free:
            return False
        return not self.waiting or (self.num_running_seqs + len(self.waiting.head().live_seqs)
                                    > self.cfg.max_num_seqs)

    def schedule_lane(self) -> tuple[int, LaneSums, KVUsage]:
        """:meth:`schedule` of the step :meth:`lane_step_ready` found; returns its step
        number, the members' sums and what the KV manager holds for its forward. Its
        cache operations can only be the slots a finished request's frees invalidated,
        which nothing modelled reads: they are dropped."""
        lane = self.lane
        assert self._window_left == 0
        step = self._step
        self._step += 1
        L1 = lane.L + 1
        taking = lane.taking(L1)
        sums = self._lane_all(L1, taking)
        ops = self.kv.take_cache_ops()
        assert not ops.copies and not ops.tier_ops, "a lane step has no copies or loads"
        lane.scheduled(sums.n, len(taking))
        return step, sums, self.kv.usage()

    def finish_lane(self) -> list[SequenceGroup]:
        """:meth:`update` of a lane step, after :meth:`end_forward`: the members whose
        update this is finish, in running order; returns their groups, retired."""
        for m in sorted(self.lane.finishing(), key=RUN_ORDER):
            self._finish_seq(m.seq, m.reason)
        return self._retire_finished()

    def leave_lane(self) -> list[int]:
        """Every member leaves, synced (the run ended or stopped); returns their request
        ids (the metrics collector brings their token times up to date)."""
        self.lane.leave_all()
        left = self._left.copy()
        self._left.clear()
        return left

    # -- the update's hooks --------------------------------------------------------------
    def _append_tokens(self, rec: StepRecord, appends: list[tuple[Sequence, NewToken]]
                       ) -> None:
        # Members finishing this step are finished where stepping one by one would: among
        # the decodes in running order, before the prefills' tokens (their freed blocks
        # enter the pool's queues in that order).
        fin = sorted(self.lane.finishing(), key=RUN_ORDER) if rec.lane_n else []
        if not fin:
            super()._append_tokens(rec, appends)
            return
        decodes = {id(s.seq) for s in rec.seqs if s.is_decode}
        k = 0
        for seq, t in appends:
            if k < len(fin):
                before = (seq.group.run_order if id(t.seq) in decodes and not t.fork
                          else None)
                while k < len(fin) and (before is None or fin[k].run_order < before):
                    self._finish_seq(fin[k].seq, fin[k].reason)
                    k += 1
            if t.cum_logprob is not None:
                seq.cum_logprob = t.cum_logprob
            self._append_token(seq, t.token)
        for m in fin[k:]:
            self._finish_seq(m.seq, m.reason)

    def _observe(self, rec: StepRecord, scores: StepScores | None) -> None:
        # A window's members whose window leaves a block this step: observed where
        # stepping one by one would (every decode is observed each step; the others' give
        # nothing back), in running order among the step's sequences.
        lane = self.lane
        due = lane.drops_due() if lane.window is not None else []
        if not due:
            super()._observe(rec, scores)
            return
        observed = [s.seq for s in rec.seqs if s.seq.status is SeqStatus.RUNNING]
        # both in running order; members and the step's groups are distinct
        observed = list(heapq.merge(observed, [m.seq for m in due],
                                    key=lambda s: s.group.run_order))
        self.kv.observe(observed, scores)
        lane.redrop(due)

    def _updated(self, rec: StepRecord, upd: StepUpdate) -> None:
        for s in rec.seqs:  # who decodes from now on joins
            g = s.seq.group
            if g.lane is None and s.sample and self.lane.try_join(g):
                upd.lane_joined.append(g.request_id)


class LaneChoice:
    """The scheduler a roofline run gets (``assemble_stack``'s ``make_scheduler``): a
    :class:`LaneScheduler` when the run can take the lane, else the base scheduler;
    ``why`` says why not (None: it took the lane)."""

    def __init__(self, costs: KVCosts, enabled: bool, tokens: TokenFn,
                 synthetic_ids: range) -> None:
        self.costs, self.tokens, self.synthetic_ids = costs, tokens, synthetic_ids
        self.why: str | None = None if enabled else "roofline.fast_path=false"

    def __call__(self, cfg: SchedulerConfig, kv: KVManager, eos_token_ids: tuple[int, ...],
                 swap: SwapManager | None) -> Scheduler:
        if self.why is None:
            self.why = scheduler_blocker(cfg) or lane_blocker(kv, self.costs)
        if self.why is not None:
            return Scheduler(cfg, kv, eos_token_ids, swap=swap)
        assert isinstance(kv, PagedKVManager | ContiguousKVManager)
        return LaneScheduler(cfg, kv, eos_token_ids, swap, self.costs, self.tokens,
                             self.synthetic_ids)
