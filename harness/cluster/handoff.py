"""A request's KV blocks handed from a prefill replica to a decode replica, on the KV
managers' own operations (no manager knows it is disaggregated):

- **hold** (prefill side): when the prompt's prefill ends, its request finishes there
  (``max_tokens=1``) and frees its blocks into the prefix cache; a hold sequence takes
  them back at once (a prefix hit on the blocks just released), so that they stay until
  the decode side has read them, as vLLM's NIXL connector delays the free of a finished
  prefill's blocks;
- **reservation** (decode side): the blocks the request will hit there, taken before the
  transfer, as vLLM's decode scheduler allocates a remote prefill's blocks before it
  pulls them: the decode side's own prefix cache (device, then its lower tiers) serves
  what it holds, and only the rest is moved. The reservation's blocks are named as the
  prompt's chain, so the request, once it lands, finds every one as a prefix hit and
  computes only its last partial block (vLLM computes only its last token: a few
  tokens' difference in one decode step). The reservation is let go once the request
  holds the blocks itself (:meth:`Reservation.release`).

The full blocks of the prompt move; the last, partial one is computed on the decode side
(it is not named, so no lookup could find it).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

from harness.kv.base import Demand, KVManager
from harness.kv.evicting import PolicyKVManager
from harness.kv.paged import PagedKVManager
from harness.sched.sequence import Sequence, SequenceGroup


def movable_manager(kv: KVManager) -> PagedKVManager | None:
    """``kv`` as a manager whose named blocks can be handed over (a plain paged pool with
    its prefix cache on), or None: a window or eviction policy rewrites or gives back
    blocks, KV cache groups keep a plan per group, contiguous storage has no blocks."""
    if isinstance(kv, PagedKVManager) and not isinstance(kv, PolicyKVManager) \
            and kv.enable_prefix_caching:
        return kv
    return None


def full_blocks(group: SequenceGroup, block_size: int) -> int:
    """The prompt's blocks that move: every full one but a last block the lookup never
    finds (the last prompt token is always computed: PagedKVManager.lookup_prefix)."""
    return (len(group.prompt_ids) - 1) // block_size


@contextlib.contextmanager
def uncounted(kv: PagedKVManager) -> Iterator[None]:
    """The manager's counters as they were before: a handoff's lookups are bookkeeping,
    not prompts looked up (the request's own admission counts its prompt once)."""
    st = kv.stats
    before = dataclasses.replace(st)
    try:
        yield
    finally:
        for f in dataclasses.fields(st):  # in place: readers may hold the object
            setattr(st, f.name, getattr(before, f.name))


@dataclass
class Reservation:
    """A sequence of no request's own (a negative id) holding blocks for one: the blocks
    of ``table`` in prompt order; the first ``hits`` were the holder's already (its
    prefix cache's), the others (``moved``) are the transfer's."""

    kv: PagedKVManager
    seq: Sequence
    hits: int
    moved: int

    @property
    def table(self) -> list[int]:
        return self.kv.table_of(self.seq)

    def release(self) -> None:
        """Let the blocks go (into the prefix cache, named): the request took them."""
        self.kv.free(self.seq)


def hold(kv: PagedKVManager, group: SequenceGroup, seq_id: int) -> Reservation:
    """Pin the prompt's full blocks ``group`` (finished this step) just released into the
    prefix cache of ``kv``; only device blocks (a block already gone down to a lower tier
    is not loaded back for this)."""
    seq = Sequence(seq_id, group, list(group.prompt_ids))
    with uncounted(kv):
        hit = kv.lookup_prefix(seq)
        kv.allocate_group([Demand(seq, 0, hit.blocks, [])])
    return Reservation(kv, seq, len(hit.blocks), 0)


def reserve(kv: PagedKVManager, group: SequenceGroup, seq_id: int, blocks: int,
            spare: int) -> Reservation | None:
    """Take ``blocks`` leading prompt blocks of ``group`` in ``kv``: its prefix cache's
    hits (device blocks referenced, lower-tier blocks loaded with its next step) and
    fresh blocks for the rest. None when that would leave fewer than ``spare`` blocks
    above the watermark (each request already on its way there needs one for its last
    block, and this one too): admission's own watermark, with their tails kept free."""
    seq = Sequence(seq_id, group, list(group.prompt_ids))
    bs = kv.block_size
    hit = kv.lookup_prefix(seq)
    n_dev = min(len(hit.blocks), blocks)
    loads = hit.loads[:max(0, blocks - n_dev)]
    hits = n_dev + len(loads)
    demand = Demand(seq, (blocks - hits) * bs, hit.blocks[:n_dev], loads)
    if kv.blocks_needed([demand]) + spare > kv.pool.num_free - kv.watermark_blocks:
        return None
    with uncounted(kv):
        kv.allocate_group([demand])
    return Reservation(kv, seq, hits, blocks - hits)
