"""Property tests: random operation sequences against both KV managers.

Each machine keeps a *shadow cache*: a dict from slot to what that slot's K/V stands for,
``(extra_key, tokens[:pos + 1])`` (a token's K/V depends on its whole prefix). The machine
writes it the way the engine would (the step's copies, then the new tokens at the slots the
manager gave) and copies it on swap. After every step each live sequence must read back its
own prefix from its slots. That one check catches a wrong prefix hit, a write into a shared
block, a lost copy and a block given to two owners; the others below say which rule broke.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from harness.kv.base import Demand
from harness.kv.contiguous import POLICIES, ContiguousKVManager
from harness.kv.evicting import WindowKVManager
from harness.kv.paged import PagedKVManager
from harness.kv.policies.base import Eviction
from harness.kv.policies.window import WindowPolicy
from harness.sched.sequence import SeqStatus, Sequence
from tests.helpers import make_seq

SETTINGS = settings(max_examples=150, stateful_step_count=40, deadline=None)

Content = tuple[object, tuple[int, ...]]

# A 3-letter alphabet: random prompts share leading blocks often, so prefix hits happen.
tokens_st = st.lists(st.integers(0, 2), min_size=1, max_size=13)
pick = st.integers(0, 1 << 16)  # an index, taken modulo the number of candidates


def content(seq: Sequence, pos: int) -> Content:
    return (seq.group.extra_key, tuple(seq.token_ids[:pos + 1]))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _child(parent: Sequence, seq_id: int) -> Sequence:
    """What ``Scheduler.fork`` builds before asking the manager to share the K/V."""
    child = Sequence(seq_id, parent.group, list(parent.token_ids))
    child.num_prompt_tokens = parent.num_prompt_tokens
    child.num_computed = parent.num_computed
    child.status = parent.status
    return child


@dataclass(eq=False)
class Group:
    seqs: list[Sequence] = field(default_factory=list)  # live ones only
    swapped: bool = False  # paged: its tables hold CPU block ids
    waiting: bool = False  # contiguous: preempted, not yet readmitted


# -- paged ---------------------------------------------------------------------------------
BS = 4
NUM_BLOCKS = 12
NUM_CPU_BLOCKS = 8


class PagedMachine(RuleBasedStateMachine):
    """Prefix caching on: admissions with hits, decode, fork (copy-on-write), free, swap."""

    CACHING = True

    def __init__(self) -> None:
        super().__init__()
        self.m = self._manager()
        self.groups: list[Group] = []
        self.dev: dict[int, Content | None] = {}
        self.cpu: dict[int, Content | None] = {}
        self.next_id = 100_000
        # Slot-steps measured from the pool at every tick, to check the ledger against.
        self.expect_reserved = 0
        self.expect_used = 0

    def _manager(self) -> PagedKVManager:
        return PagedKVManager(NUM_BLOCKS, BS, num_cpu_blocks=NUM_CPU_BLOCKS,
                              enable_prefix_caching=self.CACHING, watermark=0.0)

    # -- helpers -------------------------------------------------------------------------
    def _device_groups(self) -> list[Group]:
        return [g for g in self.groups if not g.swapped]

    def _pick_seq(self, i: int) -> tuple[Group, Sequence]:
        seqs = [(g, s) for g in self._device_groups() for s in g.seqs]
        return seqs[i % len(seqs)]

    def _demand(self, seq: Sequence, chunk: int) -> tuple[Demand, int]:
        """The next demand of ``seq`` (with prefix hits on a fresh table) and its start."""
        hits = self.m.lookup_prefix(seq).blocks if not self.m.holds(seq) else []
        start = len(hits) * BS if hits else seq.num_computed
        n = min(chunk, seq.num_tokens - start)
        assert n >= 1
        return Demand(seq, n, hits), start

    def _allocate(self, d: Demand, start: int, fast: bool = False) -> None:
        """``allocate`` (or, for a decode with ``fast``, the scheduler's ``append_slot``
        fast path) plus what the engine does after it: the copies, then the writes."""
        m, pool, seq = self.m, self.m.pool, d.seq
        shared_before = {b: pool.fill[b] for b in range(NUM_BLOCKS) if pool.ref[b] > 1}
        hits_before = m.stats.prefix_hit_tokens + m.stats.self_hit_tokens
        if fast:
            assert d.num_tokens == 1 and not d.hit_blocks and start == seq.num_computed
            table_before, used_before = m.table_of(seq), pool.num_used
            slot = m.append_slot(seq)
            if slot is None:
                # Only when the token needs a block (a new one, or a private copy of a
                # shared one) and none is free; nothing changed.
                assert pool.num_free == 0
                assert m.table_of(seq) == table_before and pool.num_used == used_before
                return
            assert slot == m.slot(seq, start)
        else:
            slots = m.allocate(d)
            assert slots == [m.slot(seq, p) for p in range(start, start + d.num_tokens)]
        hits_now = m.stats.prefix_hit_tokens + m.stats.self_hit_tokens
        assert hits_now - hits_before == len(d.hit_blocks) * BS
        for op in m.take_cache_ops().copies:
            # Copy-on-write copies the filled part of one block into a fresh one.
            assert op.src % BS == 0 and op.dst % BS == 0
            assert op.num_slots == start % BS and 0 < op.num_slots < BS
            assert op.src // BS in shared_before
            assert op.dst // BS == m.table_of(seq)[start // BS]
            for k in range(op.num_slots):
                self.dev[op.dst + k] = self.dev[op.src + k]
        # The CoW rule: a block that was shared is never written, by anyone.
        for b, fill in shared_before.items():
            assert pool.fill[b] == fill, f"shared block {b} written"
        for pos in range(start, start + d.num_tokens):
            slot = m.slot(seq, pos)
            assert pool.ref[slot // BS] == 1, "write into a shared block"
            self.dev[slot] = content(seq, pos)
        seq.num_computed = start + d.num_tokens

    # -- rules ---------------------------------------------------------------------------
    @rule(tokens=tokens_st, chunk=st.integers(1, 13),
          extra=st.sampled_from([None, None, "lora"]))
    def admit(self, tokens: list[int], chunk: int, extra: str | None) -> None:
        seq = make_seq(tokens, extra_key=extra)
        seq.status = SeqStatus.RUNNING
        d, start = self._demand(seq, chunk)
        if not self.CACHING:
            assert not d.hit_blocks
        if self.m.can_allocate([d], watermark=False):
            self._allocate(d, start)
            self.groups.append(Group([seq]))

    @precondition(lambda self: any(g.seqs for g in self._device_groups()))
    @rule(i=pick, token=st.integers(0, 2), chunk=st.integers(1, 6), fast=st.booleans())
    def compute(self, i: int, token: int, chunk: int, fast: bool) -> None:
        """One decode token (through ``append_slot`` when ``fast``), or the next prefill
        chunk of a sequence still in prefill."""
        _, seq = self._pick_seq(i)
        if seq.num_uncomputed == 0:
            seq.token_ids.append(token)
        d, start = self._demand(seq, chunk)
        if fast and self.m.holds(seq) and seq.num_uncomputed == 1:
            self._allocate(d, start, fast=True)  # the scheduler asks no can_allocate first
        elif self.m.can_allocate([d], watermark=False):
            self._allocate(d, start)

    @precondition(lambda self: any(g.seqs for g in self._device_groups()))
    @rule(i=pick, token=st.integers(0, 2))
    def decode_group(self, i: int, token: int) -> None:
        """A running group's step: every sequence with a table decodes under one check, as
        the scheduler asks for a whole group at once."""
        g, _ = self._pick_seq(i)
        seqs = [s for s in g.seqs if self.m.holds(s)]
        for s in seqs:
            if s.num_uncomputed == 0:
                s.token_ids.append(token)
        demands = [self._demand(s, 1) for s in seqs]
        if demands and self.m.can_allocate([d for d, _ in demands], watermark=False):
            for d, start in demands:
                self._allocate(d, start)

    @precondition(lambda self: any(g.seqs for g in self._device_groups()))
    @rule(i=pick)
    def fork(self, i: int) -> None:
        g, parent = self._pick_seq(i)
        if len(g.seqs) >= 4:
            return
        self.next_id += 1
        child = _child(parent, self.next_id)
        used_before = self.m.pool.num_used
        self.m.fork(parent, child)
        parent.group.seqs.append(child)
        g.seqs.append(child)
        # Forking shares every block: nothing is allocated, nothing copied.
        assert self.m.pool.num_used == used_before and self.m.take_cache_ops().copies == []
        assert self.m.table_of(child) == self.m.table_of(parent)

    @precondition(lambda self: any(g.seqs for g in self._device_groups()))
    @rule(i=pick)
    def free(self, i: int) -> None:
        g, seq = self._pick_seq(i)
        seq.status = SeqStatus.FINISHED
        self.m.free(seq)
        assert not self.m.holds(seq) and seq.seq_id not in self.m._seqs
        g.seqs.remove(seq)
        if not g.seqs:
            self.groups.remove(g)

    @precondition(lambda self: any(g.seqs for g in self._device_groups()))
    @rule(i=pick, chunk=st.integers(1, 13))
    def preempt_recompute(self, i: int, chunk: int) -> None:
        """Drop a group's K/V and prefill each sequence again (its prefix may still be
        cached). Each sequence looks up its hits right before its own allocation: hits
        looked up for the whole group first can be evicted by an earlier member's new
        blocks before the later member touches them, which ``allocate`` cannot survive."""
        g, _ = self._pick_seq(i)
        for s in g.seqs:
            self.m.free(s)
            s.num_computed = 0
        for s in g.seqs:
            d, start = self._demand(s, chunk)
            if self.m.can_allocate([d], watermark=False):
                self._allocate(d, start)

    @precondition(lambda self: any(g.seqs for g in self._device_groups()))
    @rule(i=pick)
    def swap_out(self, i: int) -> None:
        g, _ = self._pick_seq(i)
        m = self.m
        distinct = {b for s in g.seqs for b in m.table_of(s) if b >= 0}
        if not m.can_swap_out(g.seqs):
            assert len(distinct) > NUM_CPU_BLOCKS - m.num_cpu_blocks_used
            return
        pairs = m.swap_out(g.seqs)
        # Each distinct device block moves once, to its own CPU block.
        assert sorted(b for b, _ in pairs) == sorted(distinct)
        assert len({c for _, c in pairs}) == len(pairs)
        for b, c in pairs:
            for k in range(BS):
                self.cpu[c * BS + k] = self.dev.get(b * BS + k)
        g.swapped = True

    @precondition(lambda self: any(g.swapped for g in self.groups))
    @rule(i=pick)
    def swap_in(self, i: int) -> None:
        swapped = [g for g in self.groups if g.swapped]
        g = swapped[i % len(swapped)]
        if self.m.can_swap_in(g.seqs):
            self._swap_in(g)

    def _swap_in(self, g: Group) -> None:
        pairs = self.m.swap_in(g.seqs)
        assert len({b for _, b in pairs}) == len(pairs)
        for c, b in pairs:
            for k in range(BS):
                self.dev[b * BS + k] = self.cpu.get(c * BS + k)
        g.swapped = False

    @rule()
    def tick(self) -> None:
        """The engine's step counter moves on: everything held now is held one step more."""
        pool = self.m.pool
        self.expect_reserved += pool.num_used * BS
        self.expect_used += pool.used_slots
        self.m.end_forward()

    # -- invariants ----------------------------------------------------------------------
    @invariant()
    def pool_matches_tables(self) -> None:
        m, pool = self.m, self.m.pool
        holders = [0] * NUM_BLOCKS
        cpu_holders: dict[int, int] = {}
        logical = 0
        for g in self.groups:
            for s in g.seqs:
                entries = [b for b in m.table_of(s) if b >= 0]
                if not g.swapped:
                    logical += len(entries)
                for b in entries:
                    if g.swapped:
                        cpu_holders[b] = cpu_holders.get(b, 0) + 1
                    else:
                        holders[b] += 1
        assert pool.ref == holders
        assert m.cpu.ref == cpu_holders
        assert m.num_cpu_blocks_used == len(cpu_holders)
        # Counts the device-resident tables: what would be held on the device without
        # sharing (swapped tables hold CPU blocks).
        assert m.logical_blocks == logical >= 0

        used = {b for b in range(NUM_BLOCKS) if pool.ref[b] > 0}
        free, lru = pool.free_order(), pool.lru_order()
        assert len(set(free)) == len(free) and len(set(lru)) == len(lru)
        assert not (set(free) & set(lru)) and not (used & (set(free) | set(lru)))
        assert set(free) | set(lru) | used == set(range(NUM_BLOCKS))
        assert pool.num_used == len(used)
        assert pool.num_used + pool.num_free == NUM_BLOCKS
        assert pool.num_cached_free == len(lru)
        assert pool.num_shared == sum(1 for r in pool.ref if r > 1)
        assert pool.used_slots == sum(pool.fill[b] for b in used)

        # Hash index: both directions agree; only full blocks are named; a plain free block
        # has no name and an LRU block always has one.
        index = pool.hash_index()
        for h, copies in index.items():
            assert copies and all(pool.block_hash[b] == h for b in copies)
            assert len(set(copies)) == len(copies)
        for b in range(NUM_BLOCKS):
            name = pool.block_hash[b]
            if name is not None:
                assert b in index[name] and pool.fill[b] == BS
        assert all(pool.block_hash[b] is None for b in free)
        assert all(pool.block_hash[b] is not None for b in lru)
        if not self.CACHING:
            assert not index

        # The ledger has exactly the held blocks open, each at its current fill.
        opened = m.ledger.open_units()
        assert set(opened) == used
        assert all(opened[b] == pool.fill[b] for b in used)

    @invariant()
    def every_sequence_reads_its_own_prefix(self) -> None:
        m, pool = self.m, self.m.pool
        for g in self.groups:
            for s in g.seqs:
                st_ = m._seqs.get(s.seq_id)
                table = st_.table if st_ else []
                ev = st_.given_back if st_ else 0
                hashes = st_.hashes if st_ else []
                assert len(table) == _cdiv(s.num_computed, BS)
                assert all(b < 0 for b in table[:ev]) and all(b >= 0 for b in table[ev:])
                if self.CACHING:
                    assert len(hashes) == s.num_computed // BS
                shadow = self.cpu if g.swapped else self.dev
                for i in range(ev, len(table)):
                    b, filled = table[i], min(BS, s.num_computed - i * BS)
                    fill = m.cpu.fill[b] if g.swapped else pool.fill[b]
                    assert fill == filled, (s, i, b, fill, filled)
                    for k in range(filled):
                        assert shadow.get(b * BS + k) == content(s, i * BS + k), (s, i, b, k)
                    if not g.swapped and i < len(hashes):
                        h = pool.block_hash[b]
                        assert h is None or h == hashes[i]

    def teardown(self) -> None:
        m, pool = self.m, self.m.pool
        for g in self._device_groups():
            for s in g.seqs:
                m.free(s)
        # With the device empty, every swapped group (at most the CPU pool) fits back.
        for g in [g for g in self.groups if g.swapped]:
            assert m.can_swap_in(g.seqs)
            self._swap_in(g)
            for s in g.seqs:
                m.free(s)
        assert pool.num_used == 0 and pool.used_slots == 0 and pool.num_shared == 0
        assert pool.num_free == NUM_BLOCKS and m.logical_blocks == 0
        assert m.num_cpu_blocks_used == 0
        self.tick()
        t = m.ledger.finish()
        assert t.reserved == t.used + t.reservation + t.internal
        assert (t.reserved, t.used) == (self.expect_reserved, self.expect_used)
        assert min(t.reservation, t.internal) >= 0


class PagedEvictionMachine(PagedMachine):
    """Prefix caching off, as a window runs: adds giving back leading blocks through the
    evicting manager's one path (``evict``), as the window policy does."""

    CACHING = False

    def _manager(self) -> PagedKVManager:
        return WindowKVManager(NUM_BLOCKS, BS, WindowPolicy(window=1, sinks=0),
                               num_cpu_blocks=NUM_CPU_BLOCKS, enable_prefix_caching=False,
                               watermark=0.0)

    @precondition(lambda self: any(g.seqs for g in self._device_groups()))
    @rule(i=pick, upto=st.integers(0, 16))
    def give_back_leading(self, i: int, upto: int) -> None:
        _, seq = self._pick_seq(i)
        m = self.m
        assert isinstance(m, WindowKVManager)
        upto = min(upto, seq.num_computed) // BS  # a window never reaches past computed
        table = m.table_of(seq)
        blocks = [j for j in range(upto) if table[j] >= 0]
        used_before, evicted_before = m.pool.num_used, m.stats.evicted_tokens
        m.evict(seq, Eviction(blocks=blocks))
        after = m.table_of(seq)
        assert all(b < 0 for b in after[:upto]) and after[upto:] == table[upto:]
        assert m.stats.evicted_tokens - evicted_before == len(blocks) * BS
        assert m.pool.num_used <= used_before


TestPagedAllocator = PagedMachine.TestCase
TestPagedAllocator.settings = SETTINGS
TestPagedEviction = PagedEvictionMachine.TestCase
TestPagedEviction.settings = SETTINGS


# -- contiguous ----------------------------------------------------------------------------
ARENA = 64
MAX_LEN = 32


class ContiguousMachine(RuleBasedStateMachine):
    """Groups of 1-3 samples: admit, compute, fork into parked ranges, finish, preempt."""

    def __init__(self) -> None:
        super().__init__()
        self.m = ContiguousKVManager(ARENA, policy="exact", max_model_len=MAX_LEN,
                                     watermark=0.0)
        self.groups: list[Group] = []
        self.dev: dict[int, Content] = {}
        self.next_id = 200_000
        self.expect_reserved = 0
        self.expect_used = 0

    @initialize(policy=st.sampled_from(POLICIES))
    def choose_policy(self, policy: str) -> None:
        self.m = ContiguousKVManager(ARENA, policy=policy, max_model_len=MAX_LEN,
                                     watermark=0.0)

    def _active(self) -> list[Group]:
        return [g for g in self.groups if not g.waiting]

    def _pick_seq(self, i: int) -> tuple[Group, Sequence]:
        seqs = [(g, s) for g in self._active() for s in g.seqs]
        return seqs[i % len(seqs)]

    def _allocate(self, seq: Sequence, n: int) -> None:
        start = seq.num_computed
        self.m.allocate(Demand(seq, n))
        assert self.m.take_cache_ops().copies == []
        for pos in range(start, start + n):
            self.dev[self.m.slot(seq, pos)] = content(seq, pos)
        seq.num_computed = start + n

    def _admit_all(self, g: Group, chunk: int) -> bool:
        demands = [Demand(s, min(chunk, s.num_tokens)) for s in g.seqs]
        if not self.m.can_allocate(demands, watermark=True):
            return False
        for d in demands:
            self._allocate(d.seq, d.num_tokens)
        return True

    # -- rules ---------------------------------------------------------------------------
    @rule(prompt_len=st.integers(1, 12), max_tokens=st.integers(1, 12), n=st.integers(1, 3),
          chunk=st.integers(1, 12), first=st.integers(0, 2))
    def admit(self, prompt_len: int, max_tokens: int, n: int, chunk: int, first: int) -> None:
        seq = make_seq([first] * prompt_len, max_tokens=max_tokens, n=n)
        seq.status = SeqStatus.RUNNING
        if self.m.admission_error(prompt_len, max_tokens, n) is not None:
            return
        g = Group([seq])
        if self._admit_all(g, chunk):
            self.groups.append(g)

    @precondition(lambda self: any(g.seqs for g in self._active()))
    @rule(i=pick, token=st.integers(0, 2), chunk=st.integers(1, 6), fast=st.booleans())
    def compute(self, i: int, token: int, chunk: int, fast: bool) -> None:
        _, seq = self._pick_seq(i)
        if seq.num_computed == self.m.range_of(seq)[1]:
            # A range never grows: a full one refuses one more slot whatever is free.
            assert not self.m.can_allocate([Demand(seq, 1)], watermark=False)
            assert self.m.append_slot(seq) is None
        if seq.num_uncomputed == 0:
            # The scheduler stops a sequence at prompt + max_tokens (or max_model_len), so
            # its tokens never outnumber its reservation; past that it can only finish.
            limit = min(seq.num_prompt_tokens + seq.group.params.max_tokens, MAX_LEN)
            if seq.num_tokens >= limit:
                return
            seq.token_ids.append(token)
        n = min(chunk, seq.num_uncomputed)
        fits = seq.num_computed + n <= self.m.range_of(seq)[1]
        # A range never grows: the answer depends on the sequence's own range only.
        assert self.m.can_allocate([Demand(seq, n)], watermark=False) == fits
        if fast and n == 1:
            # The scheduler's decode fast path: a slot, or None when the range is full.
            slot = self.m.append_slot(seq)
            assert (slot is not None) == fits
            if slot is not None:
                assert slot == self.m.range_of(seq)[0] + seq.num_computed
                self.dev[slot] = content(seq, seq.num_computed)
                seq.num_computed += 1
        elif fits:
            self._allocate(seq, n)

    @precondition(lambda self: any(g.seqs for g in self._active()))
    @rule(i=pick)
    def fork(self, i: int) -> None:
        g, parent = self._pick_seq(i)
        if len(g.seqs) >= parent.group.params.n:
            return  # the group holds n ranges: a fork beyond n is not this test's story
        self.next_id += 1
        child = _child(parent, self.next_id)
        holes_before = self.m.arena.holes()
        self.m.fork(parent, child)
        parent.group.seqs.append(child)
        g.seqs.append(child)
        assert self.m.arena.holes() == holes_before  # it took a parked range
        n = parent.num_computed
        copies = self.m.take_cache_ops().copies
        if n:
            assert [(c.src, c.dst, c.num_slots) for c in copies] == [
                (self.m.range_of(parent)[0], self.m.range_of(child)[0], n)]
            for k in range(n):
                self.dev[self.m.range_of(child)[0] + k] = self.dev[self.m.range_of(parent)[0] + k]
        else:
            assert copies == []

    @precondition(lambda self: any(g.seqs for g in self._active()))
    @rule(i=pick)
    def finish(self, i: int) -> None:
        g, seq = self._pick_seq(i)
        seq.status = SeqStatus.FINISHED
        self.m.free(seq)
        assert not self.m.holds(seq) and self.m.range_of(seq)[1] == 0
        g.seqs.remove(seq)
        if not g.seqs:
            self.groups.remove(g)

    @precondition(lambda self: any(g.seqs for g in self._active()))
    @rule(i=pick, chunk=st.integers(1, 12))
    def preempt_recompute(self, i: int, chunk: int) -> None:
        """Every live sequence of a group gives its range back, as the scheduler's
        recompute preemption does; the group then tries to come back at once."""
        g, _ = self._pick_seq(i)
        for s in g.seqs:
            self.m.free(s)
            s.num_computed = 0
        g.waiting = not self._admit_all(g, chunk)

    @precondition(lambda self: any(g.waiting for g in self.groups))
    @rule(i=pick, chunk=st.integers(1, 12))
    def readmit(self, i: int, chunk: int) -> None:
        waiting = [g for g in self.groups if g.waiting]
        g = waiting[i % len(waiting)]
        g.waiting = not self._admit_all(g, chunk)

    @rule()
    def tick(self) -> None:
        u = self.m.usage()
        self.expect_reserved += u.reserved_slots
        self.expect_used += u.used_slots
        self.m.end_forward()

    # -- invariants ----------------------------------------------------------------------
    @invariant()
    def arena_is_tiled_by_ranges_and_holes(self) -> None:
        m = self.m
        ranges: list[tuple[int, int]] = []
        used = 0
        for g in self.groups:
            rid = g.seqs[0].group.request_id
            parked = m._parked.get(rid, [])
            if g.waiting:
                assert not parked and all(not self.m.range_of(s)[1] for s in g.seqs)
                continue
            own = [(self.m.range_of(s)[0], self.m.range_of(s)[1]) for s in g.seqs]
            # A group holds n ranges from admission: its live sequences' plus the parked.
            assert len(own) + len(parked) == g.seqs[0].group.params.n
            ranges += own + parked
            for s in g.seqs:
                p = s.group.params
                cap = self.m.range_of(s)[1]
                assert cap == m.reservation_size(s.num_prompt_tokens, p.max_tokens)
                assert s.num_computed <= self.m.range_of(s)[1]
                used += s.num_computed
                start = self.m.range_of(s)[0]
                for pos in range(s.num_computed):
                    assert self.dev[start + pos] == content(s, pos), (s, pos)
        live_rids = {g.seqs[0].group.request_id for g in self._active()}
        assert {rid for rid, p in m._parked.items() if p} <= live_rids

        holes = m.arena.holes()
        assert all(length > 0 for _, length in holes)
        # Coalesced: a hole never ends where the next one starts.
        assert all(s1 + l1 < s2 for (s1, l1), (s2, _) in pairwise(holes))
        assert m.arena.free_slots == sum(length for _, length in holes)
        # Ranges and holes tile the arena: no overlap, no gap.
        pos = 0
        for start, length in sorted(ranges + holes):
            assert start == pos, (start, pos, sorted(ranges), holes)
            pos += length
        assert pos == ARENA

        u = m.usage()
        assert u.reserved_slots == sum(size for _, size in ranges)
        assert u.used_slots == used
        opened = m.ledger.open_units()
        assert set(opened) == {start for start, _ in ranges}

    def teardown(self) -> None:
        m = self.m
        for g in self._active():
            for s in g.seqs:
                s.status = SeqStatus.FINISHED
                m.free(s)
        assert m.arena.holes() == [(0, ARENA)]
        u = m.usage()
        assert (u.reserved_slots, u.used_slots) == (0, 0)
        self.tick()
        t = m.ledger.finish()
        assert t.reserved == t.used + t.reservation + t.internal
        assert (t.reserved, t.used) == (self.expect_reserved, self.expect_used)


TestContiguousAllocator = ContiguousMachine.TestCase
TestContiguousAllocator.settings = SETTINGS
