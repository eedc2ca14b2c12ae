"""Lower tiers of the prefix cache: host memory, then disk, below the device's block pool.

Bookkeeping only (no tensors; the backend's :class:`~harness.backends.tier_storage.
TierStorage` moves the bytes, the roofline charges them as time). A tier holds whole,
named blocks by their chained prefix hash, in its own LRU over a fixed number of slots:

* **down**: a named block that leaves the device's LRU of cached-free blocks (``write=
  evict``), or every block as soon as its content is computed (``write=through``), is
  written to the first tier unless that tier holds its hash already (then it only
  becomes most recent). A tier that is full gives its least recently used block to the
  next tier (``spill``: host -> disk), or drops it from the last.
* **up**: a prompt's prefix lookup that misses on the device goes on in the tiers
  (:meth:`LowerTiers.find`); each block found is *loaded* into a fresh device block, which
  is then named and shared like any other. The tier keeps its copy (inclusive, as
  LMCache's and vLLM's CPU offloading keep theirs), so the next eviction of the same
  content costs nothing.

Everything a step moves is one ordered list of :class:`TierOp`: a spill comes before the
write that takes its slot, a store of an evicted device block before the load that
reuses that block. Operations are O(1) per block (an insertion-ordered dict per tier),
and a tier's size costs nothing until its slots are used.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

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


class Tier:
    """One tier's slots and its LRU of hashes (least recently used first)."""

    def __init__(self, level: int, num_blocks: int) -> None:
        self.level = level
        self.num_blocks = num_blocks
        self.lru: OrderedDict[int, int] = OrderedDict()  # hash -> slot
        self.owner: dict[int, int] = {}  # hash -> request that computed it
        self.fresh = 0  # slots [fresh, num_blocks) never used yet (no per-slot list: 1e9+)
        self.pinned: dict[int, int] = {}  # hash -> slot, out of the LRU while loading

    @property
    def name(self) -> str:
        return TIER_NAMES[self.level]

    @property
    def num_used(self) -> int:
        return len(self.lru) + len(self.pinned)

    def slot_of(self, h: int) -> int | None:
        s = self.lru.get(h)
        return self.pinned.get(h) if s is None else s

    def touch(self, h: int) -> None:
        if h in self.lru:
            self.lru.move_to_end(h)

    def order(self) -> list[tuple[int, int]]:
        """(hash, slot), next to leave first (tests and debugging)."""
        return list(self.lru.items())


class LowerTiers:
    """The tiers below the device, in order (host first), and the ops a step queues."""

    def __init__(self, num_blocks: list[int], block_size: int, write: str = "evict") -> None:
        if write not in WRITE_MODES:
            raise ValueError(f"tier write mode must be one of {WRITE_MODES}, got {write!r}")
        if not num_blocks or any(n <= 0 for n in num_blocks):
            raise ValueError(f"every tier needs at least one block, got {num_blocks}")
        self.tiers = [Tier(CPU + i, n) for i, n in enumerate(num_blocks)]
        self.block_size = block_size
        self.write = write
        self.ops: list[TierOp] = []
        self.stats = TierStats()

    # -- lookups -------------------------------------------------------------------------
    def find(self, h: int) -> TierHit | None:
        """The nearest tier holding ``h`` (no side effects)."""
        for t in self.tiers:
            s = t.slot_of(h)
            if s is not None:
                return TierHit(t.level, s, h, t.owner[h])
        return None

    def tier(self, level: int) -> Tier:
        return self.tiers[level - CPU]

    # -- down ----------------------------------------------------------------------------
    def store(self, gpu_block: int, h: int, owner: int) -> None:
        """Write device block ``gpu_block`` (content ``h``) to the first tier, unless it
        holds ``h`` already."""
        first = self.tiers[0]
        if first.slot_of(h) is not None:
            first.touch(h)
            return
        slot = self._take_slot(0)
        if slot is None:
            self.stats.dropped_blocks += 1
            return
        self.ops.append(TierOp(GPU, gpu_block, first.level, slot))
        self._name(first, h, slot, owner)

    def _take_slot(self, i: int) -> int | None:
        """A free slot of tier ``i``, making one by moving its LRU block down (the spill
        op is queued first, so it reads the slot before the new write lands)."""
        t = self.tiers[i]
        if t.fresh < t.num_blocks:
            t.fresh += 1
            return t.fresh - 1
        if not t.lru:
            return None  # every block of the tier is being loaded this step
        h, slot = t.lru.popitem(last=False)
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
                    self._name(nxt, h, dst, owner)
        else:
            self.stats.dropped_blocks += 1
        return slot

    def _name(self, t: Tier, h: int, slot: int, owner: int) -> None:
        t.lru[h] = slot
        t.owner[h] = owner
        self.stats.blocks_down[t.level - CPU] += 1

    # -- up ------------------------------------------------------------------------------
    def pin(self, hits: list[TierHit]) -> None:
        """Keep the blocks a step will load out of every LRU until :meth:`unpin`: the
        same step's stores must not spill or overwrite them first."""
        for hit in hits:
            t = self.tier(hit.tier)
            if hit.block_hash in t.lru:
                t.pinned[hit.block_hash] = t.lru.pop(hit.block_hash)

    def unpin(self, hits: list[TierHit]) -> None:
        """Loaded: back in their LRUs as most recently used."""
        for hit in hits:
            t = self.tier(hit.tier)
            s = t.pinned.pop(hit.block_hash, None)
            if s is not None:
                t.lru[hit.block_hash] = s

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
        return ops
