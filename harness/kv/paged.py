"""Paged KV manager: block tables, automatic prefix caching, copy-on-write, swap.

The manager owns every sequence's block table (as vLLM v1 keeps ``req_to_blocks``).
Slot of token ``j`` of a sequence: ``table[j // bs] * bs + j % bs``. A full block is named
by a chained hash ``hash((parent_hash, tokens, extra_key))`` so that equal prefixes map to
equal blocks; a new prompt reuses every leading block whose hash is known. Every method
costs O(blocks it touches); nothing scans the pool.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import islice
from typing import TYPE_CHECKING

from harness.kv.base import (
    CacheOps,
    CopyOp,
    DeferredNames,
    Demand,
    KVStats,
    KVUsage,
    PrefixHit,
    StepScores,
)
from harness.kv.block_pool import BlockPool
from harness.kv.ledger import ReservationLedger
from harness.kv.tiers import LowerTiers

if TYPE_CHECKING:
    from harness.kv.groups import GroupedKVManager
    from harness.sched.sequence import Sequence

# Parent hash of a sequence's first block. Any constant works; it only has to be fixed.
_ROOT_HASH = 0x6B76_6265_6E63_68
GIVEN_BACK = -1  # a table entry whose block an eviction policy gave back


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_hash(parent: int, tokens: list[int], extra_key: object) -> int:
    """Chained hash of one full block. Python's tuple hash of ints is process-independent
    (PYTHONHASHSEED only salts str/bytes), 64-bit, and fast; a collision would alias two
    prefixes, which at 2^-64 per pair we accept, as vLLM's default builtin hash does."""
    return hash((parent, tuple(tokens), extra_key))


def pool_admission_error(kv: PagedKVManager | GroupedKVManager, prompt_len: int,
                         max_tokens: int, n: int, over: str = "") -> str | None:
    """Why a request of this shape can never fit ``kv``'s pool (its ``slots_needed``
    exceed the whole pool), or None; ``over``: what the blocks are spread over."""
    pool = kv.pool
    bs = pool.block_size
    need = kv.slots_needed(prompt_len, max_tokens, n) // bs
    if need > pool.num_blocks:
        return (f"needs {need} blocks of {bs} tokens{over} (prompt {prompt_len} + "
                f"max_tokens {max_tokens}, n={n}) but the whole pool has "
                f"{pool.num_blocks}: raise cache.kv_budget or lower max_tokens")
    return None


@dataclass(slots=True)
class SeqBlocks:
    """Where one sequence's K/V lives. ``table[i]``: the physical block of logical block
    ``i`` (GIVEN_BACK once evicted); ``hashes``: chained hashes of its leading full blocks;
    ``given_back``: how many entries are GIVEN_BACK; ``cursor``: a window policy has
    considered the blocks before it."""

    table: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)
    given_back: int = 0
    cursor: int = 0

    @property
    def num_held(self) -> int:
        return len(self.table) - self.given_back


class CpuSwapPool:
    """CPU swap blocks: the free ids, each used block's reference count (blocks shared by
    forks move once) and fill. One per manager, or one shared by KV cache groups."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.free: deque[int] = deque(range(num_blocks))
        self.ref: dict[int, int] = {}
        self.fill: dict[int, int] = {}


class PagedKVManager:
    """Block-table bookkeeping over a :class:`BlockPool` plus a CPU swap pool, and
    optionally lower tiers of the prefix cache (``tiers``: host memory, disk) that named
    blocks leaving the pool's LRU are written to and that prompts' lookups continue in."""

    supports_swap = True

    def __init__(self, num_blocks: int, block_size: int, *, num_cpu_blocks: int = 0,
                 enable_prefix_caching: bool = True, watermark: float = 0.01,
                 tiers: LowerTiers | None = None, pool: BlockPool | None = None,
                 hash_salt: int | None = None, cpu_pool: CpuSwapPool | None = None) -> None:
        """``pool``: a block pool shared with other managers (KV cache groups,
        harness.kv.groups: each group's tables over one pool); default: its own; likewise
        ``cpu_pool``, the swap blocks (default: ``num_cpu_blocks`` of its own).
        ``hash_salt``: mixed into every block hash (a group's blocks hold other layers
        than another group's for the same tokens: their names must differ)."""
        self.block_size = block_size
        if pool is None:
            self.ledger = ReservationLedger()
            self.pool = BlockPool(num_blocks, block_size, self.ledger)
        else:
            assert pool.ledger is not None and pool.block_size == block_size
            self.ledger, self.pool = pool.ledger, pool
        self.enable_prefix_caching = enable_prefix_caching
        # At least one block whenever a watermark is asked for: int(0.01 * 45) would be 0,
        # and an admission that fills the pool to the last block preempts at once.
        self.watermark_blocks = max(1, int(watermark * num_blocks)) if watermark > 0 else 0
        self.cpu = cpu_pool if cpu_pool is not None else CpuSwapPool(num_cpu_blocks)
        self.num_cpu_blocks = self.cpu.num_blocks
        self._seqs: dict[int, SeqBlocks] = {}  # seq id -> its blocks
        self._ops = CacheOps()
        self.logical_blocks = 0
        self.stats = KVStats()
        self.tiers = tiers if enable_prefix_caching else None
        self.hash_salt = hash_salt
        self.count_group_hits = True  # KV cache groups: only one group counts a request's
        # write=through: blocks named while scheduling step t hold their K/V only after
        # forward t; they are written down with step t+1's operations.
        self._named_now: list[tuple[int, int]] = []  # (block, hash) named this step
        self._named_ready: list[tuple[int, int]] = []  # computed: to write through
        if self.tiers is not None:
            self.pool.on_evict = self.tiers.store
        # Whether allocations list their tokens' slots (ScheduledSeq.slots). A modelled
        # executor that reads none turns it off (the roofline without a scoring policy:
        # a prompt's slots were 3% of a decode-lane run); a prefill chunk's slots are then
        # empty, and append_slot still returns its one slot.
        self.slot_maps = True

    # -- per-sequence state --------------------------------------------------------------
    def blocks_of(self, seq: Sequence) -> SeqBlocks:
        st = self._seqs.get(seq.seq_id)
        if st is None:
            st = self._seqs[seq.seq_id] = SeqBlocks()
        return st

    def held_blocks(self) -> set[int]:
        """The blocks every sequence's table holds now (device blocks unless some are
        swapped out: a swapped table holds CPU block ids)."""
        return {b for st in self._seqs.values() for b in st.table if b >= 0}

    def table_of(self, seq: Sequence) -> list[int]:
        """``seq``'s block table as held (GIVEN_BACK entries included); a copy."""
        st = self._seqs.get(seq.seq_id)
        return list(st.table) if st is not None else []

    def holds(self, seq: Sequence) -> bool:
        st = self._seqs.get(seq.seq_id)
        return st is not None and bool(st.table)

    def held_tokens(self, seq: Sequence) -> int:
        """Tokens whose K/V ``seq`` holds: every computed one (nothing is evicted here)."""
        return seq.num_computed if seq.seq_id in self._seqs else 0

    def tables(self, seqs: list[Sequence]) -> list[list[int]]:
        """Block tables as attention reads them: a given-back entry reads as block 0. The
        policy that gave it back guarantees no query of the sequence reads those
        positions (a window masks them), so any valid block id serves as padding."""
        out = []
        for s in seqs:
            st = self._seqs[s.seq_id]
            out.append([max(b, 0) for b in st.table] if st.given_back else st.table)
        return out

    # -- admission -------------------------------------------------------------------
    def slots_needed(self, prompt_len: int, max_tokens: int, n: int) -> int:
        bs = self.block_size
        # n samples share the prompt's full blocks and each needs its own tail.
        return (prompt_len // bs + n * cdiv(prompt_len % bs + max_tokens, bs)) * bs

    def admission_error(self, prompt_len: int, max_tokens: int, n: int) -> str | None:
        return pool_admission_error(self, prompt_len, max_tokens, n)

    def reservation_size(self, prompt_len: int, max_tokens: int) -> int:
        return self.block_size

    def lookup_prefix(self, seq: Sequence) -> PrefixHit:
        """The device blocks holding the prompt's leading blocks, then (with lower tiers)
        the blocks after them found in a tier, nearest first. Past the first device miss
        only the tiers are asked, as vLLM's KV connectors are asked for the tokens after
        the device's hit: a block still on the device there is loaded again (rare: a
        prefix's tail leaves the device's LRU before its head)."""
        hit = PrefixHit()
        if not self.enable_prefix_caching or self.holds(seq):
            return hit
        tiers = self.tiers
        # The last token is always computed (its logits are needed), so a prompt that is
        # all cached still leaves its last block to compute, as vLLM does.
        for h in islice(self._hash_chain(seq), (len(seq.token_ids) - 1) // self.block_size):
            if not hit.loads:
                b = self.pool.lookup(h)
                if b is not None:
                    hit.blocks.append(b)
                    continue
            below = tiers.lookup(h) if tiers is not None else None
            if below is None:
                break
            hit.loads.append(below)
        return hit

    def _new_blocks(self, d: Demand) -> int:
        st = self._seqs.get(d.seq.seq_id)
        bs = self.block_size
        if d.hit_blocks or d.loads:  # a load takes a fresh block, as a computed block does
            start, have = d.num_hit_blocks * bs, len(d.hit_blocks)
        else:
            start, have = d.seq.num_computed, len(st.table) if st else 0
        need = max(0, cdiv(start + d.num_tokens, bs) - have)
        if (start % bs and d.num_tokens and st is not None
                and self.pool.ref[st.table[start // bs]] > 1):
            need += 1  # copy-on-write of the shared, partially filled last block
        return need

    def blocks_needed(self, demands: list[Demand]) -> int:
        """Blocks meeting ``demands`` together takes from the pool: fresh blocks, any
        copy-on-write copy, and hits on evictable cached blocks (each taken out of the
        free count); what :meth:`can_allocate` holds to the free blocks, and what a
        manager over a shared pool (KV cache groups) sums over its groups."""
        need = 0
        for d in demands:
            need += self._new_blocks(d)
            need += sum(1 for b in d.hit_blocks if b >= 0 and self.pool.ref[b] == 0)
        return need

    def can_allocate(self, demands: list[Demand], watermark: bool) -> bool:
        limit = self.pool.num_free - (self.watermark_blocks if watermark else 0)
        return self.blocks_needed(demands) <= limit

    def allocate(self, d: Demand) -> list[int]:
        return self.allocate_group([d])[0]

    def allocate_group(self, demands: list[Demand]) -> list[list[int]]:
        self.take_hits(demands)
        return self.extend_all(demands)

    def take_hits(self, demands: list[Demand]) -> None:
        """The demands' prefix hits (device blocks referenced, lower-tier blocks loaded):
        before any new block is allocated, which could evict a block a hit names."""
        loads = [hit for d in demands for hit in d.loads]
        if loads:
            assert self.tiers is not None
            self.tiers.pin(loads)  # no store of this step may spill or overwrite them
        for d in demands:
            if self.enable_prefix_caching and not self.holds(d.seq):
                self.stats.prefix_query_tokens += d.seq.num_tokens
                if self.pool.evicted_names:
                    self._count_regret(d)
            if d.hit_blocks or d.loads:
                self._take_hits(d)
        if loads:
            assert self.tiers is not None
            self.tiers.unpin(loads)

    def extend_all(self, demands: list[Demand]) -> list[list[int]]:
        """After :meth:`take_hits`: each demand's new tokens' slots."""
        out = []
        for d in demands:
            start = (d.num_hit_blocks * self.block_size if d.hit_blocks or d.loads
                     else d.seq.num_computed)
            out.append(self._extend(d.seq, start, d.num_tokens))
        return out

    def key_of(self, seq: Sequence) -> object:
        """The extra key of ``seq``'s block hashes (its group's, with this manager's
        salt when it has one)."""
        key = seq.group.extra_key
        return key if self.hash_salt is None else (key, self.hash_salt)

    def _hash_chain(self, seq: Sequence, start: int = 0,
                    parent: int = _ROOT_HASH) -> Iterator[int]:
        """The chained hashes of ``seq``'s full blocks from block ``start`` on, lazily
        (``parent``: block ``start - 1``'s hash): the one place blocks are named (but for
        ``_register_full_blocks``' shortcut for one block, the same link)."""
        bs, toks, key = self.block_size, seq.token_ids, self.key_of(seq)
        h = parent
        for i in range(start, len(toks) // bs):
            h = block_hash(h, toks[i * bs:(i + 1) * bs], key)
            yield h

    def chain_hashes(self, seq: Sequence, n: int) -> list[int]:
        """The chained hashes of ``seq``'s first ``n`` full blocks."""
        return list(islice(self._hash_chain(seq), n))

    def _take_hits(self, d: Demand) -> None:
        seq, pool = d.seq, self.pool
        st = self.blocks_of(seq)
        assert not st.table and seq.num_computed == 0, "hits only on a fresh table"
        # A window's hit may leave blocks it no longer sees out (GIVEN_BACK): KV cache
        # groups' sliding groups (harness.kv.groups). Their names continue the chain.
        chain = self.chain_hashes(seq, len(d.hit_blocks)) if GIVEN_BACK in d.hit_blocks \
            else None
        for i, b in enumerate(d.hit_blocks):
            if b == GIVEN_BACK:
                assert chain is not None
                st.table.append(GIVEN_BACK)
                st.hashes.append(chain[i])
                st.given_back += 1
                st.cursor = i + 1
                continue
            h = pool.block_hash[b]
            assert isinstance(h, int), f"hit block {b} lost its hash before it was taken"
            self._count_hit(seq, pool.owner[b])
            pool.touch(b)
            st.table.append(b)
            st.hashes.append(h)
        for hit in d.loads:
            h = hit.block_hash
            found = pool.lookup(h)  # loaded already by an earlier demand of this step?
            if found is not None:
                b = found
                pool.touch(b)
            else:
                new = pool.allocate()
                assert new is not None, "can_allocate must be called first"
                b = new
                assert self.tiers is not None
                self.tiers.load(hit, b, count_hit=self.count_group_hits)
                pool.set_fill(b, self.block_size)
                pool.register(b, h, hit.owner, len(st.table))
                if self.count_group_hits:
                    seq.group.tier_hit_blocks[hit.tier - 1] += 1
            self._count_hit(seq, hit.owner)
            st.table.append(b)
            st.hashes.append(h)
        self.logical_blocks += d.num_hit_blocks - d.hit_blocks.count(GIVEN_BACK)

    def _count_regret(self, d: Demand) -> None:
        """The prompt's full blocks right after its hits (and loads) whose content was
        computed earlier in the run and evicted (the pool's ``evicted_names``), up to the
        first that is named now or was never evicted: computed again because of the
        evictions (``cache.regret_blocks``). Pending names under each block passed are
        made first, so that the roofline's lazy names count as stepping one by one."""
        pool, seq = self.pool, d.seq
        evicted = pool.evicted_names
        n_hit = d.num_hit_blocks
        parent = self._last_hit_hash(d)
        full = (len(seq.token_ids) - 1) // self.block_size
        k = 0
        for h in islice(self._hash_chain(seq, n_hit, parent), full - n_hit):
            pool.name_under(parent)
            if h not in evicted or pool.has_name(h):
                break
            k += 1
            parent = h
        self.stats.regret_blocks += k
        self.stats.regret_tokens += k * self.block_size

    def _last_hit_hash(self, d: Demand) -> int:
        """The name of ``d``'s last hit block (the root before any hit): the lookup found
        it by that name, so it is read, not hashed again; hashed only past a window's
        given-back entry (KV cache groups)."""
        if d.loads:
            return d.loads[-1].block_hash
        if not d.hit_blocks:
            return _ROOT_HASH
        h = self.pool.block_hash[d.hit_blocks[-1]] if d.hit_blocks[-1] != GIVEN_BACK \
            else None
        return h if isinstance(h, int) else self.chain_hashes(d.seq, d.num_hit_blocks)[-1]

    def set_cache_policy(self, eviction: str, admission: str) -> None:
        """The pool's eviction order and admission rule (``cache.eviction``,
        ``cache.admission``: harness/kv/eviction.py), before anything is cached."""
        self.pool.set_policy(eviction, admission)

    def _count_hit(self, seq: Sequence, owner: int) -> None:
        """One hit block of ``seq``: a self hit when its own request computed it (a
        recompute after preemption), else a prefix hit, also on its group's count
        (which, under KV cache groups, one group keeps)."""
        if owner == seq.group.request_id:
            self.stats.self_hit_tokens += self.block_size
        else:
            self.stats.prefix_hit_tokens += self.block_size
            if self.count_group_hits:
                seq.group.prefix_hit_tokens += self.block_size

    def _extend(self, seq: Sequence, start: int, num_tokens: int) -> list[int]:
        """Slots for tokens ``[start, start + num_tokens)``: copy-on-write, new blocks,
        fill counts, and hashes of the blocks these tokens fill."""
        pool, bs = self.pool, self.block_size
        st = self.blocks_of(seq)
        table = st.table
        end = start + num_tokens
        if start % bs and num_tokens:
            i = start // bs
            last = table[i]
            if pool.ref[last] > 1:
                # Never write a shared block: the writer takes a private copy of the filled
                # part. Full shared blocks never get here (start % bs == 0 for them).
                new = pool.allocate()
                assert new is not None, "can_allocate must be called first"
                filled = start % bs
                assert pool.fill[last] == filled, (pool.fill[last], filled)
                self._ops.copies.append(CopyOp(last * bs, new * bs, filled))
                pool.set_fill(new, filled)
                pool.release(last)
                table[i] = new
                self.stats.cow_copies += 1
        first, held, stop = start // bs, len(table), cdiv(end, bs)
        for i in range(first, min(held, stop)):
            pool.set_fill(table[i], min(bs, end - i * bs))
        if stop > held:  # new blocks, taken at their fill: full but for the last
            assert pool.num_free >= stop - held, "can_allocate must be called first"
            table += pool.allocate_all(stop - held - 1, bs)
            table += pool.allocate_all(1, end - (stop - 1) * bs)
            self.logical_blocks += stop - held
        if self.enable_prefix_caching:
            self._register_full_blocks(seq, st, end)
        if not self.slot_maps:
            return []
        slots: list[int] = []  # block by block: a prompt's thousands of slots are ranges
        for i in range(first, stop):
            base = table[i] * bs - i * bs  # slot of token p in block i: base + p
            slots += range(base + max(start, i * bs), base + min(end, (i + 1) * bs))
        return slots

    def append_slot(self, seq: Sequence) -> int | None:
        """Fast path of ``allocate(Demand(seq, 1))`` for a decode: the slot of token
        ``seq.num_computed``, or None when that needs a block and none is free."""
        pos, bs, pool = seq.num_computed, self.block_size, self.pool
        off = pos % bs
        if off:
            st = self._seqs[seq.seq_id]
            b = st.table[pos // bs]
            if pool.ref[b] == 1:  # the common case: write in place into our own block
                pool.used_slots += 1
                pool.fill[b] = off + 1
                if pool.ledger is not None:
                    pool.ledger.fill(b, off + 1)
                if off + 1 == bs and self.enable_prefix_caching:
                    self._register_full_blocks(seq, st, pos + 1)
                return b * bs + off
        if pool.num_free == 0:
            return None
        self._extend(seq, pos, 1)
        return self.slot(seq, pos)  # (the block _extend took, or its copy-on-write copy)

    # -- the roofline's fast path (harness/roofline/fastpath): writes and names in bulk --
    def set_deferred_names(self, names: DeferredNames) -> None:
        """Blocks may carry pending names from now on (:meth:`name_pending`), made when
        ``names`` is asked (see :class:`~harness.kv.base.DeferredNames`)."""
        self.pool.deferred = names

    def name_pending(self, block: int, name: object, depth: int) -> None:
        """Block ``block``, full (its fill recorded later), at position ``depth`` of its
        table, carries pending name ``name`` (not an int): a release caches it, an
        eviction tells the hook."""
        self.pool.block_hash[block] = name
        self.pool.depth[block] = depth

    def enter_deferred(self, st: SeqBlocks, block: int, name: object, h: int,
                       owner: int) -> None:
        """The pending name ``name`` of ``st``'s next unnamed block ``block`` is made:
        ``h``, computed by ``owner``. The block is entered in the index unless it was
        evicted since (it no longer carries ``name``); ``st``'s hashes go on either way."""
        pool = self.pool
        if pool.block_hash[block] is name:
            pool.enter_name(block, h, owner, len(st.hashes))
        else:  # evicted while pending: as if named, then evicted
            pool.evicted_names.add(h)
        st.hashes.append(h)

    def note_evicted(self, hashes: list[int]) -> None:
        """``hashes`` were names evicted while pending (the roofline's lazy names, made
        now): the pool's evicted names, as if named and evicted one by one."""
        self.pool.evicted_names.update(hashes)

    def take_ramped(self, tables: list[SeqBlocks], ramp: int) -> list[int]:
        """A new block at the end of each of ``tables`` (the pool has one free for
        each), each with one slot written now and ``ramp`` more recorded ahead
        (``BlockPool.allocate_all``); returns the blocks."""
        blocks = self.pool.allocate_all(len(tables), 1, ramp=ramp)
        for st, b in zip(tables, blocks):
            st.table.append(b)
        self.logical_blocks += len(tables)
        return blocks

    def ramp_fill(self, block: int, k: int) -> None:
        """Block ``block`` took one more token at each of the last ``k`` steps (its
        used slots were counted as they happened: :meth:`add_used`)."""
        self.pool.fill[block] += k
        self.ledger.ramp(block, k)

    def ramp_fills(self, blocks: list[int], ks: list[int]) -> None:
        """:meth:`ramp_fill` of each block by its ``k`` (``k = 0``: nothing)."""
        fill = self.pool.fill
        for b, k in zip(blocks, ks):
            fill[b] += k
        self.ledger.ramp_all(blocks, ks)

    def trim_fill(self, block: int, k: int) -> None:
        """Block ``block``'s last ``k`` writes, recorded ahead when it was taken
        (``BlockPool.allocate_all``'s ``ramp``), did not happen: its writer stopped."""
        self.pool.fill[block] -= k
        self.ledger.trim(block, k)

    def add_used(self, n: int) -> None:
        """``n`` in-place writes this step, their blocks' fills settled later."""
        self.pool.used_slots += n

    def name_next_block(self, seq: Sequence, tokens: list[int]) -> None:
        """Name ``seq``'s first block not named yet, full, which holds ``tokens`` (the
        chain's next link). Not with write-through lower tiers."""
        self.name_next_blocks([self._seqs[seq.seq_id]], [tokens], [self.key_of(seq)],
                              [seq.group.request_id])

    def name_next_blocks(self, tables: list[SeqBlocks], blocks: list[list[int]],
                         keys: list[object], owners: list[int],
                         settled: bool = True) -> None:
        """:meth:`name_next_block` of each block table in turn, with its block's tokens,
        its sequence's :meth:`key_of` and request id (the roofline's fast path keeps all
        three per sequence and names their blocks in one call).
        ``settled=False``: the fast path's blocks, full though their fills are brought up to
        date later."""
        pool = self.pool
        register = pool.register if settled else pool.name
        for st, tokens, key, owner in zip(tables, blocks, keys, owners):
            hashes = st.hashes
            h = block_hash(hashes[-1] if hashes else _ROOT_HASH, tokens, key)
            register(st.table[len(hashes)], h, owner, len(hashes))
            hashes.append(h)

    def _register_full_blocks(self, seq: Sequence, st: SeqBlocks, end: int) -> None:
        """Name the blocks that ``end`` tokens fill, so a later prompt (the next turn of a
        conversation re-sending this answer) can hit them."""
        hashes, rid = st.hashes, seq.group.request_id
        first, bs = len(hashes), self.block_size
        last = end // bs
        if first >= last:
            return
        if last == first + 1 and (self.tiers is None or self.tiers.write != "through"):
            # One block (a decode filling its block): the chain's next link, directly.
            self.name_next_block(seq, seq.token_ids[first * bs:last * bs])
            return
        chain = self._hash_chain(seq, first, hashes[-1] if hashes else _ROOT_HASH)
        for i, h in zip(range(first, last), chain):
            hashes.append(h)
            if self.pool.register(st.table[i], h, rid, i) and self.tiers is not None \
                    and self.tiers.write == "through":
                self._named_now.append((st.table[i], h))

    def max_chunk(self, seq: Sequence) -> int | None:
        """Most tokens one step may add to ``seq`` (None: no limit beyond the budget)."""
        return None

    def slot(self, seq: Sequence, pos: int) -> int:
        """Physical slot of token ``pos`` of ``seq``."""
        bs = self.block_size
        return self._seqs[seq.seq_id].table[pos // bs] * bs + pos % bs

    # -- sharing and release -----------------------------------------------------------
    def fork(self, parent: Sequence, child: Sequence) -> None:
        assert not self.holds(child)
        src = self._seqs.get(parent.seq_id)
        if src is None:
            return  # the parent holds nothing yet: neither does the child
        for b in src.table:
            if b >= 0:
                self.pool.touch(b)
        self._seqs[child.seq_id] = SeqBlocks(list(src.table), list(src.hashes),
                                             src.given_back, src.cursor)
        self.logical_blocks += src.num_held

    def free(self, seq: Sequence) -> None:
        st = self._seqs.pop(seq.seq_id, None)
        if st is None:
            return
        # Reverse order: the tail (least likely to be shared) enters the LRU first and is
        # evicted first, keeping the common prefix cached longest.
        self.pool.release_all(st.table[::-1] if not st.given_back
                              else [b for b in reversed(st.table) if b != GIVEN_BACK])
        self.logical_blocks -= st.num_held

    def take_cache_ops(self) -> CacheOps:
        ops, self._ops = self._ops, CacheOps()
        if self.tiers is not None:
            pool = self.pool
            for b, h in self._named_ready:  # write-through of last step's named blocks
                if pool.block_hash[b] == h:  # (one evicted since was stored on eviction)
                    self.tiers.store(b, h, pool.owner[b], pool.depth[b])
            self._named_ready = []
            ops.tier_ops = self.tiers.take_ops()
        return ops

    # -- the step's clock and eviction (none here: see harness.kv.evicting) ---------------
    def end_forward(self) -> None:
        self.ledger.now += 1
        self.settle_named()

    def settle_named(self) -> None:
        """After a forward: the blocks named this step hold their K/V now, so they are
        written through with the next step's ops (``cache.tiers.write=through``)."""
        if self._named_now:
            self._named_ready += self._named_now
            self._named_now = []

    def observe(self, seqs: list[Sequence], scores: StepScores | None) -> None:
        return None

    def record_external(self, next_need: int | None) -> int:
        return 0  # any free block serves any request: paging has no external fragmentation

    # -- swap ---------------------------------------------------------------------------
    def _held(self, seqs: list[Sequence]) -> list[SeqBlocks]:
        return [st for s in seqs if (st := self._seqs.get(s.seq_id)) is not None]

    def _distinct(self, seqs: list[Sequence]) -> set[int]:
        return {b for st in self._held(seqs) for b in st.table if b >= 0}

    def can_swap_out(self, seqs: list[Sequence]) -> bool:
        return len(self._distinct(seqs)) <= len(self.cpu.free)

    def can_swap_in(self, seqs: list[Sequence]) -> bool:
        return len(self._distinct(seqs)) <= self.pool.num_free - self.watermark_blocks

    def swap_out(self, seqs: list[Sequence]) -> list[tuple[int, int]]:
        """Move the group's blocks to CPU; returns (device block, cpu block) copies."""
        mapping: dict[int, int] = {}
        cpu = self.cpu
        held = self._held(seqs)
        for st in held:
            table = st.table
            for i, b in enumerate(table):
                if b < 0:
                    continue
                if b not in mapping:
                    c = cpu.free.popleft()
                    mapping[b] = c
                    cpu.ref[c] = 0
                    cpu.fill[c] = self.pool.fill[b]
                c = mapping[b]
                cpu.ref[c] += 1
                table[i] = c
                self.pool.release(b)
        self.stats.swapped_out_blocks += len(mapping)
        # Swapped tables hold CPU blocks: they are not device blocks "held without sharing".
        self.logical_blocks -= sum(st.num_held for st in held)
        return list(mapping.items())

    def swap_in(self, seqs: list[Sequence]) -> list[tuple[int, int]]:
        """Bring a swapped group back; returns (cpu block, device block) copies."""
        mapping: dict[int, int] = {}
        cpu = self.cpu
        held = self._held(seqs)
        for st in held:
            table = st.table
            for i, c in enumerate(table):
                if c < 0:
                    continue
                if c not in mapping:
                    b = self.pool.allocate()
                    assert b is not None, "can_swap_in must be called first"
                    self.pool.set_fill(b, cpu.fill[c])
                    mapping[c] = b
                else:
                    self.pool.touch(mapping[c])
                table[i] = mapping[c]
                cpu.ref[c] -= 1
                if cpu.ref[c] == 0:
                    del cpu.ref[c], cpu.fill[c]
                    cpu.free.append(c)
        self.stats.swapped_in_blocks += len(mapping)
        self.logical_blocks += sum(st.num_held for st in held)
        deferred = self.pool.deferred
        if deferred is not None and deferred.pending:
            # Back with its names: the pending names under them are made first, as any
            # sequence passing those hashes has them made (DeferredNames).
            roots = [h for st in held for h in st.hashes if h in deferred.pending]
            if roots:
                deferred.materialize(roots)
        return list(mapping.items())

    # -- accounting ----------------------------------------------------------------------
    def usage(self) -> KVUsage:
        return self.pool.usage(self.logical_blocks,
                               tier_blocks=(tuple(t.num_used for t in self.tiers.tiers)
                                            if self.tiers is not None else ()))

    @property
    def num_cpu_blocks_used(self) -> int:
        return self.num_cpu_blocks - len(self.cpu.free)
