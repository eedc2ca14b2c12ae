"""``repeats=N``: the summary's statistics against brute force, the sweep's interleaved
order, the folders, and how report and gate read a group of repeats."""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from harness.app.gate import judge_interval
from harness.config import run_config
from harness.errors import UserError
from harness.metrics.repeats import median_ci, paired_ratio, summarize_repeats
from harness.repeats import expand_repeats
from harness.reporting.baseline import MetricSpec
from harness.reporting.runs import check_sweeps, find_runs
from tests.compose import compose_cfg

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["model=tiny", "workload=random", "workload.num_requests=4", "workload.input_max=24",
         "workload.output_max=6", "progress=false"]


def harness(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "harness", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)


def test_median_interval_is_the_bootstrap_of_whole_repeats() -> None:
    values = [10.0, 13.0, 11.0, 30.0, 12.0]
    med, low, high = median_ci(values)
    assert med == 12.0
    # Every resample's median is one of the values (odd n): the bounds are values, the
    # interval holds the median, and it is no wider than the data.
    assert low in values and high in values and low <= med <= high
    assert min(values) <= low and high <= max(values)
    # Brute force over all 5^5 equally likely resamples: the exact 2.5% / 97.5% quantiles
    # of the median's distribution; the seeded bootstrap (1000 draws) lands on them.
    meds = sorted(float(np.median(c)) for c in itertools.product(values, repeat=5))
    exact = (np.quantile(meds, 0.025), np.quantile(meds, 0.975))
    assert (low, high) == pytest.approx(exact, abs=1.01)
    assert median_ci([5.0, 5.0, 5.0]) == (5.0, 5.0, 5.0)


def test_summary_states_exact_metrics_once_and_lists_disagreement() -> None:
    runs = [{"throughput.output_tokens_per_s": v, "latency.ttft_ms.p50": 2 * v,
             "memory.max_running_seqs": 4, "cache.prefix_hit_rate": h,
             "run.started_at": f"t{v}", "run.backend": "paged",
             "throughput.output_tokens_per_s_ci95_low": 0.0}
            for v, h in ((100.0, 0.5), (120.0, 0.5), (110.0, 0.25))]
    s = summarize_repeats(runs, [0, 1, 2])
    m = s.metrics
    assert m["throughput.output_tokens_per_s"] == 110.0
    assert m["throughput.output_tokens_per_s_ci95_low"] >= 100.0  # the repeats', not 0
    assert m["latency.ttft_ms.p50"] == 220.0 and "latency.ttft_ms.p50_ci95_high" in m
    assert m["memory.max_running_seqs"] == 4 and "memory.max_running_seqs_ci95_low" not in m
    assert s.varied == ["cache.prefix_hit_rate"] and m["cache.prefix_hit_rate"] == 0.5
    assert m["run.started_at"] == "t100.0" and m["repeats.n"] == 3
    with pytest.raises(ValueError):
        summarize_repeats([])


def test_paired_ratio_pairs_repeats_by_index() -> None:
    # Repeat 1 ran on a slow machine for both: the paired ratio sees 2x every time.
    a, b = {0: 200.0, 1: 100.0, 2: 210.0}, {0: 100.0, 1: 50.0, 2: 105.0, 3: 7.0}
    assert paired_ratio(a, b) == (2.0, 2.0, 2.0)
    assert paired_ratio(a, {5: 1.0}) is None
    assert paired_ratio(a, {0: 0.0}) is None


def test_sweep_repeats_are_interleaved_across_configurations() -> None:
    jobs = [["backend=paged"], ["backend=contiguous"], ["backend=flex"]]
    got = expand_repeats(jobs, [2, 3, 1])
    assert got == [
        ["backend=paged", "repeat=0", "repeat_of=0"],
        ["backend=contiguous", "repeat=0", "repeat_of=1"],
        ["backend=flex", "repeat=0", "repeat_of=2"],
        ["backend=paged", "repeat=1", "repeat_of=0"],
        ["backend=contiguous", "repeat=1", "repeat_of=1"],
        ["backend=contiguous", "repeat=2", "repeat_of=1"],
    ]
    assert expand_repeats(jobs, [1, 1, 1]) == jobs


def test_gate_fails_only_outside_the_interval_by_more_than_the_tolerance() -> None:
    spec = MetricSpec("higher", 0.05, 0.0)
    assert judge_interval(spec, 100.0, 90.0, 80.0, 104.0)[0] == "ok"  # inside: noise
    assert judge_interval(spec, 100.0, 90.0, 85.0, 96.0)[0] == "ok"  # 4% below: tolerated
    v, note = judge_interval(spec, 100.0, 80.0, 75.0, 90.0)
    assert v == "REGRESSED" and "outside" in note
    assert judge_interval(spec, 100.0, 120.0, 110.0, 130.0)[0] == "improved"
    assert judge_interval(spec, 100.0, float("nan"), 1.0, 2.0)[0] == "REGRESSED"


def test_roofline_refuses_repeats() -> None:
    with pytest.raises(UserError, match="deterministic"):
        run_config(compose_cfg(["executor=roofline", "repeats=3"]))
    with pytest.raises(UserError, match="set by kvbench"):
        run_config(compose_cfg(["repeat=2"]))


def test_a_run_with_repeats_is_one_folder_of_repeats_and_one_run_to_the_report(
        tmp_path: Path) -> None:
    run = tmp_path / "run"
    p = harness(*SMALL, "repeats=3", f"hydra.run.dir={run}")
    assert p.returncode == 0, p.stderr
    assert "3 repeat(s)" in p.stdout and " [" in p.stdout  # medians with intervals
    reps = [run / f"repeat-{k}" for k in range(3)]
    assert all((r / "metrics.json").is_file() for r in reps)
    assert [yaml.safe_load((r / "config.yaml").read_text())["repeat"] for r in reps] == [0, 1, 2]
    ms = [json.loads((r / "metrics.json").read_text()) for r in reps]
    summary = json.loads((run / "repeats.json").read_text())
    assert summary["finished"] == [0, 1, 2] and summary["repeats"] == 3
    # Every arrival at t=0, greedy: the schedule and the tokens repeat exactly.
    assert summary["varied"] == []
    for key in ("memory.max_running_seqs", "cache.prefill_tokens_computed", "sched.steps"):
        assert ms[0][key] == ms[1][key] == ms[2][key] == summary["metrics"][key]
    tput = sorted(m["throughput.output_tokens_per_s"] for m in ms)
    assert summary["metrics"]["throughput.output_tokens_per_s"] == tput[1]
    runs = find_runs([run])
    assert len(runs) == 1 and runs[0].path == run.resolve() and len(runs[0].repeats) == 3
    assert runs[0].metrics is not None and runs[0].metrics["repeats.n"] == 3
    assert "repeat" not in runs[0].config and runs[0].requests().shape[0] == 4
    # A run of another configuration in the group's folder (copied or run there by
    # hand) is not one of its repeats: left out, and said (issue #55: it was merged).
    cfg = (reps[2] / "config.yaml").read_text()
    assert "backend:\n  name: paged" in cfg
    (reps[2] / "config.yaml").write_text(cfg.replace("name: paged", "name: fp8", 1))
    (group,) = find_runs([run])
    assert len(group.repeats) == 2 and group.metrics is not None
    assert group.metrics["repeats.n"] == 2
    assert "repeat-2 is another configuration's run (left out)" in str(group.failure)


def test_a_sweep_with_repeats_interleaves_and_reports_each_configuration_once(
        tmp_path: Path) -> None:
    p = harness("-m", *SMALL, "backend=paged,contiguous", "repeats=2",
                f"hydra.sweep.dir={tmp_path}")
    assert p.returncode == 0, p.stderr
    order = {}
    for h in tmp_path.glob("*/repeat-*/.hydra/hydra.yaml"):
        num = yaml.safe_load(h.read_text())["hydra"]["job"]["num"]
        order[num] = str(h.parents[1].relative_to(tmp_path))
    assert [order[k] for k in sorted(order)] == [
        "0-paged-random/repeat-0", "1-contiguous-random/repeat-0",
        "0-paged-random/repeat-1", "1-contiguous-random/repeat-1"]
    runs = find_runs([tmp_path])
    assert sorted(r.backend for r in runs) == ["contiguous", "paged"]
    assert all(len(r.repeats) == 2 for r in runs)
    assert check_sweeps([tmp_path], runs).never_started == []
    # The gate reads medians; its baseline records every repeat.
    base = tmp_path.parent / f"{tmp_path.name}-baseline.json"
    metrics = ["--metrics", "requests.finished", "throughput.output_tokens_per_s:higher:0.5"]

    def gate(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "harness.gate", *args],
                              capture_output=True, text=True, cwd=ROOT, timeout=120)

    w = gate("--write-baseline", str(base), str(tmp_path), *metrics)
    assert w.returncode == 0, w.stderr
    d = json.loads(base.read_text())
    assert len(d["repeats"]["paged/random"]["throughput.output_tokens_per_s"]) == 2
    g = gate(str(tmp_path), "--baseline", str(base))
    assert g.returncode == 0, g.stdout + g.stderr
    assert "interval" in g.stdout
    # A repeat that never ran is named as never started, and the group says so.
    shutil.rmtree(tmp_path / "1-contiguous-random" / "repeat-1")
    runs = find_runs([tmp_path])
    check = check_sweeps([tmp_path], runs)
    assert [job[-1] for _, job in check.never_started] == ["repeat=1"]
    part = next(r for r in runs if r.backend == "contiguous")
    assert part.metrics is not None and "1 of 2 repeats" in str(part.failure)
    # ... and the gate names it in its verdict, and refuses it as a baseline (issue #55:
    # one of three repeats gated PASS and wrote a baseline).
    g = gate(str(tmp_path), "--baseline", str(base))
    assert g.returncode == 1 and "PARTIAL: 1 of 2 repeats finished" in g.stdout
    assert "NOT STARTED (a job of its sweep)" in g.stdout and "FAIL (" in g.stdout
    w = gate("--write-baseline", str(base), str(tmp_path), *metrics)
    assert w.returncode == 2 and "jobs that never started" in w.stderr


def test_repeat_of_set_by_hand_is_refused_and_marks_no_group(tmp_path: Path) -> None:
    """Issue #55: repeat_of given on one run marked its parent folder (results/) as a
    group of repeats."""
    from harness.repeats import GROUP_MARK

    p = harness(*SMALL, "repeat_of=0", f"results_dir={tmp_path}")
    assert p.returncode == 2 and "repeat_of (and repeat) are set by kvbench's sweeper" \
        in p.stderr
    assert not (tmp_path / GROUP_MARK).exists()
    (run,) = list(tmp_path.iterdir())
    assert (run / "FAILED").is_file()
