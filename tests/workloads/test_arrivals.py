"""Arrival processes (statistics of seeded samples) and user-centric multi-turn timing."""

from __future__ import annotations

import itertools
import math
import random
import statistics

import pytest

from harness.errors import UserError
from harness.model import ByteTokenizer
from harness.runner import run
from harness.workloads import make_workload, workload_options
from harness.workloads.arrivals import ArrivalOptions, arrival_times, think_time
from harness.workloads.multiturn import MultiturnWorkload
from tests.compose import compose_cfg


def gaps(opts: ArrivalOptions, n: int = 20000, seed: int = 1) -> list[float]:
    t = arrival_times(n, opts, random.Random(seed))
    return [b - a for a, b in zip([0.0, *t], t)]


def cv(xs: list[float]) -> float:
    return statistics.pstdev(xs) / statistics.fmean(xs)


@pytest.mark.parametrize("burstiness", [0.25, 0.5, 1.0, 4.0])
def test_gamma_gaps_have_mean_one_over_rate_and_cv_one_over_sqrt_burstiness(
        burstiness: float) -> None:
    # vLLM's definition: shape = burstiness, scale = 1 / (rate * burstiness). With 20000
    # gaps the sample mean is within ~1.5% and the CV within ~3% (4 standard errors).
    g = gaps(ArrivalOptions(rate=4.0, arrival="gamma", burstiness=burstiness))
    assert statistics.fmean(g) == pytest.approx(0.25, rel=0.04)
    assert cv(g) == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_burstier_means_more_clumping() -> None:
    # Share of gaps under a tenth of the mean: ~1 - exp(-0.1) = 9.5% for Poisson, far more
    # for burstiness 0.25 (requests arrive in clumps), far less for 4 (near-regular).
    def short(b: float) -> float:
        g = gaps(ArrivalOptions(rate=1.0, arrival="gamma", burstiness=b))
        return sum(x < 0.1 for x in g) / len(g)

    poisson = short(1.0)
    assert poisson == pytest.approx(1 - math.exp(-0.1), abs=0.01)
    assert short(0.25) > 0.3 > poisson > 0.01 > short(4.0)


def test_poisson_constant_and_all_at_once() -> None:
    p = gaps(ArrivalOptions(rate=2.0, arrival="poisson"))
    assert statistics.fmean(p) == pytest.approx(0.5, rel=0.04) and cv(p) == pytest.approx(
        1.0, rel=0.05)
    assert arrival_times(4, ArrivalOptions(rate=2.0, arrival="constant"),
                         random.Random(0)) == [0.5, 1.0, 1.5, 2.0]
    assert arrival_times(3, ArrivalOptions(rate=2.0, arrival="all_at_once"),
                         random.Random(0)) == [0.0] * 3
    assert arrival_times(3, ArrivalOptions(rate=0.0, arrival="gamma"),
                         random.Random(0)) == [0.0] * 3


def test_same_seed_same_times_and_bad_options_say_what_to_change() -> None:
    o = ArrivalOptions(rate=3.0, arrival="gamma", burstiness=0.5)
    assert arrival_times(50, o, random.Random(7)) == arrival_times(50, o, random.Random(7))
    with pytest.raises(UserError, match="known: poisson, gamma, constant, all_at_once"):
        ArrivalOptions(arrival="bursty")
    with pytest.raises(UserError, match="burstiness must be > 0"):
        ArrivalOptions(burstiness=0.0)
    with pytest.raises(UserError, match=r"workload\.rate=-1\.0 is out of range"):
        ArrivalOptions(rate=-1.0)


@pytest.mark.parametrize("name", ["random", "shared_prefix", "parallel_sampling",
                                  "beam_search", "long_prompt", "multiturn"])
def test_every_synthetic_workload_takes_the_arrival_options(name: str) -> None:
    opts = workload_options(name, {"rate": 5.0, "arrival": "constant", "seed": 0})
    reqs = make_workload(opts, ByteTokenizer()).initial_requests()
    short = [r for r in reqs if r.meta.get("kind") != "long"]
    assert [r.arrival_s for r in short][:3] == pytest.approx([0.2, 0.4, 0.6])


def test_think_times_are_seeded_draws_of_the_given_mean() -> None:
    rng = random.Random(3)
    for dist, want_cv in (("exponential", 1.0), ("lognormal", 0.5)):
        xs = [think_time(rng, dist, 2.0, 0.5) for _ in range(20000)]
        assert statistics.fmean(xs) == pytest.approx(2.0, rel=0.04)
        assert cv(xs) == pytest.approx(want_cv, rel=0.06)
    assert think_time(rng, "constant", 2.0, 0.5) == 2.0
    assert think_time(rng, "exponential", 0.0, 1.0) == 0.0


MT = ["model=tiny", "workload=multiturn", "workload.conversations=4", "workload.turns=2",
      "workload.system_words=10", "workload.user_words=5", "workload.answer_tokens=4",
      "cache.kv_budget=512KiB"]


def _finish(row: dict[str, float]) -> float:
    return float(row["arrival_s"]) + float(row["e2e_ms"]) / 1e3


def test_think_time_separates_a_turn_from_the_answer_it_follows() -> None:
    r = run(compose_cfg([*MT, "workload.think_time_s=0.05",
                         "workload.think_time_dist=exponential"]))
    rows = {x["request_id"]: x for x in r.requests}
    wl = make_workload(workload_options("multiturn", {
        "conversations": 4, "turns": 2, "system_words": 10, "user_words": 5,
        "answer_tokens": 4, "think_time_s": 0.05, "think_time_dist": "exponential",
        "seed": 0}), ByteTokenizer())
    assert isinstance(wl, MultiturnWorkload)
    for conv in range(4):
        first, second = rows[2 * conv], rows[2 * conv + 1]
        # The engine adds the drawn think time to the instant the answer was done.
        assert second["arrival_s"] - _finish(first) == pytest.approx(wl.think[conv][1],
                                                                     abs=1e-6)


def test_a_cap_on_active_conversations_starts_the_next_when_one_ends() -> None:
    r = run(compose_cfg([*MT, "workload.max_active_conversations=1"]))
    rows = sorted(r.requests, key=lambda x: x["arrival_s"])
    assert [x["request_id"] for x in rows] == list(range(8))  # one conversation at a time
    for a, b in itertools.pairwise(rows):
        assert b["arrival_s"] >= _finish(a) - 1e-9
    assert r.metrics["requests.peak_concurrency"] == 1
    # Without the cap all four open at once.
    free = run(compose_cfg(MT))
    assert free.metrics["requests.peak_concurrency"] == 4


def test_a_rejected_turn_ends_its_conversation_and_passes_its_slot_on() -> None:
    # max_model_len fits every first turn but no second one (it re-sends the first and
    # its answer): each conversation's turn 2 is rejected. Under a cap of one, the next
    # conversation must still start (it once waited forever for the slot: 2 requests).
    opts = {"conversations": 4, "turns": 3, "system_words": 10, "user_words": 5,
            "answer_tokens": 4, "seed": 0}
    wl = make_workload(workload_options("multiturn", opts), ByteTokenizer())
    longest = max(len(r.prompt_ids) for r in wl.initial_requests())
    cfg = [*MT, "workload.turns=3", f"scheduler.max_model_len={longest + 5}"]
    seen = []
    for cap in (1, 0):
        r = run(compose_cfg([*cfg, f"workload.max_active_conversations={cap}"]))
        status = {x["request_id"]: x["status"] for x in r.requests}
        assert {rid // 3 for rid in status} == {0, 1, 2, 3}, cap  # every conversation ran
        not_sent = 0
        for c in range(4):
            turns = [status.get(3 * c + t) for t in range(3)]
            assert turns[0] == "finished", (cap, c, turns)
            if "rejected" in turns:  # a rejection ends the conversation there
                k = turns.index("rejected")
                assert turns[k + 1:] == [None] * (2 - k), (cap, c, turns)
                not_sent += 2 - k
        assert not_sent > 0 and r.metrics["multiturn.turns_not_sent"] == not_sent
        seen.append(status)
    assert seen[0] == seen[1]  # the cap changes when conversations run, not what they do
