"""The physical block pool: ids, reference counts, prefix hashes and the free queues.

Free blocks live in one of two queues:

* ``_free``: blocks with no hash (never full, or evicted). Reused first, FIFO.
* the *cached* blocks: ref count 0, still holding a name. A prefix hit on one revives it;
  a new allocation evicts cached blocks only when ``_free`` is empty, in the order its
  :class:`~harness.kv.eviction.EvictionOrder` gives (``cache.eviction``; ``lru``, the
  default: least recently freed first, a deque with *void* entries for revived blocks,
  O(1) for every operation: every block of every request enters and leaves it, the
  roofline's decode lanes, issue #24). Blocks its :class:`~harness.kv.eviction.Admission`
  rule does not admit (``cache.admission``) are evicted before any of them. No per-step
  scan of the pool.

The same content can be computed twice (two identical prompts admitted in one step,
overlapping chunked prefills, a group readmitted after recompute): every copy stays
findable under its hash, as vLLM keeps them, so evicting one copy leaves the others as hits.
Each named block also remembers the request that computed it, so a hit on a request's own
earlier work (a recompute after preemption) is told apart from a hit on another request's.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable

from harness.kv.base import DeferredNames, KVUsage
from harness.kv.eviction import ADMITS, ORDERS, Admission, EvictionOrder, LRUOrder
from harness.kv.ledger import ReservationLedger

# Called with (block, hash, owner, chain depth) as a named block is evicted from the order
# of cached-free blocks, before it is reused: a lower tier writes it down (harness.kv.tiers).
EvictHook = Callable[[int, int, int, int], None]


class BlockPool:
    """``num_blocks`` blocks of ``block_size`` slots, shared by every sequence of a run."""

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
        self.num_cached_free = 0  # cached blocks: ref 0, named
        # A named block's position in its prefix chain (0: a prompt's first block): the
        # ``cost`` eviction order's weight.
        self.depth = [0] * num_blocks
        self._order: EvictionOrder = LRUOrder(self)
        self._admission = Admission(self)
        self._counts = self._admits = False  # (whether they need every use reported)
        # Cached blocks the admission rule left out, evicted first (oldest first).
        self._unadmitted: OrderedDict[int, None] = OrderedDict()
        # Every name a block lost to an eviction in the run (a prompt that finds one of
        # them missing recomputes it: the eviction's regret, PagedKVManager). One entry
        # per distinct content evicted (~70 bytes each); a set, so that when a name
        # enters it does not matter (the roofline's lazy names add theirs when made).
        self.evicted_names: set[int] = set()
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

    def set_policy(self, eviction: str, admission: str) -> None:
        """Use eviction order ``eviction`` and admission rule ``admission`` (module
        docstring; before any block is cached)."""
        assert self.num_cached_free == 0, "the policy is chosen before anything is cached"
        self._order = ORDERS[eviction](self)
        self._admission = ADMITS[admission](self)
        self._counts = self._order.counts_uses
        self._admits = self._admission.counts_uses

    @property
    def reads_names(self) -> bool:
        """Whether the eviction order or the admission rule reads a block's name as it is
        released or evicted (then no block may carry a pending name: DeferredNames)."""
        return self._order.reads_names or self._admits

    @property
    def policy(self) -> tuple[str, str]:
        """The eviction order's and the admission rule's names."""
        return self._order.name, self._admission.name

    @property
    def compact_min(self) -> int:
        """(``lru``) void entries past twice the live ones that rebuild its deque."""
        return self._order.compact_min if isinstance(self._order, LRUOrder) \
            else LRUOrder.compact_min

    @compact_min.setter
    def compact_min(self, value: int) -> None:
        if isinstance(self._order, LRUOrder):
            self._order.compact_min = value

    def lru_order(self) -> list[int]:
        """Evictable cached blocks, next to be evicted first, under any eviction order
        (for tests and debugging)."""
        return [*self._unadmitted, *self._order.order()]

    def has_name(self, block_hash: int) -> bool:
        """Whether a block is named ``block_hash`` now (no side effect: no eviction order
        hears of it; pending names under it are not made: :meth:`name_under`)."""
        return block_hash in self._by_hash

    def name_under(self, block_hash: int) -> None:
        """Make the pending names whose chains hang under ``block_hash`` (DeferredNames)."""
        deferred = self.deferred
        if deferred is not None and block_hash in deferred.pending:
            deferred.materialize([block_hash])

    def next_victim(self) -> int | None:
        """The cached block the next eviction takes (None: none is cached)."""
        if self._unadmitted:
            return next(iter(self._unadmitted))
        return self._order.peek() if self.num_cached_free else None

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
        if copies is None:
            if self._counts:
                self._order.missed(block_hash)
            return None
        if isinstance(copies, int):
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
            on_evict, by_hash = self.on_evict, self._by_hash
            names, owner = self.block_hash, self.owner
            evicted = self.evicted_names
            self.num_cached_free -= n - k
            victims: list[int] = []
            ua = self._unadmitted
            while ua and len(victims) < n - k:
                victims.append(ua.popitem(last=False)[0])
            if len(victims) < n - k:
                victims += self._order.victims(n - k - len(victims))
            for b in victims:
                h = names[b]
                if not isinstance(h, int):  # a pending name: no index entry
                    assert h is not None and self.deferred is not None, f"cached block {b}"
                    self.deferred.evicted(h)
                    names[b] = None  # (its owner was never set: named when made)
                    out.append(b)
                    continue
                if on_evict is not None:
                    on_evict(b, h, owner[b], self.depth[b])
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
                evicted.add(h)
            self.num_evictions += n - k
        if self._counts:
            self._order.allocated(out)
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
            self.num_cached_free -= 1
            if self._unadmitted and b in self._unadmitted:
                del self._unadmitted[b]
            else:
                self._order.remove(b)
            self.num_used += 1
            self.used_slots += self.fill[b]
            if self.ledger is not None:
                self.ledger.open(b, self.block_size, self.fill[b])
        self.ref[b] += 1
        if self.ref[b] == 2:
            self.num_shared += 1
        if self._counts:
            self._order.referenced(b)
        if self._admits:
            h = self.block_hash[b]
            if isinstance(h, int):
                self._admission.used(h)

    def release(self, b: int) -> None:
        """Drop one reference; at zero the block becomes cached-free or plain free."""
        self.release_all([b])

    def release_all(self, blocks: list[int]) -> None:
        """:meth:`release` of each of ``blocks`` in turn (a sequence's table as it is freed:
        every block of every request passes here, in one call)."""
        ref, fill, names, led = self.ref, self.fill, self.block_hash, self.ledger
        insert, free = self._order.insert, self._free
        admission = self._admission if self._admits else None
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
                    if admission is None or admission.admit(b):
                        insert(b)  # (lru: most recently freed, evicted last)
                    else:
                        self._unadmitted[b] = None
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

    def register(self, b: int, block_hash: int, owner: int = -1, depth: int = 0) -> bool:
        """Name full block ``b`` by its chained hash so later prompts can hit it;
        ``owner`` is the request that computed it. Returns False if ``b`` is named already.
        A hash may name several blocks (the same content computed twice): all stay
        findable until each is evicted."""
        assert self.fill[b] == self.block_size, "only full blocks are cacheable"
        return self.name(b, block_hash, owner, depth)

    def name(self, b: int, block_hash: int, owner: int = -1, depth: int = 0) -> bool:
        """:meth:`register` of a block known to be full whose fill is recorded later (the
        roofline's fast path)."""
        if self.block_hash[b] is not None:
            return False
        deferred = self.deferred
        if deferred is not None and block_hash in deferred.pending:  # named now
            deferred.materialize([block_hash])
        self.enter_name(b, block_hash, owner, depth)
        return True

    def enter_name(self, b: int, block_hash: int, owner: int, depth: int = 0) -> None:
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
        self.depth[b] = depth
        if self._admits:
            self._admission.used(block_hash)
