"""Python's cyclic garbage collector during a run: rarely.

The collector runs a young-generation pass every 700 container allocations (Python's
default) and, from time to time, a full pass over every live container: at the
roofline's 100,000-request benchmark, ~90,000 waiting requests' groups, sequences and
token lists. Those passes cost 7.5% of a decode-lane run (5.4 of 72.9 s, measured with
``gc.callbacks``) and find nothing: the engine loop makes no reference cycles (a
finished group's sequences, which point back at it, are dropped by the engine;
tests/engine/test_gc_quiet.py checks that the garbage a run leaves does not grow with its
requests). So the loop runs with a young generation of ``LOOP_GEN0`` allocations:
collections still happen, ~140 times less often.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

LOOP_GEN0 = 100_000  # young-generation allocations between collections in a run's loop


@contextmanager
def rare_collections(gen0: int = LOOP_GEN0) -> Iterator[None]:
    """Within the block, the collector's young generation holds ``gen0`` allocations (or
    more, if it was set higher); its thresholds are restored on the way out."""
    old = gc.get_threshold()
    gc.set_threshold(max(gen0, old[0]), *old[1:])
    try:
        yield
    finally:
        gc.set_threshold(*old)
