"""Decode lanes: the roofline's fast path (``roofline.fast_path``, issue #24).

Under ``executor=roofline`` a running request that only decodes does the same thing every
step: one slot written in place into its last block, one synthetic token, one token time.
A :class:`DecodeLane` holds such requests (its *members*) and advances them all in O(1) a
step: a member's sequence, its block's fill and its token times are brought up to date
(:meth:`DecodeLane.sync`) only when something needs them:

- the step whose slot needs a new block (:meth:`DecodeLane.take_block`, in the
  scheduler's loop where the per-sequence path would allocate it);
- the step that fills its block, with prefix caching: the block is named
  (:meth:`DecodeLane.name_filled`) where the per-sequence path would name it, among the
  other groups' prefill chunks in running order, before any admission looks a prompt up;
- its finish, known when it joins: synthetic tokens are never EOS, so a request stops at
  its drawn length (``stop_after``), ``max_tokens`` or ``max_model_len``;
- with a sliding window, the update whose ``observe`` gives back a block its window left
  (:meth:`DecodeLane.drops_due`): it is observed there, in running order among the step's
  sequences, as every decode is one by one;
- a preemption: it is synced, then preempted as any group is;
- the end of the run (:meth:`DecodeLane.leave_all`).

In between, what a step needs of the members is sums: how many decode, the sum, the max
and the remainders modulo the block of their contexts, and the same apart past the
declaration's ``lane_split()`` (the step's shape: :class:`LaneSums`), the slots they
fill in place (the pool's used slots) and a count of consecutive tokens (the inter-token
latencies). Every number a run
reports equals stepping one by one (tests/roofline/test_lane.py: a hypothesis property test over
random workloads, preemption by recompute and swap, prefix hits and arrivals).

Lane steps are counted as the scheduler's non-empty steps (``L``): while a request is a
member every non-empty step schedules it (one the step cannot schedule, out of token
budget behind n > 1 groups' forks, leaves first), and the KV manager's clock (the ledger's
``now``) and the collector's token clock each advance once per non-empty step, so a
member's state after ``L`` steps is a linear function of ``L``.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass
from operator import attrgetter

from harness.backends.costs import KIVICosts, KVCosts, QuantCosts, QuestCosts, WindowCosts
from harness.kv.contiguous import ContiguousKVManager
from harness.kv.evicting import WindowKVManager
from harness.kv.paged import PagedKVManager, SeqBlocks, block_hash
from harness.kv.policies.window import WindowPolicy
from harness.kv.residual import ResidualKVManager
from harness.roofline.fastpath.lazy_names import LazyNames, PendingChain
from harness.sched.sequence import SeqStatus, Sequence, SequenceGroup
from harness.sched.step import CHECKS, LaneSums

# (request id, first position, count) -> the synthetic token ids at those positions.
TokenFn = Callable[[int, int, int], list[int]]

# A member's place in the scheduler's running list (the order of every per-member event):
# its group's run_order, held on the member (it does not change while the group runs).
RUN_ORDER = attrgetter("run_order")

# Declarations whose decode read is a fixed function of the context alone (what the
# member sums cover); any other method steps one by one.
LANE_COSTS = (KVCosts, QuantCosts, KIVICosts, QuestCosts, WindowCosts)
# Managers the lane drives: the plain paged one; kivi's, which differs only in what it
# reports when a partly filled block is freed (the lane settles fills before any free);
# a window's, which gives back the blocks a member's window left, at steps the lane
# knows in advance (the member is then synced and observed in running order).
LANE_PAGED = (PagedKVManager, ResidualKVManager, WindowKVManager)


def lane_blocker(kv: object, costs: KVCosts) -> str | None:
    """Why a run with this KV manager and cost declaration steps every sequence one by
    one (None: its decodes can take the lane)."""
    if isinstance(kv, WindowKVManager) and type(kv.policy) is not WindowPolicy:
        return f"the window manager's policy ({kv.policy.name}) is not a sliding window"
    if type(costs) in (KIVICosts, QuestCosts) and \
            costs.block_size != getattr(kv, "block_size", None):
        # their reads split at block boundaries: the lane sums remainders per KV block
        return f"the backend's blocks ({costs.block_size} tokens) are not the KV manager's"
    if type(kv) is ContiguousKVManager:
        return None if type(costs) in LANE_COSTS else \
            f"the backend's reads ({type(costs).__name__}) are not summed"
    if type(kv) not in LANE_PAGED:
        return f"the KV manager is {type(kv).__name__}, not the plain paged or contiguous one"
    assert isinstance(kv, PagedKVManager)
    if kv.tiers is not None:
        return "cache.tiers (lower tiers write blocks as they are named)"
    if kv.block_size < 2:
        return "backend.block_size=1 (every token takes a block)"
    if type(costs) not in LANE_COSTS:
        return f"the backend's reads ({type(costs).__name__}) are not summed"
    return None


@dataclass(slots=True, eq=False)
class LaneMember:
    """One member: at lane step ``L`` (steps done) its sequence holds
    ``tokens_at_join + (L - joined)`` tokens and ``computed_at_join + (L - joined)``
    computed. ``block``: its last block, whose fill is recorded through lane step
    ``settled`` (ahead of ``L`` for a block the lane took: through its last slot's step);
    ``takes_block_at``: the next lane step whose write takes a new block (its
    per-sequence path; -1 once it left); ``reason``: why it finishes (the lane files it
    under the step whose update finishes it). ``rid``, ``seq_blocks``: its request id and
    (paged) its block table's record, read at every block it takes or names."""

    uid: int
    seq: Sequence
    rid: int
    seq_blocks: SeqBlocks | None
    joined: int
    computed_at_join: int
    tokens_at_join: int
    block: int
    settled: int
    takes_block_at: int
    reason: str
    run_order: int = 0  # its group's run_order
    over: bool = False  # its context is past the declaration's lane_split()
    finish_at: int = 0  # the lane step whose update finishes it
    gives_back_at: int = -1  # a window's: the lane step whose update gives back a block
    key: object = None  # (paged, prefix caching) its block hashes' extra key (key_of)
    chain: PendingChain | None = None  # its filled blocks not named yet (lazy_names)


class DecodeLane:
    """The members of one scheduler's lane and their sums (see the module docstring)."""

    def __init__(self, kv: PagedKVManager | ContiguousKVManager, costs: KVCosts,
                 tokens: TokenFn,
                 synthetic_ids: range, eos_token_ids: frozenset[int],
                 max_model_len: int) -> None:
        """``tokens``: the executor's synthetic ids (a member's sequence is made of them
        only when read); ``synthetic_ids``: every id it can return (a request that could
        stop on one of them at EOS never joins)."""
        assert lane_blocker(kv, costs) is None, lane_blocker(kv, costs)
        self.kv, self.tokens = kv, tokens
        self.bs = kv.block_size
        # A contiguous range is one unit (its start) that a member fills until its end,
        # where its next write fails as append_slot's would (no blocks, no names).
        self.paged: PagedKVManager | None = kv if isinstance(kv, PagedKVManager) else None
        self.ranges: ContiguousKVManager | None = \
            kv if isinstance(kv, ContiguousKVManager) else None
        self.caching = self.paged is not None and self.paged.enable_prefix_caching
        # With prefix caching, members' filled blocks are named when first read
        # (lazy_names.py): the pool asks this for the names it is about to read.
        # Not when the pool reads a name as a block is released or evicted (ARC's ghost
        # lists, an admission rule counting uses: harness/kv/eviction.py): then every
        # block is named as it fills, as one by one.
        self.lazy: LazyNames | None = None
        if self.caching and self.paged is not None and not self.paged.pool.reads_names:
            self.lazy = LazyNames(self.paged, tokens, block_hash)
            self.paged.set_deferred_names(self.lazy)
        self.eos_hit = bool(eos_token_ids.intersection(synthetic_ids))
        self.max_model_len = max_model_len
        self.sinks = costs.sinks if isinstance(costs, QuantCosts) else 0
        self.L = 0  # non-empty steps scheduled
        self.n = 0  # members
        # A member's offset: computed_at_join - joined (its context at lane step L1 is
        # offset + L1). off_sum: the members' offsets summed (contexts sum to off_sum + n L1).
        self.off_sum = 0
        self._max: list[tuple[int, int]] = []  # (-offset, uid), lazily pruned
        # Members by offset mod block size: their contexts' remainders at any step.
        self._res = [0] * self.bs
        # With a split (quest: past its top blocks a read changes form), the members past
        # it apart: as the res/off_sum above; the others in a heap by offset, each moved
        # over when its context passes the split (contexts only grow).
        self.split = costs.lane_split()
        self._under: list[tuple[int, int]] = []  # (-offset, uid), lazily pruned
        self.over_n = self.over_off = 0
        self._over_res = [0] * self.bs
        # A window's manager: members by the lane step whose update's observe gives back
        # a block their window left (harness.kv.policies.window).
        self.window: WindowPolicy | None = (
            kv.policy if isinstance(kv, WindowKVManager) and type(kv.policy) is WindowPolicy
            else None)
        self._drops: dict[int, list[LaneMember]] = {}
        self._live: dict[int, LaneMember] = {}
        self._finish: dict[int, list[LaneMember]] = {}
        # Members whose write of lane step k takes a new block: the scheduler
        # visits them without a pass over every running group. With prefix caching, the
        # write of step k - 1 fills their block, which is then named (fills(k - 1)).
        self._takes: dict[int, list[LaneMember]] = {}
        # The steps whose list above may be out of running order: a list is appended to by
        # take_blocks (members in running order, before any join files a member under that
        # step) and by joins, in the order they happen; a member that joins after one with
        # a later run order (its prompt took more steps) puts its step here.
        self._unsorted: set[int] = set()
        self._uid = 0
        # Told the request id of a member that leaves other than by finishing (the
        # collector brings its token times up to date).
        self.on_leave: Callable[[int], None] | None = None

    # -- membership -----------------------------------------------------------------------
    def try_join(self, g: SequenceGroup) -> bool:
        """After ``g``'s update of lane step ``L``: make it a member if it is one plain
        decoding sequence whose next steps the lane can sum."""
        if len(g.seqs) != 1:
            return False
        seq, p = g.seqs[0], g.params
        if (seq.status is not SeqStatus.RUNNING or p.n != 1 or p.use_beam_search
                or p.temperature > 0 or p.stop_token_ids or (self.eos_hit and not p.ignore_eos)):
            return False
        c0, n0 = seq.num_computed, len(seq.token_ids)
        if n0 - c0 != 1 or c0 < seq.num_prompt_tokens or c0 + 1 < self.sinks:
            return False
        L = self.L
        st: SeqBlocks | None = None
        if self.ranges is not None:
            block, cap = self.ranges.range_of(seq)
            takes_at = L + 1 + max(0, cap - c0)  # the step whose write finds the range full
        else:
            assert self.paged is not None
            bs, pool = self.bs, self.paged.pool
            st = self.paged.blocks_of(seq)
            table = st.table
            if c0 % bs:
                block = table[c0 // bs]
                if pool.ref[block] != 1:  # a shared last block: its next write copies it
                    return False
            else:
                block = table[c0 // bs - 1]
            takes_at = self._next_take(c0, L + 1)
        n_out = n0 - seq.num_prompt_tokens
        r_stop = p.stop_after - n_out if p.stop_after is not None else 0
        r_len = max(1, min(p.max_tokens - n_out, self.max_model_len - n0))
        if 1 <= r_stop <= r_len:
            r, reason = r_stop, "stop"
        else:
            r, reason = r_len, "length"
        self._uid += 1
        m = LaneMember(self._uid, seq, g.request_id, st, L, c0, n0, block, L, takes_at, reason,
                       g.run_order)
        if self.caching:
            assert self.paged is not None
            m.key = self.paged.key_of(seq)
        filed = self._takes.setdefault(takes_at, [])
        if filed and filed[-1].run_order > m.run_order:
            self._unsorted.add(takes_at)
        filed.append(m)
        g.lane = m
        self._live[m.uid] = m
        m.finish_at = L + r
        self._track_drop(m, L + 1)
        self._finish.setdefault(L + r, []).append(m)
        self.n += 1
        self.off_sum += c0 - L
        self._res[(c0 - L) % self.bs] += 1
        heapq.heappush(self._max, (L - c0, m.uid))
        if self.split is not None:
            heapq.heappush(self._under, (L - c0, m.uid))
        return True

    def _next_take(self, pos: int, L1: int) -> int:
        """The first lane step from ``L1`` (which writes slot ``pos``) that writes a
        block's first slot."""
        return L1 + -pos % self.bs

    def _track_drop(self, m: LaneMember, earliest: int) -> None:
        """A window's: file ``m`` under the first lane step from ``earliest`` whose update
        gives back a block (WindowPolicy.gives_back_at; after the update of lane step L1
        the sequence has computed ``computed_at_join + L1 - joined`` tokens); none at or
        after its finish (it leaves before that update observes anyone)."""
        w = self.window
        if w is None:
            return
        assert self.paged is not None
        at = w.gives_back_at(self.paged.blocks_of(m.seq).cursor, self.bs)
        m.gives_back_at = max(earliest, at - (m.computed_at_join - m.joined))
        if m.gives_back_at < m.finish_at:
            self._drops.setdefault(m.gives_back_at, []).append(m)

    def drops_due(self) -> list[LaneMember]:
        """A window's: the members whose update of lane step ``L`` gives back a block,
        synced to it and in running order (the scheduler has the manager observe them
        among the step's other sequences, then calls :meth:`redrop`)."""
        out = [m for m in self._drops.pop(self.L, ())
               if m.uid in self._live and m.gives_back_at == self.L]
        if len(out) > 1:
            out.sort(key=RUN_ORDER)
        for m in out:
            self._close_chain(m)  # (its ids are made now: its next block is named now)
            self.sync(m, self.L)
        return out

    def _close_chain(self, m: LaneMember) -> None:
        """Name ``m``'s pending blocks now (lazy_names.py: nothing could read the
        names before, so naming them early changes nothing a lookup finds)."""
        c = m.chain
        if c is not None and not c.closed:
            assert self.lazy is not None
            self.lazy.materialize([c.root])

    def redrop(self, done: list[LaneMember]) -> None:
        """After the manager observed ``done`` (their cursors moved): their next drops."""
        for m in done:
            if m.uid in self._live:
                self._track_drop(m, self.L + 1)

    def blocks_taken_at(self, L1: int) -> int:
        """At most how many members take a new block at lane step ``L1`` (left or moved
        members filed there count: LaneScheduler.lane_step_ready may say no where a step
        could have been a lane step, never the reverse)."""
        return len(self._takes.get(L1, ()))

    def taking(self, L1: int) -> list[LaneMember]:
        """The members whose write of lane step ``L1`` takes a new block (or, in a
        contiguous range, finds it full), in running order."""
        out = [m for m in self._takes.pop(L1, ()) if m.takes_block_at == L1]
        if L1 in self._unsorted:
            self._unsorted.discard(L1)
            out.sort(key=RUN_ORDER)
        elif CHECKS:
            assert out == sorted(out, key=RUN_ORDER), f"lane step {L1}: blocks taken out of order"
        return out

    def fills(self, L1: int) -> list[LaneMember]:
        """The members whose write of lane step ``L1`` fills their block, in running
        order (prefix caching: :meth:`name_filled` names each): those whose next block is taken
        the step after, but for one that joined at ``L1`` or later (its block was named
        by the per-sequence path, or it joined after this step's schedule)."""
        if not self.caching:
            return []
        nxt = L1 + 1
        out = [m for m in self._takes.get(nxt, ()) if m.takes_block_at == nxt and m.joined < L1]
        if nxt in self._unsorted:
            out.sort(key=RUN_ORDER)
        elif CHECKS:
            assert out == sorted(out, key=RUN_ORDER), f"lane step {L1}: fills out of order"
        return out

    def name_filled(self, m: LaneMember, L1: int) -> None:
        """Name ``m``'s block, which its write of lane step ``L1`` filled (a member
        preempted before that write is skipped: it never made it)."""
        self.name_filled_all([m], L1)

    def name_filled_all(self, members: list[LaneMember], L1: int) -> None:
        """:meth:`name_filled` of each of ``members`` (in running order), in one pass.
        A block all of whose ids are the lane's joins its member's pending chain, named
        when first read (lazy_names.py), where its member is the only holder of
        the name before it; the others are named now. Fills are not settled here: a
        block the lane took was recorded full when taken; the one a member joined with is
        brought up to date at its next block, sync or finish."""
        if not members:
            return
        kv, lazy = self.paged, self.lazy
        assert kv is not None
        bs, tokens, nxt = self.bs, self.tokens, L1 + 1
        for m in members:
            if m.takes_block_at != nxt:  # it left (-1), or its block changed since
                continue
            c = m.chain
            if c is not None and not c.closed:
                # (the usual case) its open chain's next block: none of its ids are made
                # (a member's ids are made only as it leaves, or by drops_due, which
                # closes its chain first)
                c.n += 1
                kv.name_pending(m.block, c, c.first + c.n - 1)
                continue
            end = m.computed_at_join + L1 - m.joined  # tokens computed after the write
            toks = m.seq.token_ids
            have = len(toks)
            st = m.seq_blocks
            assert st is not None
            if have <= end - bs:  # none of the block's ids made yet
                c = m.chain = (lazy.open(st, m.key, m.rid, end - bs, m.run_order, L1)
                               if lazy is not None and lazy.may_open(st) else None)
                if c is not None:
                    assert st.table[c.first] == m.block
                    c.n = 1
                    kv.name_pending(m.block, c, c.first)
                    continue
                block = tokens(m.rid, end - bs, bs)
            else:
                block = (toks[end - bs:end] if have >= end
                         else toks[end - bs:] + tokens(m.rid, have, end - have))
            kv.name_next_blocks([st], [block], [m.key], [m.rid], settled=False)

    def _drop(self, m: LaneMember) -> None:
        del self._live[m.uid]
        m.takes_block_at = -1  # its entries under later takes and fills are void
        m.seq.group.lane = None
        self.n -= 1
        self.off_sum -= m.computed_at_join - m.joined
        self._res[(m.computed_at_join - m.joined) % self.bs] -= 1
        if m.over:
            self.over_n -= 1
            self.over_off -= m.computed_at_join - m.joined
            self._over_res[(m.computed_at_join - m.joined) % self.bs] -= 1
        if len(self._max) > 4 * self.n + 64:  # the heaps keep left members until the top
            self._max = [(m.joined - m.computed_at_join, m.uid) for m in self._live.values()]
            heapq.heapify(self._max)
            if self.split is not None:
                self._under = [(m.joined - m.computed_at_join, m.uid) for m in self._live.values()
                               if not m.over]
                heapq.heapify(self._under)

    def leave(self, m: LaneMember) -> None:
        """``m`` leaves (a preemption), synced to the steps done, its blocks named."""
        self._close_chain(m)
        self.sync(m, self.L)
        self._drop(m)
        if self.on_leave is not None:
            self.on_leave(m.rid)

    def leave_all(self) -> None:
        """Every member leaves, synced (the run ended or stopped)."""
        for m in list(self._live.values()):
            self.leave(m)

    def finishing(self) -> list[LaneMember]:
        """The members whose update of lane step ``L`` finishes them, synced and gone
        from the lane (the scheduler finishes their sequences)."""
        out = [m for m in self._finish.pop(self.L, ()) if m.uid in self._live]
        for m in out:
            self.sync(m, self.L)
            self._drop(m)
        return out

    # -- the per-sequence path, when needed ---------------------------------------------------
    def sync(self, m: LaneMember, L: int) -> None:
        """Bring ``m``'s sequence and its last block's fill to lane step ``L`` (done)."""
        self._sync_tokens(m, L)
        m.seq.num_computed = m.computed_at_join + L - m.joined
        self._settle(m, L)

    def _sync_tokens(self, m: LaneMember, L: int) -> None:
        seq = m.seq
        toks = seq.token_ids
        have, want = len(toks), m.tokens_at_join + L - m.joined
        if want > have:
            toks += self.tokens(m.rid, have, want - have)

    def _settle(self, m: LaneMember, L: int) -> None:
        """The in-place writes of lane steps ``settled + 1 .. L`` into ``m``'s block, one
        slot each: the pool's used slots were counted as they happened
        (:meth:`scheduled`); the block's fill and the ledger's integral now. A block the
        lane took was recorded full when taken (:meth:`take_blocks`): ``settled`` is then
        its last slot's step, and the writes after ``L`` are taken back."""
        k = L - m.settled
        if k > 0:
            self.kv.ramp_fill(m.block, k)
        elif k < 0:
            assert self.paged is not None  # (only take_blocks records ahead)
            self.paged.trim_fill(m.block, -k)
        m.settled = L

    def take_block(self, m: LaneMember, L1: int) -> bool:
        """Write ``m``'s slot of lane step ``L1``, a block's first, into a new block as
        ``PagedKVManager.append_slot`` would (False, nothing done: no block is free, the
        caller preempts; for a contiguous range, always: it is full)."""
        kv = self.paged
        if kv is None or kv.pool.num_free == 0:
            return False
        self.take_blocks([m], L1)
        return True

    def take_blocks(self, members: list[LaneMember], L1: int) -> None:
        """:meth:`take_block` of each of ``members`` (in running order), when the pool has a
        free block for each: the same blocks in the same order, in one pass (every
        member takes a block every ``block size`` steps)."""
        kv = self.paged
        assert kv is not None and kv.pool.num_free >= len(members)
        if not members:  # (most steps: a member takes a block every block size steps)
            return
        # Each block with this step's write and, recorded ahead, its writes to its last
        # slot at lane step L1 + bs - 1 (the member takes its next at L1 + bs; one that
        # stops before is trimmed back by _settle): a block's fill and ledger epoch are
        # made once, not made and ramped.
        bs = self.bs
        tables: list[SeqBlocks] = []
        for m in members:
            assert m.seq_blocks is not None
            tables.append(m.seq_blocks)
        blocks = kv.take_ramped(tables, bs - 1)
        nxt = L1 + bs
        # Every member that took one now takes its next at the same step (members that join can be
        # filed under it too: _unsorted).
        later = self._takes.setdefault(nxt, [])
        if later and later[-1].run_order > members[0].run_order:
            self._unsorted.add(nxt)
        # _settle to L1 - 1 of each old block not recorded ahead (the block a member held
        # when it joined: its writes since), in one call.
        old: list[int] = []
        ks: list[int] = []
        for m, b in zip(members, blocks):
            if m.settled != L1 - 1:
                old.append(m.block)
                ks.append(L1 - 1 - m.settled)
            m.block = b
            m.settled = nxt - 1
            m.takes_block_at = nxt
            later.append(m)
        if old:
            kv.ramp_fills(old, ks)

    def scheduled(self, n_sched: int, n_took: int) -> None:
        """Lane step ``L + 1`` scheduled ``n_sched`` members, ``n_took`` of them by the
        per-sequence path: the rest each filled one slot in place."""
        self.kv.add_used(n_sched - n_took)
        self.L += 1

    def context_sums(self, L1: int) -> LaneSums:
        """The members' contexts at lane step ``L1`` (the last query's position + 1: what
        each decode reads) as sums: O(block size + members passing the split)."""
        h, live = self._max, self._live
        while h and h[0][1] not in live:
            heapq.heappop(h)
        bs = self.bs
        k = bs - L1 % bs  # offset r is context (r + L1) mod bs: the counts rotated
        by_mod = self._res[k:] + self._res[:k]
        if self.split is None:
            return LaneSums(self.n, self.off_sum + self.n * L1, L1 - h[0][0] if h else 0,
                            tuple(by_mod))
        u = self._under
        while u and -u[0][0] + L1 > self.split:  # past the split from this step on
            m = live.get(heapq.heappop(u)[1])
            if m is not None:
                m.over = True
                self.over_n += 1
                self.over_off += m.computed_at_join - m.joined
                self._over_res[(m.computed_at_join - m.joined) % bs] += 1
        over = self._over_res[k:] + self._over_res[:k]
        return LaneSums(self.n, self.off_sum + self.n * L1, L1 - h[0][0] if h else 0,
                        tuple(by_mod), self.over_n, self.over_off + self.over_n * L1,
                        tuple(over))
