"""KV cache groups (issue #29): layers of one attention type share a group with its own
block tables and freeing rule, and every group allocates from one block pool, as vLLM's
hybrid KV cache manager does.

Groups are planned as vLLM plans them for a uniform page size (:func:`plan_groups`): the
group size is the layer count of the rarest attention type, and each type's layers are
split into groups of that many (the last of a type padded: its pages are sized for a full
group). A pool block is then ``block_size`` tokens of ``group_size`` layers, whatever its
group. Each group is an ordinary manager over the shared pool: a full group a
:class:`~harness.kv.paged.PagedKVManager` (it keeps every token), a sliding group a
:class:`~harness.kv.evicting.WindowKVManager` with the model's window and no sinks (blocks
wholly outside the window go back after each step), a chunked group one with
:class:`~harness.kv.policies.chunk.ChunkPolicy` (blocks of finished chunks go back).

:class:`GroupedKVManager` is the scheduler's one KV manager: a demand is met in every
group or in none, so admission and preemption count what all groups will hold. Prefix
caching works across groups as vLLM's hybrid manager does it: each group names its pages
with its own salt, and a hit is the longest prefix every group can serve (a sliding group
needs only the blocks its window still sees). The ledger sums each group's blocks apart
(its ``tag``), so the waste split is per group too. Swap moves every group's blocks of a
sequence group to one shared CPU pool and back, and the prefix cache's lower tiers hold
every group's pages (each under its group's names; a group's hit is a device run, then
loads). Under
``executor=model`` each layer attends through its group's tables (:func:`assign_layers`,
backends.base.LayerSlot; the engine builds one batch per group from :attr:`members`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from harness.errors import UserError
from harness.kv.base import CacheOps, Demand, KVStats, KVUsage, PrefixHit, StepScores
from harness.kv.block_pool import BlockPool
from harness.kv.evicting import EvictingKVManager, WindowKVManager
from harness.kv.ledger import ReservationLedger
from harness.kv.paged import (
    GIVEN_BACK,
    CpuSwapPool,
    PagedKVManager,
    cdiv,
    pool_admission_error,
)
from harness.kv.policies.base import EvictionPolicy
from harness.kv.policies.chunk import ChunkPolicy
from harness.kv.policies.window import WindowPolicy
from harness.kv.tiers import LowerTiers
from harness.layer_types import LayerAttention, groups

if TYPE_CHECKING:
    from harness.sched.sequence import Sequence


@dataclass(frozen=True)
class KVGroup:
    """One KV cache group: its attention and the real layers it holds (at most the plan's
    group size; fewer in a type's padded last group)."""

    attention: LayerAttention
    layers: int


def plan_groups(layers: tuple[LayerAttention, ...]) -> tuple[list[KVGroup], int]:
    """The groups of ``layers`` and the group size (layers per pool page), full groups
    first. Uniform attention is one group of every layer."""
    kinds = groups(layers)
    size = min(n for _, n in kinds)
    out: list[KVGroup] = []
    for a, n in kinds:
        for k in range(cdiv(n, size)):
            out.append(KVGroup(a, min(size, n - k * size)))
    return out, size


def assign_layers(layers: tuple[LayerAttention, ...], plan: list[KVGroup],
                  size: int) -> list[tuple[int, int]]:
    """(group, position in the group) of every layer, as vLLM assigns them: each attention
    type's layers, in model order, fill that type's groups in plan order, ``size`` at a
    time. A layer's position is the pool page's storage it uses (layer j of every group
    shares the j-th tensor, so a block is a page whichever group takes it)."""
    out: list[tuple[int, int]] = []
    seen: dict[LayerAttention, int] = {}
    for a in layers:
        k = seen.get(a, 0)
        seen[a] = k + 1
        own = [gi for gi, g in enumerate(plan) if g.attention == a]
        out.append((own[k // size], k % size))
    for gi, g in enumerate(plan):  # the plan's layer counts are what was assigned
        assert sum(1 for grp, _ in out if grp == gi) == g.layers, (gi, g, out)
    return out


def describe_groups(plan: list[KVGroup], size: int) -> str:
    """E.g. ``1 full + 6 sliding 1024 (10 layers a group; 8 padded)``."""
    counts: dict[LayerAttention, int] = {}
    for g in plan:
        counts[g.attention] = counts.get(g.attention, 0) + 1
    pad = sum(size - g.layers for g in plan)
    return (" + ".join(f"{n} {a}" for a, n in counts.items())
            + f" ({size} layers a group{f'; {pad} padded' if pad else ''})")


class GroupedKVManager:
    """One KV manager over several groups' managers and one pool (module docstring)."""

    def __init__(self, num_blocks: int, block_size: int, plan: list[KVGroup], *,
                 watermark: float = 0.01, max_chunk_tokens: int = 2048,
                 enable_prefix_caching: bool = True,
                 full_policy: EvictionPolicy | None = None, num_cpu_blocks: int = 0,
                 tiers: LowerTiers | None = None) -> None:
        """``max_chunk_tokens``: the most tokens one step adds to a sequence (the
        scheduler's token budget): a sliding or chunked group holds at most its span plus
        one step's tokens and a block, which is what admission counts for it.
        ``full_policy``: a positional eviction policy for the full groups (a window
        backend's: it compresses the layers that keep every token; the sliding and
        chunked groups already bound theirs); None keeps every token there."""
        self.chooses = full_policy is not None and not full_policy.positional
        if self.chooses and sum(g.attention.kind == "full" for g in plan) != 1:
            raise UserError(
                f"a policy that chooses tokens ({full_policy.name if full_policy else ''}) "
                "runs on a hybrid model with one full KV cache group only; this plan has "
                f"{sum(g.attention.kind == 'full' for g in plan)}: use backend=paged, fp8, "
                "int8 or sliding_window")
        if self.chooses and plan[0].attention.kind != "full":
            raise UserError("a policy that chooses tokens needs a full KV cache group")
        self.full_policy = full_policy
        # A token-choosing policy's slots hold no block-aligned content: no swap then.
        self.supports_swap = not self.chooses
        # The prefix cache's lower tiers, shared: each group's pages under its own names.
        self.tiers = tiers if enable_prefix_caching else None
        # Swap blocks are pages too: one CPU pool for every group's blocks.
        self.cpu = CpuSwapPool(num_cpu_blocks)
        self.num_cpu_blocks = num_cpu_blocks
        self.block_size = block_size
        self.max_chunk_tokens = max_chunk_tokens
        self.ledger = ReservationLedger()
        self.pool = BlockPool(num_blocks, block_size, self.ledger)
        self.plan = plan
        self.enable_prefix_caching = enable_prefix_caching
        self.members: list[PagedKVManager] = [self._member(g.attention, num_blocks, i)
                                              for i, g in enumerate(plan)]
        for m in self.members[1:]:
            m.count_group_hits = False  # a request's hits are counted once (the first group)
        # lookup_prefix's per-group hit blocks, for the allocation that follows it, and
        # each waiting sequence's chained hashes per group
        self._plans: dict[int, list[PrefixHit]] = {}
        self._chain_cache: dict[int, tuple[tuple[int, int], list[list[int]]]] = {}
        self.watermark_blocks = max(1, int(watermark * num_blocks)) if watermark > 0 else 0
        self.stats = KVStats()


    def set_cache_policy(self, eviction: str, admission: str) -> None:
        """The shared pool's eviction order and admission rule (harness/kv/eviction.py)."""
        self.pool.set_policy(eviction, admission)
    def _member(self, a: LayerAttention, num_blocks: int, index: int) -> PagedKVManager:
        # Each group names its blocks with its own salt: the same tokens' pages of two
        # groups hold different layers.
        common = {"enable_prefix_caching": self.enable_prefix_caching, "watermark": 0.0,
                  "pool": self.pool, "hash_salt": index, "cpu_pool": self.cpu,
                  "tiers": self.tiers}
        if a.kind == "full" and self.full_policy is None:
            return PagedKVManager(num_blocks, self.block_size, **common)  # type: ignore[arg-type]
        if a.kind == "full" and self.chooses:  # the policy chooses the full layers' tokens
            assert self.full_policy is not None
            return EvictingKVManager(num_blocks, self.block_size, self.full_policy, **common)
        policy: EvictionPolicy = (self.full_policy if a.kind == "full" and self.full_policy
                                  else WindowPolicy(a.span, 0) if a.kind == "sliding"
                                  else ChunkPolicy(a.span))
        return WindowKVManager(num_blocks, self.block_size, policy, **common)

    def _sum_stats(self) -> None:
        """The groups' counters into :attr:`stats`: copies and given-back tokens summed;
        prefix lookups, hits and regrets as the first group counted them (a hit is a hit
        of every group: counted once)."""
        for f in ("cow_copies", "evicted_tokens", "swapped_out_blocks", "swapped_in_blocks"):
            setattr(self.stats, f, sum(getattr(m.stats, f) for m in self.members))
        first = self.members[0].stats
        for f in ("prefix_query_tokens", "prefix_hit_tokens", "self_hit_tokens",
                  "regret_blocks", "regret_tokens"):
            setattr(self.stats, f, getattr(first, f))

    # -- admission -------------------------------------------------------------------
    def slots_needed(self, prompt_len: int, max_tokens: int, n: int) -> int:
        bs, total = self.block_size, prompt_len + max_tokens
        p = self.full_policy
        if isinstance(p, WindowPolicy):  # a windowed full group: its sinks' blocks on top
            full = n * cdiv(min(total, p.window + cdiv(p.sinks, bs) * bs
                                + self.max_chunk_tokens + bs), bs) * bs
        else:  # a paged count (the first group is a full one when the model has any)
            full = self.members[0].slots_needed(prompt_len, max_tokens, n)
        out = 0
        for g in self.plan:
            if g.attention.kind == "full":
                out += full
            else:  # its span, one step's tokens before the step gives back, a block
                peak = min(total, g.attention.span + self.max_chunk_tokens + bs)
                out += n * cdiv(peak, bs) * bs
        return out

    def admission_error(self, prompt_len: int, max_tokens: int, n: int) -> str | None:
        return pool_admission_error(self, prompt_len, max_tokens, n,
                                    f" over its {len(self.members)} KV cache groups")

    def reservation_size(self, prompt_len: int, max_tokens: int) -> int:
        return self.block_size * len(self.members)

    def lookup_prefix(self, seq: Sequence) -> PrefixHit:
        """The longest prefix every group can serve, as vLLM's hybrid manager finds it: a
        full group needs every block before the hit's end, a sliding or chunked group only
        the blocks the next query sees (its window, its chunk); blocks before those are
        left out of its table (GIVEN_BACK). Within what a group needs, the device serves
        a leading run and the lower tiers (if any) the rest, as the paged manager's
        lookup (a connector is asked for what follows the device's hit). Returns the
        first group's hit (its block count is the hit); each group's own is kept for the
        allocation that follows."""
        self._plans.pop(seq.seq_id, None)
        if not self.enable_prefix_caching or self.holds(seq):
            return PrefixHit()
        n_max = (len(seq.token_ids) - 1) // self.block_size
        chains, lookup, tiers = self._chains(seq, n_max), self.pool.lookup, self.tiers

        def on_device(g: int, i: int) -> bool:
            return lookup(chains[g][i]) is not None

        def below(g: int, i: int) -> bool:
            return tiers is not None and tiers.lookup(chains[g][i]) is not None

        def run(g: int, lo: int, k: int) -> int:
            """How far from ``lo`` (at most ``k``) a device run, then a tier run, reach."""
            j = lo
            while j < k and on_device(g, j):
                j += 1
            while j < k and below(g, j):
                j += 1
            return j

        # A full group's hit is its leading run (stop at the first miss: O(hit), as the
        # paged manager's lookup); windowed groups are asked only about what they see.
        k = n_max
        for gi, g in enumerate(self.plan):
            if g.attention.kind == "full":
                k = run(gi, 0, k)
        settled = False
        while k and not settled:  # a shorter hit moves every window back: ask again
            settled = True
            for gi, g in enumerate(self.plan):
                while k and run(gi, self._first_seen(g, k), k) < k:
                    k -= 1
                    settled = False
        if k == 0:
            return PrefixHit()
        plans: list[PrefixHit] = []
        for gi, g in enumerate(self.plan):
            lo = self._first_seen(g, k)
            hit = PrefixHit(blocks=[GIVEN_BACK] * lo)
            j = lo
            while j < k and (b := lookup(chains[gi][j])) is not None:
                hit.blocks.append(b)
                j += 1
            for i in range(j, k):
                assert tiers is not None
                found = tiers.find(chains[gi][i])
                assert found is not None, "run() found it"
                hit.loads.append(found)
            plans.append(hit)
        self._plans[seq.seq_id] = plans
        return PrefixHit(list(plans[0].blocks), list(plans[0].loads))

    def forget_lookup(self, seq: Sequence) -> None:
        """Drop what :meth:`lookup_prefix` kept for ``seq`` (its plan and hash chains): a
        lookup that no allocation follows (a router's probe, harness.cluster.router)."""
        self._plans.pop(seq.seq_id, None)
        self._chain_cache.pop(seq.seq_id, None)

    def _chains(self, seq: Sequence, n: int) -> list[list[int]]:
        """Each group's chained hashes of ``seq``'s first ``n`` blocks, kept while its
        tokens stay the same (a waiting request is looked up again every step)."""
        key = (len(seq.token_ids), n)
        got = self._chain_cache.get(seq.seq_id)
        if got is None or got[0] != key:
            got = self._chain_cache[seq.seq_id] = (key, [m.chain_hashes(seq, n)
                                                         for m in self.members])
        return got[1]

    def _first_seen(self, g: KVGroup, k: int) -> int:
        """The first block a group needs after a hit of ``k`` blocks: what the query at
        position k x block_size sees (every block for a full group)."""
        seen = k * self.block_size + 1  # the context of the query at that position
        return (seen - g.attention.held(seen)) // self.block_size

    def _member_demands(self, i: int, demands: list[Demand]) -> list[Demand]:
        """Group ``i``'s view of the demands: its own hit blocks and loads."""
        out = []
        for d in demands:
            plan = self._plans.get(d.seq.seq_id) if d.hit_blocks or d.loads else None
            out.append(Demand(d.seq, d.num_tokens, list(plan[i].blocks), list(plan[i].loads))
                       if plan else Demand(d.seq, d.num_tokens))
        return out

    def _need(self, demands: list[Demand]) -> int:
        return sum(m.blocks_needed(self._member_demands(i, demands))
                   for i, m in enumerate(self.members))

    def _owed(self) -> int:
        """Blocks a token-choosing full group promised its admitted sequences (kept free
        for them, as its own manager keeps them: harness.kv.evicting)."""
        m = self.members[0]
        return m.owed_blocks if isinstance(m, EvictingKVManager) else 0

    def can_allocate(self, demands: list[Demand], watermark: bool) -> bool:
        limit = self.pool.num_free - self._owed() - (self.watermark_blocks if watermark
                                                     else 0)
        return self._need(demands) <= limit

    def _tagged(self) -> Iterator[tuple[int, PagedKVManager]]:
        """Each group's manager in turn, with the ledger's tag set to the group while it
        acts (the ledger sums each group's blocks apart: the waste split)."""
        try:
            for i, m in enumerate(self.members):
                self.ledger.tag = i
                yield i, m
        finally:
            self.ledger.tag = None

    def allocate_group(self, demands: list[Demand]) -> list[list[int]]:
        """Every group's blocks for the demands (a prefix hit: each group's own hit
        blocks, taken first in every group before anything is allocated); the slots
        returned are the first group's (the step record's; each group's own are in its
        tables)."""
        views = [self._member_demands(i, demands) for i in range(len(self.members))]
        if any(d.hit_blocks or d.loads for d in demands):
            self._take_all_hits(views)
            out = [m.extend_all(views[i]) for i, m in self._tagged()]
        else:  # each group its own way (a token-choosing group reuses slots it freed)
            out = [m.allocate_group(views[i]) for i, m in self._tagged()]
        for d in demands:
            self._plans.pop(d.seq.seq_id, None)
            self._chain_cache.pop(d.seq.seq_id, None)
        return out[0]

    def _take_all_hits(self, views: list[list[Demand]]) -> None:
        """Every group's prefix hits, before any group allocates. A group's loads take
        fresh blocks, which may evict cached blocks: every group's device hits are held
        first (and every group's tier hits pinned), so that no group's loads evict or
        overwrite what another group is about to take."""
        pool = self.pool
        held: list[int] = []
        loads = [hit for v in views for d in v for hit in d.loads]
        if loads:
            assert self.tiers is not None
            for i, _ in self._tagged():
                for b in (b for d in views[i] for b in d.hit_blocks if b >= 0):
                    if pool.ref[b] == 0:
                        pool.touch(b)
                        held.append(b)
            self.tiers.pin(loads)
        for i, m in self._tagged():
            m.take_hits(views[i])
        for b in held:
            pool.release(b)
        if loads:
            assert self.tiers is not None
            self.tiers.unpin(loads)

    def append_slot(self, seq: Sequence) -> int | None:
        """A decode's slot in every group, or in none (None: the pool lacks a block some
        group needs for it)."""
        if self.pool.num_free - self._owed() < self._need([Demand(seq, 1)]):
            return None
        slots = [m.append_slot(seq) for _, m in self._tagged()]
        assert all(s is not None for s in slots), "counted first"
        return slots[0]

    def max_chunk(self, seq: Sequence) -> int | None:
        return self.members[0].max_chunk(seq) if self.chooses else None

    # -- sharing and release ---------------------------------------------------------------
    def fork(self, parent: Sequence, child: Sequence) -> None:
        for m in self.members:
            m.fork(parent, child)

    def free(self, seq: Sequence) -> None:
        for m in self.members:
            m.free(seq)
        self._chain_cache.pop(seq.seq_id, None)

    def holds(self, seq: Sequence) -> bool:
        return self.members[0].holds(seq)

    def held_tokens(self, seq: Sequence) -> int:
        """The first group's held tokens: a full group's when the model has one (the plan
        puts full groups first), which is what GroupedCosts' full layers read; its sliding
        and chunked layers' reads come from the context."""
        return self.members[0].held_tokens(seq)

    def tables(self, seqs: list[Sequence]) -> list[list[int]]:
        return self.members[0].tables(seqs)

    def take_cache_ops(self) -> CacheOps:
        ops = CacheOps()
        for m in self.members:  # each drains the shared tiers' ops queued so far: in order
            o = m.take_cache_ops()
            ops.copies += o.copies
            ops.invalidated += o.invalidated
            ops.tier_ops += o.tier_ops
        return ops

    # -- swap: every group's blocks of a sequence group, or none ---------------------------
    def _swap_blocks(self, seqs: list[Sequence]) -> int:
        # A block belongs to one group's tables: the groups' distinct blocks add up.
        return sum(len(m._distinct(seqs)) for m in self.members)

    def can_swap_out(self, seqs: list[Sequence]) -> bool:
        return self._swap_blocks(seqs) <= len(self.cpu.free)

    def can_swap_in(self, seqs: list[Sequence]) -> bool:
        return self._swap_blocks(seqs) <= self.pool.num_free - self.watermark_blocks

    def swap_out(self, seqs: list[Sequence]) -> list[tuple[int, int]]:
        """Every group's blocks of ``seqs`` to the shared CPU pool: (device block, cpu
        block) copies; a copy moves the whole page (every storage layer's block)."""
        return self._swap(seqs, out=True)

    def swap_in(self, seqs: list[Sequence]) -> list[tuple[int, int]]:
        """Every group's swapped blocks of ``seqs`` back: (cpu block, device block)."""
        return self._swap(seqs, out=False)

    def _swap(self, seqs: list[Sequence], out: bool) -> list[tuple[int, int]]:
        copies: list[tuple[int, int]] = []
        for _, m in self._tagged():  # blocks taken back in are the group's
            copies += m.swap_out(seqs) if out else m.swap_in(seqs)
        return copies

    @property
    def num_cpu_blocks_used(self) -> int:
        return self.num_cpu_blocks - len(self.cpu.free)

    # -- the step's clock and eviction -----------------------------------------------------
    def end_forward(self) -> None:
        self.ledger.now += 1  # once: the groups share this ledger
        for m in self.members:
            m.settle_named()

    def observe(self, seqs: list[Sequence], scores: StepScores | None) -> None:
        # The scores are the full group's slots' (the backend scores its full layers).
        for i, m in self._tagged():  # a copy an eviction makes (a shared block): the group's
            m.observe(seqs, scores if i == 0 and self.chooses else None)
        self._sum_stats()

    def record_external(self, next_need: int | None) -> int:
        return 0

    def usage(self) -> KVUsage:
        t = self.tiers
        return self.pool.usage(sum(m.logical_blocks for m in self.members),
                               group_blocks=tuple(self.group_blocks()),
                               tier_blocks=(tuple(x.num_used for x in t.tiers)
                                            if t is not None else ()))

    def group_used_slots(self, i: int) -> int:
        """Slots holding a token in group ``i``'s blocks (a block shared by forks once)."""
        assert not self.supports_swap or not self.cpu.ref, "swapped tables hold CPU ids"
        fill = self.pool.fill
        return sum(fill[b] for b in self.members[i].held_blocks())

    def group_blocks(self) -> list[int]:
        """Blocks each group's tables hold now (a block shared by forks counted once per
        table that holds it)."""
        return [m.logical_blocks for m in self.members]
