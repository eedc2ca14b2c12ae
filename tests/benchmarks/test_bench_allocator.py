"""pytest-benchmark: the allocator's and scheduler's per-step bookkeeping.

Run: ``.venv/bin/python -m pytest tests/benchmarks --benchmark-enable``. Targets on a
2-core CPU: a 256-sequence decode step's bookkeeping (schedule + a slot for every running
sequence + the step record + appending the sampled tokens) under 1 ms.
"""

from __future__ import annotations

from typing import Any

from harness.kv.base import Demand
from harness.kv.paged import PagedKVManager
from harness.sched.step import StepOutcome
from tests.helpers import decode_ready, make_seq

BS = 16


def test_allocate_free_2k_prompt(benchmark: Any) -> None:
    m = PagedKVManager(100_000, BS, enable_prefix_caching=False)
    seq = make_seq(list(range(2048)))

    def once() -> None:
        m.allocate(Demand(seq, 2048))
        m.free(seq)

    benchmark(once)
    assert m.pool.num_used == 0


def test_prefix_lookup_32_blocks(benchmark: Any) -> None:
    m = PagedKVManager(100_000, BS)
    first = make_seq(list(range(32 * BS + 1)))
    m.allocate(Demand(first, first.num_tokens))
    probe = make_seq(list(range(32 * BS + 1)))
    hits = benchmark(m.lookup_prefix, probe)
    assert len(hits.blocks) == 32


def test_decode_step_bookkeeping_256(benchmark: Any) -> None:
    # A pool of 100k blocks: a large pool must cost nothing per step.
    s = decode_ready(PagedKVManager(100_000, BS), 256)

    def step() -> None:
        rec = s.schedule()
        s.update(rec, StepOutcome.appending([(x.seq, 7) for x in rec.seqs]))

    benchmark.pedantic(step, rounds=300, warmup_rounds=20)
    assert s.preemptions_recompute == 0 and len(s.running) == 256
