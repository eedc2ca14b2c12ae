"""The reservation ledger: hand-computed slot-step integrals, then the same split measured
end to end through the paged manager as an engine drives it (one ``now`` per step)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.kv.base import Demand
from harness.kv.ledger import LedgerTotals, ReservationLedger
from harness.kv.paged import PagedKVManager
from harness.sched.sequence import Sequence
from tests.helpers import decode, make_seq


def split(t: LedgerTotals) -> tuple[int, int, int, int]:
    return (t.reserved, t.used, t.reservation, t.internal)


def test_one_epoch_filled_in_steps() -> None:
    led = ReservationLedger()
    led.open(7, 4)  # a 4-slot block, empty, at step 0
    led.now = 2
    led.fill(7, 1)
    led.now = 3
    led.fill(7, 3)
    led.now = 7
    led.close(7)
    # Held 7 steps: 28 slot-steps. Fill 0 for 2 steps, 1 for 1, 3 for 4: used 0 + 1 + 12.
    # The 3 slots that were eventually filled were empty before that: 3 * 7 - 13 = 8 slot-
    # steps of reservation. The 4th slot never held anything: 1 * 7 internal fragmentation.
    assert split(led.totals) == (28, 13, 8, 7)


def test_a_revived_block_opens_full_and_epochs_add_up() -> None:
    led = ReservationLedger()
    led.now = 1
    led.open(3, 4, fill=2)  # a prefix hit revives a block already holding 2 slots
    led.now = 5
    led.close(3)
    # 4 steps x 4 slots; 2 used all along, nothing reserved ahead, 2 empty for good.
    assert split(led.totals) == (16, 8, 0, 8)

    # Second epoch of the same unit: opened empty, filled at once, held 3 steps.
    led.now = 7
    led.open(3, 4)
    led.fill(3, 4)
    led.now = 10
    led.close(3)
    assert split(led.totals) == (16 + 12, 8 + 12, 0, 8)

    # Opened and closed in one step: held for no time, adds nothing.
    led.open(4, 4)
    led.fill(4, 2)
    led.close(4)
    assert split(led.totals) == (28, 20, 0, 8)
    led.add_external(5)
    assert led.totals.external == 5


def test_finish_closes_open_epochs_at_now() -> None:
    led = ReservationLedger()
    led.open(0, 8)
    led.now = 1
    led.open(1, 2)
    led.fill(0, 8)
    led.now = 4
    t = led.finish()
    # Unit 0: 8 slots x 4 steps = 32; empty for step 0 then full: used 24, reservation 8.
    # Unit 1: 2 slots x 3 steps, never filled: all 6 internal.
    assert split(t) == (32 + 6, 24, 8, 6)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5), st.integers(0, 2)),
                max_size=40))
def test_reserved_is_always_used_plus_reservation_plus_internal(
        events: list[tuple[int, int, int]]) -> None:
    led = ReservationLedger()
    fills: dict[int, int] = {}
    for unit, grow, dt in events:
        led.now += dt
        if unit not in fills:
            led.open(unit, 5, min(grow, 5))
            fills[unit] = min(grow, 5)
        elif grow == 0:
            led.close(unit)
            del fills[unit]
        else:
            fills[unit] = min(5, fills[unit] + grow)
            led.fill(unit, fills[unit])
        t = led.totals
        assert t.reserved == t.used + t.reservation + t.internal
        assert min(t.used, t.reservation, t.internal) >= 0
    t = led.finish()
    assert t.reserved == t.used + t.reservation + t.internal


# -- end to end through the paged manager ------------------------------------------------
BS = 4


def admit(m: PagedKVManager, seq: Sequence) -> None:
    hits = m.lookup_prefix(seq).blocks
    d = Demand(seq, seq.num_tokens - len(hits) * BS, hits)
    assert m.can_allocate([d], watermark=False)
    m.allocate(d)
    seq.num_computed = seq.num_tokens


def test_paged_partial_last_block_is_internal_fragmentation() -> None:
    m = PagedKVManager(8, BS, watermark=0.0)
    led = m.ledger

    led.now = 0
    a = make_seq([1, 2, 3, 4, 5, 6])  # block 0 full, block 1 holds 2 of 4
    admit(m, a)
    assert m.table_of(a) == [0, 1]
    led.now = 1
    decode(m, a, 7)  # block 1: 3 of 4
    led.now = 3
    m.free(a)
    # Block 0: 4 slots x 3 steps, all used from the start.
    # Block 1: 12 slot-steps; used 2 (step 0) + 3 + 3 = 8; the slot filled at step 1 was
    # reserved-ahead for 1 step; the 4th slot stayed empty for all 3 steps held: internal 3.
    assert split(led.totals) == (12 + 12, 12 + 8, 1, 3)

    # Block 0 is cached (full, hashed). A new prompt with the same first block revives it
    # at step 4 already holding its 4 slots: a second epoch with no reservation in it.
    led.now = 4
    b = make_seq([1, 2, 3, 4, 9, 9, 9, 9, 9])  # hit block 0, then blocks 2 (full), 3 (1 of 4)
    admit(m, b)
    assert m.table_of(b) == [0, 2, 3]
    led.now = 6
    m.free(b)
    # 3 blocks x 2 steps = 24; used 4 + 4 + 1 per step = 18; block 3's 3 empty slots x 2
    # steps = 6 internal.
    t = led.finish()
    assert split(t) == (24 + 24, 20 + 18, 1, 3 + 6)
    assert t.reserved == t.used + t.reservation + t.internal


def test_paged_shared_block_is_counted_once() -> None:
    m = PagedKVManager(8, BS, watermark=0.0, enable_prefix_caching=False)
    led = m.ledger
    p = make_seq([1, 2, 3, 4, 5])  # blocks 0 (full) and 1 (1 of 4)
    admit(m, p)
    c = Sequence(777, p.group, list(p.token_ids))
    c.num_computed = p.num_computed
    m.fork(p, c)
    led.now = 2
    # c writes into the shared partial block: it gets a copy (block 2) holding 1 slot, then
    # its new token makes 2. The parent keeps block 1.
    decode(m, c, 6)
    assert m.table_of(c) == [0, 2]
    led.now = 5
    m.free(c)
    m.free(p)
    # Block 0, shared by two tables for 5 steps, is reserved once: 20 slot-steps, all used.
    # Block 1: 5 steps x 4 = 20, 1 slot used all along, 3 empty for good: internal 15.
    # Block 2: steps 2..5 = 12, 2 slots used from the start, internal 2 x 3 = 6.
    assert split(led.finish()) == (20 + 20 + 12, 20 + 5 + 6, 0, 15 + 6)


def test_one_sequence_split_matches_a_hand_count() -> None:
    # One request, P prompt tokens, exactly M answers, contiguous exact reservation of
    # R = P + M slots. Step k (0..M-1) holds P + k tokens; the M-th answer is never fed
    # back, so one slot stays empty for all M steps. By hand: used = M*P + M(M-1)/2,
    # reservation = M(M-1)/2 (slots filled later), internal = M (the never-filled one).
    from harness.runner import run
    from tests.compose import tiny

    M = 9
    r = run(tiny("backend=contiguous", "backend.reserve=exact", "workload.conversations=1",
                 "workload.turns=1", f"workload.answer_tokens={M}",
                 "workload.ignore_eos=true", "cache.kv_budget=1MiB"))
    P = r.requests[0]["prompt_tokens"]
    R = P + M
    m = r.metrics
    assert m["sched.steps"] == M
    assert m["memory.reservation_pct"] == pytest.approx(100 * (M * (M - 1) / 2) / (R * M))
    assert m["memory.internal_frag_pct"] == pytest.approx(100 * M / (R * M))
    assert m["memory.waste_pct"] == pytest.approx(
        100 * (1 - (M * P + M * (M - 1) / 2) / (R * M)))


@settings(max_examples=200, deadline=None)
@given(cap=st.integers(1, 32), data=st.data())
def test_a_ramp_recorded_ahead_and_trimmed_equals_filling_tick_by_tick(
        cap: int, data: st.DataObject) -> None:
    """A decode lane's block (harness/roofline/fastpath) is opened with its writes to its last slot
    recorded ahead (``open_all(..., ramp=)``) and trimmed back (``trim``) when its writer
    stops early: the totals equal a block filled one slot per tick by ``fill``."""
    fill0 = data.draw(st.integers(0, cap - 1))
    ramp = data.draw(st.integers(0, cap - fill0))
    made = data.draw(st.integers(0, ramp))  # writes that happened: trim the rest
    t0, hold = data.draw(st.integers(0, 50)), data.draw(st.integers(0, 20))
    ahead, ref = ReservationLedger(), ReservationLedger()
    ahead.now = ref.now = t0
    ahead.open_all([5], cap, fill0, ramp=ramp)
    ref.open(5, cap, fill0)
    for i in range(1, made + 1):  # the write of tick t0 + i
        ref.now = t0 + i
        ref.fill(5, fill0 + i)
    if made < ramp:
        ahead.trim(5, ramp - made)
    assert ahead.open_units() == ref.open_units() == {5: fill0 + made}
    ahead.now = ref.now = t0 + made + hold
    ahead.close(5)
    ref.close(5)
    assert split(ahead.totals) == split(ref.totals)
