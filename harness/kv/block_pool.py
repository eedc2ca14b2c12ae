"""The physical block pool: ids, reference counts, prefix hashes and the free queues.

Free blocks live in one of two queues:

* ``_free``: blocks with no hash (never full, or evicted). Reused first, FIFO.
* ``_lru``: blocks with ref count 0 that still hold a name (*cached*), least recently
  freed first. A prefix hit on one revives it; a new allocation evicts the oldest only
  when ``_free`` is empty.

Both are deques, O(1) for every operation. A revived block stays in the LRU's deque as a
*void* entry, counted in ``_voids[block]`` and skipped when it comes to the front (a
block's void entries all come before its live one, which is its latest): every block of
every request enters and leaves the LRU, and an insertion-ordered dict spent a node and a
hash-table entry on each (the roofline's decode lanes, issue #24). No per-step scan of
the pool.

The same content can be computed twice (two identical prompts admitted in one step,
overlapping chunked prefills, a group readmitted after recompute): every copy stays
findable under its hash, as vLLM keeps them, so evicting one copy leaves the others as hits.
Each named block also remembers the request that computed it, so a hit on a request's own
earlier work (a recompute after preemption) is told apart from a hit on another request's.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from harness.kv.base import DeferredNames, KVUsage
from harness.kv.ledger import ReservationLedger

# Called with (block, hash, owner) as a named block is evicted from the LRU of cached-free
# blocks, before it is reused: a lower tier writes it down (harness.kv.tiers).
EvictHook = Callable[[int, int, int], None]


class BlockPool:
    """``num_blocks`` blocks of ``block_size`` slots, shared by every sequence of a run."""

    # The LRU's deque is rebuilt without its void entries once they outnumber the live
    # ones by this many (a run of prefix hits on a pool that never fills would grow it).
    compact_min = 1024

    def __init__(self, num_blocks: int, block_size: int,
                 ledger: ReservationLedger | None = None) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need num_blocks > 0 and block_size > 0, got {num_blocks}, "
                             f"{block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref = [0] * num_blocks
        self.fill = [0] * num_blocks  # slots of the block holding a token's K/V
        # A block's name: its hash, a pending name (made when first read: DeferredNames,
        # harness.kv.base), or None.
        self.block_hash: list[int | object | None] = [None] * num_blocks
        self.owner: list[int] = [-1] * num_blocks  # request that computed a named block
        # hash -> the block carrying it, or (two or more copies) every block carrying it in
        # insertion order, the oldest copy served first. Nearly every hash names one block:
        # held as an int, it costs no dict per named block to make and free (each block of
        # every request is named once and unnamed once: the roofline's decode lanes).
        self._by_hash: dict[int, int | dict[int, None]] = {}
        self._free: deque[int] = deque(range(num_blocks))
        self._lru: deque[int] = deque()  # cached blocks, oldest first, and void entries
        self._voids = [0] * num_blocks  # a block's void entries in _lru (revived since)
        self.num_cached_free = 0  # live entries of _lru
        self.num_used = 0  # blocks with ref > 0
        self.num_shared = 0  # blocks with ref > 1
        self.used_slots = 0  # sum of fill over blocks with ref > 0
        self.num_evictions = 0  # cached blocks whose hash was dropped to reuse them
        self.ledger = ledger
        self.on_evict: EvictHook | None = None
        # Pending names' hook (PagedKVManager.set_deferred_names), or None.
        self.deferred: DeferredNames | None = None

    # -- queries ---------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks an allocation can take now (plain free + evictable cached)."""
        return len(self._free) + self.num_cached_free

    def lru_order(self) -> list[int]:
        """Evictable cached blocks, next to be evicted first (for tests and debugging)."""
        voids = self._voids[:]
        out = []
        for b in self._lru:
            if voids[b]:
                voids[b] -= 1
            else:
                out.append(b)
        return out

    def free_order(self) -> list[int]:
        return list(self._free)

    def usage(self, logical_blocks: int, tier_blocks: tuple[int, ...] = (),
              group_blocks: tuple[int, ...] = ()) -> KVUsage:
        """The pool's accounting snapshot (the managers over it add what they know: the
        blocks their tables would hold without sharing, lower tiers, KV cache groups)."""
        bs = self.block_size
        return KVUsage(
            total_slots=self.num_blocks * bs,
            reserved_slots=self.num_used * bs,
            used_slots=self.used_slots,
            free_blocks=self.num_free - self.num_cached_free,
            cached_free_blocks=self.num_cached_free,
            shared_blocks=self.num_shared,
            logical_blocks=logical_blocks,
            held_blocks=self.num_used,
            tier_blocks=tier_blocks,
            group_blocks=group_blocks,
        )

    def lookup(self, block_hash: int) -> int | None:
        """A block holding this content: a held copy if any (taking it shares memory), else
        the oldest cached one."""
        deferred = self.deferred
        if deferred is not None and block_hash in deferred.pending:  # named now
            deferred.materialize([block_hash])
        copies = self._by_hash.get(block_hash)
        if copies is None or isinstance(copies, int):
            return copies
        for b in copies:
            if self.ref[b] > 0:
                return b
        return next(iter(copies))

    def sole_copy(self, block_hash: int) -> int | None:
        """The block named ``block_hash`` if it is the only one (None: none or several)."""
        c = self._by_hash.get(block_hash)
        return c if isinstance(c, int) else None

    def copies(self, block_hash: int) -> list[int]:
        """Every block named ``block_hash``, oldest first (tests and debugging: pending
        names are made first)."""
        if self.deferred is not None:
            self.deferred.materialize_all()
        c = self._by_hash.get(block_hash)
        return [] if c is None else [c] if isinstance(c, int) else list(c)

    def hash_index(self) -> dict[int, list[int]]:
        """Every name and its blocks, oldest first (tests and debugging: pending names
        are made first)."""
        if self.deferred is not None:
            self.deferred.materialize_all()
        return {h: self.copies(h) for h in self._by_hash}

    # -- state changes ---------------------------------------------------------------
    def allocate(self, fill: int = 0) -> int | None:
        """Take a fresh block (ref 1, ``fill`` slots written now: what ``set_fill`` right
        after would record), evicting the LRU cached block if needed (None: none is
        free)."""
        if self.num_free == 0:
            return None
        return self.allocate_all(1, fill)[0]

    def allocate_all(self, n: int, fill: int = 0, ramp: int = 0) -> list[int]:
        """:meth:`allocate` ``n`` times (the caller checked ``num_free >= n``): the same
        blocks in the same order, evictions included, in one call. ``ramp``: each block
        also takes one more slot at each of the next ``ramp`` steps, recorded now in its
        fill and the ledger (the roofline's fast path, which counts those writes' used
        slots as they happen and trims what did not happen, ``PagedKVManager.trim_fill``,
        before anything else reads the block)."""
        assert self.num_free >= n, (self.num_free, n)
        if n == 0:  # (a decode opening a block asks for no full ones first)
            return []
        free, ref, fills, led, bs = self._free, self.ref, self.fill, self.ledger, self.block_size
        # Plain free blocks first, then the LRU's oldest (each evicted: its name dropped).
        k = min(n, len(free))
        out = [free.popleft() for _ in range(k)]
        if k < n:
            lru, voids = self._lru, self._voids
            on_evict, by_hash = self.on_evict, self._by_hash
            names, owner = self.block_hash, self.owner
            self.num_cached_free -= n - k
            for _ in range(n - k):
                b = lru.popleft()
                while voids[b]:  # revived since it entered: its live entry is later
                    voids[b] -= 1
                    b = lru.popleft()
                h = names[b]
                if not isinstance(h, int):  # a pending name: no index entry
                    assert h is not None and self.deferred is not None, f"cached block {b}"
                    self.deferred.evicted(h)
                    names[b] = None  # (its owner was never set: named when made)
                    out.append(b)
                    continue
                if on_evict is not None:
                    on_evict(b, h, owner[b])
                # Its name goes (another copy keeps it: back to an int when one is left).
                c = by_hash[h]
                if isinstance(c, int):
                    del by_hash[h]
                else:
                    del c[b]
                    if len(c) == 1:
                        by_hash[h] = next(iter(c))
                names[b] = None
                owner[b] = -1
                out.append(b)
            self.num_evictions += n - k
        f = fill + ramp
        for b in out:
            ref[b] = 1
            fills[b] = f
        if led is not None:
            led.open_all(out, bs, fill, ramp=ramp)
        self.used_slots += fill * n
        self.num_used += n
        return out

    def touch(self, b: int) -> None:
        """Take one more reference to block ``b`` (a prefix hit, or a fork)."""
        if self.ref[b] == 0:
            # Only a cached block can be revived: a plain free block has no content.
            assert self.block_hash[b] is not None, f"touch of free block {b}"
            self._voids[b] += 1  # its LRU entry is void now
            self.num_cached_free -= 1
            if len(self._lru) > 2 * self.num_cached_free + self.compact_min:  # compact
                self._lru = deque(self.lru_order())
                self._voids = [0] * self.num_blocks
            self.num_used += 1
            self.used_slots += self.fill[b]
            if self.ledger is not None:
                self.ledger.open(b, self.block_size, self.fill[b])
        self.ref[b] += 1
        if self.ref[b] == 2:
            self.num_shared += 1

    def release(self, b: int) -> None:
        """Drop one reference; at zero the block becomes cached-free or plain free."""
        self.release_all([b])

    def release_all(self, blocks: list[int]) -> None:
        """:meth:`release` of each of ``blocks`` in turn (a sequence's table as it is freed:
        every block of every request passes here, in one call)."""
        ref, fill, names, led = self.ref, self.fill, self.block_hash, self.ledger
        lru, free = self._lru, self._free
        closed: list[int] = []
        unshared = slots = cached = 0
        for b in blocks:
            r = ref[b] - 1
            assert r >= 0, f"release of free block {b}"
            ref[b] = r
            if r == 1:
                unshared += 1
            elif r == 0:
                slots += fill[b]
                closed.append(b)
                if names[b] is not None:
                    lru.append(b)  # most recently freed: evicted last
                    cached += 1
                else:
                    free.append(b)
        self.num_cached_free += cached
        self.num_shared -= unshared
        self.num_used -= len(closed)
        self.used_slots -= slots
        if led is not None and closed:
            led.close_all(closed)

    def set_fill(self, b: int, fill: int) -> None:
        assert self.ref[b] > 0 and self.fill[b] <= fill <= self.block_size
        self.used_slots += fill - self.fill[b]
        self.fill[b] = fill
        if self.ledger is not None:
            self.ledger.fill(b, fill)

    def unfill(self, b: int, n: int) -> None:
        """``n`` of block ``b``'s tokens were evicted (their slots hold nothing now).

        The ledger's epoch of ``b`` closes and a new one opens at the lower fill: the slots
        it filled until now were *used*, and whether the emptied ones are filled again is
        known only at the next close, as for any reservation."""
        assert self.ref[b] > 0 and 0 < n <= self.fill[b]
        self.used_slots -= n
        self.fill[b] -= n
        if self.ledger is not None:
            tag = self.ledger.close(b)
            self.ledger.open(b, self.block_size, self.fill[b], tag)

    def register(self, b: int, block_hash: int, owner: int = -1) -> bool:
        """Name full block ``b`` by its chained hash so later prompts can hit it;
        ``owner`` is the request that computed it. Returns False if ``b`` is named already.
        A hash may name several blocks (the same content computed twice): all stay
        findable until each is evicted."""
        assert self.fill[b] == self.block_size, "only full blocks are cacheable"
        return self.name(b, block_hash, owner)

    def name(self, b: int, block_hash: int, owner: int = -1) -> bool:
        """:meth:`register` of a block known to be full whose fill is recorded later (the
        roofline's fast path)."""
        if self.block_hash[b] is not None:
            return False
        deferred = self.deferred
        if deferred is not None and block_hash in deferred.pending:  # named now
            deferred.materialize([block_hash])
        self.enter_name(b, block_hash, owner)
        return True

    def enter_name(self, b: int, block_hash: int, owner: int) -> None:
        """Name block ``b`` (not named, or carrying a pending name being made:
        DeferredNames) in the index."""
        by_hash = self._by_hash
        c = by_hash.setdefault(block_hash, b)
        if c is not b:  # (setdefault returns ``b`` itself when it inserted it) a new copy
            if isinstance(c, int):
                by_hash[block_hash] = {c: None, b: None}
            else:
                c[b] = None
        self.block_hash[b] = block_hash
        self.owner[b] = owner
