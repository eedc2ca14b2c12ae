"""The roofline's fast path (decode lanes, harness.sched.lane) equals stepping one by one.

A hypothesis property test over random workloads: arrivals during the run, preemption by
recompute and by swap (small KV budgets), prefix hits (shared prompts, conversations that
re-send their answers: hits on blocks that lane members named), identical prompts (two
requests naming the same content), length limits, block sizes, prefix caching on and off,
and the backends that take the lane (paged, fp8, int8) and one that does not (a sliding
window: stepped one by one either way). Each example runs twice, ``roofline.fast_path``
on and off, and compares every request's token times (so its TTFT, every ITL and its
finish), every requests.csv row, every steps.csv column, the output ids and every metric.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.metrics import collector
from harness.runner import RunResult, run
from harness.sched.lane import DecodeLane
from tests.compose import compose_cfg

# Keys a run reports that are this CPU's time or say which path ran, not the run's numbers.
NOT_COMPARED = ("engine.sim_wall_s", "run.fast_path", "run.started_at")

BASE = ["executor=roofline", "roofline.model=Llama-3.1-8B", "roofline.hardware=a100-80gb",
        "logger=none"]


def workloads() -> st.SearchStrategy[list[str]]:
    rate = st.sampled_from(["0", "50", "400"])  # 0: all at once
    random_ = st.builds(
        lambda n, r, i, o, seed: ["workload=random", f"workload.num_requests={n}",
                                  f"workload.rate={r}", f"workload.input_max={i}",
                                  f"workload.output_max={o}", f"seed={seed}"],
        st.integers(4, 40), rate, st.sampled_from([64, 300]), st.sampled_from([40, 160]),
        st.integers(0, 3))
    multiturn = st.builds(
        lambda c, t, a, r: ["workload=multiturn", f"workload.conversations={c}",
                            f"workload.turns={t}", f"workload.answer_tokens={a}",
                            "workload.system_words=20", "workload.user_words=12",
                            f"workload.rate={r}"],
        st.integers(2, 8), st.integers(2, 4), st.sampled_from([17, 48]), rate)
    # suffix 0: identical prompts; request ids 26 apart then also decode identical tokens
    shared = st.builds(
        lambda n, p, s, o, r: ["workload=shared_prefix", f"workload.num_requests={n}",
                               f"workload.num_prefixes={p}", "workload.prefix_tokens=96",
                               f"workload.suffix_tokens={s}", f"workload.output_tokens={o}",
                               f"workload.rate={r}"],
        st.sampled_from([8, 30, 60]), st.integers(1, 2), st.sampled_from([0, 9]),
        st.sampled_from([20, 40]), rate)
    return st.one_of(random_, multiturn, shared)


def options() -> st.SearchStrategy[list[str]]:
    return st.builds(
        lambda backend, bs, budget, swap, caching, seqs, tokens, mml: [
            f"backend={backend}", f"backend.block_size={bs}", f"cache.kv_budget={budget}",
            f"cache.enable_prefix_caching={caching}", f"scheduler.max_num_seqs={seqs}",
            f"scheduler.max_num_batched_tokens={tokens}", f"scheduler.max_model_len={mml}",
            *(["scheduler.preemption_mode=swap", "cache.swap_space=256MiB"] if swap else [])],
        st.sampled_from(["paged", "paged", "fp8", "int8", "sliding_window"]),
        st.sampled_from([4, 8, 16]), st.sampled_from(["48MiB", "128MiB", "512MiB"]),
        st.booleans(), st.booleans(), st.sampled_from([4, 16, 64]),
        st.sampled_from([64, 256]), st.sampled_from([256, 2048]))


def _run(overrides: list[str], fast: bool, monkeypatch: pytest.MonkeyPatch
         ) -> tuple[RunResult, dict[int, list[float]], int]:
    """The run, every request's token times as it was let go, and the lane's joins."""
    times: dict[int, list[float]] = {}
    real_let_go = collector.MetricsCollector._let_go

    def let_go(self: Any, g: Any, finished: float | None = None) -> Any:
        times[g.request_id] = list(self.requests[g.request_id].token_times)
        return real_let_go(self, g, finished)

    joins = [0]
    real_join = DecodeLane.try_join

    def try_join(self: DecodeLane, g: Any) -> bool:
        ok = real_join(self, g)
        joins[0] += ok
        return ok

    monkeypatch.setattr(collector.MetricsCollector, "_let_go", let_go)
    monkeypatch.setattr(DecodeLane, "try_join", try_join)
    r = run(compose_cfg([*BASE, *overrides, f"roofline.fast_path={str(fast).lower()}"]))
    monkeypatch.undo()
    return r, times, joins[0]


def assert_same_run(one: RunResult, lane: RunResult) -> None:
    a = {k: v for k, v in one.metrics.items() if k not in NOT_COMPARED}
    b = {k: v for k, v in lane.metrics.items() if k not in NOT_COMPARED}
    assert a.keys() == b.keys()
    for k in a:
        assert a[k] == b[k] or (a[k] != a[k] and b[k] != b[k]), (k, a[k], b[k])  # NaN
    assert one.requests == lane.requests
    assert one.outputs == lane.outputs
    assert len(one.steps) == len(lane.steps)
    cols_a, cols_b = one.steps.columns(), lane.steps.columns()  # type: ignore[attr-defined]
    assert cols_a.keys() == cols_b.keys()
    for k in cols_a:
        assert np.array_equal(cols_a[k], cols_b[k]), k


@settings(max_examples=24, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(workload=workloads(), opts=options())
def test_the_lane_equals_stepping_one_by_one(workload: list[str], opts: list[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    overrides = [*workload, *opts]
    try:
        one, t_one, _ = _run(overrides, False, monkeypatch)
    except Exception as e:  # a drawn budget too small for the workload: not this test's
        if type(e).__name__ == "UserError":
            return
        raise
    lane, t_lane, joins = _run(overrides, True, monkeypatch)
    assert t_one == t_lane  # every request's TTFT, ITLs and finish, exactly
    assert_same_run(one, lane)
    on = lane.metrics["run.fast_path"] == "lanes"
    assert on == ("sliding_window" not in " ".join(opts)), lane.metrics["run.fast_path"]
    if on and one.metrics["requests.finished"]:
        assert joins > 0  # the lane ran, not only the per-sequence path
