"""Lazy names: a decode lane's filled blocks are named when a name could first be read
(the pool's :class:`~harness.kv.base.DeferredNames` hook).

With prefix caching, every block a decode fills is named by its chained hash
(``PagedKVManager.name_next_block``) so that a later prompt holding the same tokens can
hit it. Under the roofline's decode lanes (lane.py) nearly none of those names
is ever looked up, yet computing them (the block's synthetic ids, a hash, the pool's
index) was the lane's largest per-block cost (issue #24). Here a member's filled blocks
form a :class:`PendingChain` instead: each block carries the chain as its name (so a
release still caches it and an eviction still counts), and the chain's hashes are made,
and entered into the pool's index, only when something could read them.

What could read them, and why nothing else can:

- A chain hangs under its *root*: the hash of the block before its first, which is
  named. Any lookup or naming of a pending block's content must pass the root first (a
  prefix's hashes chain from the start), by a lookup of the root (``BlockPool.lookup``),
  a naming of a copy of it (``BlockPool.name``), or a swapped-out sequence coming back
  with it in its hashes (``PagedKVManager.swap_in``). Each of those materializes the
  chains under that root first.
- A sequence that held the root *before* the chain opened would not pass it again: so a
  chain opens only where its member is the root's only holder (:meth:`LazyNames.may_open`:
  its block's only reference, the only block carrying that name). A sequence preempted by
  recompute looks its prefix up again; a swapped one comes back through ``swap_in``.
- A member that leaves the lane has its chain materialized (its own naming continues
  from its hashes), and so does one whose ids a window's give-back makes
  (``DecodeLane.drops_due``: its next block is then named when it fills).

Materializing registers each chain's blocks in the order they were filled (the lane step,
then running order), chains hanging under the hashes it names included: what stepping one
by one had registered, copies of one content in the same order. A block evicted while
pending is skipped (one by one, its name had come and gone); a chain whose blocks are all
evicted is dropped. The property test of the lane (tests/roofline/test_lane.py) covers it
(identical prompts whose requests decode identical ids, conversations that re-send their
answers).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from harness.kv.paged import PagedKVManager, SeqBlocks

# (request id, first position, count) -> that request's ids at those positions.
TokenFn = Callable[[int, int, int], list[int]]
# (parent hash, a block's tokens, extra key) -> the block's chained hash.
HashFn = Callable[[int, list[int], object], int]


@dataclass(slots=True, eq=False)
class PendingChain:
    """A member's ``n`` filled blocks not named yet, in order: block ``i`` is its block
    table's entry ``first + i``, holds its request's ids at positions
    ``start + i * block_size`` on (the lane's synthetic ids) and was filled at lane step
    ``s0 + i * block_size`` (a member fills a block every ``block_size`` lane steps, and a
    chain ends when its member leaves the lane). ``root``: the (named) hash before the
    first; ``st``: the member's block table record, whose hashes the chain's extend when
    materialized."""

    root: int
    seq_blocks: SeqBlocks
    key: object
    owner: int  # the request: its ids, and who computed the blocks
    start: int
    run_order: int  # its group's run order: fills of one step are named in running order
    uid: int
    first: int
    s0: int
    n: int = 0  # blocks so far
    gone: int = 0  # of them evicted (their names gone)
    closed: bool = False  # materialized or dropped: its member starts a new chain
    done: int = 0  # blocks materialized so far (while materializing)
    prev: int = 0  # the hash of the block before block ``done``


@dataclass(slots=True, eq=False)
class DeadChain:
    """A chain all of whose blocks were evicted while pending (:meth:`LazyNames.dropped`):
    nothing is left to name, but the names its blocks lost are the run's to know (the
    pool's evicted names, ``cache.regret_blocks``): made, compactly, when a lookup passes
    its root, as a live chain's would be."""

    root: int
    key: object
    owner: int
    start: int
    n: int


class LazyNames:
    """The pending chains of one paged KV manager's pool, by root (see the module
    docstring); the pool's :class:`~harness.kv.base.DeferredNames`, installed by the
    lane (``PagedKVManager.set_deferred_names``)."""

    def __init__(self, kv: PagedKVManager, tokens: TokenFn, hash_fn: HashFn) -> None:
        self.kv, self.pool, self.tokens, self.hash_fn = kv, kv.pool, tokens, hash_fn
        # By root: the open chains, and the dead ones (their names made only for the
        # evicted names' record).
        self.pending: dict[int, list[PendingChain | DeadChain]] = {}
        self._uid = 0

    def may_open(self, st: SeqBlocks) -> bool:
        """Whether a chain may start after ``st``'s last named block: ``st``'s sequence
        is the only holder of that name (its block's only reference, and the only block
        carrying it), so no other sequence can name or look up what follows without
        passing the root."""
        hashes = st.hashes
        if not hashes:  # the root would be the empty prefix, which everyone holds
            return False
        b = st.table[len(hashes) - 1]
        return self.pool.ref[b] == 1 and self.pool.sole_copy(hashes[-1]) == b

    def open(self, st: SeqBlocks, key: object, owner: int, start: int,
             ro: int, s0: int) -> PendingChain:
        """A chain after ``st``'s last named block (:meth:`may_open` said yes), whose
        first block is ``st``'s last, filled at lane step ``s0`` (the caller counts it and
        every later one in ``n``, and makes the chain each block's name)."""
        self._uid += 1
        c = PendingChain(st.hashes[-1], st, key, owner, start, ro, self._uid,
                         len(st.table) - 1, s0)
        self.pending.setdefault(c.root, []).append(c)
        return c

    def evicted(self, name: object) -> None:
        """A block of chain ``name`` was evicted: counted on the chain, which is dropped
        once all its blocks are gone."""
        assert isinstance(name, PendingChain), name
        name.gone += 1
        if name.gone == name.n and not name.closed:
            self.dropped(name)

    def dropped(self, c: PendingChain) -> None:
        """Every block of open chain ``c`` was evicted, nothing is left to name (the pool
        counts a chain's evicted blocks in ``gone`` as it drops their names. Only released
        blocks are evicted, and a member releases its blocks when it finishes: no block
        is added to a chain after one of its blocks was evicted)."""
        chains = self.pending[c.root]
        chains.remove(c)
        chains.append(DeadChain(c.root, c.key, c.owner, c.start, c.n))
        c.closed = True

    def materialize(self, roots: list[int]) -> None:
        """Name the blocks of every chain under ``roots`` and, in turn, under the hashes
        those names make, in the order they were filled (see the module docstring)."""
        pending, kv = self.pending, self.kv
        tokens, hash_fn = self.tokens, self.hash_fn
        bs = kv.block_size
        heap: list[tuple[int, int, int, PendingChain]] = []

        def push(root: int) -> None:
            for c in pending.pop(root, ()):
                if isinstance(c, DeadChain):  # its names, as evicted ones
                    h, made = c.root, []
                    for i in range(c.n):
                        h = hash_fn(h, tokens(c.owner, c.start + i * bs, bs), c.key)
                        made.append(h)
                    kv.note_evicted(made)
                    continue
                c.closed = True
                c.done, c.prev = 0, c.root
                heapq.heappush(heap, (c.s0, c.run_order, c.uid, c))

        for r in roots:
            push(r)
        while heap:
            c = heapq.heappop(heap)[3]
            i = c.done
            h = hash_fn(c.prev, tokens(c.owner, c.start + i * bs, bs), c.key)
            # (entered unless evicted while pending; the member's hashes go on)
            kv.enter_deferred(c.seq_blocks, c.seq_blocks.table[c.first + i], c, h, c.owner)
            c.prev, c.done = h, i + 1
            if h in pending:
                push(h)
            if c.done < c.n:
                heapq.heappush(heap, (c.s0 + c.done * bs, c.run_order, c.uid, c))

    def materialize_all(self) -> None:
        """Name every pending block (tests and debugging read the whole index)."""
        self.materialize(list(self.pending))
