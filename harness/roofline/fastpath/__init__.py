"""The roofline's fast path (``roofline.fast_path``, issue #24): running requests that
only decode are advanced in bulk, as sums, by a scheduler subclass the roofline target
builds (:class:`~harness.roofline.fastpath.scheduler.LaneScheduler`), instead of one by
one. Every number a run reports equals stepping one by one (tests/roofline/test_lane.py).

- lane.py: the decode lane (its members, their sums, the blocks they take and fill);
- lazy_names.py: the names of the blocks they fill, made when first readable (the pool's
  ``DeferredNames`` hook, harness/kv/base.py);
- scheduler.py: the scheduler subclass (the base scheduler's hooks) and the choice
  between it and the base scheduler for a run.

The core (harness/kv, harness/sched) knows none of this: the lane changes pool and
block-table state only through ``PagedKVManager``'s bulk operations."""
