"""The `ruler` workload: exact lengths, needles where asked, shared prefixes, RULER's
scores, the quality.task_* keys, the bootstrap, and a tiny-model run through the engine."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import numpy as np
import pytest

from harness.errors import UserError
from harness.metrics.bootstrap import bootstrap_ci
from harness.metrics.tasks import Scored, task_metrics
from harness.model import ByteTokenizer
from harness.runner import run
from harness.workloads import make_workload, workload_options
from harness.workloads.ruler import RulerWorkload, string_match
from harness.workloads.ruler_tasks import TASKS
from harness.workloads.ruler_text import Needle, fill, noise_stream
from tests.compose import compose_cfg

SMALL = {"tasks": list(TASKS), "lengths": [1024, 1200], "depths": [0.0, 50.0, 100.0],
         "num_queries": 3}


def _workload(**kw: object) -> RulerWorkload:
    wl = make_workload({"name": "ruler", **SMALL, **kw}, ByteTokenizer())
    assert isinstance(wl, RulerWorkload)
    return wl


def test_bootstrap_hand_examples() -> None:
    # Two observations 0 and 1: resampled means are 0, 0.5, 1 with chances 1/4, 1/2, 1/4,
    # so the 2.5th and 97.5th percentiles are 0 and 1.
    assert bootstrap_ci([0.0, 1.0], seed=3) == (0.0, 1.0)
    # Constant data: no spread. One observation: the point itself.
    assert bootstrap_ci([0.7] * 9) == pytest.approx((0.7, 0.7))
    assert bootstrap_ci([0.25]) == (0.25, 0.25)
    # 20 zeros and 20 ones: mean 0.5, standard error sqrt(0.25 / 40) = 0.079, so the
    # interval is about 0.5 +- 1.96 * 0.079 = (0.345, 0.655).
    low, high = bootstrap_ci([0.0] * 20 + [1.0] * 20, resamples=4000)
    assert low == pytest.approx(0.345, abs=0.03) and high == pytest.approx(0.655, abs=0.03)
    # Seeded: the same seed, the same interval; blocks of correlated data widen it.
    x = np.repeat(np.arange(10.0), 8)  # runs of 8 equal values
    assert bootstrap_ci(x, seed=1) == bootstrap_ci(x, seed=1)
    one = bootstrap_ci(x, seed=1)
    blocked = bootstrap_ci(x, seed=1, block=8)
    assert blocked[1] - blocked[0] > 1.5 * (one[1] - one[0])


def test_string_match_is_rulers() -> None:
    assert string_match("The numbers are 123 and 456.", ["123", "456", "789"]) == \
        pytest.approx(2 / 3)
    assert string_match("the number is 789", ["123", "789"], "part") == 1.0
    assert string_match("nothing", ["123"], "part") == 0.0
    assert string_match("WORD", ["word"]) == 1.0  # case-insensitive


def test_fill_exact_length_and_needle_at_depth() -> None:
    tok = ByteTokenizer()
    for depth in (0.0, 0.3, 1.0):
        ids, where = fill(noise_stream(tok), tok, 600, [Needle(depth, " NEEDLE 42.")])
        assert len(ids) == 600
        text = tok.decode(ids)
        pos = text.index(" NEEDLE 42.")
        # At the unit boundary nearest the depth (a unit is ~100 bytes).
        assert abs(pos - depth * (600 - 11)) <= 60
        assert where[0] == pytest.approx(pos / (600 - 11))


def test_every_prompt_has_its_length_and_its_answer() -> None:
    wl = _workload()
    tok = ByteTokenizer()
    reqs = wl.initial_requests()
    # 6 depth tasks x 2 lengths x 3 depths + 2 depthless tasks x 2 lengths.
    assert len(reqs) == 6 * 2 * 3 + 2 * 2
    for r in reqs:
        it = wl.items[r.request_id]
        assert len(r.prompt_ids) == it.length == r.meta["length"]
        text = tok.decode(r.prompt_ids)
        if it.task.startswith("niah") or it.task == "vt":
            for e in it.expected:
                assert e in text
        # An oracle answer scores 1, an empty one 0.
        assert wl.score(r.request_id, " ".join(it.expected)) == 1.0
        assert wl.score(r.request_id, "") == 0.0


def test_seeded_and_ids_follow_what_a_request_is() -> None:
    a, b, c = _workload(seed=1), _workload(seed=1), _workload(seed=2)
    key = {r.request_id: r.prompt_ids for r in a.initial_requests()}
    assert key == {r.request_id: r.prompt_ids for r in b.initial_requests()}
    assert key != {r.request_id: r.prompt_ids for r in c.initial_requests()}


@pytest.mark.parametrize(("haystack", "shared_past"), [("own", 1000), ("essays", 900)])
def test_questions_share_the_haystack_prefix(haystack: str, shared_past: int) -> None:
    wl = _workload(tasks=["niah_multikey", "niah_single_1"], haystack=haystack)
    reqs = wl.initial_requests()
    mk = [r.prompt_ids for r in reqs
          if r.meta["task"] == "niah_multikey" and r.meta["length"] == 1200]
    assert len(mk) == 3
    # The questions about one multi-key haystack share it up to its end (own keys) or
    # nearly: a question names its key twice, and RULER's longer adjective-noun keys
    # (up to ~30 bytes apart) leave a question more or less filler, which can move the
    # deepest needle by one unit.
    first_diff = min(i for i in range(1200) if len({p[i] for p in mk}) > 1)
    assert first_diff > shared_past
    # Single needles in noise at depth 100%: the 1024- and the 1200-token prompt agree up
    # to the shorter one's needle.
    deep = [r.prompt_ids for r in reqs
            if r.meta["task"] == "niah_single_1" and r.meta["depth"] > 90]
    tok = ByteTokenizer()
    text = tok.decode(min(deep, key=len))
    needle_at = len(tok.encode(text[:text.index(" One of the special")]))  # BOS counted
    assert len(deep) == 2 and needle_at > 700 and deep[0][:needle_at] == deep[1][:needle_at]


def test_bad_options_are_user_errors() -> None:
    for bad in ({"tasks": ["nope"]}, {"lengths": [10]}, {"lengths": [10_000]},
                {"depths": [120.0]}, {"samples": 0}, {"tasks": []}):
        with pytest.raises(UserError):
            workload_options("ruler", bad)
    # A length the options allow but the prompt cannot fit in: said when it is built,
    # with the task, the length and the real minimum (issue 27: "a -30-token haystack").
    with pytest.raises(UserError, match=r"workload\.tasks \w+ at workload\.lengths 100: a "
                                        r"100-token prompt cannot hold its header, question "
                                        r"and needles \(\d+ tokens with this tokenizer\): the "
                                        r"shortest it can be is (\d+) tokens") as e:
        _workload(lengths=[100])
    shortest = int(str(e.value).split("shortest it can be is ")[1].split()[0])
    assert shortest > 100
    # Duplicates would run a cell twice and count it double; more queries than keys.
    for bad, phrase in (({"lengths": [1024, 1024]}, "workload.lengths=[1024, 1024]: 1024 "
                                                    "given more than once"),
                        ({"depths": [0.0, 50.0, 0.0]}, "0.0 given more than once"),
                        ({"tasks": ["niah_single_1", "niah_single_1"]}, "niah_single_1 given"),
                        ({"tasks": ["niah_multiquery"], "depths": [0.0, 50.0],
                          "num_queries": 4}, "workload.num_queries=4 exceeds the 2 keys")):
        with pytest.raises(UserError, match=re.escape(phrase)):
            workload_options("ruler", bad)


def test_task_metrics_by_hand() -> None:
    scored = {0: Scored("a", 1024, 0.0, 1.0), 1: Scored("a", 1024, 50.0, 0.0),
              2: Scored("a", 2048, 0.0, 1.0), 3: Scored("b", 1024, -1.0, 0.5)}
    m = task_metrics(scored)
    assert m["quality.task_accuracy.a"] == pytest.approx(2 / 3)
    assert m["quality.task_accuracy.a.1024"] == 0.5
    assert m["quality.task_accuracy.b"] == 0.5
    # Every task weighs the same: (2/3 + 1/2) / 2, not the request mean 2.5 / 4.
    assert m["quality.task_accuracy"] == pytest.approx((2 / 3 + 0.5) / 2)
    assert m["quality.task_accuracy.all.1024"] == pytest.approx((0.5 + 0.5) / 2)
    assert m["quality.task_accuracy.all.2048"] == 1.0
    for k in ("quality.task_accuracy", "quality.task_accuracy.a"):
        assert m[f"{k}_ci95_low"] <= m[k] <= m[f"{k}_ci95_high"]
    assert m["quality.task_requests"] == 4


def test_tiny_run_reports_task_keys_and_columns(tmp_path: Path) -> None:
    cfg = compose_cfg(["model=tiny", "+experiment=ruler", "cache.kv_budget=8MiB",
                       "workload.tasks=[niah_single_1,niah_multikey,cwe]",
                       "workload.lengths=[1024]", "workload.depths=[0,100]",
                       "quality.enabled=true", "quality.num_texts=1",
                       "quality.text_tokens=96", "quality.generation_agreement=false"],
                      tmp_path)
    r = run(cfg)
    m = json.loads((tmp_path / "metrics.json").read_text())
    for k in ("quality.task_accuracy", "quality.task_accuracy.niah_single_1",
              "quality.task_accuracy.niah_multikey.1024", "quality.task_accuracy.all.1024",
              "quality.task_accuracy.cwe_ci95_high", "quality.ppl_delta_pct_ci95_low",
              "quality.kl_mean_ci95_high"):
        assert k in m, k
    assert m["quality.ppl_delta_pct_ci95_low"] <= m["quality.ppl_delta_pct"] \
        <= m["quality.ppl_delta_pct_ci95_high"]
    assert m["requests.finished"] == len(r.requests) == 2 + 2 + 1
    with open(tmp_path / "requests.csv") as f:
        rows = list(csv.DictReader(f))
    assert {row["task"] for row in rows} == {"niah_single_1", "niah_multikey", "cwe"}
    assert all(row["length"] == "1024" and row["score"] != "" for row in rows)
    # The multi-key questions share their haystack: the prefix cache serves it.
    assert m["cache.prefix_hit_rate"] > 0.2


def test_requests_that_never_ran_are_not_scored(tmp_path: Path) -> None:
    # Issue 27: rejected requests (longer than max_model_len) were scored 0.0 and averaged
    # in: a cell that could not run read as wrong answers (0.5 where what ran scored 1.0).
    cfg = compose_cfg(["model=tiny", "+experiment=ruler", "cache.kv_budget=8MiB",
                       "workload.tasks=[niah_single_1]", "workload.lengths=[1024,2048]",
                       "workload.depths=[0,100]", "scheduler.max_model_len=1200"], tmp_path)
    run(cfg)
    m = json.loads((tmp_path / "metrics.json").read_text())
    assert m["requests.rejected"] == 2 and m["quality.task_not_run"] == 2
    assert m["quality.task_requests"] == 2
    assert "quality.task_accuracy.all.2048" not in m
    assert "quality.task_accuracy.niah_single_1.2048" not in m
    # What ran alone makes the averages.
    assert m["quality.task_accuracy"] == m["quality.task_accuracy.all.1024"]
    with open(tmp_path / "requests.csv") as f:
        rows = list(csv.DictReader(f))
    assert sorted(r["score"] == "" for r in rows) == [False, False, True, True]
    assert all(r["status"] == "rejected" for r in rows if r["score"] == "")


def test_report_draws_heatmaps_frontier_and_table(tmp_path: Path) -> None:
    from harness.app.report import build_report

    base = ["model=tiny", "+experiment=ruler", "cache.kv_budget=8MiB",
            "workload.tasks=[niah_single_1,niah_multikey]", "workload.lengths=[1024]",
            "workload.depths=[0,50,100]"]
    for i, extra in enumerate([["backend=paged"],
                               ["backend=sliding_window", "backend.window=256"]]):
        run(compose_cfg([*base, *extra], tmp_path / f"{i}-run"))
    files = build_report([tmp_path], out=tmp_path / "report")
    names = {p.name for p in files.all()}
    assert {"task_depth_length.png", "task_frontier.png", "task_accuracy.md"} <= names
    md = (tmp_path / "report" / "task_accuracy.md").read_text().splitlines()
    assert md[0].startswith("| run | accuracy [95% CI] | niah_multikey | niah_single_1 |")
    assert len(md) == 2 + 2  # header, rule, one row per run
    # The window holds fewer bytes per sequence than paged (the KV MiB / seq column).
    held = {line.split("|")[1].strip(): float(line.split("|")[-4]) for line in md[2:]}
    assert held["sliding_window"] < held["paged"]
