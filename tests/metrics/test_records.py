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
from harness.roofline.executor import SYNTHETIC_PERIOD, synthetic_tokens
from harness.runner import run
from tests.compose import compose_cfg

ROOFLINE = ["executor=roofline", "roofline.model=Llama-3.1-8B", "roofline.hardware=a100-80gb",
            "workload=random", "workload.num_requests=40", "workload.rate=50",
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
    real_lane = collector.MetricsCollector.on_lane_tokens

    def spy(self: Any, rec: Any, upd: Any, groups: Any, now: float) -> None:
        real(self, rec, upd, groups, now)
        live.append(len(self.groups))

    def spy_lane(self: Any, n: int, finished: Any, now: float) -> None:
        real_lane(self, n, finished, now)  # a lane step (its members finish here too)
        live.append(len(self.groups))

    monkeypatch.setattr(collector.MetricsCollector, "on_tokens", spy)
    monkeypatch.setattr(collector.MetricsCollector, "on_lane_tokens", spy_lane)
    r = run(compose_cfg([*ROOFLINE, "records.output_ids=true"]))  # roofline's default: none
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
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
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
    # Steps spilled to disk every 7 steps: the same files, the same metrics.
    import json

    import harness.metrics.steplog as steplog

    monkeypatch.setattr(steplog, "SPILL_ROWS", 7)
    spilled = run(compose_cfg([*ROOFLINE], tmp_path / "spilled"))
    assert spilled.steps._on_disk > len(spilled.steps) - 7 > 0  # type: ignore[attr-defined]
    for f in ("steps.csv", "requests.csv"):
        assert (tmp_path / "spilled" / f).read_bytes() == (out / f).read_bytes()
    m, want = (json.loads((d / "metrics.json").read_text()) for d in (tmp_path / "spilled", out))
    def same(d: dict[str, Any]) -> dict[str, Any]:  # but for this CPU's seconds, the time
        return {k: v for k, v in d.items()
                if "wall" not in k and "_cpu_" not in k and k != "run.started_at"}

    assert same(m) == same(want)


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


def _random_steps(rng: np.random.Generator, n: int) -> list[Any]:
    from dataclasses import fields

    from harness.metrics.rows import StepRow

    def value(kind: str) -> Any:
        if kind == "str":
            return "|".join(map(str, rng.integers(0, 9, rng.integers(0, 3))))
        if kind == "float":
            return float(rng.normal() * 10.0 ** rng.integers(-3, 6))
        return int(rng.integers(-(2**40), 2**40))
    return [StepRow(*(value(f.type) for f in fields(StepRow))) for _ in range(n)]


@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("spill", [1, 3, 7, 64])
def test_a_spilled_step_log_reads_and_writes_as_one_held_in_memory(
        spill: int, batch: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past ``spill_rows`` the numbers go to files: every read (items, negative items,
    slices, iteration, columns) and both written formats equal those of a log that held
    everything; its folder is removed when it is let go. Rows move into the columns
    ``batch`` at a time (reads take the rest first): 3 of the 23 wait at the end."""
    import gc

    import pandas as pd

    import harness.results as results
    from harness.metrics.steplog import FIELDS, StepLog

    rows = _random_steps(np.random.default_rng(spill), 23)
    held, spilled = StepLog(), StepLog(spill_rows=spill, batch=batch)
    for r in rows:
        held.append(r)
        spilled.append(r)
    assert (spilled._dir is None) == (spill > 23 - 23 % batch)
    assert len(spilled._new) == 23 % batch
    assert len(spilled) == 23 and list(spilled) == rows
    assert [spilled[i] for i in range(-23, 23)] == [rows[i] for i in range(-23, 23)]
    assert spilled[2:17] == rows[2:17] and spilled[5:5] == []
    with pytest.raises(IndexError):
        spilled[23]
    for f in FIELDS:
        assert spilled.column(f).tolist() == held.column(f).tolist()
    monkeypatch.setattr(results, "_CHUNK", 5)  # chunks that cross the spill boundaries
    for fmt in ("csv", "parquet"):
        for name, log in (("a", held), ("b", spilled)):
            results._write_records(tmp_path / f"{name}.{fmt}", results.step_columns(log), fmt)
    assert (tmp_path / "a.csv").read_bytes() == (tmp_path / "b.csv").read_bytes()
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "a.parquet"),
                                  pd.read_parquet(tmp_path / "b.parquet"))
    folder = spilled._dir
    if spill < 23:
        assert folder.is_dir()
        del spilled, log
        gc.collect()
        assert not folder.exists()


@pytest.mark.parametrize("first_scored", [True, False])
def test_the_request_log_writes_as_its_rows_would(first_scored: bool, tmp_path: Path) -> None:
    """Rows as columns read back and write (CSV bytes, Parquet table and types) as the row
    dicts themselves did: None in the nullable reals and in a text, a nullable real that
    is None throughout (a null Parquet column), columns added afterwards on some rows only
    (their place in the file from the first row that has them) or on every row with None
    values; no rows, no columns."""
    import pyarrow.parquet as pq

    import harness.results as results
    from harness.metrics.requestlog import FIXED, RequestLog

    rng = np.random.default_rng(3 + first_scored)
    rows: list[dict[str, Any]] = []
    for _ in range(30):
        r: dict[str, Any] = {}
        for k, kind in FIXED.items():
            if kind == "s":
                r[k] = ["finished", "", "a, b \"quoted\"", None][int(rng.integers(0, 4))]
            elif kind == "q":
                r[k] = int(rng.integers(-5, 2**40))
            elif (kind == "n" and rng.random() < 0.3) or k == "itl_ms_max":
                r[k] = None  # itl_ms_max: None throughout
            else:
                r[k] = float(rng.normal() * 1e3)
        r["output_ids"] = " ".join(map(str, rng.integers(0, 50, 3)))
        rows.append(r)
    log = RequestLog()
    slots = [log.reserve() for _ in rows]
    for i in rng.permutation(len(rows)):  # rows are filled as requests finish
        log.fill(slots[i], rows[i])
    with pytest.raises(KeyError, match="not the RequestLog's columns"):
        log.fill(0, {**rows[0], "new": 1})
    # As the runner adds them: task scores on the requests that ran, the agreement on
    # every row (None where never compared), meets_slo on every row.
    scored = {i: float(rng.random()) for i in range(0 if first_scored else 1, 30, 4)}
    log.add_column("score", [scored.get(i) for i in range(30)], every_row=False)
    log.add_column("task", [None] * 30, every_row=False)  # on no row: no column
    agree = [None if rng.random() < 0.3 else int(rng.integers(0, 9)) for _ in range(30)]
    log.add_column("agree_tokens", agree)
    log.add_column("meets_slo", [bool(rng.random() < 0.5) for _ in range(30)])
    for i, r in enumerate(rows):
        if i in scored:
            r["score"] = scored[i]
        r["agree_tokens"] = agree[i]
        r["meets_slo"] = log.column("meets_slo")[i]
    assert list(log) == rows and log[-1] == rows[-1] and log[3:9] == rows[3:9]
    with pytest.raises(ValueError, match="2 values for 30 rows"):
        log.add_column("x", [1, 2])
    for name, table in (("a", log), ("b", rows)):
        for fmt in ("csv", "parquet"):
            results._write_records(tmp_path / f"{name}.{fmt}", results.request_columns(table),
                                   fmt)
    text = (tmp_path / "a.csv").read_text()
    assert text == (tmp_path / "b.csv").read_text() and text.count("\n") == 31
    assert text.index("score") > text.index("meets_slo") if not first_scored else \
        text.index("score") < text.index("agree_tokens")
    a, b = pq.read_table(tmp_path / "a.parquet"), pq.read_table(tmp_path / "b.parquet")
    assert a.schema == b.schema and a.equals(b) and str(a.schema.field("itl_ms_max").type) \
        == "null"
    assert results.request_columns(RequestLog()) == results.request_columns([]) == {}


def test_ids_text_is_joined_str() -> None:
    """requests.csv's output_ids: the table lookup gives str's text, also past the table,
    for negative ids and for none."""
    rng = np.random.default_rng(0)
    cases = [[], [0], [65_535], [65_536], [-1, 5], [2**40]]
    cases += [rng.integers(0, 70_000, size=int(rng.integers(1, 50))).tolist()
              for _ in range(300)]
    for ids in cases:
        assert collector.ids_text(ids) == " ".join(map(str, ids)), ids


def test_ids_text_of_a_periodic_list_is_joined_str(monkeypatch: pytest.MonkeyPatch) -> None:
    """The periodic shortcut (one period joined, then copied) gives str's text for every
    period it takes, every remainder, ids past the table, and lists that repeat all but
    one id (which must not take it); the roofline's synthetic outputs take it."""
    rng = np.random.default_rng(1)
    took = 0
    for _ in range(600):
        p = int(rng.integers(1, 40))
        unit = rng.integers(-3, 70_000 if rng.random() < 0.2 else 300, size=p).tolist()
        n = int(rng.integers(50, 300))
        ids = (unit * (n // p + 1))[:n]
        if rng.random() < 0.3:  # one id off the period, anywhere
            ids[int(rng.integers(0, n))] += 1
        periodic = len(ids) >= 64 and any(ids[q:] == ids[:-q] for q in range(1, 33))
        took += periodic
        assert collector.ids_text(ids) == " ".join(map(str, ids)), (p, ids)
    assert took > 200
    # The roofline's outputs take it: no join is longer than their period.
    joined: list[int] = []
    join = collector._join_ids
    monkeypatch.setattr(collector, "_join_ids", lambda ids: joined.append(len(ids)) or join(ids))
    out = synthetic_tokens(12345, 161, 338)
    assert collector.ids_text(out) == " ".join(map(str, out)) and max(joined) == SYNTHETIC_PERIOD
