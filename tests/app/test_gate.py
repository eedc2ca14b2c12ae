"""``python -m harness.gate``: pass on the baseline's own runs; fail (exit 1) on a
regression, a missing metric, a failed or missing run; exit 2 on usage errors; directions
and absolute floors as the spec says.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from harness.app.gate import DEFAULT_SPEC, judge, main
from harness.config import as_recorded
from harness.reporting.baseline import Baseline, MetricSpec
from harness.reporting.runs import flatten, fmt_value
from tests.app.test_report import make_sweep
from tests.compose import compose_cfg

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_sweep(tmp_path_factory.mktemp("sweep"))


@pytest.fixture(scope="module")
def baseline(sweep: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("baselines") / "tiny.json"
    assert main(["--write-baseline", str(path), str(sweep)]) == 0
    return path


@pytest.fixture
def copy(sweep: Path, tmp_path: Path) -> Path:
    shutil.copytree(sweep, tmp_path / "s")
    return tmp_path / "s"


def edit_metrics(run: Path, **changes: Any) -> None:
    """Set metrics (``a__b`` for ``a.b``); None deletes one."""
    m = json.loads((run / "metrics.json").read_text())
    for k, v in changes.items():
        key = k.replace("__", ".")
        if v is None:
            del m[key]
        else:
            m[key] = v
    (run / "metrics.json").write_text(json.dumps(m))


def metric(run: Path, key: str) -> Any:
    return json.loads((run / "metrics.json").read_text())[key]


def test_baseline_holds_every_run_and_default_metric(baseline: Path) -> None:
    b = Baseline.load(baseline)
    assert sorted(b.runs) == ["contiguous/multiturn", "contiguous/shared_prefix",
                              "paged/multiturn", "paged/shared_prefix"]
    assert b.key_fields == []  # the four runs differ only in backend and workload
    assert b.spec == DEFAULT_SPEC
    # Every default metric a run has, and no clock: quality.* is off in these runs.
    assert set(b.runs["paged/multiturn"]) == {m for m in DEFAULT_SPEC
                                              if not m.startswith("quality.")}
    assert not any(k.startswith(("throughput.", "latency.", "engine.")) for k in DEFAULT_SPEC)


def test_passes_on_the_baselines_own_runs(sweep: Path, baseline: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(sweep), "--baseline", str(baseline)]) == 0
    out = capsys.readouterr().out
    assert "kvbench gate: PASS (56 checks over 4 runs)" in out
    assert "note:" not in out  # same configs (out_dir does not count)
    rows = [ln.split() for ln in out.splitlines() if ln.startswith(("paged/", "contiguous/"))]
    assert len(rows) == 56 and {r[-1] for r in rows} == {"ok"}


def test_a_regression_beyond_tolerance_fails(copy: Path, baseline: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    run = copy / "0-paged-multiturn"
    hit = metric(run, "cache.prefix_hit_rate")
    edit_metrics(run, cache__prefix_hit_rate=hit * 0.9)  # tolerance: 2% of it
    assert main([str(copy), "--baseline", str(baseline)]) == 1
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if "cache.prefix_hit_rate" in ln
                and ln.startswith("paged/multiturn"))
    assert line.endswith("REGRESSED") and "(-10.0%)" in line
    assert "FAIL (1 REGRESSED; 56 checks)" in out


def test_within_tolerance_passes(copy: Path, baseline: Path) -> None:
    run = copy / "2-contiguous-multiturn"
    computed = metric(run, "cache.prefill_tokens_computed")
    edit_metrics(run, cache__prefill_tokens_computed=computed * 1.015)  # rel_tol 2%
    assert main([str(copy), "--baseline", str(baseline)]) == 0


def test_an_improvement_is_not_a_regression(copy: Path, baseline: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    run = copy / "0-paged-multiturn"
    edit_metrics(run, cache__prefix_hit_rate=metric(run, "cache.prefix_hit_rate") + 0.1,
                 memory__waste_pct=0.0)
    assert main([str(copy), "--baseline", str(baseline)]) == 0
    assert "2 improved: refresh the baseline" in capsys.readouterr().out


def test_a_missing_metric_fails_with_exit_1(copy: Path, baseline: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    edit_metrics(copy / "1-paged-shared_prefix", memory__waste_pct=None)
    assert main([str(copy), "--baseline", str(baseline)]) == 1
    out = capsys.readouterr().out
    assert any(ln.startswith("paged/shared_prefix") and "memory.waste_pct" in ln
               and ln.endswith("MISSING") for ln in out.splitlines())


def test_a_failed_or_missing_run_fails(copy: Path, baseline: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    (copy / "3-contiguous-shared_prefix" / "metrics.json").unlink()
    (copy / "3-contiguous-shared_prefix" / "FAILED").write_text("RuntimeError: boom\n")
    shutil.rmtree(copy / "2-contiguous-multiturn")
    assert main([str(copy), "--baseline", str(baseline)]) == 1
    out = capsys.readouterr().out
    assert "FAILED: RuntimeError: boom" in out and "NOT RUN" in out
    # --partial: gate one run of a sweep; the others are not missing.
    assert main([str(copy / "0-paged-multiturn"), "--baseline", str(baseline),
                 "--partial"]) == 0
    assert "PASS (14 checks over 1 runs)" in capsys.readouterr().out


def test_absolute_floor_and_direction() -> None:
    preempt = DEFAULT_SPEC["sched.preemptions_recompute"]  # lower, 10%, floor 1
    assert judge(preempt, 0, 1) == "ok"  # 10% of 0 is 0: the floor allows one
    assert judge(preempt, 0, 2) == "REGRESSED"
    assert judge(preempt, 40, 44) == "ok" and judge(preempt, 40, 45) == "REGRESSED"
    assert judge(preempt, 4, 0) == "improved"
    hit = DEFAULT_SPEC["cache.prefix_hit_rate"]  # higher, 2%, floor 0.005
    assert judge(hit, 0.1, 0.096) == "ok"  # 2% would be 0.002: the floor wins
    assert judge(hit, 0.1, 0.094) == "REGRESSED" and judge(hit, 0.1, 0.2) == "improved"
    finished = DEFAULT_SPEC["requests.finished"]  # higher, no tolerance at all
    assert judge(finished, 24, 23) == "REGRESSED" and judge(finished, 24, 24) == "ok"
    match = MetricSpec("match", 0.02, 0.0)  # neither way is better
    assert judge(match, 100, 103) == "REGRESSED" and judge(match, 100, 97) == "REGRESSED"
    assert judge(match, 100, 101) == "ok"


def test_usage_errors_exit_2(sweep: Path, baseline: Path, tmp_path: Path,
                             capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(sweep), "--baseline", str(tmp_path / "none.json")]) == 2
    assert "--write-baseline" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty"), "--baseline", str(baseline)]) == 2
    assert main([str(sweep), "--baseline", str(baseline), "--metrics", "x"]) == 2
    with pytest.raises(SystemExit) as e:  # argparse: neither --baseline nor --write-baseline
        main([str(sweep)])
    assert e.value.code == 2
    other = json.loads(baseline.read_text())
    other["runs"] = {"fp8/random": {"requests.finished": 1}}
    (tmp_path / "other.json").write_text(json.dumps(other))
    assert main([str(sweep), "--baseline", str(tmp_path / "other.json")]) == 2
    assert "no run here matches the baseline" in capsys.readouterr().err


def test_write_baseline_with_chosen_metrics_and_refresh_keeps_the_spec(
        sweep: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "b.json"
    assert main(["--write-baseline", str(path), str(sweep),
                 "--metrics", "requests.finished", "sched.steps:lower:0.05:2"]) == 0
    b = Baseline.load(path)
    assert b.spec == {"requests.finished": DEFAULT_SPEC["requests.finished"],
                      "sched.steps": MetricSpec("lower", 0.05, 2.0)}
    assert main(["--write-baseline", str(path), str(sweep)]) == 0  # refresh
    assert Baseline.load(path).spec == b.spec
    assert main(["--write-baseline", str(path), str(sweep), "--metrics", "sched.stepz"]) == 2
    assert "not in the default spec" in capsys.readouterr().err


def test_committed_cpu_baseline_matches_the_ci_smoke_sweep() -> None:
    b = Baseline.load(ROOT / "results" / "baselines" / "cpu-tiny.json")
    assert sorted(b.runs) == ["contiguous/multiturn", "contiguous/shared_prefix",
                              "paged/multiturn", "paged/shared_prefix"]
    # The smoke sweep is sized to preempt and to leave contiguous an external hole.
    assert b.runs["paged/multiturn"]["sched.preemptions_recompute"] > 0
    assert b.runs["contiguous/multiturn"]["memory.waste_pct"] > 30
    # What ci_smoke composes today is what the baseline measured (keys added since do not
    # count): a changed value means the baseline is stale.
    for key, recorded in b.configs.items():
        backend, workload = key.split("/")
        cfg = compose_cfg(["+experiment=ci_smoke", f"backend={backend}", f"workload={workload}"])
        # as its config.yaml holds it: the sizes a run resolves filled in
        now = flatten(as_recorded(
            OmegaConf.to_container(cfg, resolve=True)))  # type: ignore[arg-type]
        stale = {k: (v, fmt_value(now[k])) for k, v in recorded.items()
                 if k in now and fmt_value(now[k]) != v}
        assert not stale, (f"{key}: ci_smoke changed since the baseline (baseline, now): "
                           f"{stale}; refresh it: scripts/ci_smoke.sh --write-baseline")


# --- issue 27: a NaN never passes; a baseline of another config is said to be one --------
def test_a_nan_tolerance_is_refused_where_it_enters(sweep: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "b.json"
    assert main(["--write-baseline", str(path), str(sweep), "--metrics",
                 "requests.finished:higher:nan"]) == 2
    assert "rel_tol=nan: must be a finite number >= 0" in capsys.readouterr().err
    assert not path.exists()


def test_a_nan_baseline_value_fails_closed(copy: Path, baseline: Path, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    # Before: a NaN baseline value turned a 21% drop in finished requests into "ok".
    d = json.loads(baseline.read_text())
    d["runs"]["paged/multiturn"]["requests.finished"] = float("nan")
    bad = tmp_path / "nan.json"
    bad.write_text(json.dumps(d))  # json writes NaN, and reads it back
    run = next(copy.glob("*-paged-multiturn"))
    edit_metrics(run, requests__finished=round(metric(run, "requests.finished") * 0.79))
    assert main([str(copy), "--baseline", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"baseline {bad}: run paged/multiturn: requests.finished=nan is not a finite " \
           "number" in err
    assert judge(MetricSpec("higher", 0.0, 0.0), float("nan"), 3.0) == "REGRESSED"
    assert judge(MetricSpec("lower", 0.0, 0.0), 3.0, float("inf")) == "REGRESSED"


def test_a_baseline_from_another_config_says_so_first(copy: Path, baseline: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    d = json.loads(baseline.read_text())
    key = "paged/multiturn"
    recorded = d["configs"][key]
    ck = next(k for k in sorted(recorded) if k.startswith("workload."))
    recorded[ck] = recorded[ck] + "0"  # the baseline ran another value
    recorded.pop("seed", None)
    d["configs"][key] = recorded  # and never recorded seed: not a difference
    baseline.with_name("other.json").write_text(json.dumps(d))
    assert main([str(copy), "--baseline", str(baseline.with_name("other.json"))]) == 2
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert lines[0].startswith("kvbench gate: baseline from another config:")
    assert lines[1].startswith(f"  {key}: {ck} ") and len(lines) == 3, err
    assert "(unset)" not in err and "REGRESSED" not in err


def test_a_quality_regression_inside_its_bootstrap_interval_still_fails() -> None:
    """Issue #55: quality.ppl_delta_pct -4 -> 0.269 (+107%, tolerance 0.2) passed because
    the baseline lay inside the run's bootstrap interval. Quality is judged by its value;
    a speed metric of repeats still by its interval."""
    from pathlib import Path

    from harness.app.gate import check
    from harness.reporting.baseline import Baseline, make_spec
    from harness.reporting.runs import Run

    spec = {"quality.ppl_delta_pct": make_spec("lower", 0.0, 0.2),
            "throughput.output_tokens_per_s": make_spec("higher", 0.05, 0.0)}
    base = Baseline([], spec, {"h2o/multiturn": {
        "quality.ppl_delta_pct": -4.0, "throughput.output_tokens_per_s": 100.0}})
    metrics = {"quality.ppl_delta_pct": 0.269, "quality.ppl_delta_pct_ci95_low": -10.0,
               "quality.ppl_delta_pct_ci95_high": 5.0,
               "throughput.output_tokens_per_s": 90.0,
               "throughput.output_tokens_per_s_ci95_low": 80.0,
               "throughput.output_tokens_per_s_ci95_high": 104.0}
    run = Run(Path("r"), {"backend.name": "h2o", "workload.name": "multiturn"}, metrics, None)
    rows = {r.metric: r for r in check(base, [run])}
    assert rows["quality.ppl_delta_pct"].verdict == "REGRESSED"
    assert rows["throughput.output_tokens_per_s"].verdict == "ok"  # inside: noise
    assert "interval" in rows["throughput.output_tokens_per_s"].note


@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")
@pytest.mark.parametrize("module,name", [("harness.gate", "kvbench gate"),
                                         ("harness.report", "kvbench report")])
def test_ctrl_c_exits_130_with_one_line(module: str, name: str, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Issue #55: Ctrl-C in the report or the gate printed a KeyboardInterrupt traceback.
    Here the interrupt comes while the runs are read."""
    import runpy
    import sys

    import harness.reporting.runs as runs_mod

    def interrupted(*a: object, **k: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(runs_mod, "find_runs", interrupted)
    args = [str(tmp_path), "--baseline", str(tmp_path / "b.json")] \
        if module == "harness.gate" else [str(tmp_path)]
    monkeypatch.setattr(sys, "argv", [module, *args])
    with pytest.raises(SystemExit) as e:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    assert e.value.code == 130
    err = capsys.readouterr().err
    assert err.strip() == f"{name}: interrupted (Ctrl-C); nothing more was written"


def test_a_partial_group_of_repeats_is_no_baseline() -> None:
    """Issue #55: one of three repeats (the others interrupted) wrote a baseline."""
    from pathlib import Path

    from harness.reporting.baseline import make_spec, take_baseline
    from harness.reporting.runs import Run

    config = {"backend.name": "paged", "workload.name": "random"}
    member = Run(Path("g/repeat-0"), config, {"requests.finished": 4.0}, None)
    group = Run(Path("g"), config, {"requests.finished": 4.0},
                "1 of 3 repeats finished: repeat 1: interrupted: SIGINT", repeats=[member],
                repeats_planned=3)
    spec = {"requests.finished": make_spec("higher", 0.0, 0.0)}
    with pytest.raises(ValueError, match="partial group of repeats: g: 1 of 3 repeats"):
        take_baseline([group], spec)
    assert take_baseline([member], spec).runs == {"paged/random": {"requests.finished": 4.0}}


def test_a_sweep_whose_multirun_yaml_is_unreadable_fails_and_is_no_baseline(
        copy: Path, baseline: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Issue #55: the report said a sweep's never-started jobs could not be listed when
    its multirun.yaml was unreadable; the gate passed it. It names it in the verdict
    (unless --partial) and refuses it as a baseline."""
    from harness.results import SWEEP_CLAIM

    (copy / SWEEP_CLAIM).write_text("{}\n")
    (copy / "multirun.yaml").write_text("hydra: {sweeper: [unclosed\n")
    assert main([str(copy), "--baseline", str(baseline)]) == 1
    out = capsys.readouterr().out
    assert "UNLISTED (multirun.yaml unreadable: jobs never started cannot be listed)" in out
    assert main([str(copy), "--baseline", str(baseline), "--partial"]) == 0
    capsys.readouterr()
    assert main(["--write-baseline", str(tmp_path / "b.json"), str(copy)]) == 2
    assert "could not be read" in capsys.readouterr().err
