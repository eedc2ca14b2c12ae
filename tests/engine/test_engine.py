"""End to end on the tiny model: the engine, both backends, the results folder, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.runner import run
from tests.compose import tiny

DESIGN_KEYS_SO_FAR = """
run.backend run.workload run.model run.kernel run.device run.seed run.git_sha run.started_at
throughput.output_tokens_per_s throughput.total_tokens_per_s throughput.requests_per_s
latency.ttft_ms.p50 latency.ttft_ms.p90 latency.ttft_ms.p99 latency.itl_ms.p50
latency.itl_ms.p90 latency.itl_ms.p99 latency.e2e_ms.p50 latency.e2e_ms.p99
memory.kv_budget_bytes memory.token_capacity memory.peak_reserved_bytes memory.peak_used_bytes
memory.waste_pct memory.reservation_pct memory.internal_frag_pct memory.external_frag_pct
memory.max_running_seqs cache.prefix_hit_rate cache.prefill_tokens_computed
cache.prefill_tokens_saved cache.cow_copies cache.evicted_tokens sched.steps
sched.preemptions_recompute sched.preemptions_swap sched.recomputed_tokens sched.swapped_bytes
requests.finished requests.rejected
""".split()


def test_paged_run_writes_every_file_and_key(tmp_path: Path) -> None:
    r = run(tiny("backend=paged", out_dir=tmp_path))
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["config.yaml", "metrics.json", "requests.csv", "steps.csv"]
    m = json.loads((tmp_path / "metrics.json").read_text())
    missing = [k for k in DESIGN_KEYS_SO_FAR if k not in m]
    assert not missing
    assert m["requests.finished"] == 6 and m["requests.rejected"] == 0
    # Turn 2 of each conversation re-sends turn 1 and its answer: the cache must hit.
    assert m["cache.prefix_hit_rate"] > 0.3 and m["cache.prefill_tokens_saved"] > 0
    steps = (tmp_path / "steps.csv").read_text().splitlines()
    assert len(steps) == m["sched.steps"] + 1
    assert r.metrics == m


def test_contiguous_and_paged_produce_identical_tokens() -> None:
    paged = run(tiny("backend=paged"))
    contiguous = run(tiny("backend=contiguous", "backend.reserve=exact"))
    assert paged.outputs == contiguous.outputs
    assert all(len(v) > 0 for v in paged.outputs.values())


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_gives_the_same_tokens(mode: str) -> None:
    short = ("workload.system_words=5", "workload.user_words=4")
    tight = run(tiny(*short, "cache.enable_prefix_caching=false", "cache.kv_budget=200KiB",
                     "backend.block_size=8", f"scheduler.preemption_mode={mode}",
                     "cache.swap_space=1MiB", "workload.answer_tokens=64",
                     "workload.ignore_eos=true"))
    ref = run(tiny(*short, "cache.enable_prefix_caching=false", "workload.answer_tokens=64",
                   "workload.ignore_eos=true"))
    key = f"sched.preemptions_{mode}"
    assert tight.metrics[key] > 0
    # Per request too: the counts add up to the run's.
    per_request = sum(r[f"preemptions_{mode}"] for r in tight.requests)
    assert per_request == tight.metrics[key]
    if mode == "swap":
        assert sum(r["swapped_out_bytes"] for r in tight.requests) \
            == tight.metrics["sched.swapped_bytes"] > 0
    assert tight.outputs == ref.outputs


def test_paged_holds_more_sequences_than_contiguous_max() -> None:
    common = ("cache.kv_budget=300KiB", "workload.conversations=6", "scheduler.max_model_len=256",
              "workload.system_words=5")
    paged = run(tiny("backend=paged", *common))
    cmax = run(tiny("backend=contiguous", "backend.reserve=max", *common))
    assert paged.metrics["memory.max_running_seqs"] > cmax.metrics["memory.max_running_seqs"]
    assert paged.metrics["memory.waste_pct"] < cmax.metrics["memory.waste_pct"] / 3
    assert paged.outputs == cmax.outputs


def test_budget_too_small_names_the_budget_that_works() -> None:
    with pytest.raises(ValueError, match=r"set cache.kv_budget=\d+"):
        run(tiny("cache.kv_budget=8KiB"))


def test_request_that_cannot_fit_is_rejected_and_the_rest_run() -> None:
    # max_model_len below the later turns' prompts: those are rejected with a reason.
    r = run(tiny("scheduler.max_model_len=128", "workload.system_words=2",
                 "workload.user_words=3"))
    rejected = [x for x in r.requests if x["status"] == "rejected"]
    finished = [x for x in r.requests if x["status"] == "finished"]
    assert rejected and finished
    assert all("max_model_len" in x["rejected_reason"] for x in rejected)


def test_unknown_backend_from_registry() -> None:
    from harness.backends import get_backend

    with pytest.raises(ValueError, match="known: contiguous, paged"):
        get_backend("pagd")


def test_swap_without_swap_space_is_an_error_not_a_silent_recompute() -> None:
    with pytest.raises(ValueError, match=r"cache\.swap_space"):
        run(tiny("scheduler.preemption_mode=swap"))
    with pytest.raises(ValueError, match="does not swap"):
        run(tiny("backend=contiguous", "scheduler.preemption_mode=swap",
                 "cache.swap_space=1MiB"))
