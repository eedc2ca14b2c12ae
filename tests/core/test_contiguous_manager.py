"""Narrated scenarios for the contiguous KV manager on a 64-slot arena (max_model_len 32).

Each test walks the arena through a story and asserts exact range starts and the exact
hole list after each step, saying why first-fit put each range where it did.
"""

from __future__ import annotations

import pytest

from harness.kv.base import CopyOp, Demand
from harness.kv.contiguous import ContiguousKVManager
from harness.sched.sequence import SeqStatus, Sequence
from tests.helpers import decode, make_seq

ARENA = 64
MAX_LEN = 32


def mgr(policy: str = "exact", slots: int = ARENA) -> ContiguousKVManager:
    return ContiguousKVManager(slots, policy=policy, max_model_len=MAX_LEN, watermark=0.0)


def admit(m: ContiguousKVManager, seq: Sequence) -> int:
    """Admit ``seq``'s whole prompt as the scheduler would; returns its range start."""
    d = Demand(seq, seq.num_tokens)
    assert m.can_allocate([d], watermark=True)
    m.allocate(d)
    seq.num_computed = seq.num_tokens
    return m.range_of(seq)[0]


def req(prompt_len: int, max_tokens: int, n: int = 1) -> Sequence:
    return make_seq(list(range(1, prompt_len + 1)), max_tokens=max_tokens, n=n)


def fork(m: ContiguousKVManager, parent: Sequence, seq_id: int) -> Sequence:
    """What ``Scheduler.fork`` does: a sibling in the same group, sharing the prefix."""
    child = Sequence(seq_id, parent.group, list(parent.token_ids))
    child.num_prompt_tokens = parent.num_prompt_tokens
    child.num_computed = parent.num_computed
    m.fork(parent, child)
    parent.group.seqs.append(child)
    return child


def finish(m: ContiguousKVManager, seq: Sequence) -> None:
    """What ``Scheduler._finish_seq`` does: mark it finished, then give back its slots."""
    seq.status = SeqStatus.FINISHED
    m.free(seq)


@pytest.mark.parametrize(("policy", "size", "starts", "holes"), [
    # 5 + 6 = 11 slots needed. "max" takes max_model_len whatever the request: two fit.
    ("max", 32, [0, 32], []),
    # pow2 rounds 11 up to 16: four fit exactly, the arena is left with no hole at all.
    ("pow2", 16, [0, 16, 32, 48], []),
    # exact takes 11: five fit back to back, 9 slots left over at the end.
    ("exact", 11, [0, 11, 22, 33, 44], [(55, 9)]),
])
def test_policy_reservation_sizes_and_starts(policy: str, size: int, starts: list[int],
                                             holes: list[tuple[int, int]]) -> None:
    m = mgr(policy)
    assert m.reservation_size(5, 6) == size
    seqs = [req(5, 6) for _ in starts]
    assert [admit(m, s) for s in seqs] == starts
    assert all(m.range_of(s)[1] == size for s in seqs)
    assert m.arena.holes() == holes
    u = m.usage()
    assert u.reserved_slots == size * len(starts) and u.used_slots == 5 * len(starts)
    # One more of the same shape does not fit anywhere.
    assert not m.can_allocate([Demand(req(5, 6), 5)], watermark=False)


def test_reservation_sizes_are_capped_at_max_model_len() -> None:
    # 20 + 20 = 40 > 32: every policy reserves max_model_len, never more.
    assert [mgr(p).reservation_size(20, 20) for p in ("max", "pow2", "exact")] == [32] * 3
    # Already a power of two: pow2 does not round 16 up to 32.
    assert mgr("pow2").reservation_size(10, 6) == 16
    assert mgr("pow2").reservation_size(10, 7) == 32 and mgr("exact").reservation_size(10, 7) == 17


def test_unknown_policy_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="max, pow2, exact"):
        ContiguousKVManager(64, policy="oracle", max_model_len=32)


def test_first_fit_into_holes_and_coalescing_on_free() -> None:
    m = mgr("exact")
    a, b, c, d = (req(4, 6) for _ in range(4))  # 10 slots each
    assert [admit(m, s) for s in (a, b, c, d)] == [0, 10, 20, 30]
    assert m.arena.holes() == [(40, 24)]

    # Freeing b opens a hole between a and c; nothing is adjacent to merge with.
    m.free(b)
    assert m.arena.holes() == [(10, 10), (40, 24)]
    # First fit: an 8-slot request takes the first hole that is big enough, the one b left,
    # and leaves a 2-slot sliver behind it.
    e = req(4, 4)
    assert admit(m, e) == 10
    assert m.arena.holes() == [(18, 2), (40, 24)]
    # 12 slots do not fit the sliver: the range goes to the tail.
    f = req(6, 6)
    assert admit(m, f) == 40
    assert m.arena.holes() == [(18, 2), (52, 12)]

    # c (20..30) frees next to the sliver before it: they merge into one 12-slot hole.
    m.free(c)
    assert m.arena.holes() == [(18, 12), (52, 12)]
    # a (0..10) has e after it: a new hole at the front, nothing to merge.
    m.free(a)
    assert m.arena.holes() == [(0, 10), (18, 12), (52, 12)]
    # e (10..18) bridges two holes: all three become one.
    m.free(e)
    assert m.arena.holes() == [(0, 30), (52, 12)]
    # d (30..40) merges with the hole before it only; f (40..52) then joins both sides.
    m.free(d)
    assert m.arena.holes() == [(0, 40), (52, 12)]
    m.free(f)
    assert m.arena.holes() == [(0, ARENA)]
    assert m.arena.free_slots == ARENA
    assert m.usage().reserved_slots == 0 and m.usage().used_slots == 0


def test_external_fragmentation_counts_holes_too_small_for_the_next_request() -> None:
    m = mgr("exact")
    a, b, c, d = (req(4, 6) for _ in range(4))  # 0, 10, 20, 30
    for s in (a, b, c, d):
        admit(m, s)
    e = req(4, 8)  # 12 slots at 40..52, leaving a 12-slot tail
    assert admit(m, e) == 40
    m.free(b)
    m.free(d)
    assert m.arena.holes() == [(10, 10), (30, 10), (52, 12)]
    assert m.arena.free_slots == 32

    # A 10-slot request fits every hole: nothing is fragmented for it.
    assert m.external_fragmentation(10) == 0
    # An 11-slot one fits only the tail: the two 10-slot holes are lost to it.
    assert m.external_fragmentation(11) == 20
    # 13 slots: 32 are free but no hole is big enough, and admission agrees.
    assert m.external_fragmentation(13) == 32
    assert not m.can_allocate([Demand(req(5, 8), 5)], watermark=False)
    # No one waiting: nothing to measure against.
    assert m.external_fragmentation(None) == 0


def test_group_of_three_parks_ranges_and_forks_into_them() -> None:
    m = mgr("exact")
    p = req(4, 4, n=3)  # 8 slots per sequence
    # One demand, but admission reserves all three ranges: the forks must never fail.
    assert m.can_allocate([Demand(p, 4)], watermark=False)
    assert admit(m, p) == 0
    assert m.arena.holes() == [(24, 40)]
    u = m.usage()
    assert (u.reserved_slots, u.used_slots) == (24, 4)  # two ranges parked, empty
    decode(m, p, 50)

    # Forks pop the parked ranges last-parked first: 16, then 8. Each copies the parent's
    # 5 filled slots into the child's range.
    c1 = fork(m, p, 901)
    assert m.range_of(c1)[0] == 16 and m.range_of(c1)[1] == 8
    assert m.take_cache_ops().copies == [CopyOp(src=0, dst=16, num_slots=5)]
    c2 = fork(m, p, 902)
    assert m.range_of(c2)[0] == 8
    assert m.take_cache_ops().copies == [CopyOp(src=0, dst=8, num_slots=5)]
    assert m.arena.holes() == [(24, 40)]  # no new range was reserved
    assert m.usage().used_slots == 15
    decode(m, c1, 60)
    assert m.slot(c1, 5) == 21 and m.usage().used_slots == 16

    # A pruned beam: its range stays with the group, emptied, for the next fork.
    finish(m, c1)
    assert not m.holds(c1) and m.range_of(c1)[1] == 0
    assert m.arena.holes() == [(24, 40)]
    assert (m.usage().reserved_slots, m.usage().used_slots) == (24, 10)
    c3 = fork(m, p, 903)
    assert m.range_of(c3)[0] == 16
    assert m.take_cache_ops().copies == [CopyOp(src=0, dst=16, num_slots=5)]

    # The parent finishing parks its range too: two siblings still live.
    finish(m, p)
    assert m.arena.holes() == [(24, 40)] and m.usage().used_slots == 10
    finish(m, c3)
    assert m.arena.holes() == [(24, 40)]
    # The last live sequence releases its range and every parked one: all three merge.
    finish(m, c2)
    assert m.arena.holes() == [(0, ARENA)]
    assert (m.usage().reserved_slots, m.usage().used_slots) == (0, 0)
    t = m.ledger.finish()
    assert t.reserved == t.used + t.reservation + t.internal


def test_group_of_three_needs_three_holes_at_admission() -> None:
    m = mgr("exact")
    blocker = req(10, 10)  # 20 slots at 0..20, leaving 44: room for two 20s, not three
    admit(m, blocker)
    g = req(10, 10, n=3)
    assert not m.can_allocate([Demand(g, 10)], watermark=False)
    assert m.can_allocate([Demand(req(10, 10, n=2), 10)], watermark=False)


def test_admission_error_names_the_fix() -> None:
    msg = mgr("max").admission_error(5, 6, 3)
    assert msg is not None
    assert "needs 3 x 32 contiguous slots (reserve=max) but the arena has 64" in msg
    assert "backend.reserve=exact" in msg
    assert mgr("max").admission_error(5, 6, 2) is None  # 2 x 32 fills the arena exactly
    assert mgr("exact").admission_error(5, 6, 3) is None  # 3 x 11
    assert mgr("exact").admission_error(20, 20, 3) is not None  # 3 x 32 (capped) > 64


def test_a_range_never_grows() -> None:
    m = mgr("exact")
    s = req(4, 2)  # 6 slots at 0..6
    # Chunked prefill: the prompt arrives in two pieces within its own range.
    d = Demand(s, 3)
    assert m.can_allocate([d], watermark=False)
    m.allocate(d)
    s.num_computed = 3
    assert m.range_of(s)[0] == 0 and m.usage().used_slots == 3
    m.allocate(Demand(s, 1))
    s.num_computed = 4
    neighbour = req(4, 4)
    assert admit(m, neighbour) == 6  # right behind s: s could not grow in place anyway
    decode(m, s, 10)
    decode(m, s, 11)
    assert m.usage().used_slots == 6 + 4
    # Full: one more token does not fit, though 50 slots are free elsewhere.
    s.token_ids.append(12)
    assert not m.can_allocate([Demand(s, 1)], watermark=False)
    assert m.append_slot(s) is None  # the scheduler's decode fast path agrees
    assert m.arena.free_slots == 50
    # The refusal changed nothing.
    assert m.range_of(s)[0] == 0 and m.range_of(s)[1] == 6 and m.arena.holes() == [(14, 50)]
