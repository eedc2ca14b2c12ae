"""Paged KV managers with an eviction policy: one seam for every lossy method, one
manager per granularity.

The policy (harness.kv.policies) decides; the manager keeps the books and frees through
one path, ``evict``, called from :meth:`PolicyKVManager.observe` after each step's
forward (and, as a safety net, when a sequence would otherwise exceed its budget at
allocation). :class:`WindowKVManager` serves positional policies (a window: whole blocks
at their positional slots given back, paged allocation, prefix caching and swap kept);
:class:`EvictingKVManager` the token-granular ones (h2o, tova, snapkv, knorm). Costs per
step are O(tokens the step touches): a policy scores a sequence's held slots with numpy
over arrays indexed by slot, never a Python loop over the budget.

Token-granular policies (``positional = False``): a sequence's slots need not follow
position order. Each sequence keeps a stack of free slots inside the blocks it holds
(a new block's slots, then the slots its evictions emptied); a new token takes the top
one, copying the block first if it is shared (a fork). ``_pos[slot]`` is the position of
the live token in ``slot`` (-1: none), and a block whose last token goes is released.
The backend learns which slots stopped holding a token through
:attr:`~harness.kv.base.CacheOps.invalidated` in the next step record.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from harness.kv.base import CopyOp, Demand, PrefixHit, StepScores
from harness.kv.compaction import plan_compaction
from harness.kv.compressed import CompressedIndex, CompressedPrefix, index_for
from harness.kv.paged import GIVEN_BACK, PagedKVManager, SeqBlocks, cdiv
from harness.kv.policies.base import Eviction, EvictionPolicy, HeldBlocks, HeldTokens

if TYPE_CHECKING:
    from harness.sched.sequence import Sequence


@dataclass(slots=True)
class BudgetBlocks(SeqBlocks):
    """SeqBlocks of a token-granular policy: ``free`` is the stack of empty slots inside
    the held blocks (the next token takes ``free[-1]``); ``live`` the tokens held;
    ``cap`` the blocks its budget fills; ``owed`` the blocks it may still take to get
    there (promised at admission, see :meth:`EvictingKVManager.can_allocate`);
    ``marks`` where its state was compressed (its prompt's end, or the marks of the
    compressed prefix it started from); ``carried`` the tokens that prefix stood for
    (0: none; a sequence that started from one is not compressed again)."""

    free: list[int] = field(default_factory=list)
    live: int = 0
    cap: int = 0
    owed: int = 0
    marks: tuple[int, ...] = ()
    carried: int = 0


@dataclass(slots=True, frozen=True)
class KeptState:
    """What a compressed prefix's blocks hold besides their K/V: the empty slots among
    them (in the stack's order) and how many tokens they hold."""

    free: tuple[int, ...]
    live: int


class PolicyKVManager(PagedKVManager):
    """Paged bookkeeping + an :class:`EvictionPolicy`: the budgets the policy states, and
    :meth:`observe`, where the policy decides and the manager changes its own state (a
    policy never writes the manager's fields: what it considered comes back in its
    :class:`Eviction`). Subclasses give back what an eviction names (``evict``)."""

    def __init__(self, num_blocks: int, block_size: int, policy: EvictionPolicy,
                 **options: object) -> None:
        super().__init__(num_blocks, block_size, **options)  # type: ignore[arg-type]
        self.policy = policy
        policy.reset(num_blocks * block_size)

    # -- budgets -----------------------------------------------------------------------
    def budget_of(self, seq: Sequence) -> int | None:
        """A function of the request's shape: forks and a recomputed sequence get the same."""
        return self.policy.budget(seq.num_prompt_tokens, seq.group.params.max_tokens)

    def max_chunk(self, seq: Sequence) -> int | None:
        return self.policy.max_chunk(self.budget_of(seq))

    def slots_needed(self, prompt_len: int, max_tokens: int, n: int) -> int:
        b = self.policy.peak(prompt_len, max_tokens)
        if b is None:
            return super().slots_needed(prompt_len, max_tokens, n)
        return n * cdiv(min(b, prompt_len + max_tokens), self.block_size) * self.block_size

    def held_tokens(self, seq: Sequence) -> int:
        """Tokens ``seq`` holds now (what its blocks hold, the given-back ones not)."""
        st = self._seqs.get(seq.seq_id)
        if st is None:
            return 0
        return seq.num_computed - st.given_back * self.block_size

    def _over(self, seq: Sequence, n: int) -> int:
        """Tokens ``seq`` must give back before ``n`` more fit its budget."""
        b = self.policy.held_limit(seq, n)
        return 0 if b is None else max(0, self.held_tokens(seq) + n - b)

    # -- eviction --------------------------------------------------------------------------
    def observe(self, seqs: list[Sequence], scores: StepScores | None) -> None:
        if scores is not None:
            self.policy.on_scores(scores)
        for seq in seqs:
            if seq.seq_id in self._seqs:
                ev = self._select(seq, self._over(seq, self._next_tokens(seq)))
                if ev:
                    self.evict(seq, ev)
                    self.after_eviction(seq)

    def after_eviction(self, seq: Sequence) -> None:
        """After ``seq`` gave something back in :meth:`observe` (token managers compact)."""

    def _next_tokens(self, seq: Sequence) -> int:
        """Tokens ``seq``'s next step adds: its sampled token, or its next prefill chunk."""
        left = seq.num_uncomputed
        cap = self.max_chunk(seq)
        return left if cap is None else min(left, cap)

    def _select(self, seq: Sequence, need: int) -> Eviction:
        held = self.held_view(seq, need)
        ev = Eviction() if held is None else self.policy.select(seq, held, need)
        if ev.considered is not None:  # the policy decides, the manager keeps the books
            self._seqs[seq.seq_id].cursor = ev.considered
        assert len(ev.slots) + len(ev.blocks) * self.block_size >= need, \
            f"policy {self.policy.name} freed too little"
        return ev

    def held_view(self, seq: Sequence, need: int) -> HeldBlocks | HeldTokens | None:
        """What the policy is handed to decide on (None: nothing to ask it)."""
        raise NotImplementedError

    def evict(self, seq: Sequence, ev: Eviction) -> None:
        """Give back ``ev``'s blocks or slots of ``seq``: the one path the policy frees
        through. O(tokens given back)."""
        raise NotImplementedError

    def live_slots(self, seq: Sequence) -> tuple[np.ndarray, np.ndarray]:
        """(slots, positions) of the tokens ``seq`` holds: int64 (held,) each. Here, at
        their positional slots: every computed position of a block not given back."""
        st = self._seqs[seq.seq_id]
        bs = self.block_size
        table = np.asarray(st.table, dtype=np.int64)
        pos = np.arange(len(table) * bs, dtype=np.int64)
        slots = (table[:, None] * bs + np.arange(bs, dtype=np.int64)).ravel()
        keep = (np.repeat(table, bs) >= 0) & (pos < seq.num_computed)
        return slots[keep], pos[keep]


class WindowKVManager(PolicyKVManager):
    """A positional policy (a window): paged allocation as it is, whole blocks given back
    at their positional slots (their K/V still what their hashes name: prefix caching and
    swap stay on)."""

    def held_view(self, seq: Sequence, need: int) -> HeldBlocks:
        # Every step: a window gives back what it no longer sees, whatever the budget.
        st = self._seqs[seq.seq_id]
        return HeldBlocks(st.table, st.cursor, self.block_size)

    def evict(self, seq: Sequence, ev: Eviction) -> None:
        if not ev:
            return
        assert not ev.slots, "a positional policy gives back whole blocks"
        st = self._seqs[seq.seq_id]
        for i in ev.blocks:
            b = st.table[i]
            assert b >= 0, "blocks are given back once, positionally"
            self.pool.release(b)
            st.table[i] = GIVEN_BACK
            st.given_back += 1
            self.logical_blocks -= 1
            self.stats.evicted_tokens += self.block_size


class EvictingKVManager(PolicyKVManager):
    """A token-granular policy (h2o, tova, snapkv, knorm): single slots given back and
    reused, per-slot positions, compaction after a one-shot selection. Per-slot state
    lives beside the cache: blocks do not swap.

    Prefix caching: a rewritten block is not what a positional name says, so no block is
    named by its tokens. Under a policy that compresses once (``compresses_once``) and
    with ``enable_prefix_caching``, a sequence's compressed state is kept when it ends,
    named by the method, its parameters and its original tokens (harness.kv.compressed):
    its blocks are named after that prefix and go to the pool's cache of freed blocks as a
    paged block does (free to take, evicted in the pool's order; their slots keep their
    positions until then); a later prompt starting with those tokens copies them. A
    prefix loses its name with any of its blocks. Otherwise (h2o, tova: they re-score
    every step) every prompt is compressed anew."""

    def __init__(self, num_blocks: int, block_size: int, policy: EvictionPolicy,
                 **options: object) -> None:
        if policy.positional:
            raise ValueError(f"policy {policy.name} is positional: use WindowKVManager")
        caching = bool(options.get("enable_prefix_caching", False)) and policy.compresses_once
        options["enable_prefix_caching"] = caching
        options["num_cpu_blocks"] = 0
        options.pop("tiers", None)  # (no lower tiers: a stack gives none to this backend)
        super().__init__(num_blocks, block_size, policy, **options)
        self.supports_swap = False
        self._pos = np.full(num_blocks * block_size, -1, dtype=np.int64)
        # Blocks promised to admitted budgeted sequences that they do not hold yet: an
        # admission must leave them free, or it over-admits and then thrashes (20 admitted
        # and 65 preemptions recomputing 93% of the prompts, before this was counted).
        self._owed = 0
        self._index: CompressedIndex | None = None  # made at first use (the policy's
        # parameters are final then: duo's heads are measured after the stack is built)
        self._prefix_of: dict[int, CompressedPrefix] = {}  # a kept prefix's blocks
        self._pinned: list[int] = []  # this step's hits' source blocks, held until its end
        if caching:
            self.pool.on_evict = self._evicted

    @property
    def index(self) -> CompressedIndex:
        """The kept compressed prefixes (harness.kv.compressed)."""
        if self._index is None:
            self._index = index_for(self.policy.name, self.policy.params(), self.block_size)
        return self._index

    def held_tokens(self, seq: Sequence) -> int:
        """Tokens ``seq`` holds now (its budget's count, not a mask)."""
        st = self._seqs.get(seq.seq_id)
        return st.live if isinstance(st, BudgetBlocks) else 0

    def _over(self, seq: Sequence, n: int) -> int:
        st = self._seqs.get(seq.seq_id)
        if isinstance(st, BudgetBlocks) and st.carried:
            return 0  # it started from a compressed prefix: compressed already, all kept
        return super()._over(seq, n)

    # -- compressed prefixes (harness.kv.compressed) -----------------------------------
    def lookup_prefix(self, seq: Sequence) -> PrefixHit:
        """The longest kept compressed prefix of ``seq``'s tokens (all but its last)."""
        if not self.enable_prefix_caching or self.holds(seq):
            return PrefixHit()
        p = self.index.lookup(seq.token_ids, len(seq.token_ids) - 1, self.key_of(seq))
        return PrefixHit() if p is None else PrefixHit(list(p.blocks), compressed=p.covered)

    def _carried_cap(self, seq: Sequence, p: CompressedPrefix) -> int:
        """Blocks a sequence starting from ``p`` holds once its prompt is in: the kept
        tokens and every token after them (nothing is compressed again)."""
        assert isinstance(p.state, KeptState)
        rest = len(seq.token_ids) - p.covered
        return max(len(p.blocks), cdiv(p.state.live + rest, self.block_size))

    def _start_from(self, d: Demand) -> None:
        """``d.seq`` starts from a copy of the compressed prefix its hit names (its blocks
        pinned already): fresh blocks, whole-block copies (K/V, positions, scores), the
        prefix's empty slots, count and marks."""
        seq, p, pool, bs = d.seq, self._prefix_of[d.hit_blocks[0]], self.pool, self.block_size
        assert isinstance(p.state, KeptState)
        st = self.blocks_of(seq)
        assert isinstance(st, BudgetBlocks) and not st.table, "a hit on a fresh table"
        new = pool.allocate_all(len(p.blocks))
        for src, dst in zip(p.blocks, new):
            self._ops.copies.append(CopyOp(src * bs, dst * bs, bs))
            self.policy.on_copy(src * bs, dst * bs, bs)
            self._pos[dst * bs:(dst + 1) * bs] = self._pos[src * bs:(src + 1) * bs]
            pool.set_fill(dst, pool.fill[src])
        moved = dict(zip(p.blocks, new))
        st.table = new
        st.free = [moved[s // bs] * bs + s % bs for s in p.state.free]
        st.live, st.marks, st.carried = p.state.live, p.marks, p.covered
        st.cap = self._carried_cap(seq, p)
        self._set_owed(seq, st)
        self.logical_blocks += len(new)
        if p.owner == seq.group.request_id:  # its own state, kept when it was preempted
            self.stats.self_hit_tokens += p.covered
        else:
            self.stats.prefix_hit_tokens += p.covered
            seq.group.prefix_hit_tokens += p.covered

    def _keep_prefix(self, seq: Sequence, st: BudgetBlocks) -> bool:
        """As ``seq`` ends: keep its state as a compressed prefix (its blocks named after
        it) if it was compressed, is one request's only sequence, holds its blocks alone
        and is not kept already. Returns whether it was kept."""
        pool = self.pool
        if (not self.enable_prefix_caching or not st.marks or not st.table
                or len(seq.group.seqs) != 1 or seq.num_computed < seq.num_prompt_tokens
                or any(pool.ref[b] != 1 or pool.block_hash[b] is not None
                       for b in st.table)):
            return False
        index = self.index
        covered = seq.num_computed
        name, chain, tail = index.name_of(seq.token_ids, covered, st.marks, self.key_of(seq))
        if index.get(name) is not None:
            return False
        p = CompressedPrefix(name, chain, tail, covered, st.marks, seq.group.request_id,
                             list(st.table), KeptState(tuple(st.free), st.live))
        for i, (b, h) in enumerate(zip(p.blocks, index.block_names(p))):
            pool.name(b, h, p.owner, i)
            self._prefix_of[b] = p
        index.add(p)
        return True

    def _evicted(self, b: int, h: int, owner: int, depth: int) -> None:
        """The pool evicts cached block ``b`` (to reuse it): the prefix it held is gone
        (its other blocks stay cached, unfindable, until evicted in turn) and its slots
        hold nothing from now on."""
        p = self._prefix_of.pop(b, None)
        if p is not None:
            self.index.remove(p)
            for other in p.blocks:
                self._prefix_of.pop(other, None)
        self._clear_block(b)

    def cached_slots(self) -> int:
        """Slots of the pool's cached blocks (kept compressed prefixes, and blocks of
        prefixes that lost a block, until evicted) that still hold a token: the device
        holds them, no sequence does."""
        pool = self.pool
        return sum(pool.fill[b] for b in pool.lru_order())

    def end_forward(self) -> None:
        super().end_forward()
        if self._pinned:  # the hits' copies are made: their sources go back to the cache
            self.pool.release_all(self._pinned)
            self._pinned = []

    def held_view(self, seq: Sequence, need: int) -> HeldTokens | None:
        # A token policy is asked only when the sequence is over its limit: building the
        # view is O(held), and within the limit there is nothing to give back.
        return HeldTokens(*self.live_slots(seq)) if need > 0 else None

    def after_eviction(self, seq: Sequence) -> None:
        if self.policy.compacts:
            self._compact(seq)

    def live_slots(self, seq: Sequence) -> tuple[np.ndarray, np.ndarray]:
        """(slots, positions) of the tokens ``seq`` holds: int64 (held,) each."""
        st = self._seqs[seq.seq_id]
        bs = self.block_size
        slots = (np.asarray(st.table, dtype=np.int64)[:, None] * bs
                 + np.arange(bs, dtype=np.int64)).ravel()
        pos = self._pos[slots]
        keep = pos >= 0
        return slots[keep], pos[keep]

    # -- allocation (token-granular) -----------------------------------------------------
    def blocks_of(self, seq: Sequence) -> SeqBlocks:
        st = self._seqs.get(seq.seq_id)
        if st is None:
            st = self._seqs[seq.seq_id] = BudgetBlocks()
        return st

    def _cap_blocks(self, seq: Sequence) -> int:
        """Blocks ``seq`` holds once its budget is full (all its tokens, if fewer)."""
        b = self.budget_of(seq)
        total = seq.num_prompt_tokens + seq.group.params.max_tokens
        return cdiv(min(total, b if b is not None else total), self.block_size)

    def _set_owed(self, seq: Sequence, st: BudgetBlocks) -> None:
        if not st.cap:
            st.cap = self._cap_blocks(seq)
        owed = max(0, st.cap - len(st.table))
        self._owed += owed - st.owed
        st.owed = owed

    @property
    def owed_blocks(self) -> int:
        """Blocks promised to admitted sequences that they do not hold yet."""
        return self._owed

    def can_allocate(self, demands: list[Demand], watermark: bool) -> bool:
        need = self.blocks_needed(demands)
        limit = self.pool.num_free - self._owed - (self.watermark_blocks if watermark else 0)
        return need <= limit

    def _new_blocks(self, d: Demand) -> int:
        """Blocks beyond what is promised to ``d.seq``: for an admission, all it will hold
        (its budget, not just its first chunk); for a running sequence, new blocks past
        its promise, plus copies of shared blocks it must write."""
        seq, bs = d.seq, self.block_size
        st = self._seqs.get(seq.seq_id)
        if d.compressed:  # a hit: the copies and what follows them (blocks_needed adds
            # the cached blocks revived for the copy)
            return self._carried_cap(seq, self._prefix_of[d.hit_blocks[0]])
        if not isinstance(st, BudgetBlocks) or not st.table:
            return max(cdiv(d.num_tokens, bs), self._cap_blocks(seq))
        take = min(d.num_tokens, len(st.free))
        need = max(0, cdiv(d.num_tokens - take, bs) - st.owed)
        pool = self.pool
        need += len({s // bs for s in st.free[len(st.free) - take:] if pool.ref[s // bs] > 1})
        if pool.num_shared:
            need += self._over(seq, d.num_tokens)  # a victim may sit in a shared block
        return need

    def allocate_group(self, demands: list[Demand]) -> list[list[int]]:
        if self.enable_prefix_caching:
            for d in demands:
                if not self.holds(d.seq):
                    self.stats.prefix_query_tokens += d.seq.num_tokens
            hits = [d for d in demands if d.compressed]
            for d in hits:  # held before any block is taken (which could evict them)
                for b in self._prefix_of[d.hit_blocks[0]].blocks:
                    self.pool.touch(b)
                    self._pinned.append(b)
            for d in hits:
                self._start_from(d)
        return [self._take_slots(d.seq, d.num_tokens, d.compressed or None)
                for d in demands]

    def append_slot(self, seq: Sequence) -> int | None:
        if not self.can_allocate([Demand(seq, 1)], watermark=False):
            return None
        return self._take_slots(seq, 1)[0]

    def _take_slots(self, seq: Sequence, n: int, start: int | None = None) -> list[int]:
        """Slots for ``n`` tokens of ``seq`` from position ``start`` (default: its
        computed count)."""
        st = self.blocks_of(seq)
        assert isinstance(st, BudgetBlocks)
        over = self._over(seq, n)
        if over:  # a step's eviction could not keep the budget (a victim's copy failed)
            self.evict(seq, self._select(seq, over))
        pool, bs = self.pool, self.block_size
        pos0 = seq.num_computed if start is None else start
        out = []
        for i in range(n):
            if not st.free:
                b = pool.allocate()
                assert b is not None, "can_allocate must be called first"
                st.table.append(b)
                self.logical_blocks += 1
                self._set_owed(seq, st)
                st.free.extend(range(b * bs + bs - 1, b * bs - 1, -1))  # pop: ascending
            slot = st.free.pop()
            blk = slot // bs
            if pool.ref[blk] > 1:
                new = self._private(st, blk)
                assert new is not None, "can_allocate counted this copy"
                slot = new * bs + slot % bs
                blk = new
            pool.set_fill(blk, pool.fill[blk] + 1)
            self._pos[slot] = pos0 + i
            out.append(slot)
        st.live += n
        self.policy.on_write(out)
        return out

    def _private(self, st: BudgetBlocks, blk: int) -> int | None:
        """Copy shared block ``blk`` into a fresh block of this sequence (copy-on-write of
        the whole block); None when the pool has none left."""
        pool, bs = self.pool, self.block_size
        new = pool.allocate()
        if new is None:
            return None
        self._ops.copies.append(CopyOp(blk * bs, new * bs, bs))
        self.policy.on_copy(blk * bs, new * bs, bs)
        self._pos[new * bs:(new + 1) * bs] = self._pos[blk * bs:(blk + 1) * bs]
        pool.set_fill(new, pool.fill[blk])
        pool.release(blk)
        st.table[st.table.index(blk)] = new
        lo, d = blk * bs, (new - blk) * bs
        st.free = [s + d if lo <= s < lo + bs else s for s in st.free]
        self.stats.cow_copies += 1
        return new

    def fork(self, parent: Sequence, child: Sequence) -> None:
        super().fork(parent, child)
        src = self._seqs.get(parent.seq_id)
        if isinstance(src, BudgetBlocks):
            dst = self._seqs[child.seq_id]
            child_st = BudgetBlocks(dst.table, dst.hashes, dst.given_back, dst.cursor,
                                    list(src.free), src.live, src.cap, marks=src.marks,
                                    carried=src.carried)
            self._seqs[child.seq_id] = child_st
            self._set_owed(child, child_st)

    def free(self, seq: Sequence) -> None:
        st = self._seqs.get(seq.seq_id)
        if isinstance(st, BudgetBlocks):
            if not self._keep_prefix(seq, st):  # (kept: the slots hold it until evicted)
                pool = self.pool
                for b in st.table:
                    if pool.ref[b] == 1:  # the last holder: its slots hold nothing any more
                        self._clear_block(b)
            self._owed -= st.owed
        super().free(seq)

    def _clear_block(self, b: int) -> None:
        bs = self.block_size
        live = np.flatnonzero(self._pos[b * bs:(b + 1) * bs] >= 0) + b * bs
        self._pos[b * bs:(b + 1) * bs] = -1
        self._ops.invalidated += live.tolist()

    # -- eviction --------------------------------------------------------------------------
    def evict(self, seq: Sequence, ev: Eviction) -> None:
        if not ev:
            return
        assert not ev.blocks, "a token-granular policy gives back single slots"
        st = self._seqs[seq.seq_id]
        pool, bs = self.pool, self.block_size
        assert isinstance(st, BudgetBlocks), "single tokens are given back by budget policies"
        if not st.marks:  # (a compress-once policy evicts only here, at the prompt's end)
            st.marks = (seq.num_prompt_tokens,)
        by_block: dict[int, list[int]] = {}
        for slot in ev.slots:
            by_block.setdefault(slot // bs, []).append(slot)
        for blk, slots in by_block.items():
            if pool.ref[blk] > 1:
                new = self._private(st, blk)
                if new is None:
                    continue  # no room for the copy now: _take_slots catches up later
                slots = [s + (new - blk) * bs for s in slots]
                blk = new
            assert (self._pos[slots] >= 0).all(), "evicting a slot that holds nothing"
            self._pos[slots] = -1
            self._ops.invalidated += slots
            st.live -= len(slots)
            self.stats.evicted_tokens += len(slots)
            if pool.fill[blk] == len(slots):  # its last tokens: the block goes back
                pool.release(blk)
                st.table.remove(blk)
                self.logical_blocks -= 1
                self._set_owed(seq, st)
                lo = blk * bs
                st.free = [s for s in st.free if not lo <= s < lo + bs]
            else:
                pool.unfill(blk, len(slots))
                st.free += slots

    def _compact(self, seq: Sequence) -> None:
        """Move ``seq``'s tokens out of its sparsest private blocks into the holes of its
        densest (one-slot moves the step record carries) and give back the emptied
        blocks: O(tokens of the sequence), once per selection. Shared blocks (a fork's)
        are neither written nor emptied."""
        st = self._seqs[seq.seq_id]
        assert isinstance(st, BudgetBlocks)
        pool, bs = self.pool, self.block_size
        private = [b for b in st.table if pool.ref[b] == 1]
        plan = plan_compaction(private, self._pos, bs)
        if not plan.release:
            return
        src, dst = plan.src, plan.dst
        self._ops.copies += [CopyOp(s, d, 1, move=True) for s, d in zip(src.tolist(),
                                                                       dst.tolist())]
        for s, d in zip(src.tolist(), dst.tolist()):
            self.policy.on_copy(s, d, 1)
        self._pos[dst] = self._pos[src]
        self._pos[src] = -1
        for b, k in zip(*np.unique(dst // bs, return_counts=True)):
            pool.set_fill(int(b), pool.fill[int(b)] + int(k))
        gone = set(plan.release)
        for b in plan.release:
            pool.release(b)
            self.logical_blocks -= 1
        st.table = [b for b in st.table if b not in gone]
        taken = set(dst.tolist())
        st.free = [s for s in st.free if s // bs not in gone and s not in taken]
        self._set_owed(seq, st)
