"""Goodput and SLO attainment: a hand-computed example, the quality floor, the config."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from harness.config import run_config
from harness.errors import UserError
from harness.metrics.goodput import SLOConfig, peak_concurrency, slo_metrics
from harness.runner import run
from tests.compose import compose_cfg


def row(ttft: float | None, tpot: float | None, e2e: float | None, status: str = "finished",
        out: int = 10, agree: int | None = None) -> dict[str, Any]:
    return {"status": status, "ttft_ms": ttft, "tpot_ms": tpot, "e2e_ms": e2e,
            "output_tokens": out, "agree_tokens": agree}


# Six requests over a 4-second run, targets TTFT <= 200 ms and TPOT <= 50 ms:
ROWS = [
    row(150, 40, 550),  # meets both
    row(200, 50, 650),  # exactly on both targets: meets (<=)
    row(250, 30, 520),  # TTFT misses
    row(100, 60, 640),  # TPOT misses
    row(120, None, 120, out=1),  # one token, no gap: meets any TPOT target
    row(None, None, None, status="rejected", out=0),  # never ran: misses
]


def test_goodput_on_a_hand_computed_example() -> None:
    m = slo_metrics([dict(r) for r in ROWS], SLOConfig(ttft_ms=200, tpot_ms=50), wall_s=4.0)
    # Met: rows 0, 1, 4 -> 3 requests in 4 s = 0.75 req/s; 3 of the 6 that arrived.
    assert m == {"latency.goodput_rps": 0.75, "latency.slo_attainment": 0.5,
                 "requests.meeting_slo": 3}
    # Adding an e2e target of 600 ms also drops row 1 (650 ms): 2 met.
    m = slo_metrics([dict(r) for r in ROWS], SLOConfig(ttft_ms=200, tpot_ms=50, e2e_ms=600),
                    wall_s=4.0)
    assert m["requests.meeting_slo"] == 2 and m["latency.goodput_rps"] == 0.5
    # Only TPOT: rows 0, 1, 2, 4.
    assert slo_metrics([dict(r) for r in ROWS], SLOConfig(tpot_ms=50), 4.0)[
        "requests.meeting_slo"] == 4


def test_rows_are_marked_and_no_target_means_no_goodput_keys() -> None:
    rows = [dict(r) for r in ROWS]
    slo_metrics(rows, SLOConfig(ttft_ms=200), 1.0)
    assert [r["meets_slo"] for r in rows] == [True, True, False, True, True, False]
    assert slo_metrics([dict(r) for r in ROWS], SLOConfig(), 1.0) == {}


def test_the_quality_floor_counts_agreeing_requests_only() -> None:
    rows = [row(100, 10, 200, out=10, agree=10), row(100, 10, 200, out=10, agree=7),
            row(100, 10, 200, out=10, agree=6), row(100, 10, 200, out=10, agree=None)]
    m = slo_metrics(rows, SLOConfig(ttft_ms=500, min_agreement=0.7), wall_s=2.0)
    # 10/10 and 7/10 reach 0.7; 6/10 does not; a request never compared cannot meet it.
    assert m["requests.meeting_slo"] == 2 and m["latency.slo_attainment"] == 0.5


def test_peak_concurrency_counts_overlaps_not_touching_ends() -> None:
    # [0, 2] and [1, 3] overlap; [3, 4] starts as [1, 3] ends; [0.5, 1.5] overlaps both
    # of the first two: three at once around t = 1.2.
    assert peak_concurrency([0, 1, 3, 0.5], [2, 3, 4, 1.5]) == 3
    assert peak_concurrency([0, 1, 2], [1, 2, 3]) == 1
    assert peak_concurrency([], []) == 0
    # Against counting every instant by brute force on random spans (ties included).
    rng = np.random.default_rng(0)
    for _ in range(200):
        a = rng.integers(0, 20, size=rng.integers(1, 12)).astype(float)
        f = a + rng.integers(1, 6, size=len(a))
        # In flight at t: arrived at or before t, finishing after it.
        want = max(int(((a <= t) & (f > t)).sum()) for t in np.concatenate([a, f]))
        assert peak_concurrency(a, f) == want


def test_slo_config_errors_say_what_to_change() -> None:
    with pytest.raises(UserError, match=r"slo\.ttft_ms=0 must be > 0"):
        SLOConfig(ttft_ms=0)
    with pytest.raises(UserError, match=r"must be in \[0, 1\]"):
        SLOConfig(min_agreement=1.5)
    with pytest.raises(UserError, match=r"slo\.min_agreement needs quality\.enabled=true"):
        run_config(compose_cfg(["model=tiny", "slo.min_agreement=0.9"]))


def test_a_run_reports_goodput_consistent_with_its_requests(tmp_path: Path) -> None:
    r = run(compose_cfg(["model=tiny", "workload=random", "workload.num_requests=6",
                         "workload.output_max=16", "workload.input_max=32",
                         "cache.kv_budget=512KiB", "slo.ttft_ms=60000", "slo.tpot_ms=60000"],
                        tmp_path))
    m = r.metrics
    with (tmp_path / "requests.csv").open() as f:
        met = sum(x["meets_slo"] == "True" for x in csv.DictReader(f))
    assert m["requests.meeting_slo"] == met == 6  # generous targets: every request
    assert m["latency.slo_attainment"] == 1.0
    assert m["latency.goodput_rps"] == pytest.approx(m["throughput.requests_per_s"])
    assert 1 <= m["requests.peak_concurrency"] <= 6


def test_the_quality_floor_in_a_run_counts_agreement_with_the_reference() -> None:
    # paged is exact: every request agrees with the reference token for token, so a floor
    # of 1.0 keeps them all; the rows carry the agreement the floor was judged on.
    r = run(compose_cfg(["model=tiny", "workload=random", "workload.num_requests=3",
                         "workload.output_max=8", "workload.input_max=24",
                         "cache.kv_budget=512KiB", "quality.enabled=true",
                         "quality.num_texts=1", "quality.text_tokens=48",
                         "quality.prefill_tokens=8", "slo.min_agreement=1.0"]))
    assert all(x["agree_tokens"] == x["output_tokens"] for x in r.requests)
    assert r.metrics["requests.meeting_slo"] == 3 and r.metrics["latency.slo_attainment"] == 1


def test_weighted_percentiles_equal_numpys_on_the_repeated_values() -> None:
    # The run's ITLs are kept as (value, count) (MetricsCollector.itl_ms): a percentile of
    # them must be numpy's of the values repeated, to the last bit.
    import numpy as np

    from harness.metrics.summary import weighted_percentile

    rng = np.random.default_rng(3)
    for trial in range(300):
        n = int(rng.integers(1, 40))
        vals = rng.choice([0.1, 0.2, 0.30000000000000004, 1e-3, 7.5, 12.0],
                          size=n) if trial % 2 else rng.exponential(5.0, size=n)
        counts = rng.integers(0, 5, size=n)
        counts[int(rng.integers(0, n))] += 1  # at least one value
        flat = np.repeat(vals, counts)
        for q in (0, 1, 33.3, 50, 90, 99, 99.9, 100):
            assert weighted_percentile(vals, counts, q) == float(np.percentile(flat, q))
    assert weighted_percentile(np.zeros(0), np.zeros(0, dtype=np.int64), 50) is None
