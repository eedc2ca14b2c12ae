"""pytest-benchmark: everything an engine step does besides the model's forward.

Run: ``.venv/bin/python -m pytest tests/benchmarks --benchmark-enable``. Targets on a
2-core CPU (medians): the whole non-forward decode step at 256 running sequences
(schedule, the inputs' build, sampling, update, the metrics collector) <= 0.5 ms, i.e.
<= 2 us per sequence; an h2o decode step's eviction bookkeeping (schedule + the policy's
scoring and eviction in ``observe``) at 64 sequences is reported per sequence. Without
``--benchmark-enable`` each runs once, as a test of the same code.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from harness.backends.h2o import H2OOptions
from harness.engine.batch import InputBuilder
from harness.engine.sampler import Sampler
from harness.kv.base import StepScores
from harness.kv.evicting import EvictingKVManager
from harness.kv.paged import PagedKVManager
from harness.kv.policies.h2o import H2OPolicy
from harness.metrics.collector import MetricsCollector
from harness.sched.step import StepOutcome
from tests.helpers import decode_ready

BS = 16
VOCAB = 64  # bookkeeping, not the argmax over a real vocabulary, is what is timed


def test_non_forward_step_256(benchmark: Any) -> None:
    kv = PagedKVManager(100_000, BS)
    s = decode_ready(kv, 256)
    col = MetricsCollector(kv, s, bytes_per_slot=1)
    for g in s.running:
        col.on_arrival(g, 0.0)
    sampler = Sampler(0)
    logits = torch.randn(256, VOCAB)
    builder = InputBuilder(torch.device("cpu"))  # persistent buffers, as the executor's

    def step() -> None:
        t0 = time.perf_counter()
        rec = s.schedule()
        inputs = builder.build(rec, kv)
        seqs = [x.seq for x in inputs.samplers]
        toks = sampler.sample(logits[inputs.logits_rows], seqs)
        upd = s.update(rec, StepOutcome.appending(list(zip(seqs, toks))))
        col.on_tokens(rec, upd, [q.group for q in seqs], 0.0)
        col.on_step(rec, upd, t0, time.perf_counter(), 0.0, 0.0)

    benchmark.pedantic(step, rounds=200, warmup_rounds=20)
    assert s.preemptions_recompute == 0 and len(s.running) == 256


def test_h2o_eviction_bookkeeping_64(benchmark: Any) -> None:
    # Budget 128 tokens, prompts of 160: every decode step evicts one token per sequence,
    # scored over its 128 held slots.
    pol = H2OPolicy(H2OOptions(budget=128, budget_ratio=0.0, heavy_ratio=0.5))
    kv = EvictingKVManager(4096, BS, pol, watermark=0.0)
    s = decode_ready(kv, 64)
    rng = np.random.default_rng(0)
    for _ in range(200):  # reach the budget: from here on each step evicts
        rec = s.schedule()
        s.update(rec, StepOutcome.appending([(x.seq, 7) for x in rec.seqs if x.sample]))
    held = [kv.live_slots(g.seqs[0])[0] for g in s.running]
    touched = np.unique(np.concatenate(held))
    values = rng.random(len(touched))

    def step() -> None:
        rec = s.schedule()
        toks = [(x.seq, 7) for x in rec.seqs if x.sample]
        s.update(rec, StepOutcome.appending(toks, StepScores(touched, values)))

    before = kv.stats.evicted_tokens
    benchmark.pedantic(step, rounds=100, warmup_rounds=5)
    assert kv.stats.evicted_tokens > before
    assert all(kv.held_tokens(g.seqs[0]) <= 128 for g in s.running)
