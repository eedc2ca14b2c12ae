"""Property tests (hypothesis state machines) for the evicting KV manager.

Each machine drives :class:`EvictingKVManager` as the scheduler and engine do: steps of
allocations (prefill chunks bounded by ``max_chunk``, decodes), the cache operations
applied to a shadow of the device (copies, invalidations, writes), random scores after
the forward, then ``observe``. After every rule: reference counts equal the tables that
hold each block; the slots of one step are distinct; no sequence holds more than its
budget; every live slot holds the token the manager says it does; the recent window and
the sink blocks are never given back; at the end nothing is leaked.
"""

from __future__ import annotations

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from harness.backends.h2o import H2OOptions
from harness.backends.knorm import KnormOptions, KnormPolicy
from harness.backends.snapkv import SnapKVOptions
from harness.kv.base import Demand, StepScores
from harness.kv.evicting import BudgetBlocks, EvictingKVManager, PolicyKVManager, WindowKVManager
from harness.kv.policies.h2o import H2OPolicy
from harness.kv.policies.snapkv import SnapKVPolicy
from harness.kv.policies.window import WindowPolicy
from harness.sched.sequence import SamplingParams, SeqStatus, Sequence, SequenceGroup

BS = 4
NUM_BLOCKS = 24
SETTINGS = settings(max_examples=60, stateful_step_count=40, deadline=None)


class _Machine(RuleBasedStateMachine):
    """Shared driving: admit, step, fork, finish. Subclasses pick the policy."""

    def __init__(self) -> None:
        super().__init__()
        self.m = self._manager()
        self.seqs: list[Sequence] = []
        self.dev: dict[int, tuple[int, int]] = {}  # slot -> (token, position) written
        self.slot_pos: dict[int, int] = {}  # the backend's per-slot position map
        self.next_id = 0
        self.rng = np.random.default_rng(0)

    def _manager(self) -> PolicyKVManager:
        raise NotImplementedError

    def _new_seq(self, prompt: list[int], max_tokens: int) -> Sequence:
        self.next_id += 1
        g = SequenceGroup(self.next_id, list(prompt), SamplingParams(max_tokens=max_tokens))
        s = Sequence(self.next_id, g, list(prompt))
        g.seqs.append(s)
        return s

    def _apply_ops(self) -> None:
        ops = self.m.take_cache_ops()
        for slot in ops.invalidated:
            self.slot_pos.pop(slot, None)
        for op in ops.copies:
            for k in range(op.num_slots):
                if op.src + k in self.dev:
                    self.dev[op.dst + k] = self.dev[op.src + k]
                if op.src + k in self.slot_pos:
                    self.slot_pos[op.dst + k] = self.slot_pos[op.src + k]
                if op.move:  # compaction: the source holds nothing now
                    self.slot_pos.pop(op.src + k, None)

    def _write(self, seq: Sequence, start: int, slots: list[int]) -> None:
        for i, slot in enumerate(slots):
            self.dev[slot] = (seq.token_ids[start + i], start + i)
            self.slot_pos[slot] = start + i

    def _carried(self, s: Sequence) -> bool:
        """Whether ``s`` (or the sequence it forked from) started from a compressed prefix:
        not compressed again, so no budget holds it (harness.kv.compressed)."""
        st_ = self.m._seqs.get(s.seq_id)
        return isinstance(st_, BudgetBlocks) and st_.carried > 0

    def _demand(self, s: Sequence) -> Demand:
        cap = self.m.max_chunk(s)
        left = s.num_uncomputed
        return Demand(s, min(left, cap) if cap else left)

    @rule(n=st.integers(1, 14), max_tokens=st.integers(1, 12), tok=st.integers(0, 3))
    def admit(self, n: int, max_tokens: int, tok: int) -> None:
        s = self._new_seq([tok + i for i in range(n)], max_tokens)
        if not self.m.can_allocate([self._demand(s)], watermark=False):
            return
        s.status = SeqStatus.RUNNING
        self.seqs.append(s)
        self._step([s])

    @precondition(lambda self: bool(self.seqs))
    @rule(tok=st.integers(0, 50))
    def step(self, tok: int) -> None:
        """One engine step over every running sequence: a decode or its next chunk each."""
        for s in self.seqs:
            if s.num_uncomputed == 0:
                s.token_ids.append(tok + s.seq_id)  # sampled last step
        self._step(list(self.seqs))

    def _step(self, seqs: list[Sequence]) -> None:
        step_slots: list[int] = []
        ran = []
        for s in seqs:
            d = self._demand(s)
            if not self.m.can_allocate([d], watermark=False):
                self._finish(s)  # a stand-in for preemption
                continue
            start = s.num_computed
            slots = self.m.allocate(d)
            budget = self.m.policy.held_limit(s, d.num_tokens)
            if budget is not None and not self._carried(s):
                assert self.m.held_tokens(s) <= budget, "over its budget at allocation"
            self._apply_ops()  # copies queued by this allocation precede its writes
            self._write(s, start, slots)
            s.num_computed += d.num_tokens
            step_slots += slots
            ran.append(s)
        assert len(set(step_slots)) == len(step_slots), "two tokens of a step in one slot"
        self.m.end_forward()
        scores = None
        if step_slots:
            touched = np.unique(np.asarray(step_slots + [
                x for s in ran for x in self.m.live_slots(s)[0].tolist()]))
            scores = StepScores(touched, self.rng.random(len(touched)))
        for s in list(self.seqs):
            if s.num_computed >= s.num_prompt_tokens + s.group.params.max_tokens:
                self._finish(s)
        self.m.observe([s for s in ran if s in self.seqs], scores)
        self._apply_ops()

    @precondition(lambda self: bool(self.seqs))
    @rule(i=st.integers(0, 100))
    def fork(self, i: int) -> None:
        parent = self.seqs[i % len(self.seqs)]
        if parent.num_uncomputed:
            return  # forks happen after sampling, at a step boundary
        self.next_id += 1
        child = Sequence(self.next_id, parent.group, list(parent.token_ids))
        child.num_prompt_tokens = parent.num_prompt_tokens
        child.num_computed = parent.num_computed
        child.status = SeqStatus.RUNNING
        parent.group.seqs.append(child)
        self.m.fork(parent, child)
        self.seqs.append(child)

    @precondition(lambda self: bool(self.seqs))
    @rule(i=st.integers(0, 100))
    def finish(self, i: int) -> None:
        self._finish(self.seqs[i % len(self.seqs)])
        self._apply_ops()

    def _finish(self, s: Sequence) -> None:
        s.status = SeqStatus.FINISHED
        self.m.free(s)
        self.seqs.remove(s)

    # -- invariants ----------------------------------------------------------------------
    @invariant()
    def refs_match_tables(self) -> None:
        m, pool = self.m, self.m.pool
        holders = [0] * NUM_BLOCKS
        for st_ in m._seqs.values():
            for b in st_.table:
                if b >= 0:
                    holders[b] += 1
        assert pool.ref == holders
        assert pool.num_used + pool.num_free == NUM_BLOCKS

    @invariant()
    def live_slots_hold_their_tokens(self) -> None:
        for s in self.seqs:
            if not self.m.holds(s):
                continue
            slots, pos = self.m.live_slots(s)
            assert len(set(pos.tolist())) == len(pos), "a position held twice"
            for slot, p in zip(slots.tolist(), pos.tolist()):
                assert self.dev[slot] == (s.token_ids[p], p), (s, slot, p)
                assert self.slot_pos.get(slot) == p  # the backend agrees
            budget = self.m.policy.held_limit(s, 0)
            if budget is not None and not s.num_uncomputed and not self._carried(s):
                assert len(slots) <= budget

    def teardown(self) -> None:
        for s in list(self.seqs):
            self._finish(s)
        m = self.m
        assert m.pool.num_used == 0 and m.logical_blocks == 0 and not m._seqs
        if isinstance(m, EvictingKVManager):  # the token-granular books
            assert m._owed == 0
            assert (m._pos == -1).all()
        m.end_forward()
        t = m.ledger.finish()
        assert t.reserved == t.used + t.reservation + t.internal
        assert min(t.reservation, t.internal) >= 0


class BudgetMachine(_Machine):
    """h2o: single tokens given back, slots reused, forks copy-on-write."""

    def _manager(self) -> EvictingKVManager:
        opts = H2OOptions(budget=7, budget_ratio=0.0, heavy_ratio=0.5)
        return EvictingKVManager(NUM_BLOCKS, BS, H2OPolicy(opts), watermark=0.0)

    @invariant()
    def recent_window_is_kept(self) -> None:
        pol = self.m.policy
        assert isinstance(pol, H2OPolicy)
        for s in self.seqs:
            if not self.m.holds(s):
                continue
            _, pos = self.m.live_slots(s)
            recent = pol.recent(pol.budget(s.num_prompt_tokens, s.group.params.max_tokens))
            want = set(range(max(0, s.num_computed - recent), s.num_computed))
            assert want <= set(pos.tolist())
            st_ = self.m._seqs[s.seq_id]
            assert isinstance(st_, BudgetBlocks) and st_.live == len(pos)


class WindowMachine(_Machine):
    """A window of 5 with 6 sinks: whole blocks given back; sink blocks never."""

    def _manager(self) -> PolicyKVManager:
        return WindowKVManager(NUM_BLOCKS, BS, WindowPolicy(window=5, sinks=6),
                               enable_prefix_caching=False, watermark=0.0)

    @invariant()
    def sinks_kept_and_outside_given_back(self) -> None:
        keep = -(-6 // BS)
        for s in self.seqs:
            table = self.m.table_of(s)
            assert all(b >= 0 for b in table[:keep]), "a sink block was given back"
            if s.num_uncomputed:
                continue  # mid-prefill: the policy acts after the step
            upto = max(0, s.num_computed + 1 - 5) // BS
            assert all(b < 0 for b in table[keep:upto])
            assert all(b >= 0 for b in table[max(keep, upto):])


class SnapKVMachine(_Machine):
    """snapkv (keep 3 + a window of 2, at most 9 held while decoding): one selection when
    a prompt ends, then compaction; forks share and copy-on-write."""

    def _manager(self) -> EvictingKVManager:
        pol = SnapKVPolicy(SnapKVOptions(budget=3, budget_ratio=0.0, window=2, max_tokens=9))
        return EvictingKVManager(NUM_BLOCKS, BS, pol, watermark=0.0)

    @invariant()
    def window_and_selection_kept_and_compacted(self) -> None:
        pol = self.m.policy
        assert isinstance(pol, SnapKVPolicy)
        pool = self.m.pool
        for s in self.seqs:
            if not self.m.holds(s) or s.num_uncomputed:
                continue  # mid-prefill: everything is held until the prompt ends
            _, pos = self.m.live_slots(s)
            p = s.num_prompt_tokens
            held = set(pos.tolist())
            assert set(range(max(0, p - 2), p)) <= held, "the observation window went"
            assert sum(1 for x in held if x < p) <= pol.keep(p)
            table = self.m.table_of(s)
            if all(pool.ref[b] == 1 for b in table):  # compacted: no block to spare
                assert len(table) == -(-len(pos) // BS)


class CompressedPrefixMachine(_Machine):
    """knorm's press (keeps 4 of a prompt, everything generated) with compressed prefixes
    (issue #59): an ended sequence's state stays cached; a later turn (an ended sequence's
    tokens, its last, and more) starts from a copy of it. The shadow device follows the
    copies, so the live-slot invariant holds a hit's copied slots to the turn's own tokens
    at their positions; evicted cached blocks' slots are invalidated."""

    def __init__(self) -> None:
        super().__init__()
        self.ended: list[list[int]] = []  # token lists of sequences that ended

    def _manager(self) -> EvictingKVManager:
        pol = KnormPolicy(KnormOptions(budget=4, budget_ratio=0.0))
        return EvictingKVManager(NUM_BLOCKS, BS, pol, watermark=0.0,
                                 enable_prefix_caching=True)

    def _finish(self, s: Sequence) -> None:
        if s.num_computed >= s.num_prompt_tokens:
            self.ended.append(list(s.token_ids))
        super()._finish(s)

    @precondition(lambda self: bool(self.ended))
    @rule(i=st.integers(0, 100), more=st.integers(1, 6), max_tokens=st.integers(1, 6))
    def next_turn(self, i: int, more: int, max_tokens: int) -> None:
        tokens = self.ended[i % len(self.ended)]
        s = self._new_seq([*tokens, *range(60, 60 + more)], max_tokens)
        hit = self.m.lookup_prefix(s)
        covered = hit.num_tokens(BS)
        d = Demand.after(s, len(s.token_ids) - covered, hit)
        if not self.m.can_allocate([d], watermark=False):
            return
        assert covered <= len(s.token_ids) - 1  # (the longest kept state: any turn's)
        s.status = SeqStatus.RUNNING
        self.seqs.append(s)
        slots = self.m.allocate(d)
        self._apply_ops()  # the hit's copies, then its new tokens' writes
        self._write(s, covered, slots)
        s.num_computed = covered + d.num_tokens
        s.compressed_prefix = hit.compressed
        self.m.end_forward()
        self.m.observe([s], None)
        self._apply_ops()
        if hit.compressed:  # not compressed again: every token after the prefix is held
            _, pos = self.m.live_slots(s)
            assert set(range(covered, s.num_computed)) <= set(pos.tolist())

    def teardown(self) -> None:
        for s in list(self.seqs):
            self._finish(s)
        m = self.m
        assert m.pool.num_used == 0 and m.logical_blocks == 0 and not m._seqs and m._owed == 0
        cached = {b for b in m.pool.lru_order()}
        live = {int(x) // BS for x in np.flatnonzero(m._pos >= 0)}
        assert live <= cached, "a slot holds a token outside every cached block"
        assert m.cached_slots() == int((m._pos >= 0).sum())


TestBudgetEviction = BudgetMachine.TestCase
TestBudgetEviction.settings = SETTINGS
TestWindowEviction = WindowMachine.TestCase
TestWindowEviction.settings = SETTINGS
TestSnapKVEviction = SnapKVMachine.TestCase
TestSnapKVEviction.settings = SETTINGS
TestCompressedPrefixes = CompressedPrefixMachine.TestCase
TestCompressedPrefixes.settings = SETTINGS
