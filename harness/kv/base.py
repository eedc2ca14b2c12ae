"""What the scheduler needs from a KV manager, and the records they exchange.

Two managers implement it: :class:`~harness.kv.paged.PagedKVManager` (blocks, prefix
caching, copy-on-write, swap) and :class:`~harness.kv.contiguous.ContiguousKVManager`
(one first-fit range per sequence). The scheduler is written against this Protocol only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from harness.kv.ledger import ReservationLedger
from harness.sched.sequence import Sequence


@dataclass(slots=True, frozen=True)
class CopyOp:
    """Copy ``num_slots`` token slots of K/V from ``src`` to ``dst`` (slot indices)."""

    src: int
    dst: int
    num_slots: int


@dataclass(slots=True)
class Demand:
    """A sequence asking for ``num_tokens`` more slots, reusing ``hit_blocks`` first."""

    seq: Sequence
    num_tokens: int
    hit_blocks: list[int] = field(default_factory=list)


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


class KVManager(Protocol):
    """Owns where each sequence's K/V lives. Pure bookkeeping: no tensors."""

    block_size: int
    ledger: ReservationLedger
    supports_swap: bool
    prefix_hit_tokens: int
    prefix_query_tokens: int
    cow_copies: int
    evicted_tokens: int

    def slots_needed(self, prompt_len: int, max_tokens: int, n: int) -> int:
        """Slots a request of this shape holds when it has generated ``max_tokens``."""
        ...

    def admission_error(self, prompt_len: int, max_tokens: int, n: int) -> str | None:
        """Why a request of this shape can never fit (None if it can)."""
        ...

    def lookup_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks that hold a prefix of ``seq``'s tokens (no side effects)."""
        ...

    def can_allocate(self, demands: list[Demand], watermark: bool) -> bool:
        """Whether every demand can be met at once (keeping the watermark if asked)."""
        ...

    def allocate(self, demand: Demand) -> None:
        """Meet a demand that :meth:`can_allocate` accepted; advances nothing else."""
        ...

    def allocate_group(self, demands: list[Demand]) -> None:
        """Meet demands that :meth:`can_allocate` accepted together, safely for shared
        prefix hits among them."""
        ...

    def append_slot(self, seq: Sequence) -> int | None:
        """Decode fast path: a slot for token ``seq.num_computed`` (None: no room)."""
        ...

    def max_chunk(self, seq: Sequence) -> int | None:
        """Most tokens one step may add to ``seq`` (eviction managers bound it; the
        scheduler splits prefills accordingly, with or without chunked prefill)."""
        ...

    def slot(self, seq: Sequence, pos: int) -> int:
        """Physical slot of token ``pos`` of ``seq``."""
        ...

    def fork(self, parent: Sequence, child: Sequence) -> None: ...

    def free(self, seq: Sequence) -> None: ...

    def take_copies(self) -> list[CopyOp]:
        """Copies queued since the last call (copy-on-write, fork of a contiguous range)."""
        ...

    def usage(self) -> KVUsage: ...

    def external_fragmentation(self, next_need: int | None) -> int:
        """Free slots that cannot serve a next request needing ``next_need`` slots."""
        ...

    def reservation_size(self, prompt_len: int, max_tokens: int) -> int:
        """Slots a new sequence of this shape takes at admission (for external frag)."""
        ...
