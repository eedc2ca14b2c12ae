"""The per-head tables (harness.kv.headwise) under forks, page reuse and release: a fork's
selection copies what it keeps of shared pages into fresh ones and leaves the shared
ones to its sibling, which then compacts in place; freed pages of a partly held block go
to the next allocation before a fresh block; the books (page references, fills, block
fills, free pages) always equal a recount from the tables; everything goes back."""

from __future__ import annotations

import numpy as np

from harness.kv.headwise import HeadwiseKVManager
from harness.sched.sequence import SeqStatus, Sequence
from tests.backend_steps import Driver
from tests.backends.headwise_ref import check_books, check_decode, prefill_recording

BS = 8
OPTS = {"budget": 20, "budget_ratio": 0.0, "window": 8, "beta": 2}


def _fork(d: Driver, parent: Sequence, seq_id: int) -> Sequence:
    """A child of ``parent`` as the scheduler forks one: the same tokens and computed
    count, sharing every page; its K/V are the parent's for the prompt, its own after."""
    child = Sequence(seq_id, parent.group, list(parent.token_ids))
    child.num_prompt_tokens = parent.num_prompt_tokens
    child.num_computed = parent.num_computed
    child.status = SeqStatus.RUNNING
    parent.group.seqs.append(child)
    d.kv.fork(parent, child)
    p = parent.num_computed
    d.k[seq_id], d.v[seq_id] = d.k[parent.seq_id].clone(), d.v[parent.seq_id].clone()
    d.k[seq_id][:, p:] = d.randn(*d.k[seq_id][:, p:].shape)
    d.v[seq_id][:, p:] = d.randn(*d.v[seq_id][:, p:].shape)
    return child


def test_a_fork_at_the_prompt_end_selects_into_fresh_pages_then_in_place() -> None:
    d = Driver("pyramidkv", block_size=BS, options=OPTS, seed=5)
    kv = d.kv
    assert isinstance(kv, HeadwiseKVManager)
    parent = d.add(60, max_tokens=6)
    prefill_recording(d, parent, [60], observe=False)
    child = _fork(d, parent, 100)  # forked at the sampling, before the policy acts
    check_books(kv, [parent, child])
    shared = set(np.concatenate([np.asarray(p) for p in kv._seqs[parent.seq_id].pages]))
    kv.observe([parent], d.last_scores)
    mine = set(np.concatenate([np.asarray(p) for p in kv._seqs[parent.seq_id].pages]))
    assert not mine & shared  # every page it kept is a fresh copy
    assert kv.held_tokens(child) == 60 * kv.heads  # the sibling still holds all of it
    check_books(kv, [parent, child])
    out = d.step([(parent, 1), (child, 1)], observe=False)
    check_decode(d, parent, out)
    check_decode(d, child, out)
    kv.observe([parent, child], d.last_scores)
    # The sibling's pages were its own by then: compacted in place, no fresh page taken.
    theirs = set(np.concatenate([np.asarray(p) for p in kv._seqs[child.seq_id].pages]))
    assert theirs <= shared
    for a, b in zip(kv.positions(parent), kv.positions(child)):
        assert sorted(a.tolist()) == sorted(b.tolist())  # the same scores and selection
    check_books(kv, [parent, child])
    for _ in range(3):
        out = d.step([(parent, 1), (child, 1)])
        check_decode(d, parent, out)
        check_decode(d, child, out)
    check_books(kv, [parent, child])
    kv.free(parent)
    kv.free(child)
    check_books(kv, [])
    assert kv.pool.num_free == kv.pool.num_blocks and not kv.ref.any()


def test_a_fork_after_the_selection_copies_each_heads_shared_last_page() -> None:
    d = Driver("pyramidkv", block_size=BS, options=OPTS, seed=6)
    kv = d.kv
    assert isinstance(kv, HeadwiseKVManager)
    parent = d.add(60, max_tokens=6)
    prefill_recording(d, parent, [60])
    child = _fork(d, parent, 101)
    partial = int((kv._seqs[parent.seq_id].count % BS > 0).sum())
    before = kv.stats.cow_copies
    out = d.step([(parent, 1), (child, 1)])
    # The first writer of each partly filled shared last page copies it; the second
    # writes the original, its own by then.
    assert kv.stats.cow_copies - before == partial > 0
    check_decode(d, parent, out)
    check_decode(d, child, out)
    check_books(kv, [parent, child])


def test_freed_pages_are_reused_before_a_fresh_block() -> None:
    d = Driver("pyramidkv", block_size=BS, num_blocks=16, options=OPTS, seed=7)
    kv = d.kv
    assert isinstance(kv, HeadwiseKVManager)
    a = d.add(64, max_tokens=4)
    prefill_recording(d, a, [64])  # 8 blocks, then most of each head's pages freed
    held = kv.pool.num_used
    assert kv.num_free_pages > 0 and held < 8
    b = d.add(8, max_tokens=4)
    d.step([(b, 8)])  # 4 pages (one per head): from the freed ones, no fresh block
    assert kv.pool.num_used == held
    check_books(kv, [a, b])


def test_usage_counts_a_block_held_while_any_page_is() -> None:
    d = Driver("pyramidkv", block_size=BS, options=OPTS, seed=8)
    kv = d.kv
    assert isinstance(kv, HeadwiseKVManager)
    s = d.add(60, max_tokens=4)
    prefill_recording(d, s, [60])
    u = kv.usage()
    pages_held = int((kv.ref > 0).sum())
    blocks = {p // kv.heads for p in np.flatnonzero(kv.ref)}
    assert u.held_blocks == len(blocks) and u.reserved_slots == len(blocks) * BS
    assert pages_held < len(blocks) * kv.heads  # partly freed blocks among them
    assert u.used_slots <= kv.held_tokens(s) // kv.heads
