"""The prefix cache's lower tiers (harness.kv.tiers) on a tiny pool: a narrated block story
(GPU -> CPU -> disk -> back, exact block ids, tier slots and LRU orders after each step,
as vLLM's prefix-caching tests narrate theirs), write-through, pinning, and the hit-rate
and traffic metrics.

Pool: 4 device blocks of 4 tokens, watermark 0; tiers: 2 CPU slots, then 2 disk slots.
"""

from __future__ import annotations

from harness.kv.base import Demand
from harness.kv.paged import PagedKVManager
from harness.kv.tiers import CPU, DISK, GPU, LowerTiers, TierOp
from harness.sched.sequence import Sequence
from tests.helpers import make_seq

BS = 4


def mgr(cpu: int = 2, disk: int = 2, write: str = "evict") -> PagedKVManager:
    tiers = LowerTiers([cpu, disk] if disk else [cpu], BS, write)
    return PagedKVManager(4, BS, watermark=0.0, tiers=tiers)


def admit(m: PagedKVManager, seq: Sequence) -> list[TierOp]:
    """Admit ``seq``'s whole prompt as the scheduler would (its prefix hit first); returns
    the tier operations the step queued."""
    hit = m.lookup_prefix(seq)
    d = Demand.after(seq, seq.num_tokens - hit.num_blocks * BS, hit)
    assert m.can_allocate([d], watermark=False)
    m.allocate_group([d])
    seq.num_computed = seq.num_tokens
    m.end_forward()
    return m.take_cache_ops().tier_ops


def lru(m: PagedKVManager, level: int) -> list[int]:
    """The tier's slots, next to leave first."""
    assert m.tiers is not None
    return [slot for _, slot in m.tiers.tier(level).order()]


def test_block_story_gpu_cpu_disk_and_back() -> None:
    m = mgr()
    pool = m.pool
    a = make_seq(list(range(9)))  # two full blocks (named) and one partial
    assert admit(m, a) == []
    assert m.table_of(a) == [0, 1, 2]
    m.free(a)
    # Released tail first: the partial block 2 has no name and is plainly free; 1 then 0
    # enter the LRU of cached blocks, so A's head (0) is evicted last.
    assert pool.free_order() == [3, 2] and pool.lru_order() == [1, 0]

    b = make_seq(list(range(100, 109)))
    ops = admit(m, b)
    # B takes 3 and 2 (free), then evicts the LRU cached block 1 (A's second block): it
    # goes down to the CPU tier's first slot before B's K/V overwrite it.
    assert m.table_of(b) == [3, 2, 1]
    assert ops == [TierOp(GPU, 1, CPU, 0)]
    assert lru(m, CPU) == [0] and lru(m, DISK) == []
    m.free(b)
    assert pool.free_order() == [1] and pool.lru_order() == [0, 2, 3]

    c = make_seq(list(range(200, 209)))
    ops = admit(m, c)
    # C takes 1, then evicts 0 (A's first block: CPU slot 1) and 2 (B's second block):
    # the CPU tier is full, so its LRU block (A's second, slot 0) spills to disk slot 0
    # first, and B's block takes slot 0.
    assert m.table_of(c) == [1, 0, 2]
    assert ops == [TierOp(GPU, 0, CPU, 1), TierOp(CPU, 0, DISK, 0), TierOp(GPU, 2, CPU, 0)]
    assert lru(m, CPU) == [1, 0] and lru(m, DISK) == [0]
    m.free(c)
    assert pool.free_order() == [2] and pool.lru_order() == [3, 0, 1]

    # A's conversation comes back: its first block is in the CPU tier (slot 1), its
    # second on disk (slot 0); none is on the device.
    a2 = make_seq(list(range(12)))
    hit = m.lookup_prefix(a2)
    assert hit.blocks == [] and [(h.tier, h.slot) for h in hit.loads] == [(CPU, 1), (DISK, 0)]
    ops = admit(m, a2)
    # The loads are pinned while the step allocates. Load 1 takes free block 2. Load 2
    # evicts block 3 (B's first): down to the CPU tier, whose only unpinned block (B's
    # second, slot 0) spills to disk slot 1; then the disk block loads into 3. The new
    # tokens' block evicts 0 (C's second), after the unpin: the CPU LRU is now B's first
    # (slot 0) then A's first (slot 1, just loaded); slot 0 spills to disk, where the LRU
    # block (B's second, slot 1) falls out of the last tier.
    assert m.table_of(a2) == [2, 3, 0]
    assert ops == [TierOp(CPU, 1, GPU, 2), TierOp(CPU, 0, DISK, 1), TierOp(GPU, 3, CPU, 0),
                   TierOp(DISK, 0, GPU, 3), TierOp(CPU, 0, DISK, 1), TierOp(GPU, 0, CPU, 0)]
    assert lru(m, CPU) == [1, 0] and lru(m, DISK) == [0, 1]
    assert m.tiers is not None
    st = m.tiers.stats
    assert st.hit_tokens == [BS, BS] and st.blocks_up == [1, 1]
    assert st.blocks_down == [5, 3] and st.dropped_blocks == 1
    # The next turn is another request: hits on the blocks A computed, whatever the tier.
    assert m.stats.prefix_hit_tokens == 2 * BS and m.stats.self_hit_tokens == 0
    assert a2.group.tier_hit_blocks == [1, 1] and a2.group.prefix_source == "disk"
    # The loaded blocks are named again: a third copy of A's prompt hits them on the GPU.
    a3 = make_seq(list(range(9)))
    assert m.lookup_prefix(a3).blocks == [2, 3]


def test_write_through_stores_after_the_forward_and_eviction_then_moves_nothing() -> None:
    m = mgr(cpu=4, disk=0, write="through")
    a = make_seq(list(range(9)))
    d = Demand(a, a.num_tokens)
    assert m.can_allocate([d], watermark=False)
    m.allocate_group([d])
    # Scheduled, not computed yet: nothing can be written down before the forward.
    assert m.take_cache_ops().tier_ops == []
    a.num_computed = a.num_tokens
    m.end_forward()
    # The next step's operations write A's two named blocks through.
    assert m.take_cache_ops().tier_ops == [TierOp(GPU, 0, CPU, 0), TierOp(GPU, 1, CPU, 1)]
    m.free(a)
    b = make_seq(list(range(100, 116)))  # 4 blocks: evicts both of A's
    ops = admit(m, b)
    # Evicting A's blocks (1, then 0) costs nothing: the tier holds their hashes (they
    # only become its most recent). Then B's four named blocks are written through: two
    # into the free slots, two into the slots of A's blocks, which fall out (no disk).
    assert m.table_of(b) == [3, 2, 1, 0]
    assert ops == [TierOp(GPU, 3, CPU, 2), TierOp(GPU, 2, CPU, 3), TierOp(GPU, 1, CPU, 1),
                   TierOp(GPU, 0, CPU, 0)]
    assert m.tiers is not None and m.tiers.stats.blocks_down == [6, 0]
    assert m.tiers.stats.dropped_blocks == 2


def test_no_tiers_without_prefix_caching() -> None:
    m = PagedKVManager(4, BS, enable_prefix_caching=False, tiers=LowerTiers([2], BS))
    assert m.tiers is None


def test_a_pinned_block_is_never_spilled_or_overwritten() -> None:
    """Every CPU slot is being loaded this step: a store finds no slot and drops its
    block instead of overwriting one that a load has yet to read."""
    m = mgr(cpu=1, disk=0)
    a = make_seq(list(range(5)))  # one named block
    admit(m, a)
    m.free(a)
    filler = make_seq(list(range(100, 116)))  # evicts A's block to the CPU tier
    assert admit(m, filler) == [TierOp(GPU, 0, CPU, 0)]
    m.free(filler)
    assert m.tiers is not None
    hit = m.lookup_prefix(make_seq(list(range(5))))
    assert [(h.tier, h.slot) for h in hit.loads] == [(CPU, 0)]
    m.tiers.pin(hit.loads)
    m.tiers.store(3, 12345, -1)  # a store while the only slot is pinned
    assert m.tiers.take_ops() == [] and m.tiers.stats.dropped_blocks == 1
    m.tiers.unpin(hit.loads)
    assert m.tiers.tier(CPU).order() == [(hit.loads[0].block_hash, 0)]
