"""The pool's LRU of cached blocks (a deque whose revived entries are void, skipped when
they come to the front) against an insertion-ordered dict doing the same, on random
allocations, namings, releases and revivals: the same order, the same evictions."""

from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.kv.block_pool import BlockPool

NUM_BLOCKS = 12

ops_st = st.lists(st.tuples(st.sampled_from(["alloc", "release", "revive"]),
                            st.integers(1, 5), st.integers(0, 1 << 16)),
                  min_size=1, max_size=120)


@pytest.mark.parametrize("compact_min", [-(1 << 30), 1024])
@settings(max_examples=200, deadline=None)
@given(ops=ops_st)
def test_lru_order_and_evictions_match_an_ordered_dict(
        compact_min: int, ops: list[tuple[str, int, int]]) -> None:
    pool = BlockPool(NUM_BLOCKS, 4)
    pool.compact_min = compact_min  # negative: compacted at every revival
    model: OrderedDict[int, None] = OrderedDict()  # cached blocks, oldest first
    held: list[int] = []
    next_hash = 1
    for op, n, pick in ops:
        if op == "alloc":
            n = min(n, pool.num_free)
            expect_evicted = list(model)[:max(0, n - len(pool.free_order()))]
            out = pool.allocate_all(n, 4)
            evicted = [b for b in out if b in expect_evicted]
            assert evicted == expect_evicted  # the oldest cached, in order
            for b in expect_evicted:
                del model[b]
            for b in out:
                if pick % 3:  # most blocks are named (a full block with content)
                    pool.name(b, next_hash)
                    next_hash += 1
            held += out
        elif op == "release" and held:
            k = min(n, len(held))
            i = pick % (len(held) - k + 1)
            gone, held[i:i + k] = held[i:i + k], []
            pool.release_all(gone)
            for b in gone:
                if pool.block_hash[b] is not None:
                    model[b] = None
        elif op == "revive" and model:
            b = list(model)[pick % len(model)]
            pool.touch(b)  # a prefix hit on a cached block
            del model[b]
            held.append(b)
        assert pool.lru_order() == list(model)
        assert pool.num_cached_free == len(model)
        assert pool.num_free == len(pool.free_order()) + len(model)
