"""The waiting queue against a sorted list (what the scheduler held before it)."""

from __future__ import annotations

import bisect

from hypothesis import given, settings
from hypothesis import strategies as st

from harness.sched.sequence import SamplingParams, SequenceGroup
from harness.sched.waiting import WaitingQueue


def _group(rid: int) -> SequenceGroup:
    return SequenceGroup(rid, [1, 2, 3], SamplingParams())


# A program: push a group with a key (priority, arrival), or take the head.
OPS = st.lists(st.one_of(st.tuples(st.integers(0, 3), st.integers(0, 50)),
                         st.just(None)), max_size=3000)


@settings(max_examples=60, deadline=None)
@given(OPS)
def test_queue_matches_a_sorted_list(ops: list[tuple[int, int] | None]) -> None:
    q, ref, ref_keys = WaitingQueue(), [], []
    for rid, op in enumerate(ops):
        if op is None:
            if ref:
                assert q.head() is ref[0]
                assert q.pop_head() is ref.pop(0)
                del ref_keys[0]
            continue
        key = (op[0], float(op[1]), rid)
        g = _group(rid)
        q.push(key, g)
        i = bisect.bisect_right(ref_keys, key)
        ref_keys.insert(i, key)
        ref.insert(i, g)
        assert len(q) == len(ref) and bool(q) == bool(ref)
    assert list(q) == ref
    assert [q[i] for i in range(len(q))] == ref


def test_spent_entries_are_dropped() -> None:
    """Taking the head does not keep every taken group: the list is cut once they are half
    of it (the queue's memory follows what it holds)."""
    q = WaitingQueue()
    for rid in range(5000):
        q.push((0, float(rid), rid), _group(rid))
    for _ in range(4000):
        q.pop_head()
    assert len(q) == 1000 and len(q._groups) < 3000
    assert q.head().request_id == 4000
    q.remove(q[1])
    assert [g.request_id for g in q][:3] == [4000, 4002, 4003]
