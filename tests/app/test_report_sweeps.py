"""The report on parameter sweeps and single runs (issue #54, item 6): a sweep of one
backend compared with its reference run (not each run with itself), a notice on the noise
of single-run speeds, one tok/s per table, RULER's accuracy in the run summary, the
memory panels on one y axis, quality_vs_memory named by a legend."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from harness.app.report import build_report, main
from harness.reporting import plots
from harness.reporting.runs import find_runs, variant_keys
from harness.reporting.table import RATIO, compare, default_config
from harness.reporting.task_plots import table as task_table
from tests.app.test_report import write_run

TPS = "throughput.output_tokens_per_s"


def m(tps: float, **more: Any) -> dict[str, Any]:
    return {TPS: tps, "memory.waste_pct": 5.0, "requests.finished": 4, **more}


def block_sweep(root: Path, sizes: list[int], executor: str | None = None) -> Path:
    for i, bs in enumerate(sizes):
        extra = {"run.executor": executor} if executor else {}
        write_run(root / f"{i}-paged-random", {"name": "paged", "block_size": bs},
                  m(100.0 * (i + 1), **extra))
    return root


def test_a_one_backend_sweep_is_compared_with_the_default_value(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # block_size 8, 16, 32: 16 is paged's default, so it is the reference (200 tok/s).
    assert default_config("paged", "random")["backend.block_size"] == "16"
    block_sweep(tmp_path, [8, 16, 32])
    t = compare(find_runs([tmp_path])).frame.set_index("path")
    ratio = {Path(p).name: r for p, r in t[TPS + RATIO].items()}
    assert ratio == {"0-paged-random": 0.5, "1-paged-random": 1.0, "2-paged-random": 1.5}
    assert set(t["baseline"]) == {"paged/random/backend.block_size=16"}
    assert main([str(tmp_path), "--out", str(tmp_path / "rep")]) == 0
    out = capsys.readouterr().out
    assert "random: a parameter sweep of one backend: ratios to " \
        "paged/random/backend.block_size=16" in out
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "A parameter sweep of `paged`: every ratio here is to " \
        "`paged/random/backend.block_size=16`" in md
    assert "(0.50x)" in md and "(1.50x)" in md


def test_without_the_default_the_first_value_is_the_reference(tmp_path: Path) -> None:
    block_sweep(tmp_path, [32, 8, 64])
    t = compare(find_runs([tmp_path])).frame
    assert list(t[TPS + RATIO]) == [1.0, 2.0, 3.0]  # all to block_size=32, the first job


def test_where_still_pins_the_baseline_of_a_one_backend_sweep(tmp_path: Path) -> None:
    block_sweep(tmp_path, [8, 16, 32])
    t = compare(find_runs([tmp_path]), where={"backend.block_size": "32"}).frame
    # --where keeps the old rule among its runs: the one pinned run is every run's.
    assert list(t[TPS + RATIO]) == [pytest.approx(1 / 3), pytest.approx(2 / 3), 1.0]


def test_two_backends_keep_comparing_like_with_like(tmp_path: Path) -> None:
    block_sweep(tmp_path, [8, 16])
    write_run(tmp_path / "2-fp8-random", {"name": "fp8", "block_size": 8}, m(400.0))
    runs = find_runs([tmp_path])
    cmp = compare(runs)
    assert cmp.references == {}
    t = cmp.frame.set_index("path")
    assert t.loc[str(tmp_path / "2-fp8-random"), TPS + RATIO] == 4.0  # to paged at 8
    assert variant_keys(runs) == ["backend.block_size"]


def test_single_run_speeds_carry_a_noise_notice_with_the_repeats_hint(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    block_sweep(tmp_path / "model", [8, 16])
    files = build_report([tmp_path / "model"], out=tmp_path / "rep")
    md = files.markdown.read_text()
    assert "**Noise:** Speeds (tok/s, TTFT, ITL, e2e) of 2 run(s) here are single " \
        "wall-clock measurements" in md and "`repeats=3`" in md
    assert main([str(tmp_path / "model"), "--out", str(tmp_path / "rep2")]) == 0
    assert "note: Speeds" in capsys.readouterr().out
    # A what-if's times are modelled, the same every time: no notice.
    block_sweep(tmp_path / "roof", [8, 16], executor="roofline")
    files = build_report([tmp_path / "roof"], out=tmp_path / "rep3")
    assert "**Noise:**" not in files.markdown.read_text()


def test_the_report_names_its_tok_s() -> None:
    from harness.reporting.table import KEY_METRICS

    headers = {k: h for k, h, _ in KEY_METRICS}
    assert headers[TPS] == "output tok/s"


def test_task_accuracy_names_its_tok_s_total(tmp_path: Path) -> None:
    write_run(tmp_path / "0", {"name": "paged", "block_size": 16},
              m(10.0, **{"quality.task_accuracy": 0.5, "throughput.total_tokens_per_s": 900.0}),
              workload="ruler")
    md = task_table(find_runs([tmp_path]), [])
    head = md.splitlines()[0]
    assert "| total tok/s |" in head and "| tok/s |" not in head
    assert "| 900 |" in md


def test_the_run_summary_of_a_ruler_run_shows_its_accuracy(
        capsys: pytest.CaptureFixture[str]) -> None:
    from harness.runner import print_summary

    base = {"run.backend": "paged", "run.workload": "ruler", "run.kernel": "torch",
            "run.device": "cpu", "requests.finished": 3, "requests.rejected": 0,
            "memory.token_capacity": 100, "memory.max_running_seqs": 2,
            "sched.preemptions_recompute": 0, "sched.preemptions_swap": 0}
    print_summary(base, None)
    assert "task accuracy" not in capsys.readouterr().out
    print_summary({**base, "quality.task_accuracy": 0.625,
                   "quality.task_accuracy_ci95_low": 0.4,
                   "quality.task_accuracy_ci95_high": 0.8}, None)
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "task accuracy" in ln)
    assert line.split() == ["task", "accuracy", "[95%", "CI]", "0.625", "[0.400,", "0.800]"]


def _figures(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    figs: list[Any] = []

    def keep(fig: Any, path: Path) -> Path:
        figs.append(fig)
        return path

    monkeypatch.setattr(plots, "_save", keep)
    return figs


def test_memory_over_time_panels_share_one_y_axis(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    block_sweep(tmp_path, [8, 16, 32])
    runs = find_runs([tmp_path])
    # One run holds 10x the bytes: on its own axis its panel would read like the others.
    steps = tmp_path / "2-paged-random" / "steps.csv"
    s = pd.read_csv(steps)
    s[["reserved_bytes", "used_bytes"]] *= 10
    s.to_csv(steps, index=False)
    figs = _figures(monkeypatch)
    assert plots.kv_over_time(runs, variant_keys(runs), tmp_path / "kv.png") is not None
    axes = [ax for ax in figs[0].axes if ax.get_visible()]
    assert len(axes) == 3
    assert all(ax.get_ylim() == axes[0].get_ylim() for ax in axes)
    assert axes[0].get_shared_y_axes().joined(axes[0], axes[2])


def test_quality_vs_memory_names_points_in_a_legend_not_on_the_plot(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Three runs at the same memory and nearly the same KL: labels on the plot overlapped.
    for i, bs in enumerate([8, 16, 32]):
        write_run(tmp_path / f"{i}", {"name": "paged", "block_size": bs},
                  m(100.0, **{"quality.kl_mean": 0.01 + i * 1e-4}))
    runs = find_runs([tmp_path])
    figs = _figures(monkeypatch)
    assert plots.quality_vs_memory(compare(runs), runs, tmp_path / "q.png") is not None
    fig = figs[0]
    assert all(not ax.texts for ax in fig.axes)  # no annotation on any panel
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == [
        "paged block_size=8", "paged block_size=16", "paged block_size=32"]
    markers = {tuple(map(tuple, h.get_paths()[0].vertices)) for h in legend.legend_handles}
    assert len(markers) == 3  # one marker each: same colour, told apart


def test_report_json_of_a_sweep_is_unchanged_by_the_notice(tmp_path: Path) -> None:
    # comparison.csv stays the table's numbers: the notice is prose only.
    block_sweep(tmp_path, [8, 16])
    files = build_report([tmp_path], out=tmp_path / "rep")
    t = pd.read_csv(files.comparison_csv)
    assert not any("noise" in c.lower() for c in t.columns)
    assert json.loads((tmp_path / "0-paged-random" / "metrics.json").read_text())[TPS] == 100.0
