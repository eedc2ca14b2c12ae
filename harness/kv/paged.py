"""Paged KV manager: block tables, automatic prefix caching, copy-on-write, swap, eviction.

Slot of token ``j`` of a sequence: ``table[j // bs] * bs + j % bs``. A full block is named
by a chained hash ``hash((parent_hash, tokens, extra_key))`` so that equal prefixes map to
equal blocks; a new prompt reuses every leading block whose hash is known. Every method
costs O(blocks it touches); nothing scans the pool.
"""

from __future__ import annotations

from collections import deque

from harness.kv.base import CopyOp, Demand, KVUsage
from harness.kv.block_pool import BlockPool
from harness.kv.ledger import ReservationLedger
from harness.sched.sequence import Sequence

# Parent hash of a sequence's first block. Any constant works; it only has to be fixed.
_ROOT_HASH = 0x6B76_6265_6E63_68


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_hash(parent: int, tokens: list[int], extra_key: int | str | None) -> int:
    """Chained hash of one full block. Python's tuple hash of ints is process-independent
    (PYTHONHASHSEED only salts str/bytes), 64-bit, and fast; a collision would alias two
    prefixes, which at 2^-64 per pair we accept, as vLLM's default builtin hash does."""
    return hash((parent, tuple(tokens), extra_key))


class PagedKVManager:
    """Block-table bookkeeping over a :class:`BlockPool` plus a CPU swap pool."""

    supports_swap = True

    def __init__(self, num_blocks: int, block_size: int, *, num_cpu_blocks: int = 0,
                 enable_prefix_caching: bool = True, watermark: float = 0.01) -> None:
        self.block_size = block_size
        self.ledger = ReservationLedger()
        self.pool = BlockPool(num_blocks, block_size, self.ledger)
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark_blocks = int(watermark * num_blocks)
        self.num_cpu_blocks = num_cpu_blocks
        self._cpu_free: deque[int] = deque(range(num_cpu_blocks))
        self._cpu_ref: dict[int, int] = {}
        self._cpu_fill: dict[int, int] = {}
        self._copies: list[CopyOp] = []
        self.logical_blocks = 0
        # Counters for the run's metrics.
        self.prefix_hit_tokens = 0
        self.prefix_query_tokens = 0
        self.cow_copies = 0
        self.evicted_tokens = 0
        self.swapped_out_blocks = 0
        self.swapped_in_blocks = 0

    # -- admission -------------------------------------------------------------------
    def slots_needed(self, prompt_len: int, max_tokens: int, n: int) -> int:
        bs = self.block_size
        # n samples share the prompt's full blocks and each needs its own tail.
        return (prompt_len // bs + n * _cdiv(prompt_len % bs + max_tokens, bs)) * bs

    def admission_error(self, prompt_len: int, max_tokens: int, n: int) -> str | None:
        bs = self.block_size
        need = self.slots_needed(prompt_len, max_tokens, n) // bs
        if need > self.pool.num_blocks:
            return (f"needs {need} blocks of {bs} tokens (prompt {prompt_len} + max_tokens "
                    f"{max_tokens}, n={n}) but the whole pool has {self.pool.num_blocks}: "
                    f"raise cache.kv_budget or lower max_tokens")
        return None

    def reservation_size(self, prompt_len: int, max_tokens: int) -> int:
        return self.block_size

    def lookup_prefix(self, seq: Sequence) -> list[int]:
        if not self.enable_prefix_caching or seq.block_table:
            return []
        bs, toks, extra = self.block_size, seq.token_ids, seq.group.extra_key
        hits: list[int] = []
        h = _ROOT_HASH
        # The last token is always computed (its logits are needed), so a prompt that is
        # all cached still leaves its last block to compute, as vLLM does.
        for i in range((len(toks) - 1) // bs):
            h = block_hash(h, toks[i * bs:(i + 1) * bs], extra)
            b = self.pool.lookup(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def _new_blocks(self, d: Demand) -> int:
        seq, bs = d.seq, self.block_size
        if d.hit_blocks:
            start, have = len(d.hit_blocks) * bs, len(d.hit_blocks)
        else:
            start, have = seq.num_computed, len(seq.block_table)
        need = max(0, _cdiv(start + d.num_tokens, bs) - have)
        if start % bs and d.num_tokens and self.pool.ref[seq.block_table[start // bs]] > 1:
            need += 1  # copy-on-write of the shared, partially filled last block
        return need

    def can_allocate(self, demands: list[Demand], watermark: bool) -> bool:
        need = 0
        for d in demands:
            need += self._new_blocks(d)
            # A hit on an evictable block takes it out of the free count.
            need += sum(1 for b in d.hit_blocks if self.pool.ref[b] == 0)
        limit = self.pool.num_free - (self.watermark_blocks if watermark else 0)
        return need <= limit

    def allocate(self, d: Demand) -> None:
        self.allocate_group([d])

    def allocate_group(self, demands: list[Demand]) -> None:
        """Meet several demands accepted together by :meth:`can_allocate`.

        Every demand's prefix hits are taken first: a later demand's new blocks may
        otherwise evict a cached block that an earlier lookup promised to another
        sequence of the group (a group readmitted after recompute preemption).
        """
        for d in demands:
            if d.hit_blocks:
                self._take_hits(d)
        for d in demands:
            start = len(d.hit_blocks) * self.block_size if d.hit_blocks else d.seq.num_computed
            self._extend(d.seq, start, d.num_tokens)

    def _take_hits(self, d: Demand) -> None:
        seq, pool = d.seq, self.pool
        assert not seq.block_table and seq.num_computed == 0, "hits only on a fresh table"
        for b in d.hit_blocks:
            pool.touch(b)
            seq.block_table.append(b)
            h = pool.block_hash[b]
            assert h is not None, f"hit block {b} lost its hash before it was taken"
            seq.block_hashes.append(h)
        self.logical_blocks += len(d.hit_blocks)
        self.prefix_hit_tokens += len(d.hit_blocks) * self.block_size

    def _extend(self, seq: Sequence, start: int, num_tokens: int) -> None:
        """Slots for tokens ``[start, start + num_tokens)``: copy-on-write, new blocks,
        fill counts, and hashes of the blocks these tokens fill."""
        pool, bs, table = self.pool, self.block_size, seq.block_table
        end = start + num_tokens
        if start % bs and num_tokens:
            i = start // bs
            last = table[i]
            if pool.ref[last] > 1:
                # Never write a shared block: the writer takes a private copy of the filled
                # part. Full shared blocks never get here (start % bs == 0 for them).
                new = pool.allocate()
                assert new is not None, "can_allocate must be called first"
                filled = start % bs
                assert pool.fill[last] == filled, (pool.fill[last], filled)
                self._copies.append(CopyOp(last * bs, new * bs, filled))
                pool.set_fill(new, filled)
                pool.release(last)
                table[i] = new
                self.cow_copies += 1
        for _ in range(_cdiv(end, bs) - len(table)):
            fresh = pool.allocate()
            assert fresh is not None, "can_allocate must be called first"
            table.append(fresh)
            self.logical_blocks += 1
        for i in range(start // bs, _cdiv(end, bs)):
            pool.set_fill(table[i], min(bs, end - i * bs))
        if self.enable_prefix_caching:
            self._register_full_blocks(seq, end)

    def append_slot(self, seq: Sequence) -> int | None:
        """Fast path of ``allocate(Demand(seq, 1))`` for a decode: the slot of token
        ``seq.num_computed``, or None when that needs a block and none is free."""
        pos, bs, pool = seq.num_computed, self.block_size, self.pool
        off = pos % bs
        if off:
            b = seq.block_table[pos // bs]
            if pool.ref[b] == 1:  # the common case: write in place into our own block
                pool.used_slots += 1
                pool.fill[b] = off + 1
                if pool.ledger is not None:
                    pool.ledger.fill(b, off + 1)
                if off + 1 == bs and self.enable_prefix_caching:
                    self._register_full_blocks(seq, pos + 1)
                return b * bs + off
        if pool.num_free == 0:
            return None
        self._extend(seq, pos, 1)
        return self.slot(seq, pos)

    def _register_full_blocks(self, seq: Sequence, end: int) -> None:
        """Name the blocks that ``end`` tokens fill, so a later prompt (the next turn of a
        conversation re-sending this answer) can hit them."""
        bs, toks, extra = self.block_size, seq.token_ids, seq.group.extra_key
        hashes = seq.block_hashes
        for i in range(len(hashes), end // bs):
            h = block_hash(hashes[-1] if hashes else _ROOT_HASH, toks[i * bs:(i + 1) * bs],
                           extra)
            hashes.append(h)
            self.pool.register(seq.block_table[i], h)

    def max_chunk(self, seq: Sequence) -> int | None:
        """Most tokens one step may add to ``seq`` (None: no limit beyond the budget)."""
        return None

    # -- per-token queries -------------------------------------------------------------
    def slot(self, seq: Sequence, pos: int) -> int:
        bs = self.block_size
        return seq.block_table[pos // bs] * bs + pos % bs

    # -- sharing and release -----------------------------------------------------------
    def fork(self, parent: Sequence, child: Sequence) -> None:
        assert not child.block_table
        for b in parent.block_table:
            if b >= 0:
                self.pool.touch(b)
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_evicted_blocks = parent.num_evicted_blocks
        child.evict_cursor = parent.evict_cursor
        self.logical_blocks += parent.num_table_blocks

    def free(self, seq: Sequence) -> None:
        # Reverse order: the tail (least likely to be shared) enters the LRU first and is
        # evicted first, keeping the common prefix cached longest.
        for b in reversed(seq.block_table):
            if b >= 0:
                self.pool.release(b)
        self.logical_blocks -= seq.num_table_blocks
        seq.block_table = []
        seq.block_hashes = []
        seq.num_evicted_blocks = 0
        seq.evict_cursor = 0

    def free_leading(self, seq: Sequence, num_tokens: int, keep_first: int = 0) -> int:
        """Give back the blocks wholly inside tokens ``[0, num_tokens)`` except the first
        ``keep_first`` (attention sinks); the table keeps their positions as -1 so logical
        indexing is unchanged. O(blocks freed). Returns the number of blocks freed."""
        first = max(keep_first, seq.evict_cursor)
        upto = num_tokens // self.block_size
        freed = 0
        for i in range(first, upto):
            b = seq.block_table[i]
            if b >= 0:
                self.pool.release(b)
                seq.block_table[i] = -1
                freed += 1
        if upto > seq.evict_cursor:
            seq.evict_cursor = upto
        seq.num_evicted_blocks += freed
        self.logical_blocks -= freed
        self.evicted_tokens += freed * self.block_size
        return freed

    def take_copies(self) -> list[CopyOp]:
        copies, self._copies = self._copies, []
        return copies

    # -- swap ---------------------------------------------------------------------------
    @staticmethod
    def _distinct(seqs: list[Sequence]) -> set[int]:
        return {b for s in seqs for b in s.block_table if b >= 0}

    def can_swap_out(self, seqs: list[Sequence]) -> bool:
        return len(self._distinct(seqs)) <= len(self._cpu_free)

    def can_swap_in(self, seqs: list[Sequence]) -> bool:
        return len(self._distinct(seqs)) <= self.pool.num_free - self.watermark_blocks

    def swap_out(self, seqs: list[Sequence]) -> list[tuple[int, int]]:
        """Move the group's blocks to CPU; returns (device block, cpu block) copies."""
        mapping: dict[int, int] = {}
        for s in seqs:
            for i, b in enumerate(s.block_table):
                if b < 0:
                    continue
                if b not in mapping:
                    c = self._cpu_free.popleft()
                    mapping[b] = c
                    self._cpu_ref[c] = 0
                    self._cpu_fill[c] = self.pool.fill[b]
                c = mapping[b]
                self._cpu_ref[c] += 1
                s.block_table[i] = c
                self.pool.release(b)
        self.swapped_out_blocks += len(mapping)
        # Swapped tables hold CPU blocks: they are not device blocks "held without sharing".
        self.logical_blocks -= sum(s.num_table_blocks for s in seqs)
        return list(mapping.items())

    def swap_in(self, seqs: list[Sequence]) -> list[tuple[int, int]]:
        """Bring a swapped group back; returns (cpu block, device block) copies."""
        mapping: dict[int, int] = {}
        for s in seqs:
            for i, c in enumerate(s.block_table):
                if c < 0:
                    continue
                if c not in mapping:
                    b = self.pool.allocate()
                    assert b is not None, "can_swap_in must be called first"
                    self.pool.set_fill(b, self._cpu_fill[c])
                    mapping[c] = b
                else:
                    self.pool.touch(mapping[c])
                s.block_table[i] = mapping[c]
                self._cpu_ref[c] -= 1
                if self._cpu_ref[c] == 0:
                    del self._cpu_ref[c], self._cpu_fill[c]
                    self._cpu_free.append(c)
        self.swapped_in_blocks += len(mapping)
        self.logical_blocks += sum(s.num_table_blocks for s in seqs)
        return list(mapping.items())

    # -- accounting ----------------------------------------------------------------------
    def usage(self) -> KVUsage:
        p = self.pool
        return KVUsage(
            total_slots=p.num_blocks * self.block_size,
            reserved_slots=p.num_used * self.block_size,
            used_slots=p.used_slots,
            free_blocks=p.num_free - p.num_cached_free,
            cached_free_blocks=p.num_cached_free,
            shared_blocks=p.num_shared,
            logical_blocks=self.logical_blocks,
            held_blocks=p.num_used,
        )

    def external_fragmentation(self, next_need: int | None) -> int:
        return 0  # any free block serves any request: paging has no external fragmentation

    @property
    def num_cpu_blocks_used(self) -> int:
        return self.num_cpu_blocks - len(self._cpu_free)
