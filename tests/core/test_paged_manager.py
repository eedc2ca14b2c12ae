"""Narrated scenarios for the paged KV manager on a tiny pool (block size 4, 10 blocks).

Each test walks the pool through a story and asserts exact block ids, reference counts
and queue orders after each step, saying why that order is the right one.
"""

from __future__ import annotations

import random

from harness.kv.base import CopyOp, Demand
from harness.kv.block_pool import BlockPool
from harness.kv.evicting import WindowKVManager
from harness.kv.paged import PagedKVManager
from harness.kv.policies.window import WindowPolicy
from harness.sched.sequence import Sequence
from tests.helpers import decode, make_seq

BS = 4


def mgr(num_blocks: int = 10, **kw: object) -> PagedKVManager:
    return PagedKVManager(num_blocks, BS, watermark=0.0, **kw)  # type: ignore[arg-type]


def admit(m: PagedKVManager, seq, use_cache: bool = True) -> int:  # type: ignore[no-untyped-def]
    """Admit ``seq``'s whole prompt as the scheduler would; returns prefix-hit tokens."""
    hits = m.lookup_prefix(seq).blocks if use_cache else []
    d = Demand(seq, seq.num_tokens - len(hits) * BS, hits)
    assert m.can_allocate([d], watermark=False)
    m.allocate(d)
    seq.num_computed = seq.num_tokens
    return len(hits) * BS


def test_prefix_hit_and_miss_and_lru_eviction() -> None:
    m = mgr()
    a = make_seq(list(range(10)))  # blocks: [0..3] [4..7] [8 9 _ _]
    admit(m, a)
    assert m.table_of(a) == [0, 1, 2]
    assert m.pool.fill[2] == 2
    # Two full blocks are named; the partial third is not cacheable.
    assert m.pool.block_hash[0] is not None and m.pool.block_hash[2] is None

    # Same first block, different second: hits exactly one block.
    b = make_seq([0, 1, 2, 3, 99, 98, 97, 96, 95])
    assert admit(m, b) == 4
    assert m.table_of(b) == [0, 3, 4]
    assert m.pool.ref[0] == 2 and m.pool.num_shared == 1

    # Free a: reverse order puts its tail first into the LRU. Block 0 is still held by b.
    m.free(a)
    assert m.pool.lru_order() == [1]  # block 2 had no hash: it went to the plain free list
    assert m.pool.free_order()[-1] == 2
    m.free(b)
    # b's release order: 4 (no hash -> free), 3 (hashed), 0 (hashed, now ref 0).
    assert m.pool.lru_order() == [1, 3, 0]

    # A fresh allocation takes plain free blocks before evicting any cached one.
    c = make_seq(list(range(100, 120)))  # 5 blocks, all new
    admit(m, c, use_cache=False)
    assert m.table_of(c) == [5, 6, 7, 8, 9]
    assert m.pool.num_evictions == 0
    d = make_seq(list(range(200, 212)))  # 3 blocks: free list holds 2 and 4, then evict LRU
    admit(m, d, use_cache=False)
    assert m.table_of(d) == [2, 4, 1]
    assert m.pool.num_evictions == 1 and m.pool.lru_order() == [3, 0]

    # c finishes: its full blocks were named too, so they join the LRU, tail first.
    m.free(c)
    assert m.pool.lru_order() == [3, 0, 9, 8, 7, 6, 5]
    # a's first block (hash of tokens 0..3) survived eviction: a new copy of a hits it,
    # reviving it out of the LRU; its two new blocks evict the two oldest entries.
    e = make_seq(list(range(10)))
    assert admit(m, e) == 4
    assert m.table_of(e) == [0, 3, 9]
    assert m.pool.lru_order() == [8, 7, 6, 5]


def test_whole_prompt_cached_still_computes_last_block() -> None:
    m = mgr()
    a = make_seq(list(range(8)))
    admit(m, a)
    b = make_seq(list(range(8)))
    # Both blocks are cached, but the last token's logits are needed: only block 0 hits.
    assert m.lookup_prefix(b).blocks == [0]


def test_decode_filled_block_becomes_cacheable_for_next_turn() -> None:
    m = mgr()
    a = make_seq([1, 2, 3, 4, 5, 6])
    admit(m, a)
    decode(m, a, 7)
    assert m.pool.block_hash[1] is None  # 7 of 8 slots filled
    decode(m, a, 8)
    assert m.pool.block_hash[1] is not None  # the answer's block is full: named
    m.free(a)
    # The next turn re-sends the history plus a user message: both blocks hit.
    nxt = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    assert admit(m, nxt) == 8
    assert m.table_of(nxt)[:2] == [0, 1]


def test_extra_key_separates_prefixes() -> None:
    m = mgr()
    admit(m, make_seq(list(range(9)), extra_key="lora-a"))
    assert m.lookup_prefix(make_seq(list(range(9)), extra_key="lora-b")).blocks == []
    assert m.lookup_prefix(make_seq(list(range(9)), extra_key="lora-a")).blocks == [0, 1]


def test_fork_and_copy_on_write() -> None:
    m = mgr()
    p = make_seq([1, 2, 3, 4, 5, 6])  # blocks 0 (full) and 1 (2 of 4)
    admit(m, p)
    c = make_seq([0])
    c.token_ids = list(p.token_ids)
    m.fork(p, c)
    c.num_computed = p.num_computed
    assert m.table_of(c) == [0, 1] and m.pool.ref[0] == 2 and m.pool.ref[1] == 2
    assert m.logical_blocks == 4 and m.pool.num_used == 2

    # The first writer into the shared partial block gets a private copy of its 2 slots.
    decode(m, c, 50)
    assert m.table_of(c) == [0, 2]
    assert m.take_cache_ops().copies == [CopyOp(src=1 * BS, dst=2 * BS, num_slots=2)]
    assert m.pool.ref[1] == 1 and m.stats.cow_copies == 1
    # The parent is now the only holder of block 1: it writes in place, no copy.
    decode(m, p, 60)
    assert m.table_of(p) == [0, 1] and m.take_cache_ops().copies == []
    # Full shared blocks are never copied: block 0 stays shared.
    assert m.pool.ref[0] == 2
    m.free(c)
    m.free(p)
    assert m.pool.num_used == 0 and m.logical_blocks == 0


def test_fork_on_block_boundary_needs_no_copy() -> None:
    m = mgr()
    p = make_seq([1, 2, 3, 4])
    admit(m, p)
    c = make_seq([0])
    c.token_ids = list(p.token_ids)
    m.fork(p, c)
    c.num_computed = 4
    decode(m, c, 9)
    decode(m, p, 8)
    assert m.take_cache_ops().copies == [] and m.table_of(c) == [0, 1] and m.table_of(p) == [0, 2]


def test_swap_out_and_in_round_trip() -> None:
    m = mgr(num_cpu_blocks=4)
    p = make_seq([1, 2, 3, 4, 5])
    admit(m, p)
    c = make_seq([0])
    c.token_ids = list(p.token_ids)
    m.fork(p, c)
    assert m.can_swap_out([p, c])
    out = m.swap_out([p, c])
    # Shared blocks move once: 2 device blocks -> 2 CPU blocks, both tables point at them.
    assert out == [(0, 0), (1, 1)]
    assert m.table_of(p) == [0, 1] and m.table_of(c) == [0, 1]  # now CPU ids
    assert m.pool.num_used == 0 and m.num_cpu_blocks_used == 2
    # Hashed block 0 stays in the prefix cache; unhashed block 1 is plain free.
    assert m.pool.lru_order() == [0]
    admit(m, make_seq(list(range(100, 108))), use_cache=False)  # takes 2..3 (free list)
    back = m.swap_in([p, c])
    assert [cpu for cpu, _ in back] == [0, 1]
    new0, new1 = (dev for _, dev in back)
    assert m.table_of(p) == [new0, new1] == m.table_of(c)
    assert m.pool.ref[new0] == 2 and m.pool.fill[new1] == 1
    assert m.num_cpu_blocks_used == 0


def test_window_policy_gives_back_whole_blocks_outside_the_window() -> None:
    pol = WindowPolicy(window=6, sinks=0)
    m = WindowKVManager(10, BS, pol, watermark=0.0, enable_prefix_caching=False)
    s = make_seq([*range(13), 99])  # 13 computed, the 14th sampled
    d = Demand(s, 13)
    m.allocate(d)
    s.num_computed = 13
    # The next query (position 13) sees positions 8..13: blocks 0 and 1 are wholly outside.
    m.observe([s], None)
    assert m.table_of(s) == [-1, -1, 2, 3]
    assert m.pool.num_used == 2 and m.stats.evicted_tokens == 8
    m.observe([s], None)  # idempotent: the cursor remembers what was considered
    assert m.stats.evicted_tokens == 8
    # Attention reads a given-back entry as block 0 (masked by the window).
    assert m.tables([s]) == [[0, 0, 2, 3]]
    assert m.slot(s, 12) == 3 * BS
    m.free(s)
    assert m.pool.num_used == 0 and m.logical_blocks == 0


def test_window_keeps_the_sink_blocks() -> None:
    pol = WindowPolicy(window=4, sinks=5)  # sinks span blocks 0 and 1
    m = WindowKVManager(10, BS, pol, watermark=0.0, enable_prefix_caching=False)
    s = make_seq(list(range(21)))
    m.allocate(Demand(s, 20))
    s.num_computed = 20
    m.observe([s], None)
    # Next query at 20 sees 17..20 and the sinks 0..4: blocks 2 and 3 (8..15) go.
    assert m.table_of(s) == [0, 1, -1, -1, 4]


def test_duplicate_content_stays_findable_after_one_copy_is_evicted() -> None:
    # Two identical prompts admitted in one step compute the same first block twice
    # (blocks 0 and 2). vLLM keeps both under the hash; so do we.
    m = mgr(4)
    a, b = make_seq(list(range(5))), make_seq(list(range(5)))
    m.allocate_group([Demand(a, 5), Demand(b, 5)])
    a.num_computed = b.num_computed = 5
    assert m.table_of(a) == [0, 1] and m.table_of(b) == [2, 3]
    h = m.pool.block_hash[0]
    assert h is not None and m.pool.block_hash[2] == h
    m.free(a)  # partial block 1 goes to the free list, named block 0 to the LRU
    # A new 2-block prompt takes free block 1, then evicts cached block 0.
    c = make_seq(list(range(50, 58)))
    admit(m, c, use_cache=False)
    assert m.table_of(c) == [1, 0] and m.pool.block_hash[0] != h
    # The held copy (block 2) still answers the hash: a later prompt hits it.
    later = make_seq([*range(5), 7])
    assert m.lookup_prefix(later).blocks == [2]


def test_a_name_keeps_its_copies_in_order_as_they_come_and_go() -> None:
    """The pool's index of names: one copy, then three, then one again (held as an int
    for one copy, as a dict for more), the oldest copy served first throughout."""
    pool = BlockPool(6, BS)
    for b in range(5):
        assert pool.allocate(BS) == b
    assert pool.register(3, 77) and pool.copies(77) == [3] and pool.lookup(77) == 3
    assert pool.register(1, 77) and pool.register(4, 77) and not pool.register(4, 77)
    assert pool.copies(77) == [3, 1, 4] and pool.hash_index() == {77: [3, 1, 4]}
    pool.release(3)  # cached-free now: a held copy answers first
    assert pool.lookup(77) == 1
    pool.release_all([1, 4])
    assert pool.lookup(77) == 3  # none held: the oldest
    pool.release_all([0, 2])  # unnamed: plain free, behind block 5 (never taken)
    # Allocations take the plain free blocks (5, 0, 2), then evict the LRU: 3, then 1.
    assert pool.allocate_all(5, BS) == [5, 0, 2, 3, 1]
    assert pool.copies(77) == [4] and pool.hash_index() == {77: [4]}
    assert pool.lookup(77) == 4 and pool.allocate(BS) == 4 and pool.copies(77) == []
    assert pool.lookup(77) is None and pool.hash_index() == {}


def test_a_recomputed_request_hitting_its_own_blocks_is_not_a_prefix_hit() -> None:
    m = mgr()
    s = make_seq(list(range(9)))
    assert admit(m, s) == 0
    m.free(s)  # recompute preemption: its full blocks stay cached
    s.num_computed = 0
    assert admit(m, s) == 8  # the cache saves the recompute...
    # ...but it is the request's own work, not another request's prefix.
    assert m.stats.self_hit_tokens == 8 and m.stats.prefix_hit_tokens == 0
    other = make_seq(list(range(9)))
    admit(m, other)
    assert m.stats.prefix_hit_tokens == 8


def test_allocation_fails_cleanly_when_full() -> None:
    m = mgr(num_blocks=3)
    a = make_seq(list(range(12)))
    admit(m, a)
    d = Demand(a, 1)
    a.token_ids.append(1)
    assert not m.can_allocate([d], watermark=False)


def test_watermark_holds_back_blocks() -> None:
    m = PagedKVManager(10, BS, watermark=0.2)
    s = make_seq(list(range(33)))  # 9 blocks: fits 10, but not with 2 held back
    d = Demand(s, 33)
    assert m.can_allocate([d], watermark=False)
    assert not m.can_allocate([d], watermark=True)


def test_admission_error_names_the_fix() -> None:
    m = mgr(num_blocks=4)
    msg = m.admission_error(10, 10, 1)
    assert msg is not None and "cache.kv_budget" in msg
    assert m.admission_error(8, 8, 1) is None


def test_group_hits_are_taken_before_new_blocks_evict_them() -> None:
    # Two sequences of one group (readmitted after recompute preemption) hit different
    # cached blocks. The first one's new block must not evict the second one's hit.
    m = mgr()
    a = make_seq([0, 1, 2, 3, 8, 9, 10, 11, 7])
    admit(m, a)  # blocks 0 1 2
    b = make_seq([0, 1, 2, 3, 20, 21, 22, 23, 7])
    admit(m, b)  # blocks 0 3 4
    other = make_seq(list(range(100, 113)))
    admit(m, other, use_cache=False)  # 5 6 7 8
    m.free(a)
    m.free(b)
    m.free(other)
    filler = make_seq(list(range(200, 216)))
    admit(m, filler, use_cache=False)  # takes the 4 plain-free blocks
    assert m.pool.free_order() == [] and m.pool.lru_order()[:2] == [1, 3]
    a2 = make_seq(list(a.token_ids))
    b2 = make_seq(list(b.token_ids))
    da = Demand(a2, 1, m.lookup_prefix(a2).blocks)
    db = Demand(b2, 1, m.lookup_prefix(b2).blocks)
    assert (da.hit_blocks, db.hit_blocks) == ([0, 1], [0, 3])
    assert m.can_allocate([da, db], watermark=False)
    m.allocate_group([da, db])
    # Hits taken first leave LRU [7, 6, 5]: the new blocks evict 7 and 6, not block 3.
    assert m.table_of(a2) == [0, 1, 7] and m.table_of(b2) == [0, 3, 6]
    assert m.pool.ref[3] == 1 and m.pool.ref[0] == 2


def test_without_slot_maps_only_the_prompts_slot_lists_go() -> None:
    """``slot_maps=False`` (the roofline: nothing reads a step's slots): a prefill chunk's
    slot list is empty, and everything else is as with them: append_slot's slot (in
    place, into a new block, after a fork's copy-on-write), the tables, the names, the
    pool's and the ledger's state, over a random mix of admissions, decodes and frees."""
    rng = random.Random(3)
    on, off = mgr(64), mgr(64)
    off.slot_maps = False
    live: list[tuple[Sequence, Sequence]] = []
    for _ in range(400):
        r = rng.random()
        if r < 0.2 and len(live) < 8:
            toks = [rng.randrange(2) for _ in range(rng.randrange(1, 14))]
            a, b = make_seq(toks), make_seq(toks)
            da = Demand(a, len(toks), on.lookup_prefix(a).blocks)
            db = Demand(b, len(toks), off.lookup_prefix(b).blocks)
            if not on.can_allocate([da], watermark=False):
                continue
            da.num_tokens = db.num_tokens = len(toks) - len(da.hit_blocks) * BS
            sa, sb = on.allocate(da), off.allocate(db)
            assert sb == [] and len(sa) == da.num_tokens
            a.num_computed = b.num_computed = len(toks)
            live.append((a, b))
        elif r < 0.25 and live:
            a, b = live[rng.randrange(len(live))]
            ca, cb = make_seq([0]), make_seq([0])
            ca.token_ids, cb.token_ids = list(a.token_ids), list(b.token_ids)
            on.fork(a, ca)
            off.fork(b, cb)
            ca.num_computed, cb.num_computed = a.num_computed, b.num_computed
            live.append((ca, cb))
        elif r < 0.4 and live:
            a, b = live.pop(rng.randrange(len(live)))
            on.free(a)
            off.free(b)
        elif live:
            a, b = live[rng.randrange(len(live))]
            t = rng.randrange(3)
            a.token_ids.append(t)
            b.token_ids.append(t)
            x, y = on.append_slot(a), off.append_slot(b)
            assert x == y
            if x is None:
                continue
            pos = a.num_computed  # the slot is where the table puts the token
            assert x == on.table_of(a)[pos // BS] * BS + pos % BS
            a.num_computed += 1
            b.num_computed += 1
        assert [on.table_of(a) for a, _ in live] == [off.table_of(b) for _, b in live]
        assert on.pool.block_hash == off.pool.block_hash and on.pool.fill == off.pool.fill
        assert on.ledger.open_units() == off.ledger.open_units()
        assert on.take_cache_ops() == off.take_cache_ops()
    assert on.stats.cow_copies > 5 and on.stats.prefix_hit_tokens > 0 and on.pool.num_evictions
