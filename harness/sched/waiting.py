"""The scheduler's waiting queue: groups in policy order, the head taken in O(1).

A run whose arrivals outpace the deployment holds most of its requests here (the
roofline's 100,000-request benchmark: ~90,000 at its peak), and admission takes the head
of the queue: ``del list[0]`` moved every entry behind it, a memmove of the whole queue
per admission (2.5% of a decode-lane run at 100,000 requests). Entries before ``_head``
are spent; they are dropped in one slice once they are at least half the list, so each
entry is moved O(1) times on average.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from itertools import islice

from harness.sched.sequence import SequenceGroup

SortKey = tuple[int, float, int]  # SequenceGroup.sort_key: (priority, arrival, request id)


class WaitingQueue:
    """Groups sorted by their sort keys (ties: the later insertion after the earlier)."""

    def __init__(self) -> None:
        self._groups: list[SequenceGroup | None] = []
        self._keys: list[SortKey] = []
        self._head = 0  # entries before it were taken

    def push(self, key: SortKey, g: SequenceGroup) -> None:
        """Insert ``g`` after every group whose key is at most ``key``."""
        i = bisect.bisect_right(self._keys, key, lo=self._head)
        self._keys.insert(i, key)
        self._groups.insert(i, g)

    def head(self) -> SequenceGroup:
        """The first group (the queue is not empty)."""
        g = self._groups[self._head]
        assert g is not None
        return g

    def pop_head(self) -> SequenceGroup:
        """Take the first group (the queue is not empty)."""
        h = self._head
        g = self._groups[h]
        assert g is not None
        self._groups[h] = None  # the queue no longer holds it
        h += 1
        if h >= 1024 and 2 * h >= len(self._groups):
            del self._groups[:h], self._keys[:h]
            h = 0
        self._head = h
        return g

    def remove(self, g: SequenceGroup) -> None:
        """Take ``g`` out wherever it is (tests)."""
        i = self._groups.index(g, self._head)
        del self._groups[i], self._keys[i]

    def __len__(self) -> int:
        return len(self._groups) - self._head

    def __bool__(self) -> bool:
        return len(self._groups) > self._head

    def __iter__(self) -> Iterator[SequenceGroup]:
        for g in islice(self._groups, self._head, None):
            assert g is not None
            yield g

    def __getitem__(self, i: int) -> SequenceGroup:
        """The ``i``-th group from the head (``i >= 0``)."""
        if not 0 <= i < len(self):
            raise IndexError(i)
        g = self._groups[self._head + i]
        assert g is not None
        return g

    def __repr__(self) -> str:
        return f"WaitingQueue({list(self)!r})"
