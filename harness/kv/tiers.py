"""Lower tiers of the prefix cache: host memory, then disk, below the device's block pool.

Bookkeeping only (no tensors; the backend's :class:`~harness.backends.tier_storage.
TierStorage` moves the bytes, the roofline charges them as time). A tier holds whole,
named blocks by their chained prefix hash over a fixed number of slots, in its own
eviction order (``cache.tiers.cpu_policy`` / ``disk_policy``, default ``cache.eviction``:
one of harness/kv/eviction.py's orders, its ids the tier's slots; ``lru`` below):

* **down**: a named block that leaves the device's cached-free blocks (``write=evict``),
  or every block as soon as its content is computed (``write=through``), is written to
  the first tier unless that tier holds its hash already (then it only becomes most
  recent: its order hears it removed and inserted again, not used). A tier that is full
  gives the block its order evicts next to the next tier (``spill``: host -> disk), or
  drops it from the last.
* **up**: a prompt's prefix lookup that misses on the device goes on in the tiers
  (:meth:`LowerTiers.lookup`); each block found is *loaded* into a fresh device block,
  which is then named and shared like any other. The tier keeps its copy (inclusive, as
  LMCache's and vLLM's CPU offloading keep theirs), so the next eviction of the same
  content costs nothing. A load is the tier's *use* of a block (for the orders that count
  reuse: each tier counts the uses of its own copy, a spilled block starts over), and a
  lookup that does not find a name in a tier is that tier's *miss* (arc's ghost lists).

The disk tier's files can fail under ``executor=model`` (harness/backends/tier_storage.py):
a block whose write did not land (a full disk, a file-size limit) is dropped from the
tier after its step (:meth:`LowerTiers.lose`), and a prompt's lookup that finds a block
on disk first has its file checked (:attr:`LowerTiers.check_disk`): a damaged one is
dropped and the lookup misses there, so the block is computed again. Both are counted
(:class:`TierStats`), and the run goes on.

Everything a step moves is one ordered list of :class:`TierOp`: a spill comes before the
write that takes its slot, a store of an evicted device block before the load that
reuses that block. Operations are O(1) per block under ``lru`` (amortized; the other
orders as in the device pool), and a tier's size costs nothing until its slots are used.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from harness.kv.eviction import ORDERS, EvictionOrder

GPU, CPU, DISK = 0, 1, 2
TIER_NAMES = ("gpu", "cpu", "disk")
WRITE_MODES = ("evict", "through")


@dataclass(frozen=True, slots=True)
class TierOp:
    """Copy one block's K/V from ``(src_tier, src)`` to ``(dst_tier, dst)``; indices are
    the tier's own: a device block id, a host slot, a disk slot. Tiers: GPU, CPU, DISK."""

    src_tier: int
    src: int
    dst_tier: int
    dst: int


@dataclass(frozen=True, slots=True)
class TierHit:
    """A prompt block found below the device: where it lies, its hash, and the request
    that first computed it (a hit on one's own blocks is a self hit)."""

    tier: int
    slot: int
    block_hash: int
    owner: int


@dataclass(slots=True)
class TierStats:
    """Per lower tier (index 0: cpu, 1: disk): blocks written into it (stores and
    spills), blocks loaded from it, and prompt tokens found there."""

    blocks_down: list[int] = field(default_factory=lambda: [0, 0])
    blocks_up: list[int] = field(default_factory=lambda: [0, 0])
    hit_tokens: list[int] = field(default_factory=lambda: [0, 0])
    dropped_blocks: int = 0  # fell out of the last tier (or found no room: all pinned)
    # The disk tier's faults (executor=model): blocks whose file write failed, and blocks
    # whose file was found damaged by a lookup; each dropped from the tier.
    disk_write_failures: int = 0
    disk_damaged: int = 0


class Tier:
    """One tier's slots and the order its blocks leave in (``policy``: one of
    harness/kv/eviction.py's orders over this tier's slots, the tier its
    :class:`~harness.kv.eviction.OrderHost`)."""

    def __init__(self, level: int, num_blocks: int, policy: str = "lru") -> None:
        self.level = level
        self.num_blocks = num_blocks
        self.slots: dict[int, int] = {}  # hash -> slot, of every block held (pinned too)
        self.owner: dict[int, int] = {}  # hash -> request that computed it
        self.pinned: set[int] = set()  # hashes out of the order while loading
        # Per slot used so far (no list over all of a tier's 1e9+ slots): its hash and
        # chain position, what the order reads. Slots [fresh, num_blocks) were never used.
        self.block_hash: list[int] = []
        self.depth: list[int] = []
        self.num_cached_free = 0  # blocks in the order: held, not pinned
        self.spare: list[int] = []  # used slots left empty by a dropped block
        self.eviction: EvictionOrder = ORDERS[policy](self)
        self._uses = self.eviction.counts_uses  # (whether it hears loads and misses)

    @property
    def name(self) -> str:
        return TIER_NAMES[self.level]

    @property
    def policy(self) -> str:
        """The eviction order's name."""
        return self.eviction.name

    @property
    def fresh(self) -> int:
        """Slots used so far: [fresh, num_blocks) never were."""
        return len(self.block_hash)

    @property
    def num_used(self) -> int:
        return len(self.slots)

    def slot_of(self, h: int) -> int | None:
        return self.slots.get(h)

    def free_slot(self) -> int | None:
        """An empty slot: one a dropped block left, else one never used yet (None: every
        slot holds a block)."""
        if self.spare:
            return self.spare.pop()
        s = len(self.block_hash)
        if s >= self.num_blocks:
            return None
        self.block_hash.append(0)
        self.depth.append(0)
        self.eviction.grow(s + 1)
        return s

    def victim(self) -> tuple[int, int] | None:
        """Take the block the order evicts next out of the tier: its (hash, slot) (None:
        every block is pinned)."""
        if not self.num_cached_free:
            return None
        self.num_cached_free -= 1
        (slot,) = self.eviction.victims(1)
        h = self.block_hash[slot]
        del self.slots[h]
        return h, slot

    def add(self, h: int, slot: int, owner: int, depth: int) -> None:
        """Block ``h`` now lies in free ``slot`` (new, or a victim's), most recent."""
        self.slots[h] = slot
        self.owner[h] = owner
        self.block_hash[slot] = h
        self.depth[slot] = depth
        if self._uses:
            self.eviction.allocated([slot])
        self.eviction.insert(slot)
        self.num_cached_free += 1

    def touch(self, h: int) -> None:
        """Held ``h`` was written down again: it becomes most recent (not a use)."""
        if h in self.slots and h not in self.pinned:
            s = self.slots[h]
            self.num_cached_free -= 1
            self.eviction.remove(s)
            self.eviction.insert(s)
            self.num_cached_free += 1

    def pin(self, h: int) -> None:
        """``h`` is being loaded (a use): out of the order until :meth:`unpin`."""
        if h in self.slots and h not in self.pinned:
            s = self.slots[h]
            self.pinned.add(h)
            self.num_cached_free -= 1
            self.eviction.remove(s)
            if self._uses:
                self.eviction.referenced(s)

    def unpin(self, h: int) -> None:
        """Loaded: back in the order, most recent."""
        if h in self.pinned:
            self.pinned.discard(h)
            self.eviction.insert(self.slots[h])
            self.num_cached_free += 1

    def drop(self, h: int) -> None:
        """Take held, unpinned ``h`` out of the tier (its copy is lost): its slot is
        empty again."""
        assert h not in self.pinned, "a block being loaded cannot be dropped"
        s = self.slots.pop(h)
        del self.owner[h]
        self.num_cached_free -= 1
        self.eviction.remove(s)
        self.spare.append(s)

    def missed(self, h: int) -> None:
        """A prompt's lookup asked this tier for ``h``, which it does not hold."""
        if self._uses:
            self.eviction.missed(h)

    def order(self) -> list[tuple[int, int]]:
        """(hash, slot), next to leave first (tests and debugging)."""
        return [(self.block_hash[s], s) for s in self.eviction.order()]


class LowerTiers:
    """The tiers below the device, in order (host first), and the ops a step queues."""

    def __init__(self, num_blocks: list[int], block_size: int, write: str = "evict",
                 policies: Sequence[str] | None = None) -> None:
        """``policies``: each tier's eviction order (default: ``lru`` for each)."""
        if write not in WRITE_MODES:
            raise ValueError(f"tier write mode must be one of {WRITE_MODES}, got {write!r}")
        if not num_blocks or any(n <= 0 for n in num_blocks):
            raise ValueError(f"every tier needs at least one block, got {num_blocks}")
        names = list(policies) if policies is not None else ["lru"] * len(num_blocks)
        if len(names) != len(num_blocks) or any(p not in ORDERS for p in names):
            raise ValueError(f"one eviction order of {', '.join(ORDERS)} per tier, got "
                             f"{names} for {len(num_blocks)} tiers")
        self.tiers = [Tier(CPU + i, n, p) for i, (n, p) in enumerate(zip(num_blocks, names))]
        self.block_size = block_size
        self.write = write
        self.ops: list[TierOp] = []
        self.stats = TierStats()
        # Whether a disk slot's file still holds a whole block (executor=model: the
        # backend's TierStorage reads it back; None: nothing to check). Not asked of the
        # slots this step's queued ops write: their files are written after scheduling.
        self.check_disk: Callable[[int], bool] | None = None
        self._disk_queued: set[int] = set()
        # Whether any tier's order hears a lookup's misses (else a lookup is a find).
        self._hears_misses = any(t.eviction.counts_uses for t in self.tiers)

    @property
    def policies(self) -> list[str]:
        """Each tier's eviction order, host first."""
        return [t.policy for t in self.tiers]

    # -- lookups -------------------------------------------------------------------------
    def find(self, h: int) -> TierHit | None:
        """The nearest tier holding ``h`` (no side effects)."""
        for t in self.tiers:
            s = t.slot_of(h)
            if s is not None:
                return TierHit(t.level, s, h, t.owner[h])
        return None

    def lookup(self, h: int) -> TierHit | None:
        """:meth:`find` for a prompt's lookup: each tier asked before the one holding
        ``h`` (every tier, when none does) hears that it missed ``h``; a block found on
        disk whose file is damaged (:attr:`check_disk`) is dropped, and missed."""
        check = self.check_disk
        if not self._hears_misses and check is None:
            return self.find(h)
        for t in self.tiers:
            s = t.slot_of(h)
            if s is not None:
                if check is not None and t.level == DISK and h not in t.pinned \
                        and s not in self._disk_queued and not check(s):
                    t.drop(h)
                    self.stats.disk_damaged += 1
                    return None  # (the tiers above missed it already)
                return TierHit(t.level, s, h, t.owner[h])
            t.missed(h)
        return None

    def tier(self, level: int) -> Tier:
        return self.tiers[level - CPU]

    # -- down ----------------------------------------------------------------------------
    def store(self, gpu_block: int, h: int, owner: int, depth: int = 0) -> None:
        """Write device block ``gpu_block`` (content ``h``, at ``depth`` in its prefix
        chain) to the first tier, unless it holds ``h`` already."""
        first = self.tiers[0]
        if first.slot_of(h) is not None:
            first.touch(h)
            return
        slot = self._take_slot(0)
        if slot is None:
            self.stats.dropped_blocks += 1
            return
        self.ops.append(TierOp(GPU, gpu_block, first.level, slot))
        self._name(first, h, slot, owner, depth)

    def _take_slot(self, i: int) -> int | None:
        """A free slot of tier ``i``, making one by moving the block its order evicts next
        down (the spill op is queued first, so it reads the slot before the new write
        lands)."""
        t = self.tiers[i]
        s = t.free_slot()
        if s is not None:
            return s
        out = t.victim()
        if out is None:
            return None  # every block of the tier is being loaded this step
        h, slot = out
        owner = t.owner.pop(h)
        if i + 1 < len(self.tiers):
            nxt = self.tiers[i + 1]
            if nxt.slot_of(h) is not None:
                nxt.touch(h)
            else:
                dst = self._take_slot(i + 1)
                if dst is None:
                    self.stats.dropped_blocks += 1
                else:
                    self.ops.append(TierOp(t.level, slot, nxt.level, dst))
                    self._name(nxt, h, dst, owner, t.depth[slot])
                    if nxt.level == DISK:
                        self._disk_queued.add(dst)
        else:
            self.stats.dropped_blocks += 1
        return slot

    def _name(self, t: Tier, h: int, slot: int, owner: int, depth: int) -> None:
        t.add(h, slot, owner, depth)
        self.stats.blocks_down[t.level - CPU] += 1

    def lose(self, level: int, slot: int) -> None:
        """The write of the block tier ``level`` holds in ``slot`` did not land (the
        disk tier's files, after the step's operations): drop it, uncounted as written."""
        t = self.tier(level)
        if slot < t.fresh and t.slots.get(t.block_hash[slot]) == slot:
            t.drop(t.block_hash[slot])
            self.stats.blocks_down[level - CPU] -= 1
            self.stats.disk_write_failures += 1

    # -- up ------------------------------------------------------------------------------
    def pin(self, hits: list[TierHit]) -> None:
        """Keep the blocks a step will load out of their tiers' orders until
        :meth:`unpin`: the same step's stores must not spill or overwrite them first."""
        for hit in hits:
            self.tier(hit.tier).pin(hit.block_hash)

    def unpin(self, hits: list[TierHit]) -> None:
        """Loaded: back in their orders as most recently used."""
        for hit in hits:
            self.tier(hit.tier).unpin(hit.block_hash)

    def load(self, hit: TierHit, gpu_block: int, count_hit: bool = True) -> None:
        """Queue the copy of ``hit`` into device block ``gpu_block``. ``count_hit``: its
        tokens count as hit tokens (KV cache groups: one group counts a prompt's hits,
        every group's loads move bytes)."""
        t = self.tier(hit.tier)
        assert t.slot_of(hit.block_hash) == hit.slot, "a hit must be pinned until loaded"
        self.ops.append(TierOp(hit.tier, hit.slot, GPU, gpu_block))
        self.stats.blocks_up[hit.tier - CPU] += 1
        if count_hit:
            self.stats.hit_tokens[hit.tier - CPU] += self.block_size

    def take_ops(self) -> list[TierOp]:
        ops, self.ops = self.ops, []
        self._disk_queued.clear()
        return ops
