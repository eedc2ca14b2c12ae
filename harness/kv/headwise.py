"""Per-head tables over one block pool: the KV manager of the methods whose heads keep
different tokens (pyramidkv: per-layer budgets; adakv: per-head budgets; duo_attention:
streaming heads keep sinks + a window), freeing what each head drops.

A *head* is one KV head of one layer (``layer * num_kv_heads + kv_head``). A pool block is
``block_size`` tokens of every head, as paged's, and is cut into ``heads`` *pages*: page
``block * heads + i`` holds ``block_size`` tokens of any one head (the backend's cache is
one tensor of pages, ``(blocks * heads, block_size, head_dim)`` for K and for V). Each
sequence holds a table of pages per head, dense: head h's i-th token sits at index i, in
page ``pages[h][i // block_size]``. New tokens are appended to every head; before its
selection a head's index is the token's position. When a prompt's prefill ends the
policy (harness.kv.policies.headwise) says what each head keeps; the manager moves each
head's kept tokens into its first ``ceil(kept / block_size)`` pages (one-slot moves in
the step record, sources and destinations disjoint) and gives the other pages back. A
fork shares pages (reference counts per page); a shared page is never written: a
selection copies what it keeps of one into a fresh page, a decode copies a shared, partly
filled last page first.

How a partly freed block is counted: a block is held (``reserved``, in steps.csv and the
ledger) while any of its pages is, whole; a free page inside a held block is handed out
before a fresh block is taken, so freed pages are memory other sequences use at once, and
the block goes back to the pool when its last page does. A block's ``used`` slots are
the tokens its pages hold over all heads, divided by the heads (rounded down); a page is
``used`` only in the slots holding a token. Slots (``total_slots`` and the rest) are
tokens of every head, as for every backend; ``held_tokens`` is in head-tokens (one per
token a head holds), what the declared reads need (backends.costs.HeadwiseCosts).

Compressed prefixes (harness.kv.compressed; ``enable_prefix_caching``): when a sequence
whose prompt was compressed ends, its pages stay held by the manager's cache under the
prefix's name instead of going back (a page belongs to one sequence's head, and a block
holds pages of several sequences, so the pool's own cache of freed blocks cannot hold
them): in held blocks, counted reserved and used as when the sequence held them, and
free to take (:meth:`pages_free`), the least recently used prefix evicted first when
an allocation needs its pages. A prompt that hits one copies its pages (each head's, whole
pages) into pages of its own and starts from its counts and kept positions; it is not
compressed again.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from itertools import chain
from typing import TYPE_CHECKING

import numpy as np

from harness.kv.base import CacheOps, CopyOp, Demand, KVStats, KVUsage, PrefixHit, StepScores
from harness.kv.block_pool import BlockPool
from harness.kv.compressed import CompressedIndex, CompressedPrefix, index_for
from harness.kv.ledger import ReservationLedger
from harness.kv.paged import cdiv
from harness.kv.policies.headwise import HeadPolicy

if TYPE_CHECKING:
    from harness.sched.sequence import Sequence


def _cdiv(a: np.ndarray, b: int) -> np.ndarray:
    return -(-a // b)


@dataclass(slots=True)
class HeadTables:
    """One sequence's pages: ``pages[h]`` head h's, in index order; ``count[h]`` the tokens
    it holds (int64 (heads,)); after the selection, ``kept[h]`` the positions of head h's
    first ``len(kept[h])`` indices (the prompt it kept, and what was computed past the
    prompt then), every index after them the next position in order."""

    pages: list[list[int]]
    count: np.ndarray
    kept: list[np.ndarray] | None = None
    computed_at_selection: int = 0  # positions past it follow ``kept`` in order
    deferred: int = field(default=0)  # selections put off (no fresh page for a shared one)
    marks: tuple[int, ...] = ()  # where it was compressed (or the prefix it hit was)
    carried: int = 0  # tokens of the compressed prefix it started from (0: none)

    @property
    def selected(self) -> bool:
        return self.kept is not None


@dataclass(slots=True, frozen=True)
class KeptPages:
    """A kept compressed prefix's tables: each head's pages, counts, kept positions and
    the position its selection was made at (HeadTables' fields, frozen)."""

    pages: tuple[tuple[int, ...], ...]
    count: np.ndarray
    kept: tuple[np.ndarray, ...]
    computed_at_selection: int


class HeadwiseKVManager:
    """A :class:`~harness.kv.base.KVManager` with a table of pages per (layer, KV head)
    (module docstring). ``policy`` decides what each head keeps of a prompt."""

    supports_swap = False

    def __init__(self, num_blocks: int, block_size: int, heads: int, policy: HeadPolicy, *,
                 watermark: float = 0.01, enable_prefix_caching: bool = False) -> None:
        assert policy.heads == heads, (policy.heads, heads)
        self.block_size, self.heads, self.policy = block_size, heads, policy
        self.ledger = ReservationLedger()
        self.pool = BlockPool(num_blocks, block_size, self.ledger)
        self.stats = KVStats()
        self.watermark_blocks = max(1, int(watermark * num_blocks)) if watermark > 0 else 0
        self.watermark_slots = self.watermark_blocks * block_size
        n = num_blocks * heads
        self.ref = np.zeros(n, dtype=np.int64)  # holders of each page
        self.fill = np.zeros(n, dtype=np.int64)  # tokens each page holds
        self._live = np.zeros(num_blocks, dtype=np.int64)  # head-tokens each block holds
        self._told = np.zeros(num_blocks, dtype=np.int64)  # its fill in the pool's books
        self._free: list[int] = []  # free pages of held blocks (stale entries skipped)
        self._is_free = np.zeros(n, dtype=bool)
        self._block_free = np.zeros(num_blocks, dtype=np.int64)
        self.num_free_pages = 0
        self._extra_refs = 0  # sum over held pages of (ref - 1): what sharing saves
        self._shared_pages = 0
        self._seqs: dict[int, HeadTables] = {}
        self._ops = CacheOps()
        policy.reset(n * block_size)
        # Compressed prefixes (module docstring): the index (made at first use: duo's
        # heads are measured after the stack is built), the kept ones least recently used
        # first, their pages, the first page of each (a hit's key), this step's sources.
        self.enable_prefix_caching = enable_prefix_caching and policy.compresses_once
        self._index: CompressedIndex | None = None
        self._kept: OrderedDict[int, CompressedPrefix] = OrderedDict()
        self._kept_pages = 0
        self._prefix_of: dict[int, CompressedPrefix] = {}
        self._busy: dict[int, CompressedPrefix] = {}

    @property
    def index(self) -> CompressedIndex:
        if self._index is None:
            self._index = index_for(self.policy.name, self.policy.params(), self.block_size)
        return self._index

    # -- pages -----------------------------------------------------------------------
    def pages_free(self) -> int:
        """Pages an allocation can take now: free pages of held blocks + free blocks' +
        the kept compressed prefixes' (evicted for them), but this step's hits'."""
        busy = sum(len(p.blocks) for p in self._busy.values())
        return self.num_free_pages + self.pool.num_free * self.heads + self._kept_pages - busy

    def _take(self, n: int) -> list[int]:
        """``n`` pages (the caller checked :meth:`pages_free`), each held once; kept
        compressed prefixes evicted, least recently used first, when the free pages and
        blocks are short."""
        h = self.heads
        while n > self.num_free_pages + self.pool.num_free * h:
            victim = next(p for p in self._kept.values() if p.name not in self._busy)
            self._evict(victim)
        short = n - self.num_free_pages
        if short > 0:  # fresh blocks, their pages handed out lowest first
            for b in self.pool.allocate_all(cdiv(short, h)):
                pages = range(b * h + h - 1, b * h - 1, -1)
                self._free += pages
                self._is_free[b * h:(b + 1) * h] = True
                self._block_free[b] = h
                self.num_free_pages += h
        out: list[int] = []
        while len(out) < n:
            p = self._free.pop()
            if not self._is_free[p]:
                continue  # its block went back to the pool since
            self._is_free[p] = False
            self._block_free[p // h] -= 1
            out.append(p)
        self.num_free_pages -= n
        self.ref[out] = 1
        return out

    def _release(self, pages: np.ndarray) -> None:
        """Drop one reference to each of ``pages`` (distinct); a page nobody holds is free
        (its tokens gone), and a block whose last page that was goes back to the pool."""
        if not len(pages):
            return
        h, ref = self.heads, self.ref
        ref[pages] -= 1
        r = ref[pages]
        self._extra_refs -= int((r >= 1).sum())
        self._shared_pages -= int((r == 1).sum())
        gone = pages[r == 0]
        if not len(gone):
            return
        filled = gone[self.fill[gone] > 0]
        if len(filled):
            self._add_fill(filled, -self.fill[filled])
        self._free += gone.tolist()
        self._is_free[gone] = True
        self.num_free_pages += len(gone)
        blocks = gone // h
        np.add.at(self._block_free, blocks, 1)
        ub = np.unique(blocks)
        for b in ub[self._block_free[ub] == h].tolist():  # a block's last page: it goes
            self._is_free[b * h:(b + 1) * h] = False
            self._block_free[b] = 0
            self.num_free_pages -= h
            self.pool.release(b)
        if len(self._free) > 4 * (self.num_free_pages + h):
            # The released blocks' entries are stale: drop them (and repeats).
            self._free = [q for q in dict.fromkeys(self._free) if self._is_free[q]]

    def _add_fill(self, pages: np.ndarray, delta: np.ndarray | int) -> None:
        """``pages`` hold ``delta`` more tokens each; their blocks' fills follow (the
        block pool's and the ledger's: head-tokens / heads, rounded down)."""
        np.add.at(self.fill, pages, delta)
        blocks = pages // self.heads
        np.add.at(self._live, blocks, delta)
        ub = np.unique(blocks)
        want = self._live[ub] // self.heads
        pool, told = self.pool, self._told
        for b, w in zip(ub[want != told[ub]].tolist(), want[want != told[ub]].tolist()):
            if w > told[b]:
                pool.set_fill(b, w)
            else:
                pool.unfill(b, int(told[b]) - w)
            told[b] = w

    # -- the KVManager protocol: admission -------------------------------------------
    def slots_needed(self, prompt_len: int, max_tokens: int, n: int) -> int:
        """Paged's count: the prompt's full blocks once, each sample's tail (a head never
        holds more than every token; a fork's selection may briefly need fresh pages for
        what it keeps of shared ones, and waits for them)."""
        bs = self.block_size
        return (prompt_len // bs + n * cdiv(prompt_len % bs + max_tokens, bs)) * bs

    def admission_error(self, prompt_len: int, max_tokens: int, n: int) -> str | None:
        need = self.slots_needed(prompt_len, max_tokens, n) // self.block_size
        if need > self.pool.num_blocks:
            return (f"needs {need} blocks of {self.block_size} tokens (prompt {prompt_len} + "
                    f"max_tokens {max_tokens}, n={n}) but the whole pool has "
                    f"{self.pool.num_blocks}: raise cache.kv_budget or lower max_tokens")
        return None

    def reservation_size(self, prompt_len: int, max_tokens: int) -> int:
        return self.block_size

    def lookup_prefix(self, seq: Sequence) -> PrefixHit:
        """The longest kept compressed prefix of ``seq``'s tokens (all but its last)."""
        if not self.enable_prefix_caching or self.holds(seq):
            return PrefixHit()
        p = self.index.lookup(seq.token_ids, len(seq.token_ids) - 1, seq.group.extra_key)
        return PrefixHit() if p is None else PrefixHit(list(p.blocks), compressed=p.covered)

    def max_chunk(self, seq: Sequence) -> int | None:
        return None

    def _need(self, d: Demand) -> int:
        """Pages ``d`` takes: every head's new pages, and a copy of each shared, partly
        filled last page it writes."""
        st, bs = self._seqs.get(d.seq.seq_id), self.block_size
        if d.compressed:
            # A hit: its prefix's pages, which pages_free counts as free to evict but the hit
            # holds through its step; their copies; the new tokens' pages after them.
            kp = self._prefix_of[d.hit_blocks[0]].state
            assert isinstance(kp, KeptPages)
            c = kp.count
            new = int((_cdiv(c + d.num_tokens, bs) - _cdiv(c, bs)).sum())
            return 2 * len(d.hit_blocks) + new
        if st is None:
            return self.heads * cdiv(d.num_tokens, bs)
        c = st.count
        need = int((_cdiv(c + d.num_tokens, bs) - _cdiv(c, bs)).sum())
        part = np.flatnonzero(c % bs)
        if len(part):
            last = np.asarray([st.pages[h][-1] for h in part.tolist()], dtype=np.int64)
            need += int((self.ref[last] > 1).sum())
        return need

    def can_allocate(self, demands: list[Demand], watermark: bool) -> bool:
        limit = self.pages_free() - (self.watermark_blocks * self.heads if watermark else 0)
        return sum(self._need(d) for d in demands) <= limit

    def allocate_group(self, demands: list[Demand]) -> list[list[int]]:
        if self.enable_prefix_caching:
            for d in demands:
                if not self.holds(d.seq):
                    self.stats.prefix_query_tokens += d.seq.num_tokens
            hits = [d for d in demands if d.compressed]
            for d in hits:  # no page taken this step may evict them
                p = self._prefix_of[d.hit_blocks[0]]
                self._busy[p.name] = p
                self._kept.move_to_end(p.name)
            for d in hits:
                self._start_from(d)
        return [self._extend(d.seq, d.num_tokens) for d in demands]

    # -- compressed prefixes (harness.kv.compressed) -----------------------------------
    def _start_from(self, d: Demand) -> None:
        """``d.seq`` starts from a copy of the kept prefix its hit names: each head's pages
        copied whole into fresh ones, its counts, kept positions and marks."""
        seq, p, bs, h = d.seq, self._prefix_of[d.hit_blocks[0]], self.block_size, self.heads
        kp = p.state
        assert isinstance(kp, KeptPages) and seq.seq_id not in self._seqs
        fresh = iter(self._take(len(p.blocks)))
        pages = [[next(fresh) for _ in src] for src in kp.pages]
        src = np.asarray(p.blocks, dtype=np.int64)
        dst = np.fromiter(chain.from_iterable(pages), dtype=np.int64, count=len(src))
        self._ops.copies += [CopyOp(s * bs, t * bs, bs, share=1.0 / h)
                             for s, t in zip(src.tolist(), dst.tolist())]
        self._add_fill(dst, self.fill[src])
        self._seqs[seq.seq_id] = HeadTables(pages, kp.count.copy(), [k.copy() for k in kp.kept],
                                            kp.computed_at_selection, marks=p.marks,
                                            carried=p.covered)
        if p.owner == seq.group.request_id:
            self.stats.self_hit_tokens += p.covered
        else:
            self.stats.prefix_hit_tokens += p.covered
            seq.group.prefix_hit_tokens += p.covered

    def _keep_prefix(self, seq: Sequence, st: HeadTables) -> bool:
        """As ``seq`` ends: keep its tables as a compressed prefix (the manager holds its
        pages) if its prompt was compressed, it is its request's only sequence, it holds
        its pages alone and the same state is not kept already."""
        pages = np.fromiter(chain.from_iterable(st.pages), dtype=np.int64)
        if (not self.enable_prefix_caching or not st.marks or st.kept is None
                or not len(pages) or len(seq.group.seqs) != 1
                or seq.num_computed < seq.num_prompt_tokens or (self.ref[pages] != 1).any()):
            return False
        index, covered = self.index, seq.num_computed
        name, chain_, tail = index.name_of(seq.token_ids, covered, st.marks,
                                           seq.group.extra_key)
        if index.get(name) is not None:
            return False
        kp = KeptPages(tuple(tuple(pg) for pg in st.pages), st.count.copy(), tuple(st.kept),
                       st.computed_at_selection)
        p = CompressedPrefix(name, chain_, tail, covered, st.marks, seq.group.request_id,
                             pages.tolist(), kp)
        index.add(p)
        self._kept[name] = p
        self._kept_pages += len(pages)
        self._prefix_of[p.blocks[0]] = p
        return True

    def _evict(self, p: CompressedPrefix) -> None:
        """Give a kept prefix's pages back (its name goes with them)."""
        self.index.remove(p)
        del self._kept[p.name]
        del self._prefix_of[p.blocks[0]]
        self._kept_pages -= len(p.blocks)
        self._release(np.asarray(p.blocks, dtype=np.int64))

    def append_slot(self, seq: Sequence) -> int | None:
        if self._need(Demand(seq, 1)) > self.pages_free():
            return None
        return self._extend(seq, 1)[0]

    def _extend(self, seq: Sequence, n: int) -> list[int]:
        """Append ``n`` tokens to every head of ``seq``; returns their slots in head 0
        (distinct across a step's tokens: what the step record carries; the backend
        reads every head's from the tables)."""
        st = self._seqs.get(seq.seq_id)
        h, bs = self.heads, self.block_size
        if st is None:
            st = self._seqs[seq.seq_id] = HeadTables([[] for _ in range(h)],
                                                    np.zeros(h, dtype=np.int64))
        c = st.count
        last = np.fromiter((pg[-1] if pg else -1 for pg in st.pages), dtype=np.int64,
                           count=h)
        # Never write a shared page: a head whose partly filled last page is shared (a
        # fork's) copies the filled part into a page of its own first.
        for i in np.flatnonzero((c % bs > 0) & (self.ref[last] > 1)).tolist():
            new = self._take(1)[0]
            filled = int(c[i] % bs)
            self._ops.copies.append(CopyOp(int(last[i]) * bs, new * bs, filled,
                                           share=1.0 / h))
            self._add_fill(np.asarray([new]), filled)
            self._release(last[i:i + 1])
            st.pages[i][-1] = new
            last[i] = new
            self.stats.cow_copies += 1
        new_pages = _cdiv(c + n, bs) - _cdiv(c, bs)
        if n == 1:  # a decode: one token in every head's last page, some of them new
            opening = np.flatnonzero(new_pages)
            for i, p in zip(opening.tolist(), self._take(len(opening))):
                st.pages[i].append(p)
                last[i] = p
            self._add_fill(last, 1)
        else:
            fresh = iter(self._take(int(new_pages.sum())))
            written: list[int] = []
            amounts: list[int] = []
            for i in range(h):
                pages = st.pages[i]
                for _ in range(int(new_pages[i])):
                    pages.append(next(fresh))
                first, ci = int(c[i]), int(c[i])
                while first < ci + n:  # the tokens [c, c + n) page by page
                    stop = min((first // bs + 1) * bs, ci + n)
                    written.append(pages[first // bs])
                    amounts.append(stop - first)
                    first = stop
            self._add_fill(np.asarray(written, dtype=np.int64),
                           np.asarray(amounts, dtype=np.int64))
        start = int(c[0])
        st.count = c + n
        p0 = st.pages[0]
        return [p0[j // bs] * bs + j % bs for j in range(start, start + n)]

    # -- sharing and release ----------------------------------------------------------
    def fork(self, parent: Sequence, child: Sequence) -> None:
        src = self._seqs.get(parent.seq_id)
        if src is None:
            return
        pages = np.fromiter(chain.from_iterable(src.pages), dtype=np.int64)
        self._shared_pages += int((self.ref[pages] == 1).sum())
        self._extra_refs += len(pages)
        np.add.at(self.ref, pages, 1)
        self._seqs[child.seq_id] = HeadTables(
            [list(p) for p in src.pages], src.count.copy(),
            None if src.kept is None else [k.copy() for k in src.kept],
            src.computed_at_selection, marks=src.marks, carried=src.carried)

    def free(self, seq: Sequence) -> None:
        st = self._seqs.pop(seq.seq_id, None)
        if st is not None and not self._keep_prefix(seq, st):
            self._release(np.fromiter(chain.from_iterable(st.pages), dtype=np.int64))

    def holds(self, seq: Sequence) -> bool:
        st = self._seqs.get(seq.seq_id)
        return st is not None and bool(st.count.any())

    def held_tokens(self, seq: Sequence) -> int:
        """Head-tokens ``seq`` holds: the sum over heads of the tokens each keeps."""
        st = self._seqs.get(seq.seq_id)
        return int(st.count.sum()) if st is not None else 0

    def tables(self, seqs: list[Sequence]) -> list[list[int]]:
        """Per sequence: ``[count_0, ..., count_{heads-1}]`` then every head's pages in head
        order (head h's are ``ceil(count_h / block_size)`` entries after those of the heads
        before it): the form the backend unpacks (backends.headwise)."""
        out = []
        for s in seqs:
            st = self._seqs[s.seq_id]
            out.append(st.count.tolist() + list(chain.from_iterable(st.pages)))
        return out

    def positions(self, seq: Sequence) -> list[np.ndarray]:
        """Each head's held positions in index order (tests and debugging)."""
        st = self._seqs[seq.seq_id]
        out = []
        for i in range(self.heads):
            n = int(st.count[i])
            if st.kept is None:
                out.append(np.arange(n))
                continue
            k, nxt = st.kept[i], st.computed_at_selection
            out.append(np.concatenate([k, np.arange(nxt, nxt + n - len(k))]))
        return out

    # -- the step ----------------------------------------------------------------------
    def take_cache_ops(self) -> CacheOps:
        ops, self._ops = self._ops, CacheOps()
        return ops

    def end_forward(self) -> None:
        self.ledger.now += 1
        self._busy.clear()  # the hits' copies are made

    def record_external(self, next_need: int | None) -> int:
        return 0  # any free page serves any head of any sequence

    def observe(self, seqs: list[Sequence], scores: StepScores | None) -> None:
        """After a step: a sequence whose prompt is computed now (or whose selection waited
        for pages) is compressed once."""
        if scores is not None:
            self.policy.on_scores(scores)
        for seq in seqs:
            st = self._seqs.get(seq.seq_id)
            if st is None or st.selected or seq.num_computed < seq.num_prompt_tokens:
                continue
            if not self.policy.compresses(seq.num_prompt_tokens):
                st.kept = [np.arange(int(c)) for c in st.count]  # (nothing to drop)
                st.computed_at_selection = seq.num_computed
                continue
            self._select(seq, st)

    def _select(self, seq: Sequence, st: HeadTables) -> None:
        """Keep what the policy says of each head's prompt (and everything computed past
        it), moved into the head's first pages; give back the rest."""
        p, bs, h = seq.num_prompt_tokens, self.block_size, self.heads
        c = int(st.count[0])
        assert (st.count == c).all() and c >= p, "before its selection a head holds all"
        tables = [np.asarray(pg, dtype=np.int64) for pg in st.pages]
        idx = np.arange(c)
        slots = np.stack([t[idx // bs] * bs + idx % bs for t in tables])  # (heads, c)
        scores = self.policy.scores[slots[:, :p]] if self.policy.needs_scores else None
        keep = np.ones((h, c), dtype=bool)
        keep[:, :p] = self.policy.keep(p, scores)
        m = keep.sum(axis=1)
        dest = [t[:cdiv(int(k), bs)].copy() for t, k in zip(tables, m)]
        shared = [self.ref[d] > 1 for d in dest]
        fresh_need = sum(int(s.sum()) for s in shared)
        if fresh_need > self.pages_free():
            st.deferred += 1  # retried after a later step (a sibling may free its share)
            return
        # Fresh pages for the shared ones first, before any page goes back, so that no
        # destination is a page this selection still reads from.
        fresh = iter(self._take(fresh_need))
        for d, s in zip(dest, shared):
            for j in np.flatnonzero(s).tolist():
                d[j] = next(fresh)
        src_all: list[np.ndarray] = []
        dst_all: list[np.ndarray] = []
        kept: list[np.ndarray] = []
        for i in range(h):
            mi, k = int(m[i]), keep[i]
            d = dest[i]
            stay = np.flatnonzero(k[:mi])  # kept at their index
            movers = np.flatnonzero(k[mi:]) + mi  # kept past the new count: into holes
            holes = np.flatnonzero(~k[:mi])
            moved_in = stay[shared[i][stay // bs]]  # kept in place in a shared page: copied
            src = np.concatenate([slots[i, moved_in], slots[i, movers]])
            to = np.concatenate([moved_in, holes])
            src_all.append(src)
            dst_all.append(d[to // bs] * bs + to % bs)
            pos = idx[:mi].copy()
            pos[holes] = movers
            kept.append(pos)
        src, dst = np.concatenate(src_all), np.concatenate(dst_all)
        one = 1.0 / self.heads  # a slot is one (layer, KV head) of a token
        self._ops.copies += [CopyOp(s, t, 1, move=True, share=one)
                             for s, t in zip(src.tolist(), dst.tolist())]
        # The books: this sequence's private pages are emptied, its pages past the new
        # counts and its shared ones replaced are given back, the destinations filled.
        mine = np.concatenate(tables)
        mine = mine[self.ref[mine] == 1]
        self._add_fill(mine, -self.fill[mine])
        old = [np.concatenate([t[len(d):], t[:len(d)][s]]) for t, d, s in
               zip(tables, dest, shared)]
        self._release(np.concatenate(old))
        for i, d in enumerate(dest):
            amounts = np.minimum(bs, int(m[i]) - np.arange(len(d)) * bs)
            self._add_fill(d, amounts)
            st.pages[i] = d.tolist()
        self.stats.evicted_tokens += (h * c - int(m.sum())) // h
        st.count = m.astype(np.int64)
        st.kept, st.computed_at_selection = kept, c
        st.marks = (p,)

    # -- accounting --------------------------------------------------------------------
    def usage(self) -> KVUsage:
        """In tokens of every head (slots): blocks held whole while any page is
        (module docstring); ``shared_blocks`` and ``logical_blocks`` count shared pages
        in blocks' worth, rounded up and down."""
        u = self.pool.usage(0)
        u.shared_blocks = cdiv(self._shared_pages, self.heads)
        u.logical_blocks = u.held_blocks + self._extra_refs // self.heads
        return u
