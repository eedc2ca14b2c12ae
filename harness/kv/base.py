"""What the scheduler needs from a KV manager, and the records they exchange.

Two managers implement :class:`KVManager`: :class:`~harness.kv.paged.PagedKVManager`
(blocks, prefix caching, copy-on-write; with an eviction policy,
:class:`~harness.kv.evicting.EvictingKVManager`) and
:class:`~harness.kv.contiguous.ContiguousKVManager` (one first-fit range per sequence).
The scheduler is written against these Protocols only. A manager owns where every
sequence's K/V lives (its block table); a :class:`~harness.sched.sequence.Sequence` holds
only tokens, the computed count and a status. Managers never touch tensors.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from harness.kv.ledger import ReservationLedger
from harness.kv.tiers import TierHit, TierOp

if TYPE_CHECKING:  # only for annotations: kv never imports the scheduler at run time
    import numpy as np

    from harness.sched.sequence import Sequence


@dataclass(slots=True, frozen=True)
class CopyOp:
    """Copy ``num_slots`` token slots of K/V from ``src`` to ``dst`` (slot indices).

    ``move``: the tokens move (compaction), so the source slots hold nothing afterwards (a
    backend with per-slot metadata clears theirs after copying it). The moves of one
    compaction have disjoint sources and destinations, so a backend may apply a run of
    them as one gather and scatter.

    ``share``: the share of a whole token's K/V one slot holds: 1 for the pools whose slot
    is a token (all layers, all KV heads), 1 / (layers x KV heads) where a slot is one
    (layer, KV head) of a token (harness.kv.headwise); the what-if charges a copy's bytes
    by it."""

    src: int
    dst: int
    num_slots: int
    move: bool = False
    share: float = 1.0


@dataclass(slots=True)
class PrefixHit:
    """A prompt's cached prefix: ``blocks``, device blocks holding its first blocks, then
    ``loads``, the blocks after them found in a lower tier (harness.kv.tiers), each to be
    copied into a fresh device block before the forward.

    ``compressed``: a compressed prefix (harness.kv.compressed) stands for the prompt's
    first ``compressed`` tokens, and ``blocks`` hold what the method kept of them (fewer);
    0: each block holds ``block_size`` of the prompt's tokens."""

    blocks: list[int] = field(default_factory=list)
    loads: list[TierHit] = field(default_factory=list)
    compressed: int = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks) + len(self.loads)

    def num_tokens(self, block_size: int) -> int:
        """The prompt tokens the hit spares computing."""
        return self.compressed or self.num_blocks * block_size


@dataclass(slots=True)
class Demand:
    """A sequence asking for ``num_tokens`` more slots, after its prefix hit: the device
    blocks ``hit_blocks`` reused, then the lower-tier blocks ``loads`` loaded (or, with
    ``compressed`` > 0, a compressed prefix standing for that many tokens: PrefixHit)."""

    seq: Sequence
    num_tokens: int
    hit_blocks: list[int] = field(default_factory=list)
    loads: list[TierHit] = field(default_factory=list)
    compressed: int = 0

    @classmethod
    def after(cls, seq: Sequence, num_tokens: int, hit: PrefixHit) -> Demand:
        return cls(seq, num_tokens, hit.blocks, hit.loads, hit.compressed)

    @property
    def num_hit_blocks(self) -> int:
        return len(self.hit_blocks) + len(self.loads)

    def num_hit_tokens(self, block_size: int) -> int:
        """The tokens the hit spares computing (where this demand's new tokens start)."""
        return self.compressed or self.num_hit_blocks * block_size


@dataclass(slots=True)
class KVUsage:
    """Accounting snapshot, in token slots unless the name says blocks."""

    total_slots: int
    reserved_slots: int  # slots held by live sequences (a shared block counts once)
    used_slots: int  # reserved slots holding a live token's K/V
    free_blocks: int  # paged: plain free; contiguous: 0
    cached_free_blocks: int  # paged: ref 0 but still hashed (evictable)
    shared_blocks: int  # blocks held by more than one table
    logical_blocks: int  # sum of table lengths: what would be held without sharing
    held_blocks: int  # distinct device blocks held (paged; 0 for contiguous)
    tier_blocks: tuple[int, ...] = ()  # blocks held in each lower tier (cpu, disk)
    group_blocks: tuple[int, ...] = ()  # KV cache groups: blocks each group's tables hold


@dataclass(slots=True)
class KVStats:
    """Counters of a run, written by the manager only (collectors read them)."""

    prefix_query_tokens: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int = 0  # of those, found in blocks other requests computed
    self_hit_tokens: int = 0  # found in blocks the request itself computed (recompute)
    cow_copies: int = 0
    evicted_tokens: int = 0  # tokens an eviction policy gave back
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    # Prompt blocks computed again because their content was evicted from the device
    # within the run (harness.kv.paged: the run of them right after a prompt's hits).
    regret_blocks: int = 0
    regret_tokens: int = 0


@dataclass(slots=True)
class CacheOps:
    """What the backend must do to its tensors before the next forward, in this order:
    ``tier_ops`` (blocks written to, spilled between and loaded from the lower tiers, in
    order), ``invalidated`` slots hold nothing any more (a backend that keeps per-slot
    metadata, as h2o's positions, clears it), then ``copies``."""

    copies: list[CopyOp] = field(default_factory=list)
    invalidated: list[int] = field(default_factory=list)
    tier_ops: list[TierOp] = field(default_factory=list)


@dataclass(slots=True)
class StepScores:
    """What an eviction policy needs from one forward, in one device-to-host transfer:
    ``values[i]`` is the score slot ``slots[i]`` earned this step (its meaning is the
    policy's: e.g. attention received, summed over layers, heads and queries).
    slots: int64 (N,) distinct; values: float64 (N,)."""

    slots: np.ndarray
    values: np.ndarray


class KVManager(Protocol):
    """Owns where each sequence's K/V lives. Pure bookkeeping: no tensors."""

    block_size: int
    ledger: ReservationLedger
    stats: KVStats

    def slots_needed(self, prompt_len: int, max_tokens: int, n: int) -> int:
        """Slots a request of this shape holds at most (all its tokens, or its budget)."""
        ...

    def admission_error(self, prompt_len: int, max_tokens: int, n: int) -> str | None:
        """Why a request of this shape can never fit (None if it can)."""
        ...

    def lookup_prefix(self, seq: Sequence) -> PrefixHit:
        """Cached blocks that hold a prefix of ``seq``'s tokens, on the device and then in
        lower tiers (no side effects)."""
        ...

    def can_allocate(self, demands: list[Demand], watermark: bool) -> bool:
        """Whether every demand can be met at once (keeping the watermark if asked: an
        admission must leave that much free, so it does not preempt at once)."""
        ...

    def allocate_group(self, demands: list[Demand]) -> list[list[int]]:
        """Meet demands that :meth:`can_allocate` accepted together (prefix hits first, so
        a later demand cannot evict a block promised to an earlier one; lower-tier hits
        are loaded into fresh blocks). Returns, per demand, the slots of its
        ``num_tokens`` new tokens (after its hit blocks)."""
        ...

    def append_slot(self, seq: Sequence) -> int | None:
        """Decode fast path: a slot for token ``seq.num_computed`` (None: no room)."""
        ...

    def max_chunk(self, seq: Sequence) -> int | None:
        """Most tokens one step may add to ``seq`` (eviction managers bound it; the
        scheduler splits prefills accordingly, with or without chunked prefill)."""
        ...

    def fork(self, parent: Sequence, child: Sequence) -> None: ...

    def free(self, seq: Sequence) -> None: ...

    def holds(self, seq: Sequence) -> bool:
        """Whether ``seq`` holds any K/V here."""
        ...

    def held_tokens(self, seq: Sequence) -> int:
        """Tokens whose K/V ``seq`` holds now (an eviction method's count; every computed
        token without one): what a method's declared reads are a function of
        (harness.backends.costs)."""
        ...

    def tables(self, seqs: list[Sequence]) -> list[list[int]]:
        """Each sequence's table in the form attention reads it (see the manager)."""
        ...

    def take_cache_ops(self) -> CacheOps:
        """Copies and invalidations queued since the last call."""
        ...

    def end_forward(self) -> None:
        """The step's forward is done: advance the ledger's clock (blocks freed from now
        on were held during this step)."""
        ...

    def observe(self, seqs: list[Sequence], scores: StepScores | None) -> None:
        """After the step's tokens are appended: an eviction policy decides what the step's
        still-running ``seqs`` give back, and frees it."""
        ...

    def record_external(self, next_need: int | None) -> int:
        """Account this step's external fragmentation (free slots that cannot serve a next
        request needing ``next_need`` slots); returns it."""
        ...

    def usage(self) -> KVUsage: ...

    def reservation_size(self, prompt_len: int, max_tokens: int) -> int:
        """Slots a new sequence of this shape takes at admission (for external frag)."""
        ...


class SwapManager(Protocol):
    """A KV manager that can move a group's blocks to CPU and back (paged, exact)."""

    def can_swap_out(self, seqs: list[Sequence]) -> bool: ...

    def can_swap_in(self, seqs: list[Sequence]) -> bool: ...

    def swap_out(self, seqs: list[Sequence]) -> list[tuple[int, int]]:
        """(device block, cpu block) copies."""
        ...

    def swap_in(self, seqs: list[Sequence]) -> list[tuple[int, int]]:
        """(cpu block, device block) copies."""
        ...


class DeferredNames(Protocol):
    """Names of full blocks made only when something could read them (prefix caching): a
    block may carry a *pending name* (any object not an int, given by
    ``PagedKVManager.name_pending``) until the names under one of its ancestors' hashes
    are made. The pool asks this hook before it reads names (a lookup, a naming, a
    swap-in) and tells it of each pending block it evicts. The roofline's fast path is
    the one user (harness/roofline/fastpath); installed by
    ``PagedKVManager.set_deferred_names``."""

    @property
    def pending(self) -> Container[int]:
        """The named hashes that have pending names under them."""
        ...

    def materialize(self, roots: list[int]) -> None:
        """Make the names under each of ``roots`` now (entered with
        ``PagedKVManager.enter_deferred``)."""
        ...

    def materialize_all(self) -> None:
        """Make every pending name (tests and debugging read the whole index)."""
        ...

    def evicted(self, name: object) -> None:
        """A block carrying pending name ``name`` was evicted (its name is gone)."""
        ...
