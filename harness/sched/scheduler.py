"""Iteration-level (continuous) batching over waiting / running / swapped queues.

Each :meth:`Scheduler.schedule` call decides one engine step under two budgets,
``max_num_seqs`` and ``max_num_batched_tokens``:

1. Running groups, oldest first. Decodes take one token per sequence; a group still in
   (chunked) prefill takes what the budget leaves after every running decode has been
   counted, so prefills never starve decodes. A group that cannot get its slots preempts
   the most recently admitted group (LIFO), by recompute or swap, until it fits or is the
   victim itself.
2. If nobody was preempted: swapped groups come back (oldest first).
3. If nobody was preempted and nothing is swapped: waiting groups are admitted in policy
   order (FCFS, or priority then arrival), each only if the KV manager can hold it with a
   watermark of free blocks to spare, so an admission does not immediately preempt.

A group's sequences are admitted, scheduled, preempted and finished together.

Options mirror what published engines do (``SchedulerConfig``): ``mixing=
prefill_first`` (a step that can prefill runs only prefills, else only decodes: vLLM V0
without chunked prefill, whole prompts; SGLang with ``chunked_prefill``, whose prefill
batches take chunks of the budget and continue a chunked prompt before the decodes run
again), ``admission=no_evict`` (TensorRT-LLM's GUARANTEED_NO_EVICT:
a request starts only when its prompt plus max_tokens fits beside every running request's
own worst case, so nothing is ever preempted for room), ``admission=reserve`` (SGLang's
reserved output tokens, harness.sched.admission) and ``num_scheduler_steps=k``
(vLLM 0.6's multi-step scheduling: a decode-only batch is scheduled once and then runs k
steps with no admission in between; ``StepRecord.fresh`` says which steps were scheduled
anew, which is what the roofline's engine profile charges scheduling time to).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from harness.kv.base import Demand, KVManager, StepScores, SwapManager
from harness.sched.admission import TokenReserve
from harness.sched.sequence import SeqStatus, Sequence, SequenceGroup
from harness.sched.step import (
    CHECKS,
    NewToken,
    ScheduledSeq,
    StepOutcome,
    StepRecord,
    StepUpdate,
    check_distinct_slots,
)
from harness.sched.waiting import WaitingQueue
from harness.validate import at_least, one_of

PREEMPTION_MODES = ("recompute", "swap")
POLICIES = ("fcfs", "priority")
MIXING = ("mixed", "prefill_first")
ADMISSION = ("watermark", "no_evict", "reserve")


@dataclass
class SchedulerConfig:
    """The ``scheduler`` config group (its Hydra schema): the one place for its defaults."""

    max_num_seqs: int = 32
    max_num_batched_tokens: int = 1024
    chunked_prefill: bool = True
    preemption_mode: str = "recompute"  # recompute | swap
    policy: str = "fcfs"  # fcfs | priority
    max_model_len: int = 2048
    # How prefills and decodes share a step: "mixed" (decodes first, prefill chunks in
    # the budget they leave: vLLM V1, TensorRT-LLM, SGLang --enable-mixed-chunk) or
    # "prefill_first" (a step that can prefill runs only prefills and the running decodes
    # wait; otherwise a decode-only step: vLLM V0 with chunked prefill off, whole prompts;
    # SGLang's default with chunked prefill on, chunks of the budget, a chunked prompt
    # continued first).
    mixing: str = "mixed"
    # When a waiting request may start: "watermark" (its prompt fits now, leaving a
    # watermark of free blocks; its growth may preempt later: vLLM), "no_evict" (its
    # prompt + max_tokens fit beside every running request's worst case: TensorRT-LLM's
    # GUARANTEED_NO_EVICT, which never preempts for room) or "reserve" (its prompt + its
    # output budget fit beside a decaying share of the running requests' outputs: SGLang's
    # new_token_ratio, harness.sched.admission).
    admission: str = "watermark"
    # Steps one scheduling decision runs (vLLM 0.6's --num-scheduler-steps): a decode-only
    # batch is scheduled once, then decodes k steps with no admission in between.
    num_scheduler_steps: int = 1

    def __post_init__(self) -> None:
        one_of(self, "scheduler", "preemption_mode", PREEMPTION_MODES)
        one_of(self, "scheduler", "policy", POLICIES)
        one_of(self, "scheduler", "mixing", MIXING)
        one_of(self, "scheduler", "admission", ADMISSION)
        at_least(self, "scheduler", 1, "max_num_seqs", "max_num_batched_tokens",
                 "num_scheduler_steps")
        at_least(self, "scheduler", 2, "max_model_len")


# What builds a run's scheduler (assemble_stack's ``make_scheduler``): the scheduler
# class itself, or a choice of a subclass (the roofline's fast path).
SchedulerFactory = Callable[["SchedulerConfig", KVManager, tuple[int, ...],
                             "SwapManager | None"], "Scheduler"]


@dataclass(slots=True)
class RunningPass:
    """One step's pass over the running groups (:meth:`Scheduler._schedule_running`):
    the record it fills, the token ``budget`` left, the tokens the running decodes not
    scheduled yet will still need (``pending``: prefills get only what is left of the
    budget after them), whether each group decodes (by its index in ``running`` when the
    pass began: preemptions only shrink its tail) and ``i``, the group being scheduled."""

    rec: StepRecord
    budget: int
    pending: int
    decoding: list[bool]
    i: int = 0


class Scheduler:
    """Decides what runs each step; owns the queues, never touches tensors.

    ``swap``: the KV manager's swap interface when preemption by swap is on (checked once
    when the stack is built), else None.
    """

    def __init__(self, cfg: SchedulerConfig, kv: KVManager,
                 eos_token_ids: tuple[int, ...] = (), swap: SwapManager | None = None) -> None:
        self.cfg = cfg
        self.kv = kv
        self.swap = swap
        self.eos_token_ids = frozenset(eos_token_ids)
        self._by_priority = cfg.policy == "priority"
        self.waiting = WaitingQueue()  # sorted by sort_key
        self.running: list[SequenceGroup] = []  # admission order: LIFO victims at the end
        self.swapped: deque[SequenceGroup] = deque()
        self.num_rejected = 0  # requests that can never run (their rows say why)
        self._just_finished: list[SequenceGroup] = []
        self._next_seq_id = 0
        self._step = 0
        self.num_running_seqs = 0
        self.preemptions_recompute = 0
        self.preemptions_swap = 0
        self.recomputed_tokens = 0
        self._window_left = 0  # steps left of a multi-step window (num_scheduler_steps)
        # admission=no_evict: each running group's worst-case slots (prompt + max_tokens),
        # and the pool's slots they must fit in together.
        self._worst: dict[int, int] = {}
        self._worst_total = 0
        self._capacity = kv.usage().total_slots if cfg.admission == "no_evict" else 0
        # admission=reserve: SGLang's reserved share of the running requests' outputs.
        self._reserve = TokenReserve(cfg.max_model_len) if cfg.admission == "reserve" \
            else None
        self._run_order = 0  # admissions to ``running`` so far: its order, as a key
        # Requests whose blocks the KV manager holds for a transfer between replicas (a
        # disaggregated cluster's: harness.cluster.disagg). They come back, so a waiting
        # head that does not fit beside them now is not stuck.
        self.loans = 0

    # -- queue management --------------------------------------------------------------
    def add(self, group: SequenceGroup) -> bool:
        """Queue a request; False (and ``group.rejected_reason``) if it can never run."""
        reason = self._rejection(group)
        if reason is not None:
            group.rejected_reason = reason
            self.num_rejected += 1
            return False
        seq = Sequence(self._new_seq_id(), group, list(group.prompt_ids))
        group.seqs.append(seq)
        self._enqueue(group)
        return True

    def refusal(self, group: SequenceGroup) -> str | None:
        """Why :meth:`add` would reject ``group`` (None: it would queue it), asked before
        it is added (a disaggregated cluster's decode side: harness.cluster.disagg)."""
        return self._rejection(group)

    def _rejection(self, group: SequenceGroup) -> str | None:
        if group.rejected_reason:  # the workload knew already (harness.workloads.base)
            return group.rejected_reason
        n_prompt, p = len(group.prompt_ids), group.params
        if n_prompt == 0:
            return "empty prompt"
        if n_prompt >= self.cfg.max_model_len:
            return (f"prompt of {n_prompt} tokens leaves no room to generate within "
                    f"max_model_len={self.cfg.max_model_len}")
        if not self.cfg.chunked_prefill and n_prompt > self.cfg.max_num_batched_tokens:
            return (f"prompt of {n_prompt} tokens exceeds scheduler.max_num_batched_tokens="
                    f"{self.cfg.max_num_batched_tokens} with chunked_prefill off")
        if p.n > self.cfg.max_num_seqs:
            return f"n={p.n} exceeds scheduler.max_num_seqs={self.cfg.max_num_seqs}"
        max_tokens = min(p.max_tokens, self.cfg.max_model_len - n_prompt)
        return self.kv.admission_error(n_prompt, max_tokens, p.n)

    def _enqueue(self, group: SequenceGroup) -> None:
        self.waiting.push(group.sort_key(self._by_priority), group)
        for s in group.live_seqs:
            s.status = SeqStatus.WAITING

    def _reject_stuck_head(self) -> SequenceGroup | None:
        """Reject the head of the waiting queue when nothing runs or is swapped and it still
        cannot be admitted: the pool is then as free as it will ever be (only evictable
        cached blocks are held), so it never will be. This happens to a group of several
        sequences preempted by recompute whose sequences, recomputed without the blocks
        they shared, need more than the pool. The run goes on without it."""
        if self.running or self.swapped or not self.waiting or self.loans:
            return None
        g = self.waiting.pop_head()
        need = sum(s.num_tokens for s in g.live_seqs)
        g.rejected_reason = (
            f"cannot be readmitted: its {len(g.live_seqs)} sequences hold {need} tokens "
            "unshared after recompute preemption, more than the KV pool can take; raise "
            "cache.kv_budget, or use scheduler.preemption_mode=swap with cache.swap_space")
        for s in g.live_seqs:
            s.status = SeqStatus.FINISHED
            s.finish_reason = "rejected"
        self.num_rejected += 1
        return g

    def _new_seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id - 1

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def next_waiting_need(self) -> int | None:
        """Slots the head of the waiting queue would reserve (for external fragmentation)."""
        if not self.waiting:
            return None
        g = self.waiting.head()
        return self.kv.reservation_size(len(g.prompt_ids), g.params.max_tokens)

    # -- the step -----------------------------------------------------------------------
    def schedule(self) -> StepRecord:
        rec = StepRecord(step=self._step)
        self._step += 1
        # Inside a multi-step window the running decodes go on without a new decision.
        # (A window whose groups all finished ends early: nothing is left to continue.)
        continuing = self._window_left > 0 and bool(self.running)
        self._window_left = self._window_left - 1 if continuing else 0
        rec.fresh = not continuing
        if self.cfg.mixing == "prefill_first" and not continuing and not self.swapped:
            if self.cfg.chunked_prefill:  # SGLang: chunks of the budget, one's rest first
                self._prefill_step(rec, self.cfg.max_num_batched_tokens)
            elif self.waiting:  # vLLM V0: whole prompts
                self._admit(rec, self.cfg.max_num_batched_tokens)
            if rec.seqs:  # a prefill-only step: the running decodes wait for the next
                return self._close(rec)
        budget = self._schedule_running(rec, self.cfg.max_num_batched_tokens)
        return self._after_running(rec, budget, continuing)

    def _schedule_running(self, rec: StepRecord, budget: int) -> int:
        """The running groups' tokens this step, in running order, preempting from the
        back when the KV manager is out of room, until the token budget is spent; returns
        the budget left (a subclass may step some groups in bulk: the roofline's)."""
        running = self.running
        decoding = [self._is_decoding(g) for g in running]
        pending = sum(self._decode_tokens(g) for g, d in zip(running, decoding) if d)
        run = RunningPass(rec, budget, pending, decoding)
        while run.i < len(self.running) and self._schedule_group(run):
            run.i += 1
        return run.budget

    def _schedule_group(self, run: RunningPass) -> bool:
        """Schedule running group ``run.i``: its decodes, or the prefill chunks the
        budget leaves after the decodes. False: the pass ends here (out of budget, or the
        group was itself preempted for room)."""
        g = self.running[run.i]
        decoding = run.decoding[run.i]
        if decoding and len(g.seqs) == 1:
            return self._decode_one(run, g)
        live = g.live_seqs
        if decoding:
            n_tokens = [1] * len(live)
            if len(live) > run.budget:
                return False  # out of token budget: the rest decode next step
        else:
            n_tokens = self._chunks(live, run.budget - run.pending)
            if not any(n_tokens):
                return True
        demands = [Demand(s, n) for s, n in zip(live, n_tokens) if n]
        if not self._make_room(g, demands, lambda victim: self._preempt_in_pass(run, victim)):
            return False  # g itself was preempted (it was the last running group)
        self._commit_all(demands, run.rec)
        run.budget -= sum(n_tokens)
        if decoding:
            run.pending -= len(live)
        return True

    def _decode_one(self, run: RunningPass, g: SequenceGroup) -> bool:
        """The fast path (the bulk of every step): one sequence, one token."""
        if run.budget == 0:
            return False
        seq = g.seqs[0]
        slot = self.kv.append_slot(seq)
        while slot is None:
            victim = self.running[-1]
            self._preempt_in_pass(run, victim)
            if victim is g:
                return False
            slot = self.kv.append_slot(seq)
        run.rec.seqs.append(ScheduledSeq(seq, seq.num_computed, 1, [slot], True))
        seq.num_computed += 1
        run.rec.num_decode_tokens += 1
        run.budget -= 1
        run.pending -= 1
        return True

    def _prefill_step(self, rec: StepRecord, budget: int) -> None:
        """A prefill-only step (``mixing=prefill_first`` with chunked prefill, SGLang's
        prefill batch): the running groups still in prefill take their next chunks, then
        waiting groups are admitted in what the budget leaves; no decode runs."""
        decoding = [self._is_decoding(g) for g in self.running]
        # No decode shares this step: none holds budget back (``pending`` 0, and no
        # victim's decode is counted back).
        run = RunningPass(rec, budget, 0, [False] * len(decoding))
        while run.i < len(self.running):
            if not decoding[run.i] and not self._schedule_group(run):
                break
            run.i += 1
        if self.waiting and not rec.preempted:
            self._admit(rec, run.budget)

    def _preempt_in_pass(self, run: RunningPass, victim: SequenceGroup) -> None:
        """Preempt ``victim`` (the back of ``running``) during ``run``: a decoding victim
        not yet scheduled this step gives its share of the budget back to the prefills."""
        j = len(self.running) - 1
        if victim is not self.running[run.i] and run.decoding[j]:
            run.pending -= self._decode_tokens(victim)
        self._preempt(victim, run.rec)

    def _after_running(self, rec: StepRecord, budget: int, continuing: bool) -> StepRecord:
        """The step after its running groups: swap-ins, admissions, the multi-step window,
        then :meth:`_close`."""
        admits = not continuing and self.cfg.mixing == "mixed"
        if not rec.preempted and admits:
            self._swap_in(rec, budget)
            budget = self.cfg.max_num_batched_tokens - rec.num_tokens
        if not rec.preempted and not self.swapped and admits:
            self._admit(rec, budget)
        if rec.preempted:
            self._window_left = 0
        elif (not continuing and self.cfg.num_scheduler_steps > 1 and rec.seqs
              and rec.num_prefill_tokens == 0):
            self._window_left = self.cfg.num_scheduler_steps - 1
        return self._close(rec)

    def _close(self, rec: StepRecord) -> StepRecord:
        """The step's cache operations, usage and stuck-head rejection."""
        ops = self.kv.take_cache_ops()
        rec.copies, rec.invalidated, rec.tier_ops = ops.copies, ops.invalidated, ops.tier_ops
        if self._reserve is not None:
            self._reserve.stepped(rec.num_decode_tokens > 0, bool(self.running))
        self._scheduled(rec)
        if not rec.is_empty:
            rec.usage = self.kv.usage()  # what the forward holds (steps.csv, the ledger)
        elif not rec.preempted:
            stuck = self._reject_stuck_head()
            if stuck is not None:
                rec.rejected.append(stuck)
        if CHECKS:
            check_distinct_slots(rec)
        return rec

    def _scheduled(self, rec: StepRecord) -> None:
        """``rec`` is scheduled, before its usage is read (a hook: a subclass that steps
        groups in bulk counts their writes here)."""

    @staticmethod
    def _decode_tokens(g: SequenceGroup) -> int:
        """Tokens ``g`` decodes in a step: one per live sequence."""
        return len(g.live_seqs) if len(g.seqs) > 1 else 1

    @staticmethod
    def _is_decoding(g: SequenceGroup) -> bool:
        """Every live sequence has exactly its last sampled token left to compute. (A
        prompt with one token left is a prefill: its last token is not an output.)"""
        seqs = g.seqs
        if len(seqs) == 1:  # fast path: no generator for the common single-sequence group
            s = seqs[0]
            return (len(s.token_ids) - s.num_computed == 1
                    and s.num_computed >= s.num_prompt_tokens)
        return all(s.num_uncomputed == 1 and s.num_computed >= s.num_prompt_tokens
                   for s in seqs if s.status is SeqStatus.RUNNING)

    def _chunks(self, seqs: list[Sequence], budget: int) -> list[int]:
        """Prefill tokens per sequence: whole remainders, or chunks of the budget."""
        out = []
        for s in seqs:
            n = self._chunk_len(s, s.num_uncomputed, budget)
            budget -= n
            out.append(n)
        return out

    def _chunk_len(self, seq: Sequence, n: int, budget: int) -> int:
        """How many of the ``n`` tokens ``seq`` still has to prefill this step takes: at
        most the manager's bound (eviction backends), a chunk of the budget with chunked
        prefill, or else all of them if they fit and 0 if they do not (the whole prompt
        waits for a step it fits)."""
        budget = max(0, budget)
        cap = self.kv.max_chunk(seq)
        if cap is not None:
            return min(n, cap, budget)
        if self.cfg.chunked_prefill:
            return min(n, budget)
        return n if n <= budget else 0

    def _make_room(self, g: SequenceGroup, demands: list[Demand],
                   preempt: Callable[[SequenceGroup], None]) -> bool:
        """Preempt from the back of ``running`` until ``demands`` fit. False if ``g`` was
        the one preempted."""
        while not self.kv.can_allocate(demands, watermark=False):
            victim = self.running[-1]
            preempt(victim)
            if victim is g:
                return False
        return True

    def _commit_all(self, demands: list[Demand], rec: StepRecord) -> None:
        slots = self.kv.allocate_group(demands)
        bs = self.kv.block_size
        for d, sl in zip(demands, slots):
            seq = d.seq
            seq.num_computed += d.num_hit_tokens(bs)
            if d.compressed:
                seq.compressed_prefix = d.compressed
            start = seq.num_computed
            seq.num_computed += d.num_tokens
            sample = seq.num_computed == seq.num_tokens
            sched = ScheduledSeq(seq, start, d.num_tokens, sl, sample)
            rec.seqs.append(sched)
            if sched.is_decode:
                rec.num_decode_tokens += 1
            else:
                rec.num_prefill_tokens += d.num_tokens

    def _worst_case(self, g: SequenceGroup) -> int:
        """Slots ``g`` can come to hold: its prompt (and any output so far, after a
        preemption) plus what it may still generate, per the KV manager's sizing."""
        p, n_prompt = g.params, len(g.prompt_ids)
        max_tokens = min(p.max_tokens, self.cfg.max_model_len - n_prompt)
        return self.kv.slots_needed(n_prompt, max_tokens, p.n)

    def _release_worst(self, g: SequenceGroup) -> None:
        self._worst_total -= self._worst.pop(id(g), 0)

    def _preempt(self, g: SequenceGroup, rec: StepRecord) -> None:
        self._release_worst(g)
        self.running.remove(g)
        live = g.live_seqs
        self.num_running_seqs -= len(live)
        rec.preempted.append(g)
        kv, swap = self.kv, self.swap
        if swap is not None and swap.can_swap_out(live):
            ops = swap.swap_out(live)
            rec.swap_out += ops
            g.num_swapped_blocks += len(ops)
            for s in live:
                s.status = SeqStatus.SWAPPED
            self.swapped.append(g)
            g.num_preemptions_swap += 1
            self.preemptions_swap += 1
            return
        # Recompute: drop the K/V; the tokens (prompt + output so far) are prefilled again
        # on readmission, where the prefix cache may still hold some of them.
        for s in live:
            g.num_recomputed_tokens += s.num_computed
            self.recomputed_tokens += s.num_computed
            kv.free(s)
            s.num_computed = s.compressed_prefix = 0
        g.num_preemptions_recompute += 1
        self.preemptions_recompute += 1
        self._enqueue(g)
        if self._reserve is not None:  # SGLang's retract: admit more carefully from now
            self._reserve.retracted(self.running)

    def _swap_in(self, rec: StepRecord, budget: int) -> None:
        kv, swap = self.kv, self.swap
        while self.swapped:
            assert swap is not None, "only a swapping manager swaps out"
            g = self.swapped[0]
            live = g.live_seqs
            if (self.num_running_seqs + len(live) > self.cfg.max_num_seqs
                    or not swap.can_swap_in(live)):
                return
            self.swapped.popleft()
            rec.swap_in += swap.swap_in(live)
            for s in live:
                s.status = SeqStatus.RUNNING
            if self._capacity:
                self._worst[id(g)] = self._worst_case(g)
                self._worst_total += self._worst[id(g)]
            self._append_running(g)
            self.num_running_seqs += len(live)
            n_tokens = self._chunks(live, budget)
            demands = [Demand(s, n) for s, n in zip(live, n_tokens) if n]
            if demands and kv.can_allocate(demands, watermark=False):
                self._commit_all(demands, rec)
                budget -= sum(n_tokens)

    def _admit(self, rec: StepRecord, budget: int) -> None:
        kv = self.kv
        reserve, room = self._reserve, 0.0
        if reserve is not None:
            room = reserve.room(kv.usage(), kv.block_size, self.running)
        while self.waiting and budget > 0:
            g = self.waiting.head()
            live = g.live_seqs
            if self.num_running_seqs + len(live) > self.cfg.max_num_seqs:
                return
            demands, left, prompt_left = [], budget, 0
            for s in live:
                hit = kv.lookup_prefix(s)
                todo = s.num_tokens - hit.num_tokens(kv.block_size)
                n = self._chunk_len(s, todo, left)
                if n <= 0:
                    return  # no room this step: later requests wait behind this one
                left -= n
                prompt_left += todo
                demands.append(Demand.after(s, n, hit))
            if not kv.can_allocate(demands, watermark=True):
                return  # head-of-line: later requests wait behind this one
            if reserve is not None:  # reserve: its prompt and outputs beside the reserved
                need = reserve.need(g, prompt_left)
                if need >= room:
                    return
                room -= need
            if self._capacity:  # no_evict: the group's worst case must fit beside the rest
                worst = self._worst_case(g)
                if self._worst_total + worst > self._capacity:
                    return
                self._worst[id(g)] = worst
                self._worst_total += worst
            self.waiting.pop_head()
            for d in demands:
                d.seq.status = SeqStatus.RUNNING
            self._commit_all(demands, rec)
            self._append_running(g)
            self.num_running_seqs += len(live)
            budget = left

    def _append_running(self, g: SequenceGroup) -> None:
        g.run_order = self._run_order
        self._run_order += 1
        self.running.append(g)

    # -- after the forward (only through update) ------------------------------------------
    def _fork(self, parent: Sequence) -> Sequence:
        """A new sequence of ``parent``'s group sharing all of its K/V (beam, sample)."""
        child = Sequence(self._new_seq_id(), parent.group, list(parent.token_ids))
        child.num_prompt_tokens = parent.num_prompt_tokens
        child.num_computed = parent.num_computed
        child.compressed_prefix = parent.compressed_prefix
        child.cum_logprob = parent.cum_logprob
        child.status = parent.status
        self.kv.fork(parent, child)
        parent.group.seqs.append(child)
        if child.status is SeqStatus.RUNNING:
            self.num_running_seqs += 1
        return child

    def _finish_seq(self, seq: Sequence, reason: str) -> None:
        """Stop one sequence and give back its K/V (a pruned beam, or a finished one)."""
        if seq.status is SeqStatus.FINISHED:
            return
        if seq.status is SeqStatus.RUNNING:
            self.num_running_seqs -= 1
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self.kv.free(seq)
        if seq.group.is_finished:
            self._just_finished.append(seq.group)

    def _append_token(self, seq: Sequence, token: int) -> None:
        """Append a sampled token and stop the sequence if it hit EOS or a length limit."""
        toks = seq.token_ids
        toks.append(token)
        p = seq.group.params
        n_out = len(toks) - seq.num_prompt_tokens
        if ((token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids
                or n_out == p.stop_after):
            self._finish_seq(seq, "stop")
        elif n_out >= p.max_tokens or len(toks) >= self.cfg.max_model_len:
            self._finish_seq(seq, "length")

    def end_forward(self) -> None:
        """The step's forward is done: from here on (the forks, stops and finishes that
        :meth:`update` applies) changes count from the next step on the KV manager's
        clock; what the forward held was held for this step."""
        self.kv.end_forward()

    def update(self, rec: StepRecord, outcome: StepOutcome) -> StepUpdate:
        """After :meth:`end_forward` and sampling: apply the step's ``outcome`` (forks,
        beam hypotheses and stops, then the sampled tokens, stopping and freeing finished
        sequences), retire finished groups, let the manager's eviction policy act on the
        step's running sequences (with the backend's ``outcome.scores``), and account
        external fragmentation. The only way a step changes sequences."""
        appends = self._apply_outcome(outcome)
        self._append_tokens(rec, appends)
        done = self._retire_finished()
        self._observe(rec, outcome.scores)
        upd = StepUpdate(done, self.kv.record_external(self.next_waiting_need()))
        self._updated(rec, upd)
        return upd

    def _apply_outcome(self, outcome: StepOutcome) -> list[tuple[Sequence, NewToken]]:
        """Forks (a child copies its parent as it is, before anything is appended), beam
        hypotheses and stops; returns the sequences and their tokens to append."""
        appends = [(self._fork(t.seq) if t.fork else t.seq, t) for t in outcome.tokens]
        for g, score, toks in outcome.hypotheses:
            g.beam_finished.append((score, toks))
        for g in outcome.beams_done:
            g.best_output = max(g.beam_finished, key=lambda f: f[0])[1]
        for seq, reason in outcome.stops:
            self._finish_seq(seq, reason)
        return appends

    def _append_tokens(self, rec: StepRecord, appends: list[tuple[Sequence, NewToken]]
                       ) -> None:
        """Append the step's sampled tokens in order, stopping finished sequences."""
        for seq, t in appends:
            if t.cum_logprob is not None:
                seq.cum_logprob = t.cum_logprob
            self._append_token(seq, t.token)

    def _observe(self, rec: StepRecord, scores: StepScores | None) -> None:
        """The KV manager's eviction policy acts on the step's running sequences."""
        self.kv.observe([s.seq for s in rec.seqs if s.seq.status is SeqStatus.RUNNING],
                        scores)

    def _updated(self, rec: StepRecord, upd: StepUpdate) -> None:
        """The step's update is done (a hook)."""

    def _retire_finished(self) -> list[SequenceGroup]:
        """Move groups whose last sequence finished out of ``running``; returns them."""
        if not self._just_finished:
            return []
        done_groups = self._just_finished
        for g in done_groups:
            self._release_worst(g)
        if len(done_groups) <= 4:  # list.remove is a C scan (groups compare by identity)
            for g in done_groups:
                self.running.remove(g)
        else:
            done = {id(g) for g in done_groups}
            self.running = [g for g in self.running if id(g) not in done]
        self._just_finished = []
        return done_groups
