"""Contiguous KV manager: one range of token slots per sequence, reserved at admission.

This is how serving systems before paging held the cache (FasterTransformer, Orca), kept
so the harness can measure what paging removes. The arena is one flat run of slots; each
sequence reserves ``reservation_size`` slots first-fit, so holes between live ranges are
real external fragmentation. Policies (``reserve``):

* ``max``: ``max_model_len`` slots, whatever the request (Orca "max")
* ``pow2``: prompt + max_tokens rounded up to a power of two (Orca "pow2")
* ``exact``: prompt + max_tokens (Orca "oracle", given the output length bound)

A group of n samples/beams holds n ranges from its admission: the ranges not yet used by
a sequence are *parked* (reserved, empty), so a fork never fails for lack of a hole.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

from harness.kv.base import CacheOps, CopyOp, Demand, KVStats, KVUsage, PrefixHit, StepScores
from harness.kv.ledger import ReservationLedger

if TYPE_CHECKING:
    from harness.sched.sequence import Sequence

POLICIES = ("max", "pow2", "exact")


class _Arena:
    """Free extents of a flat slot range, sorted by start; coalesced on free."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.starts: list[int] = [0]
        self.lengths: dict[int, int] = {0: size}
        self.free_slots = size

    def first_fit(self, n: int) -> int | None:
        for s in self.starts:  # O(holes): bounded by the number of live ranges + 1
            if self.lengths[s] >= n:
                return s
        return None

    def take(self, start: int, n: int) -> None:
        length = self.lengths.pop(start)
        i = bisect.bisect_left(self.starts, start)
        del self.starts[i]
        if length > n:
            self.starts.insert(i, start + n)
            self.lengths[start + n] = length - n
        self.free_slots -= n

    def give(self, start: int, n: int) -> None:
        self.free_slots += n
        i = bisect.bisect_left(self.starts, start)
        # Merge with the following hole, then with the preceding one.
        if i < len(self.starts) and self.starts[i] == start + n:
            n += self.lengths.pop(self.starts[i])
            del self.starts[i]
        if i > 0 and self.starts[i - 1] + self.lengths[self.starts[i - 1]] == start:
            self.lengths[self.starts[i - 1]] += n
        else:
            self.starts.insert(i, start)
            self.lengths[start] = n

    def holes(self) -> list[tuple[int, int]]:
        return [(s, self.lengths[s]) for s in self.starts]


class ContiguousKVManager:
    """Reservation bookkeeping over a flat arena of ``num_slots`` token slots."""

    supports_swap = False
    block_size = 1  # slots are addressed one by one

    def __init__(self, num_slots: int, *, policy: str, max_model_len: int,
                 watermark: float = 0.01, granule: int = 16) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown reserve policy {policy!r}; known: {', '.join(POLICIES)}")
        self.policy = policy
        self.max_model_len = max_model_len
        self.arena = _Arena(num_slots)
        self.ledger = ReservationLedger()
        # The paged manager's rule (a share of the capacity, at least one block: here
        # ``granule`` slots, the run's block size), so compared backends admit alike.
        self.watermark_slots = (max(granule, int(watermark * num_slots)) if watermark > 0
                                else 0)
        self._parked: dict[int, list[tuple[int, int]]] = {}  # request id -> (start, size)
        self._range: dict[int, tuple[int, int]] = {}  # seq id -> (start, capacity)
        self._reserved = 0
        self._used = 0
        self._fills: dict[int, int] = {}  # range start -> slots filled
        self._copies: list[CopyOp] = []
        self.stats = KVStats()

    # -- per-sequence state --------------------------------------------------------------
    def range_of(self, seq: Sequence) -> tuple[int, int]:
        """(first slot, capacity) of ``seq``'s range; (0, 0) when it holds none."""
        return self._range.get(seq.seq_id, (0, 0))

    def holds(self, seq: Sequence) -> bool:
        return seq.seq_id in self._range

    def held_tokens(self, seq: Sequence) -> int:
        """Tokens whose K/V ``seq`` holds: every computed one."""
        return seq.num_computed if seq.seq_id in self._range else 0

    def tables(self, seqs: list[Sequence]) -> list[list[int]]:
        """One entry per sequence: the first slot of its range (a single block as long as
        the range; attention reads slots ``start + j``)."""
        return [[self._range[s.seq_id][0]] for s in seqs]

    # -- sizes -----------------------------------------------------------------------
    def reservation_size(self, prompt_len: int, max_tokens: int) -> int:
        need = min(prompt_len + max_tokens, self.max_model_len)
        if self.policy == "max":
            return self.max_model_len
        if self.policy == "pow2":
            return min(1 << (need - 1).bit_length(), self.max_model_len)
        return need

    def _size_for(self, seq: Sequence) -> int:
        return self.reservation_size(seq.num_prompt_tokens, seq.group.params.max_tokens)

    def slots_needed(self, prompt_len: int, max_tokens: int, n: int) -> int:
        return self.reservation_size(prompt_len, max_tokens) * n

    def admission_error(self, prompt_len: int, max_tokens: int, n: int) -> str | None:
        size = self.reservation_size(prompt_len, max_tokens)
        if size * n > self.arena.size:
            return (f"needs {n} x {size} contiguous slots (reserve={self.policy}) but the "
                    f"arena has {self.arena.size}: raise cache.kv_budget, lower max_tokens "
                    f"or use backend.reserve=exact")
        return None

    # -- allocation --------------------------------------------------------------------
    def lookup_prefix(self, seq: Sequence) -> PrefixHit:
        return PrefixHit()  # no sharing between contiguous ranges

    def can_allocate(self, demands: list[Demand], watermark: bool) -> bool:
        sizes: list[int] = []
        seen: set[int] = set()
        for d in demands:
            seq = d.seq
            cap = self.range_of(seq)[1]
            if cap:
                if seq.num_computed + d.num_tokens > cap:
                    return False  # a range never grows
                continue
            if seq.num_computed + d.num_tokens > self._size_for(seq):
                return False  # more than the range it would reserve
            g = seq.group
            if g.request_id in seen:
                continue
            seen.add(g.request_id)
            parked = len(self._parked.get(g.request_id, ()))
            live_reserved = sum(1 for s in g.live_seqs if self.holds(s))
            unreserved = sum(1 for s in g.live_seqs if not self.holds(s))
            want = max(g.params.n - live_reserved, unreserved) - parked
            sizes += [self._size_for(seq)] * max(0, want)
        if not sizes:
            return True
        if watermark and self.arena.free_slots - sum(sizes) < self.watermark_slots:
            return False
        # First-fit the new ranges on a scratch copy of the holes.
        holes = [length for _, length in self.arena.holes()]
        for n in sizes:
            for i, length in enumerate(holes):
                if length >= n:
                    holes[i] -= n
                    break
            else:
                return False
        return True

    def _reserve(self, size: int) -> int:
        start = self.arena.first_fit(size)
        assert start is not None, "can_allocate must be called first"
        self.arena.take(start, size)
        self._reserved += size
        self.ledger.open(start, size)
        return start

    def allocate_group(self, demands: list[Demand]) -> list[list[int]]:
        return [self.allocate(d) for d in demands]

    def allocate(self, d: Demand) -> list[int]:
        seq = d.seq
        assert not d.hit_blocks
        if not self.holds(seq):
            g = seq.group
            self._claim(seq, self._size_for(seq))
            size = self.range_of(seq)[1]
            parked = self._parked[g.request_id]
            live_reserved = sum(1 for s in g.live_seqs if self.holds(s))
            for _ in range(g.params.n - live_reserved - len(parked)):
                parked.append((self._reserve(size), size))
        start, cap = self.range_of(seq)
        end = seq.num_computed + d.num_tokens
        assert end <= cap, "a contiguous range never grows"
        self._set_fill(seq, end)
        return list(range(start + seq.num_computed, start + end))

    def append_slot(self, seq: Sequence) -> int | None:
        """Fast path of ``allocate(Demand(seq, 1))``: None when the range is full."""
        pos = seq.num_computed
        start, cap = self.range_of(seq)
        if pos >= cap:
            return None
        self._set_fill(seq, pos + 1)
        return start + pos

    def _set_fill(self, seq: Sequence, fill: int) -> None:
        start = self._range[seq.seq_id][0]
        self._used += fill - self._fills.get(start, 0)
        self._fills[start] = fill
        self.ledger.fill(start, fill)

    def max_chunk(self, seq: Sequence) -> int | None:
        return None

    # -- the roofline's fast path (harness/roofline/fastpath): in-place writes in bulk ---
    def ramp_fill(self, start: int, k: int) -> None:
        """The range at ``start`` took one more token at each of the last ``k`` steps
        (its used slots were counted as they happened: :meth:`add_used`)."""
        self._fills[start] += k
        self.ledger.ramp(start, k)

    def add_used(self, n: int) -> None:
        """``n`` in-place writes this step, their ranges' fills settled later."""
        self._used += n

    def slot(self, seq: Sequence, pos: int) -> int:
        """Physical slot of token ``pos`` of ``seq`` (tests and debugging)."""
        return self._range[seq.seq_id][0] + pos

    def fork(self, parent: Sequence, child: Sequence) -> None:
        assert not self.holds(child)
        p_start, p_cap = self._range[parent.seq_id]
        if (not self._parked.get(parent.group.request_id)
                and self.arena.first_fit(p_cap) is None):
            raise RuntimeError("contiguous fork found no hole; group under-reserved")
        self._claim(child, p_cap)
        n = parent.num_computed
        if n:
            self._copies.append(CopyOp(p_start, self._range[child.seq_id][0], n))
        self._set_fill(child, n)

    def _claim(self, seq: Sequence, size: int) -> None:
        """Give ``seq`` a range its group parked, or reserve a new one of ``size``."""
        parked = self._parked.setdefault(seq.group.request_id, [])
        start, size = parked.pop() if parked else (self._reserve(size), size)
        self._range[seq.seq_id] = (start, size)

    def _close(self, start: int) -> None:
        """End the range's ledger epoch and forget its fill (it holds no tokens now)."""
        self.ledger.close(start)
        self._used -= self._fills.pop(start, 0)

    def _release_range(self, start: int, size: int) -> None:
        self._close(start)
        self._reserved -= size
        self.arena.give(start, size)

    def free(self, seq: Sequence) -> None:
        if not self.holds(seq):
            return
        start, size = self._range.pop(seq.seq_id)
        g = seq.group
        rid = g.request_id
        if any(self.holds(s) for s in g.seqs if s is not seq):
            # Siblings live on: keep the range for the group's next fork, emptied.
            self._close(start)
            self.ledger.open(start, size)
            self._parked.setdefault(rid, []).append((start, size))
            return
        self._release_range(start, size)
        for p_start, p_size in self._parked.pop(rid, []):
            self._release_range(p_start, p_size)

    def take_cache_ops(self) -> CacheOps:
        copies, self._copies = self._copies, []
        return CacheOps(copies=copies)

    def end_forward(self) -> None:
        self.ledger.now += 1

    def observe(self, seqs: list[Sequence], scores: StepScores | None) -> None:
        return None  # nothing is ever evicted from a reserved range

    # -- accounting ----------------------------------------------------------------------
    def usage(self) -> KVUsage:
        return KVUsage(
            total_slots=self.arena.size,
            reserved_slots=self._reserved,
            used_slots=self._used,
            free_blocks=0,
            cached_free_blocks=0,
            shared_blocks=0,
            logical_blocks=0,
            held_blocks=0,
        )

    def external_fragmentation(self, next_need: int | None) -> int:
        """Free slots in holes too small for a next request needing ``next_need``."""
        if next_need is None:
            return 0
        return sum(length for _, length in self.arena.holes() if length < next_need)

    def record_external(self, next_need: int | None) -> int:
        ext = self.external_fragmentation(next_need)
        self.ledger.add_external(ext)
        return ext
