"""Which cached block a block pool gives up, and which finished blocks it caches at all
(``cache.eviction``, ``cache.admission``; issue #58).

A *cached* block has ref count 0 and still holds a name (a prefix a later prompt can hit).
When an allocation finds no plain free block, the pool (harness/kv/block_pool.py) evicts
cached blocks: its :class:`EvictionOrder` says which, in what order. The pool tells the
order what happens to its blocks:

- ``insert(b)``: ``b`` became cached (its last reference was released);
- ``remove(b)``: cached ``b`` was referenced again (a prefix hit revived it);
- ``referenced(b)``: a reference was taken to named ``b``, cached or held (a prefix hit, a
  fork): its reuse, for the orders that count it (:attr:`EvictionOrder.counts_uses`);
- ``allocated(blocks)``: fresh blocks were taken (their history starts over);
- ``missed(h)``: a lookup did not find name ``h`` (ARC's ghost lists);
- ``victims(n)``: the next ``n`` to evict, removed from the order.

The orders: ``lru`` (least recently released first: the seed's, vLLM's GPU pool),
``fifo`` (the order blocks first became cached since they were computed, reuse ignored),
``lfu`` (fewest uses first, with dynamic aging, LFU-DA: a block's priority is its uses
plus the priority of the last block evicted when it became cached, so old counts fade),
``slru`` (segmented LRU: blocks used once wait in a probation segment and go first; a
block used again enters the protected segment, at most 80% of the pool, whose overflow
goes back to probation), ``arc`` (Megiddo and Modha's adaptive replacement cache: blocks
used once and blocks used again in two LRU lists, the names of evicted blocks in two ghost
lists, and the target size of the first list moved by hits on the ghosts) and ``cost``
(GreedyDual-Size-Frequency: priority = uses x cost + the last eviction's priority, the
cost of a block its chain position + 1: recomputing the block at position d of a prompt
attends over the d blocks before it, so a deeper block saves more when kept).

**Chains.** Names are chained (a block's hash covers every block before it), and a lookup
stops at the first name it does not find. Any order may evict a block while blocks after
it in its chain stay cached: those then cannot be hit (no prompt reaches them) and wait
for their own eviction. ``lru`` evicts a chain's blocks in the order they were released (a
finished sequence releases its table front to back, as the seed's pool does); ``cost``
keeps deeper blocks longer at equal use.

An :class:`Admission` rule decides, when a named block's last reference goes, whether it
joins the order (``always``, the default), or is put first in line for eviction, ahead of
every cached block (its name kept until then): ``second_hit`` caches a block whose content
was used at least twice (computed or hit) among the recently seen names, ``tinylfu`` one
whose content was used more often than the block the order would evict next (TinyLFU's
frequency comparison, with an exact counter halved every 10 x pool-size uses where TinyLFU
keeps a count-min sketch). A one-off prompt's blocks then stop pushing out a history that
is reused.

**Hosts.** An order reads what it orders through :class:`OrderHost`: a block pool (its
ids the pool's blocks), or a lower tier of the prefix cache (harness/kv/tiers.py, its ids
the tier's slots: ``cache.tiers.cpu_policy`` / ``disk_policy``). Per-id state is a list
as long as the host's ids so far (``len(host.block_hash)``): the pool's from the start,
a tier's grown by :meth:`EvictionOrder.grow` as it first uses a slot (a tier may have
1e9 slots and use a few).

Every order here is checked against a brute-force reference (tests/core/test_eviction.py,
hypothesis, on a pool and on a tier) and ``lru`` keeps every record of the pool and the
tiers it replaced.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar, Protocol

if TYPE_CHECKING:
    from harness.kv.block_pool import BlockPool

EVICTIONS = ("lru", "fifo", "lfu", "slru", "arc", "cost")
ADMISSIONS = ("always", "second_hit", "tinylfu")


class OrderHost(Protocol):
    """What an order reads of the blocks it orders (module docstring, Hosts): a
    :class:`~harness.kv.block_pool.BlockPool` or a :class:`~harness.kv.tiers.Tier`."""

    @property
    def num_blocks(self) -> int:
        """How many blocks it can hold (arc's cache size, slru's protected share)."""

    @property
    def num_cached_free(self) -> int:
        """How many blocks are in the order now."""

    @property
    def block_hash(self) -> Sequence[object]:
        """Each id's name (an int hash; anything else is no name to remember); its
        length is the number of ids so far."""

    @property
    def depth(self) -> Sequence[int]:
        """Each id's position in its prefix chain (``cost``)."""


def _grow(xs: list[int], n: int, value: int) -> None:
    """``xs`` extended with ``value`` to ``n`` entries."""
    if len(xs) < n:
        xs.extend([value] * (n - len(xs)))


class EvictionOrder(ABC):
    """The order a pool's cached blocks (or a tier's blocks) are evicted in (module
    docstring)."""

    name: ClassVar[str]
    # Whether the order needs ``referenced`` / ``allocated`` calls (the pool skips them
    # for the orders that ignore reuse: every block's allocation and hit is a call).
    counts_uses: ClassVar[bool] = False
    # Whether it reads a block's name (its hash) as the block is cached or evicted.
    reads_names: ClassVar[bool] = False

    def __init__(self, pool: OrderHost) -> None:
        self.pool = pool

    def grow(self, n: int) -> None:  # noqa: B027 (a hook for the orders with per-id state)
        """The host has ``n`` ids now (a tier used a new slot): per-id state for them."""

    @abstractmethod
    def insert(self, b: int) -> None:
        """``b`` became cached."""

    @abstractmethod
    def remove(self, b: int) -> None:
        """Cached ``b`` was referenced again: it is no longer evictable."""

    def referenced(self, b: int) -> None:  # noqa: B027 (an optional hook)
        """A reference was taken to named block ``b`` (after :meth:`remove` if it was
        cached)."""

    def allocated(self, blocks: list[int]) -> None:  # noqa: B027 (an optional hook)
        """``blocks`` were taken fresh: their uses start over."""

    def missed(self, h: int) -> None:  # noqa: B027 (an optional hook)
        """A lookup did not find name ``h``."""

    @abstractmethod
    def victims(self, n: int) -> list[int]:
        """Remove and return the next ``n`` cached blocks to evict (``n`` at most the
        cached count), in order."""

    @abstractmethod
    def order(self) -> list[int]:
        """Every cached block, the next to evict first (tests, debugging, admission)."""

    def peek(self) -> int | None:
        """The next block :meth:`victims` would return (None: none is cached)."""
        o = self.order()
        return o[0] if o else None


class LRUOrder(EvictionOrder):
    """Least recently released first: a deque of blocks in release order, where a block
    revived by a hit leaves a *void* entry, counted in ``voids[b]`` and skipped when it
    comes to the front (a block's void entries all come before its live one, its latest);
    the deque is rebuilt without them once they outnumber the live entries by
    ``compact_min`` (a run of prefix hits on a pool that never fills would grow it)."""

    name = "lru"
    compact_min = 1024

    def __init__(self, pool: OrderHost) -> None:
        super().__init__(pool)
        self.q: deque[int] = deque()
        self.voids = [0] * len(pool.block_hash)
        self.insert = self.q.append  # type: ignore[method-assign,assignment]  # (the hot path)

    def grow(self, n: int) -> None:
        _grow(self.voids, n, 0)

    def insert(self, b: int) -> None:  # (replaced per instance by the deque's append)
        self.q.append(b)

    def remove(self, b: int) -> None:
        self.voids[b] += 1
        if len(self.q) > 2 * self.pool.num_cached_free + self.compact_min:
            self.q = deque(self.order())
            self.insert = self.q.append  # type: ignore[method-assign,assignment]
            self.voids = [0] * len(self.voids)

    def victims(self, n: int) -> list[int]:
        q, voids = self.q, self.voids
        out = []
        for _ in range(n):
            b = q.popleft()
            while voids[b]:  # revived since it entered: its live entry is later
                voids[b] -= 1
                b = q.popleft()
            out.append(b)
        return out

    def order(self) -> list[int]:
        voids = self.voids[:]
        out = []
        for b in self.q:
            if voids[b]:
                voids[b] -= 1
            else:
                out.append(b)
        return out

    def peek(self) -> int | None:
        voids, seen = self.voids, dict[int, int]()
        for b in self.q:
            k = seen.get(b, 0)
            if k < voids[b]:
                seen[b] = k + 1
                continue
            return b
        return None


class _CountsUses(EvictionOrder):
    """An order that weighs reuse: ``uses[b]``, references taken to ``b`` since it was
    computed (1 for its computation)."""

    counts_uses = True

    def __init__(self, pool: OrderHost) -> None:
        super().__init__(pool)
        self.uses = [1] * len(pool.block_hash)

    def grow(self, n: int) -> None:
        super().grow(n)
        _grow(self.uses, n, 1)

    def referenced(self, b: int) -> None:
        self.uses[b] += 1

    def allocated(self, blocks: list[int]) -> None:
        for b in blocks:
            self.uses[b] = 1


class _HeapOrder(EvictionOrder):
    """Cached blocks in a heap by :meth:`key` (the smallest goes first), a revived
    block's entry left stale (its version moved on) and skipped when it comes up."""

    counts_uses = True

    def __init__(self, pool: OrderHost) -> None:
        super().__init__(pool)
        self.ver = [0] * len(pool.block_hash)  # bumped when a block's heap entry goes stale
        self.heap: list[tuple[float, int, int, int]] = []  # (*key, block, ver)
        self.n_live = 0

    def grow(self, n: int) -> None:
        super().grow(n)
        _grow(self.ver, n, 0)

    @abstractmethod
    def key(self, b: int) -> tuple[float, int]:
        """``b``'s place as it becomes cached (smallest evicted first)."""

    def popped(self, key: tuple[float, int]) -> None:
        """An entry with ``key`` was evicted (a hook: the priority orders' aging)."""

    def insert(self, b: int) -> None:
        k0, k1 = self.key(b)
        self.ver[b] += 1
        self.n_live += 1
        heapq.heappush(self.heap, (k0, k1, b, self.ver[b]))

    def remove(self, b: int) -> None:
        self.ver[b] += 1
        self.n_live -= 1
        if len(self.heap) > 2 * self.n_live + 1024:  # drop the stale entries
            self.heap = [e for e in self.heap if e[3] == self.ver[e[2]]]
            heapq.heapify(self.heap)

    def victims(self, n: int) -> list[int]:
        out: list[int] = []
        heap, ver = self.heap, self.ver
        while len(out) < n:
            k0, k1, b, v = heapq.heappop(heap)
            if v != ver[b]:
                continue
            ver[b] += 1
            self.popped((k0, k1))
            out.append(b)
        self.n_live -= n
        return out

    def order(self) -> list[int]:
        return [e[2] for e in sorted(self.heap) if e[3] == self.ver[e[2]]]

    def peek(self) -> int | None:
        heap, ver = self.heap, self.ver
        while heap and heap[0][3] != ver[heap[0][2]]:
            heapq.heappop(heap)
        return heap[0][2] if heap else None


class FIFOOrder(_HeapOrder):
    """The order blocks first became cached since they were computed; a block revived
    and released again keeps its place (reuse is ignored)."""

    name = "fifo"  # (counts_uses: ``allocated`` gives a block computed anew a new place)

    def __init__(self, pool: OrderHost) -> None:
        super().__init__(pool)
        self.first = [0] * len(pool.block_hash)  # when first cached (0: not since computed)
        self.stamp = 0

    def grow(self, n: int) -> None:
        super().grow(n)
        _grow(self.first, n, 0)

    def key(self, b: int) -> tuple[float, int]:
        if not self.first[b]:
            self.stamp += 1
            self.first[b] = self.stamp
        return float(self.first[b]), 0

    def allocated(self, blocks: list[int]) -> None:
        for b in blocks:
            self.first[b] = 0


class _PriorityOrder(_HeapOrder, _CountsUses):
    """Evict the lowest priority first (ties: the earliest cached), with the aging of
    GreedyDual: a block's priority when it becomes cached is ``value(b)`` plus ``floor``,
    the priority of the last block evicted (LFU-DA, GDSF)."""

    def __init__(self, pool: OrderHost) -> None:
        super().__init__(pool)
        self.floor = 0.0
        self.stamp = 0

    @abstractmethod
    def value(self, b: int) -> float:
        """What keeping ``b`` is worth (before aging)."""

    def key(self, b: int) -> tuple[float, int]:
        self.stamp += 1
        return self.floor + self.value(b), self.stamp

    def popped(self, key: tuple[float, int]) -> None:
        self.floor = key[0]


class LFUOrder(_PriorityOrder):
    """Fewest uses first, with dynamic aging (LFU-DA)."""

    name = "lfu"

    def value(self, b: int) -> float:
        return float(self.uses[b])


class CostOrder(_PriorityOrder):
    """GreedyDual-Size-Frequency with a block's cost its chain position + 1 (module
    docstring): priority = uses x (depth + 1) + the last eviction's priority."""

    name = "cost"

    def value(self, b: int) -> float:
        return float(self.uses[b] * (self.pool.depth[b] + 1))


class SLRUOrder(_CountsUses):
    """Segmented LRU: a block used once waits in *probation*, one used again (a hit or a
    fork since it was computed) in *protected*, at most ``protected_share`` of the pool;
    protected's overflow goes back to probation's most recent end. Probation's least
    recent goes first, then protected's."""

    name = "slru"
    protected_share = 0.8

    def __init__(self, pool: OrderHost) -> None:
        super().__init__(pool)
        self.probation: OrderedDict[int, None] = OrderedDict()
        self.protected: OrderedDict[int, None] = OrderedDict()
        self.cap = max(1, int(self.protected_share * pool.num_blocks))

    def insert(self, b: int) -> None:
        if self.uses[b] > 1:
            self.protected[b] = None
            if len(self.protected) > self.cap:
                old, _ = self.protected.popitem(last=False)
                self.probation[old] = None
        else:
            self.probation[b] = None

    def remove(self, b: int) -> None:
        del (self.probation if b in self.probation else self.protected)[b]

    def victims(self, n: int) -> list[int]:
        out: list[int] = []
        for _ in range(n):
            seg = self.probation if self.probation else self.protected
            out.append(seg.popitem(last=False)[0])
        return out

    def order(self) -> list[int]:
        return [*self.probation, *self.protected]


class ARCOrder(_CountsUses):
    """Adaptive replacement (Megiddo and Modha, FAST'03) over the cached blocks: ``t1``
    holds blocks used once, ``t2`` blocks used again, least recent first; ``b1`` / ``b2``
    the names of blocks evicted from them (ghosts, at most the pool's size together with
    the lists); ``p``, the target size of ``t1``, grows on a lookup that misses a name in
    ``b1`` and shrinks on one in ``b2``. A name found in a ghost list comes back into
    ``t2``. Eviction takes ``t1``'s least recent when ``t1`` is over ``p``, else ``t2``'s
    (the held blocks are not in the lists: they cannot be evicted)."""

    name = "arc"
    reads_names = True  # (its ghost lists remember evicted blocks' names)

    def __init__(self, pool: OrderHost) -> None:
        super().__init__(pool)
        self.c = pool.num_blocks
        self.t1: OrderedDict[int, None] = OrderedDict()
        self.t2: OrderedDict[int, None] = OrderedDict()
        self.b1: OrderedDict[int, None] = OrderedDict()
        self.b2: OrderedDict[int, None] = OrderedDict()
        self.back: set[int] = set()  # names that came back from a ghost list
        self.p = 0.0

    def insert(self, b: int) -> None:
        h = self.pool.block_hash[b]
        if self.uses[b] > 1 or h in self.back:
            if isinstance(h, int):
                self.back.discard(h)
            self.t2[b] = None
        else:
            self.t1[b] = None

    def remove(self, b: int) -> None:
        del (self.t1 if b in self.t1 else self.t2)[b]

    def missed(self, h: int) -> None:
        if h in self.b1:
            self.p = min(float(self.c), self.p + max(len(self.b2) / len(self.b1), 1.0))
            del self.b1[h]
            self.back.add(h)
        elif h in self.b2:
            self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1.0))
            del self.b2[h]
            self.back.add(h)

    def _ghost(self, ghosts: OrderedDict[int, None], b: int) -> None:
        h = self.pool.block_hash[b]
        if isinstance(h, int):  # (a pending name has no hash to remember)
            ghosts[h] = None
            ghosts.move_to_end(h)
        while len(self.b1) + len(self.b2) > self.c:
            (self.b1 if len(self.b1) >= len(self.b2) else self.b2).popitem(last=False)

    def victims(self, n: int) -> list[int]:
        out: list[int] = []
        for _ in range(n):
            if self.t1 and (len(self.t1) > self.p or not self.t2):
                b = self.t1.popitem(last=False)[0]
                self._ghost(self.b1, b)
            else:
                b = self.t2.popitem(last=False)[0]
                self._ghost(self.b2, b)
            out.append(b)
        return out

    def order(self) -> list[int]:
        # The next victim depends on p and the lists' sizes as they shrink: simulate.
        t1, t2 = list(self.t1), list(self.t2)
        out: list[int] = []
        i = j = 0
        while i < len(t1) or j < len(t2):
            if i < len(t1) and (len(t1) - i > self.p or j == len(t2)):
                out.append(t1[i])
                i += 1
            else:
                out.append(t2[j])
                j += 1
        return out


ORDERS: dict[str, type[EvictionOrder]] = {o.name: o for o in (
    LRUOrder, FIFOOrder, LFUOrder, SLRUOrder, ARCOrder, CostOrder)}


class Admission:
    """Whether a finished block is cached (``always``)."""

    name: ClassVar[str] = "always"
    counts_uses: ClassVar[bool] = False

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool

    def used(self, h: int) -> None:
        """Content ``h`` was used: computed (named) or hit."""

    def admit(self, b: int) -> bool:
        """Whether block ``b``, whose last reference just went, joins the order."""
        return True


class SecondHit(Admission):
    """Cache a block whose content was used twice or more (computed or hit) among the
    last ``4 x pool size`` names seen (a doorkeeper, as CDNs' cache-on-second-hit)."""

    name = "second_hit"
    counts_uses = True

    def __init__(self, pool: BlockPool) -> None:
        super().__init__(pool)
        self.seen: OrderedDict[int, int] = OrderedDict()
        self.cap = 4 * pool.num_blocks

    def used(self, h: int) -> None:
        self.seen[h] = self.seen.get(h, 0) + 1
        self.seen.move_to_end(h)
        if len(self.seen) > self.cap:
            self.seen.popitem(last=False)

    def admit(self, b: int) -> bool:
        h = self.pool.block_hash[b]
        return not isinstance(h, int) or self.seen.get(h, 0) >= 2


class TinyLFU(Admission):
    """Cache a block when its content was used more often than the content of the block
    the order would evict next (or nothing is cached); uses counted exactly and halved
    every ``10 x pool size`` uses (TinyLFU's aging; it keeps a count-min sketch)."""

    name = "tinylfu"
    counts_uses = True

    def __init__(self, pool: BlockPool) -> None:
        super().__init__(pool)
        self.freq: dict[int, int] = {}
        self.n = 0
        self.sample = 10 * pool.num_blocks

    def used(self, h: int) -> None:
        self.freq[h] = self.freq.get(h, 0) + 1
        self.n += 1
        if self.n >= self.sample:
            self.freq = {k: v // 2 for k, v in self.freq.items() if v > 1}
            self.n //= 2

    def admit(self, b: int) -> bool:
        names = self.pool.block_hash
        h = names[b]
        v = self.pool.next_victim()
        if v is None or not isinstance(h, int):
            return True
        hv = names[v]
        return self.freq.get(h, 0) > (self.freq.get(hv, 0) if isinstance(hv, int) else 0)


ADMITS: dict[str, type[Admission]] = {a.name: a for a in (Admission, SecondHit, TinyLFU)}
