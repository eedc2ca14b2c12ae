"""Workloads: seeded and reproducible; each runs through the engine on the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.model import ByteTokenizer
from harness.runner import run
from harness.workloads import WORKLOADS, make_workload
from tests.compose import compose_cfg

SMALL = {
    "multiturn": ["workload.conversations=2", "workload.system_words=10",
                  "workload.user_words=5", "workload.answer_tokens=6"],
    "shared_prefix": ["workload.num_requests=5", "workload.prefix_tokens=48",
                      "workload.output_tokens=6"],
    "beam_search": ["workload.num_requests=2", "workload.output_tokens=6"],
    "parallel_sampling": ["workload.num_requests=2", "workload.output_tokens=6"],
    "long_prompt": ["workload.num_short=3", "workload.long_prompt_tokens=160",
                    "workload.short_output_tokens=12", "workload.long_start_s=0.01",
                    "workload.long_interval_s=0.01"],
    "random": ["workload.num_requests=6", "workload.output_max=24", "workload.input_max=48"],
    "trace": ["workload.path=traces/kvbench_example.csv", "workload.max_requests=8",
              "workload.speedup=20"],
    "ruler": ["workload.lengths=[600]", "workload.depths=[50]",
              "workload.tasks=[niah_single_1,niah_multikey]"],
    # (The second turn's prompt, ~630 tokens, fits tiny_gemma3's three groups at 1 MiB:
    # tests/engine/test_gemma3.py runs these too.)
    "shared_context": ["workload.contexts=2", "workload.turns=2", "workload.length=480",
                       "workload.haystack=noise", "workload.answer_tokens=4"],
}

DESIGN_KEYS = """
run.backend run.workload run.model run.kernel run.device run.seed run.git_sha run.started_at
throughput.output_tokens_per_s throughput.total_tokens_per_s throughput.requests_per_s
latency.ttft_ms.p50 latency.ttft_ms.p90 latency.ttft_ms.p99
latency.itl_ms.p50 latency.itl_ms.p90 latency.itl_ms.p99 latency.e2e_ms.p50 latency.e2e_ms.p99
memory.kv_budget_bytes memory.token_capacity memory.peak_reserved_bytes memory.peak_used_bytes
memory.waste_pct memory.reservation_pct memory.internal_frag_pct memory.external_frag_pct
memory.max_running_seqs
cache.prefix_hit_rate cache.prefill_tokens_computed cache.prefill_tokens_saved
cache.cow_copies cache.blocks_saved_by_sharing cache.evicted_tokens
sched.steps sched.preemptions_recompute sched.preemptions_swap sched.recomputed_tokens
sched.swapped_bytes requests.finished requests.rejected
""".split()


def cfg_for(name: str, seed: int = 0) -> dict[str, object]:
    c = compose_cfg([f"workload={name}", f"workload.seed={seed}"])
    return dict(c.workload)


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_same_seed_same_requests(name: str) -> None:
    tok = ByteTokenizer()

    def requests(seed: int) -> list[tuple[list[int], float, int]]:
        wl = make_workload(cfg_for(name, seed), tok)
        return [(r.prompt_ids, r.arrival_s, r.params.max_tokens)
                for r in wl.initial_requests()]

    assert requests(0) == requests(0)
    assert requests(0) != requests(1)


def test_unknown_workload_lists_known_ones() -> None:
    with pytest.raises(ValueError, match="known: multiturn, shared_prefix"):
        make_workload({"name": "multi"}, ByteTokenizer())


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_every_workload_runs_and_reports_every_key(name: str, tmp_path: Path) -> None:
    r = run(compose_cfg(["model=tiny", f"workload={name}", "cache.kv_budget=512KiB",
                         *SMALL[name]], tmp_path))
    m = json.loads((tmp_path / "metrics.json").read_text())
    assert [k for k in DESIGN_KEYS if k not in m] == []
    assert m["requests.finished"] == len(r.requests) and m["requests.rejected"] == 0
    # The waste split adds up to the total waste.
    parts = m["memory.reservation_pct"] + m["memory.internal_frag_pct"] + \
        m["memory.external_frag_pct"]
    assert parts == pytest.approx(m["memory.waste_pct"], abs=1e-9)


def test_random_lengths_follow_the_draw() -> None:
    r = run(compose_cfg(["model=tiny", "workload=random", *SMALL["random"],
                         "cache.kv_budget=512KiB"]))
    for row in r.requests:
        assert row["finish_reason"] == "stop" and 1 <= row["output_tokens"] <= 24


def test_chunked_prefill_gives_the_same_tokens() -> None:
    base = ["model=tiny", "workload=long_prompt", *SMALL["long_prompt"],
            "cache.kv_budget=512KiB", "scheduler.max_num_batched_tokens=64"]
    chunked = run(compose_cfg([*base, "scheduler.chunked_prefill=true"]))
    whole = run(compose_cfg([*base, "scheduler.chunked_prefill=false",
                             "scheduler.max_num_batched_tokens=256"]))
    assert chunked.outputs == whole.outputs
    assert max(s.batch_tokens for s in chunked.steps) <= 64
    assert max(s.prefill_tokens for s in whole.steps) >= 160  # a whole long prompt at once


def test_parallel_samples_share_the_prompt_and_differ() -> None:
    r = run(compose_cfg(["model=tiny", "workload=parallel_sampling", *SMALL["parallel_sampling"],
                         "workload.prompt_tokens=40", "cache.kv_budget=512KiB"]))
    assert r.metrics["cache.blocks_saved_by_sharing_peak"] >= 2 * 3  # 2 prompt blocks x 3 forks
    rows = {x["request_id"]: x for x in r.requests}
    assert all(rows[i]["num_seqs"] == 4 and rows[i]["output_tokens"] == 24 for i in rows)


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_initial_requests_are_the_same_on_every_call(name: str) -> None:
    wl = make_workload(cfg_for(name), ByteTokenizer())
    first = [(r.request_id, r.prompt_ids) for r in wl.initial_requests()]
    assert first == [(r.request_id, r.prompt_ids) for r in wl.initial_requests()]


def test_a_prompt_longer_than_the_corpus() -> None:
    """A 126k-token random prompt (the hybrid experiment's 128k context) is several
    passages; it failed in randrange once a passage had to be as long as the prompt."""
    import random

    from harness.model.tokenizer import ByteTokenizer
    from harness.workloads.common import token_prompt
    from harness.workloads.text import corpus_words

    n = 3 * len(corpus_words())
    ids = token_prompt(ByteTokenizer(), random.Random(0), n)
    assert len(ids) == n
