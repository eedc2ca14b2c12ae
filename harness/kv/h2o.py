"""KV manager for Heavy-Hitter Oracle eviction: a per-sequence token budget.

A sequence fills positional slots (as in :class:`PagedKVManager`) until it holds
``budget`` tokens; from then on every new token takes the slot of a token the eviction
policy gives up (the lowest accumulated attention outside the recent window), so the
sequence never holds more than its budget and its table never grows. A victim slot in a
block shared with a fork is first copied (copy-on-write of the whole block).

Prefix caching is off under this manager: a block whose slots were rewritten is no
longer the block its hash names.
"""

from __future__ import annotations

from typing import Protocol

from harness.kv.base import CopyOp, Demand
from harness.kv.paged import PagedKVManager, _cdiv
from harness.sched.sequence import Sequence


class EvictionPolicy(Protocol):
    def victims(self, seq: Sequence, slots: list[int], n: int, next_pos: int) -> list[int]:
        """``n`` distinct slots among ``slots`` (the sequence's held slots) to give up
        before the tokens from position ``next_pos`` on are written."""
        ...


class H2OKVManager(PagedKVManager):
    supports_swap = False

    def __init__(self, num_blocks: int, block_size: int, *, budget: int = 0,
                 budget_ratio: float = 0.0, heavy_ratio: float = 0.5,
                 policy: EvictionPolicy | None = None, **options: object) -> None:
        options["enable_prefix_caching"] = False
        super().__init__(num_blocks, block_size, **options)  # type: ignore[arg-type]
        if (budget <= 0) == (budget_ratio <= 0):
            raise ValueError("set exactly one of backend.budget (tokens) and "
                             "backend.budget_ratio (share of prompt + max_tokens)")
        if not 0.0 < heavy_ratio < 1.0:
            raise ValueError(f"backend.heavy_ratio must be in (0, 1), got {heavy_ratio}")
        self.budget_tokens = budget
        self.budget_ratio = budget_ratio
        self.heavy_ratio = heavy_ratio
        self.policy = policy
        self._budget: dict[int, int] = {}  # seq id -> its budget in tokens
        self._placed: dict[int, dict[int, int]] = {}  # seq id -> {position: reused slot}

    # -- budgets -----------------------------------------------------------------------
    def budget_of(self, seq: Sequence) -> int:
        b = self._budget.get(seq.seq_id)
        if b is None:
            if self.budget_tokens:
                b = self.budget_tokens
            else:
                total = seq.num_prompt_tokens + seq.group.params.max_tokens
                b = _cdiv(int(self.budget_ratio * total * 1000), 1000)
            b = max(b, 2)  # at least one heavy hitter and one recent token
            self._budget[seq.seq_id] = b
        return b

    def recent_of(self, seq: Sequence) -> int:
        b = self.budget_of(seq)
        return max(1, b - max(1, round(self.heavy_ratio * b)))

    def max_chunk(self, seq: Sequence) -> int:
        """Most tokens one step may add: the evictable (heavy) part of the budget, so a
        chunk never has to evict the recent window or itself."""
        return max(1, self.budget_of(seq) - self.recent_of(seq))

    def slots_needed(self, prompt_len: int, max_tokens: int, n: int) -> int:
        total = prompt_len + max_tokens
        b = self.budget_tokens or max(2, _cdiv(int(self.budget_ratio * total * 1000), 1000))
        return n * _cdiv(min(b, total), self.block_size) * self.block_size

    # -- allocation ----------------------------------------------------------------------
    def _split(self, seq: Sequence, start: int, n: int) -> tuple[int, int]:
        """(positional tokens, tokens that reuse evicted slots) of ``n`` from ``start``."""
        fit = max(0, self.budget_of(seq) - start)
        return min(n, fit), n - min(n, fit)

    def _new_blocks(self, d: Demand) -> int:
        seq = d.seq
        n_pos, n_evict = self._split(seq, seq.num_computed, d.num_tokens)
        need = super()._new_blocks(Demand(seq, n_pos)) if n_pos else 0
        if n_evict and self.pool.num_shared:
            need += n_evict  # a victim's block may need a private copy first
        return need

    def allocate_group(self, demands: list[Demand]) -> None:
        for d in demands:
            self._allocate_one(d.seq, d.num_tokens)

    def _allocate_one(self, seq: Sequence, n: int) -> None:
        start = seq.num_computed
        n_pos, n_evict = self._split(seq, start, n)
        self._placed[seq.seq_id] = {}
        if n_pos:
            self._extend(seq, start, n_pos)
        if n_evict:
            assert self.policy is not None, "the h2o backend binds its policy"
            held = self._held_slots(seq)
            victims = self.policy.victims(seq, held, n_evict, start + n_pos)
            assert len(set(victims)) == n_evict
            placed = self._placed[seq.seq_id]
            for i, slot in enumerate(victims):
                placed[start + n_pos + i] = self._private(seq, slot)
            self.evicted_tokens += n_evict

    def _held_slots(self, seq: Sequence) -> list[int]:
        bs, b = self.block_size, self.budget_of(seq)
        return [seq.block_table[j // bs] * bs + j % bs for j in range(b)]

    def _private(self, seq: Sequence, slot: int) -> int:
        """``slot`` itself, or its image in a private copy of its block when shared."""
        bs, pool = self.block_size, self.pool
        blk, off = divmod(slot, bs)
        if pool.ref[blk] == 1:
            return slot
        new = pool.allocate()
        assert new is not None, "can_allocate counted a copy per victim"
        self._copies.append(CopyOp(blk * bs, new * bs, bs))
        pool.set_fill(new, pool.fill[blk])
        pool.release(blk)
        seq.block_table[seq.block_table.index(blk)] = new
        self.cow_copies += 1
        return new * bs + off

    def append_slot(self, seq: Sequence) -> int | None:
        if seq.num_computed < self.budget_of(seq):
            return super().append_slot(seq)
        if self.pool.num_shared and self.pool.num_free == 0:
            return None
        self._allocate_one(seq, 1)
        return self._placed[seq.seq_id][seq.num_computed]

    def slot(self, seq: Sequence, pos: int) -> int:
        placed = self._placed.get(seq.seq_id)
        if placed and pos in placed:
            return placed[pos]
        return super().slot(seq, pos)

    def held_tokens(self, seq: Sequence, upto: int) -> int:
        """Slots holding live tokens once positions ``[0, upto)`` are written."""
        return min(upto, self.budget_of(seq))

    def fork(self, parent: Sequence, child: Sequence) -> None:
        super().fork(parent, child)
        self._budget[child.seq_id] = self.budget_of(parent)

    def free(self, seq: Sequence) -> None:
        super().free(seq)
        self._placed.pop(seq.seq_id, None)
        # The budget stays: a recompute-preempted sequence keeps the one it was given.
