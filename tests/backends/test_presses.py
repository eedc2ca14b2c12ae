"""The kvpress-style presses (knorm, keydiff, observed_attention, expected_attention)
through the real engine: the trigger is recorded, the prompt's memory is freed, attention
then reads well under paged's bytes per decode token, every request finishes. Their rules
against brute force: tests/backends/test_knorm.py, test_keydiff.py, test_observed_attention.py,
test_expected_attention.py."""

from __future__ import annotations

import pytest

from harness.runner import run
from tests.compose import tiny

LONG_ANSWERS = ("workload.answer_tokens=16", "workload.ignore_eos=true", "backend.block_size=8")


@pytest.fixture(scope="module")
def paged_reads() -> float:
    r = run(tiny("backend=paged", *LONG_ANSWERS, "cache.enable_prefix_caching=false"))
    return float(r.metrics["attention.kv_read_bytes_per_token"])


@pytest.mark.parametrize("backend", ["knorm", "keydiff", "observed_attention",
                                     "expected_attention"])
def test_engine_run_records_the_trigger_and_frees_memory(backend: str,
                                                         paged_reads: float) -> None:
    r = run(tiny(f"backend={backend}", "backend.budget_ratio=0.25", *LONG_ANSWERS))
    m = r.metrics
    # Compressed once, at a prompt's end: its compressed prefixes are cached (the next turn
    # of a conversation starts from one: harness.kv.compressed).
    assert m["run.prefill"] == "full" and m["run.prefix_caching"] is True
    assert m["cache.prefix_hit_rate"] > 0
    assert m["cache.evicted_tokens"] > 0 and m["requests.finished"] == len(r.requests)
    assert m["attention.kv_read_bytes_per_token"] < 0.6 * paged_reads
