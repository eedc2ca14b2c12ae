"""Compressed prefixes (harness/kv/compressed.py) in the evicting KV manager, as a story
on a pool of 12 blocks of 4 slots: a compress-once press (knorm's policy, 6 prompt tokens
kept) compresses a 20-token prompt, decodes, ends, and its state stays in the pool's cache
of freed blocks under a name of its own; the next turn's prompt hits it, starts from a
copy, and is not compressed again; a full pool evicts it; other parameters name the same
tokens otherwise; h2o (re-scores every step) keeps nothing. The per-head tables the same
way, by pages."""

from __future__ import annotations

import numpy as np

from harness.backends.h2o import H2OOptions
from harness.backends.knorm import KnormOptions, KnormPolicy
from harness.kv.base import Demand, StepScores
from harness.kv.compressed import CompressedIndex, CompressedPrefix, fingerprint
from harness.kv.evicting import BudgetBlocks, EvictingKVManager
from harness.kv.headwise import HeadwiseKVManager
from harness.kv.policies.duo import DuoPolicy
from harness.kv.policies.h2o import H2OPolicy
from tests.helpers import make_seq

BS, BLOCKS = 4, 12
PROMPT = list(range(100, 120))  # 20 tokens: 5 blocks


def knorm(budget: int = 6) -> EvictingKVManager:
    policy = KnormPolicy(KnormOptions(budget=budget, budget_ratio=0.0))
    return EvictingKVManager(BLOCKS, BS, policy, watermark=0.0, enable_prefix_caching=True)


def prefill(m: EvictingKVManager, seq, n: int | None = None, start: int = 0,
            demand: Demand | None = None) -> list[int]:
    """One prefill step of ``seq`` (``n`` tokens, default the rest): slots taken, its
    sampled token appended, and every position scored by itself (the lowest go first),
    then the manager observes."""
    d = demand if demand is not None else Demand(seq, n or seq.num_uncomputed)
    assert m.can_allocate([d], watermark=False)
    slots = m.allocate_group([d])[0]
    seq.num_computed += d.num_hit_tokens(BS) + d.num_tokens
    seq.compressed_prefix = seq.compressed_prefix or d.compressed
    if seq.num_computed == len(seq.token_ids):
        seq.token_ids.append(7)  # the step samples its next token
    m.end_forward()
    pos = np.arange(seq.num_computed - len(slots), seq.num_computed, dtype=np.float64)
    m.observe([seq], StepScores(np.asarray(slots, dtype=np.int64), pos))
    return slots


def decode(m: EvictingKVManager, seq) -> None:
    slot = m.append_slot(seq)
    assert slot is not None
    seq.num_computed += 1
    seq.token_ids.append(8)
    m.end_forward()
    m.observe([seq], None)


def positions(m: EvictingKVManager, seq) -> list[int]:
    return sorted(m.live_slots(seq)[1].tolist())


def test_a_later_turn_starts_from_the_compressed_state_and_keeps_the_rest() -> None:
    m = knorm()
    a = make_seq(PROMPT, max_tokens=4)
    prefill(m, a)
    # The selection at the prompt's end: the 6 highest-scored positions, in 2 blocks.
    assert positions(m, a) == list(range(14, 20)) and len(m.table_of(a)) == 2
    decode(m, a)  # position 20 fills a hole of the second block
    blocks = m.table_of(a)
    m.take_cache_ops()  # (the steps' own)
    m.free(a)  # it ends: 21 tokens computed (its last sampled one never is), marked at 20
    pool = m.pool
    assert pool.num_cached_free == 2 and pool.num_free == BLOCKS  # cached, and free to take
    (p,) = [m.index.lookup(a.token_ids, 21, None)]
    assert p is not None and (p.covered, p.marks, p.blocks) == (21, (20,), blocks)
    assert [pool.block_hash[b] for b in blocks] == CompressedIndex.block_names(p)
    assert m.take_cache_ops().invalidated == []  # its slots keep their positions

    # The next turn: the same 22 tokens and 3 more. All but its last token are looked up;
    # the state stands for the 21 computed ones.
    b = make_seq([*a.token_ids, 50, 51], max_tokens=4)
    hit = m.lookup_prefix(b)
    assert (hit.blocks, hit.compressed, hit.num_tokens(BS)) == (blocks, 21, 21)
    d = Demand.after(b, len(b.token_ids) - 21, hit)
    # 2 cached blocks revived for the copy, and the blocks its 10 tokens fill: 3.
    assert m.blocks_needed([d]) == 2 + 3
    slots = prefill(m, b, demand=d)
    new = m.table_of(b)
    assert not set(new) & set(blocks) and len(new) == 3
    # Positions: the kept 14..20, then 21..23 (the first into the state's one hole).
    assert positions(m, b) == [*range(14, 21), 21, 22, 23]
    assert slots[0] // BS in new[:2] and slots[1] // BS == slots[2] // BS == new[2]
    st = m._seqs[b.seq_id]
    assert isinstance(st, BudgetBlocks) and (st.carried, st.marks) == (21, (20,))
    # Not compressed again (its budget would keep 6): everything held, and decodes too.
    decode(m, b)
    assert m.held_tokens(b) == 7 + 3 + 1 and m.stats.evicted_tokens == 14
    assert (m.stats.prefix_hit_tokens, b.group.prefix_hit_tokens) == (21, 21)
    # The source blocks went back to the cache at the step's end, still named.
    assert pool.ref[blocks[0]] == pool.ref[blocks[1]] == 0
    assert m.index.lookup(a.token_ids, 21, None) is p


def test_the_hit_copies_whole_blocks_before_its_step() -> None:
    m = knorm()
    a = make_seq(PROMPT, max_tokens=4)
    prefill(m, a)
    decode(m, a)
    blocks = m.table_of(a)
    m.free(a)
    m.take_cache_ops()
    b = make_seq([*a.token_ids, 50], max_tokens=4)
    d = Demand.after(b, 2, m.lookup_prefix(b))
    m.allocate_group([d])
    ops = m.take_cache_ops()
    new = m.table_of(b)
    assert [(c.src, c.dst, c.num_slots, c.move) for c in ops.copies] == [
        (blocks[0] * BS, new[0] * BS, BS, False), (blocks[1] * BS, new[1] * BS, BS, False)]
    assert [m.pool.ref[x] for x in blocks] == [1, 1]  # held until the step's end
    src = np.concatenate([np.arange(x * BS, x * BS + BS) for x in blocks])
    dst = np.concatenate([np.arange(x * BS, x * BS + BS) for x in new[:2]])
    kept = m._pos[src] >= 0  # the copies' positions (the new tokens took the one hole)
    assert np.array_equal(m._pos[dst][kept], m._pos[src][kept])
    assert sorted(m._pos[dst][~kept].tolist()) == [21]


def test_a_full_pool_evicts_the_state_and_invalidates_its_slots() -> None:
    m = knorm()
    a = make_seq(PROMPT, max_tokens=4)
    prefill(m, a)
    blocks = m.table_of(a)
    m.free(a)  # kept (computed 20 of 21 tokens)
    m.take_cache_ops()
    assert len(m.index) == 1
    # 12 blocks' worth of prompt: the 10 plain free blocks, then the 2 cached ones.
    c = make_seq(list(range(500, 548)), max_tokens=1)
    d = Demand(c, 48)
    assert m.can_allocate([d], watermark=False)
    m.allocate_group([d])
    ops = m.take_cache_ops()
    # The kept tokens' slots hold nothing from now on (the backend clears them before the
    # step writes there).
    assert len(ops.invalidated) == 6 and {s // BS for s in ops.invalidated} == set(blocks)
    assert len(m.index) == 0
    assert m.lookup_prefix(make_seq([*a.token_ids, 1], max_tokens=2)).compressed == 0


def test_a_preempted_sequence_finds_its_own_state() -> None:
    m = knorm()
    a = make_seq(PROMPT, max_tokens=8)
    prefill(m, a)
    decode(m, a)
    decode(m, a)
    m.free(a)  # preempted (recompute): its 22 computed tokens are kept
    a.num_computed = a.compressed_prefix = 0
    hit = m.lookup_prefix(a)
    assert hit.compressed == 22  # every token but its last, never computed
    prefill(m, a, demand=Demand.after(a, 1, hit))
    assert (m.stats.self_hit_tokens, m.stats.prefix_hit_tokens) == (22, 0)
    assert m.held_tokens(a) == 6 + 2 + 1


def test_other_parameters_or_methods_name_the_same_tokens_otherwise() -> None:
    tokens, marks = [*PROMPT, 7], (20,)
    names = set()
    for params in ({"budget": 6}, {"budget": 5}, {"budget": 6, "pool_width": 3}):
        idx = CompressedIndex(fingerprint("knorm", params), BS)
        names.add(idx.name_of(tokens, 21, marks, None)[0])
    idx = CompressedIndex(fingerprint("keydiff", {"budget": 6}), BS)
    names.add(idx.name_of(tokens, 21, marks, None)[0])
    assert len(names) == 4
    # And within one method: other marks, another covered length, another extra key.
    idx = CompressedIndex(fingerprint("knorm", {"budget": 6}), BS)
    assert len({idx.name_of(tokens, 21, (20,), None)[0],
                idx.name_of(tokens, 21, (12,), None)[0],
                idx.name_of(tokens, 20, (20,), None)[0],
                idx.name_of(tokens, 21, (20,), "lora")[0]}) == 4
    # The fingerprint is a function of its inputs, not of the process (blake2b).
    assert fingerprint("knorm", {"budget": 6, "x": [1, 2]}) == fingerprint(
        "knorm", {"x": (1, 2), "budget": 6})
    assert knorm(6).index.root != knorm(5).index.root


def test_the_index_finds_the_longest_prefix_within_the_limit() -> None:
    idx = CompressedIndex(fingerprint("m", {}), BS)
    toks = list(range(30))

    def add(covered: int) -> CompressedPrefix:
        name, chain, tail = idx.name_of(toks, covered, (covered,), None)
        p = CompressedPrefix(name, chain, tail, covered, (covered,), 0, [covered])
        idx.add(p)
        return p

    p9, p14, p3 = add(9), add(14), add(3)
    assert idx.lookup(toks, 29, None) is p14
    assert idx.lookup(toks, 13, None) is p9
    assert idx.lookup(toks, 8, None) is p3
    assert idx.lookup(toks[:10] + [99] * 20, 29, None) is p9  # differs at position 10
    assert idx.lookup([5, *toks[1:]], 29, None) is None
    idx.remove(p14)
    assert idx.lookup(toks, 29, None) is p9 and len(idx) == 2
    idx.remove(p9)
    idx.remove(p3)
    assert idx.lookup(toks, 29, None) is None and not idx._passing


def test_h2o_rescoring_every_step_keeps_nothing() -> None:
    m = EvictingKVManager(BLOCKS, BS, H2OPolicy(H2OOptions(budget=8, budget_ratio=0.0)),
                          watermark=0.0, enable_prefix_caching=True)
    assert not m.enable_prefix_caching
    a = make_seq(PROMPT, max_tokens=4)
    prefill(m, a, n=8)
    prefill(m, a)
    m.free(a)
    assert m.pool.num_cached_free == 0
    assert m.lookup_prefix(make_seq([*a.token_ids, 1])).blocks == []


def test_per_head_tables_keep_the_pages_and_evict_them_under_pressure() -> None:
    """harness.kv.headwise: duo's rule on one layer of 2 KV heads (head 0 streams: 2 sinks
    + 4 recent of a 20-token prompt; head 1 keeps all), 10 blocks of 4 (20 pages)."""
    policy = DuoPolicy(1, 2, head_ratio=0.5, sink=2, recent=4)
    m = HeadwiseKVManager(10, BS, 2, policy, watermark=0.0, enable_prefix_caching=True)
    a = make_seq(PROMPT, max_tokens=4)
    m.allocate_group([Demand(a, 20)])
    a.num_computed = 20
    a.token_ids.append(7)
    m.end_forward()
    m.observe([a], None)
    assert [p.tolist() for p in m.positions(a)] == [[0, 1, 16, 17, 18, 19], list(range(20))]
    m.append_slot(a)  # position 20 in both heads: 7 and 21 tokens, 2 + 6 pages
    a.num_computed += 1
    a.token_ids.append(8)
    m.end_forward()
    pages = [list(pg) for pg in m._seqs[a.seq_id].pages]
    m.take_cache_ops()  # (the selection's moves: its steps')
    free_before = m.pages_free()
    m.free(a)
    assert m.pages_free() == free_before + 8  # kept, and counted free to take
    b = make_seq([*a.token_ids, 50], max_tokens=4)
    hit = m.lookup_prefix(b)
    assert hit.compressed == 21 and hit.blocks == pages[0] + pages[1]
    d = Demand.after(b, 2, hit)
    assert m._need(d) == 2 * 8 + 1  # held, copied, and head 0's 9th token opens a page
    assert m.can_allocate([d], watermark=False)
    m.allocate_group([d])
    b.num_computed, b.compressed_prefix = 23, 21
    ops = m.take_cache_ops()
    assert [(c.src // BS, c.num_slots, c.share) for c in ops.copies] == [
        (pg, BS, 0.5) for pg in pages[0] + pages[1]]
    assert [p.tolist() for p in m.positions(b)] == [[0, 1, 16, 17, 18, 19, 20, 21, 22],
                                                    list(range(23))]
    m.end_forward()
    m.free(b)  # its own state (marks of a's) kept too: 3 + 6 pages
    assert len(m.index) == 2
    # 17 pages kept, 3 free: a 32-token prompt's 16 pages evict both, oldest first.
    c = make_seq(list(range(500, 532)), max_tokens=1)
    assert m.pages_free() == 20 and m.can_allocate([Demand(c, 32)], watermark=False)
    m.allocate_group([Demand(c, 32)])
    assert len(m.index) == 0 and m.pages_free() == 4
