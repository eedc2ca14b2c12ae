"""What a run keeps of its requests: a finished request's row is made when it finishes and
its group let go, and the run's inter-token latencies are kept as counts per step, from
which every percentile equals the one over each request's own token times."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import harness.metrics.collector as collector
from harness.runner import run
from tests.compose import compose_cfg

ROOFLINE = ["executor=roofline", "roofline.model=Llama-3.1-8B", "roofline.hardware=a100-80gb",
            "workload=random", "workload.num_requests=40", "workload.rate=200",
            "workload.input_max=600", "workload.output_max=120", "scheduler.max_num_seqs=12",
            "cache.kv_budget=160MiB"]


@pytest.mark.parametrize("extra", [
    ["scheduler.preemption_mode=recompute"],
    ["scheduler.preemption_mode=swap", "cache.swap_space=1GiB"],
    # prompt-only steps between a request's tokens: ITLs over two steps and more
    ["scheduler.mixing=prefill_first", "scheduler.chunked_prefill=false",
     "scheduler.max_num_batched_tokens=1024"],
])
def test_itl_percentiles_equal_those_of_every_requests_token_times(
        extra: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[int, list[float]] = {}
    real = collector.MetricsCollector.on_tokens

    def spy(self: Any, rec: Any, upd: Any, groups: Any, now: float) -> None:
        for rid in dict.fromkeys(g.request_id for g in groups):
            seen.setdefault(rid, []).append(now)
        real(self, rec, upd, groups, now)

    monkeypatch.setattr(collector.MetricsCollector, "on_tokens", spy)
    # Stepped one by one, every sampled group passes through on_tokens (decode-lane
    # members do not: they are counted; the lane run must give the same percentiles).
    r = run(compose_cfg([*ROOFLINE, *extra, "roofline.fast_path=false"]))
    itl = [(b - a) * 1e3 for tt in seen.values() for a, b in itertools.pairwise(tt)]
    monkeypatch.setattr(collector.MetricsCollector, "on_tokens", real)
    lanes = run(compose_cfg([*ROOFLINE, *extra]))
    for q in (50, 90, 99):
        assert r.metrics[f"latency.itl_ms.p{q}"] == float(np.percentile(itl, q))
        assert lanes.metrics[f"latency.itl_ms.p{q}"] == r.metrics[f"latency.itl_ms.p{q}"]
    m = r.metrics
    if "recompute" in extra[0]:
        assert m["sched.preemptions_recompute"] > 0  # tokens of a request steps apart
    if "swap" in extra[0]:
        assert m["sched.preemptions_swap"] > 0
    rows = {x["request_id"]: x for x in r.requests}
    assert list(rows) == sorted(rows, key=lambda i: rows[i]["arrival_s"])  # arrival order
    for rid, tt in seen.items():
        gaps = [(b - a) * 1e3 for a, b in itertools.pairwise(tt)]
        assert rows[rid]["itl_ms_max"] == (max(gaps) if gaps else None)


def test_a_finished_request_is_let_go(monkeypatch: pytest.MonkeyPatch) -> None:
    live: list[int] = []
    real = collector.MetricsCollector.on_tokens

    def spy(self: Any, rec: Any, upd: Any, groups: Any, now: float) -> None:
        real(self, rec, upd, groups, now)
        live.append(len(self.groups))

    monkeypatch.setattr(collector.MetricsCollector, "on_tokens", spy)
    r = run(compose_cfg(ROOFLINE))
    # Never more groups held than requests in flight (12 running plus the queue), and
    # none at the end; every finished request's outputs and row are still there.
    assert max(live) < 40 and live[-1] == 0
    assert len(r.outputs) == 40 and all(len(o) == x["output_tokens"] for o, x in
                                        zip((r.outputs[x["request_id"]] for x in r.requests),
                                            r.requests))


def test_the_step_log_reads_as_the_rows_it_was_given() -> None:
    from dataclasses import fields

    from harness.metrics.rows import StepRow
    from harness.metrics.steplog import StepLog

    def row(i: int) -> StepRow:
        return StepRow(*(f"{i}|{j}" if f.type == "str" else i + j / 8 if f.type == "float"
                         else 1000 * i + j for j, f in enumerate(fields(StepRow))))

    rows = [row(i) for i in range(5)]
    log = StepLog()
    for r in rows:
        log.append(r)
    assert len(log) == 5 and list(log) == rows and log[3] == rows[3] and log[1:4] == rows[1:4]
    assert log.column("step_ms").tolist() == [r.step_ms for r in rows]
    assert log.column("reserved_bytes").tolist() == [r.reserved_bytes for r in rows]
    assert log.column("group_blocks").tolist() == [r.group_blocks for r in rows]


def test_records_as_csv_are_the_files_they_always_were_and_parquet_the_same_table(
        tmp_path: Path) -> None:
    import csv
    import io
    from dataclasses import asdict

    import pandas as pd

    from harness.reporting.runs import _load as load_run

    runs = {}
    for fmt in ("csv", "parquet"):
        out = tmp_path / fmt
        runs[fmt] = run(compose_cfg([*ROOFLINE, f"records.format={fmt}"], out))
    r = runs["csv"]
    out = tmp_path / "csv"
    # steps.csv byte for byte as csv.DictWriter wrote it from every row (the old writer)
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(asdict(r.steps[0])))
    w.writeheader()
    w.writerows(asdict(s) for s in r.steps)
    assert (out / "steps.csv").read_bytes() == buf.getvalue().encode()
    assert not (out / "steps.parquet").exists()
    a, b = load_run(out), load_run(tmp_path / "parquet")
    assert (tmp_path / "parquet" / "steps.parquet").exists()
    assert not (tmp_path / "parquet" / "steps.csv").exists()
    for name in ("steps", "requests"):
        x, y = getattr(a, name)(), getattr(b, name)()
        assert len(x) > 0
        # (CSV reads an empty text as NaN, Parquet keeps it "")
        pd.testing.assert_frame_equal(x.astype(object).fillna(""), y.astype(object).fillna(""),
                                      check_dtype=False)


def test_output_ids_can_be_left_out_of_a_roofline_run_only() -> None:
    from harness.errors import UserError

    r = run(compose_cfg([*ROOFLINE, "records.output_ids=false"]))
    assert r.outputs == {} and "output_ids" not in r.requests[0]
    assert len(r.requests) == 40 and r.requests[0]["output_tokens"] > 0
    with pytest.raises(UserError, match=r"records\.output_ids=false drops the outputs"):
        run(compose_cfg(["model=tiny", "records.output_ids=false"]))


def test_parquet_takes_a_column_whose_first_value_is_none(tmp_path: Path) -> None:
    import pandas as pd

    from harness.reporting.runs import _load as load_run

    trace = tmp_path / "t.csv"  # the first row is rejected: no TTFT, no finish reason
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0,5000,4\n0.1,50,4\n0.2,60,3\n")
    frames = []
    for fmt in ("csv", "parquet"):
        out = tmp_path / fmt
        run(compose_cfg([*ROOFLINE[:3], "workload=trace", f"workload.path={trace}",
                         "workload.over_length=reject", "scheduler.max_model_len=1024",
                         f"records.format={fmt}"], out))
        frames.append(load_run(out).requests())
    a, b = frames
    assert a["status"].tolist() == ["rejected", "finished", "finished"]
    assert b["ttft_ms"].isna().tolist() == [True, False, False]
    pd.testing.assert_frame_equal(a.astype(object).fillna(""), b.astype(object).fillna(""),
                                  check_dtype=False)
