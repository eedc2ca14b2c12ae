"""``python -m harness.report``: the tables, their ratios, the plots, and clear errors.

A real tiny sweep (paged/contiguous x multiturn/shared_prefix, in-process, ~2 s) checks
the files and that ratios are value / baseline value; hand-written run folders with known
numbers check the variant columns and which baseline run is picked.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import yaml

from harness.app.report import build_report, main
from harness.reporting.runs import find_runs, label, run_key, variant_keys
from harness.reporting.table import RATIO, compare
from harness.runner import run
from tests.compose import compose_cfg

PNG = b"\x89PNG\r\n\x1a\n"
SIZES = {
    "multiturn": ["workload.conversations=3", "workload.turns=2", "workload.system_words=20",
                  "workload.user_words=6", "workload.answer_tokens=8"],
    "shared_prefix": ["workload.num_requests=4", "workload.prefix_tokens=48",
                      "workload.suffix_tokens=8", "workload.output_tokens=8"],
}


def make_sweep(root: Path) -> Path:
    """A 2x2 sweep of tiny runs laid out as Hydra lays out a multirun."""
    job = 0
    for backend in ("paged", "contiguous"):
        for wl, sizes in SIZES.items():
            cfg = compose_cfg(["model=tiny", f"backend={backend}", f"workload={wl}", *sizes,
                               "cache.kv_budget=2MiB", "scheduler.max_model_len=256",
                               "device=cpu"], root / f"{job}-{backend}-{wl}")
            run(cfg)
            job += 1
    return root


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_sweep(tmp_path_factory.mktemp("sweep"))


def test_report_writes_tables_and_plots_with_ratios_to_the_baseline(
        sweep: Path, tmp_path: Path) -> None:
    files = build_report([sweep], out=tmp_path / "rep")
    names = sorted(p.name for p in (tmp_path / "rep").iterdir())
    assert names == ["comparison.csv", "kv_memory_over_time.png", "latency_cdf.png",
                     "report.md", "runs.csv", "throughput_vs_waste.png"]
    for p in files.plots:
        assert p.read_bytes()[:8] == PNG and p.stat().st_size > 10_000
    md = files.markdown.read_text()
    assert "## workload: multiturn" in md and "## workload: shared_prefix" in md
    assert "![latency_cdf.png](latency_cdf.png)" in md
    assert "(1.00x)" in md

    table = pd.read_csv(files.comparison_csv)
    assert len(table) == 4
    metrics = {r.path.name: r.metrics for r in find_runs([sweep])}
    for _, row in table.iterrows():
        mine = metrics[Path(row["path"]).name]
        base = metrics[f"{0 if row['workload'] == 'multiturn' else 1}-paged-{row['workload']}"]
        assert mine is not None and base is not None
        assert row["baseline"] == f"paged/{row['workload']}"
        for m in ("throughput.output_tokens_per_s", "memory.waste_pct",
                  "memory.peak_reserved_bytes", "latency.ttft_ms.p50"):
            want = 1.0 if row["backend"] == "paged" else mine[m] / base[m]
            assert row[m + RATIO] == pytest.approx(want, rel=1e-12), (row["key"], m)
    # Contiguous reserves max_model_len per sequence: more bytes, more waste than paged.
    cont = table[table["backend"] == "contiguous"]
    assert (cont["memory.waste_pct" + RATIO] > 1).all()
    runs_csv = pd.read_csv(files.runs_csv)
    assert set(runs_csv["status"]) == {"finished"} and "engine.wall_s" in runs_csv


def test_cli_writes_under_the_first_folder_by_default(sweep: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    copy = tmp_path / "s"
    shutil.copytree(sweep, copy)
    assert main([str(copy), "--baseline-backend", "contiguous"]) == 0
    out = capsys.readouterr().out
    assert f"written to {copy / 'report'}/" in out and "ratios to contiguous" in out
    table = pd.read_csv(copy / "report" / "comparison.csv")
    assert (table[table["backend"] == "contiguous"]["requests.finished" + RATIO] == 1.0).all()


def test_failed_runs_are_listed_apart(sweep: Path, tmp_path: Path) -> None:
    copy = tmp_path / "s"
    shutil.copytree(sweep, copy)
    # A failed run has no config.yaml; its config is Hydra's .hydra/config.yaml.
    bad = copy / "4-paged-multiturn"
    cfg = yaml.safe_load((copy / "0-paged-multiturn" / "config.yaml").read_text())
    del cfg["out_dir"]
    cfg["cache"]["kv_budget"] = "1KiB"
    (bad / ".hydra").mkdir(parents=True)
    (bad / ".hydra" / "config.yaml").write_text(yaml.safe_dump(cfg))
    (bad / "FAILED").write_text("ValueError: cache.kv_budget=1KiB holds 0 tokens\n")
    files = build_report([copy])
    assert len(pd.read_csv(files.comparison_csv)) == 4
    md = files.markdown.read_text()
    assert "## Runs that did not finish" in md and "4-paged-multiturn" in md
    assert "holds 0 tokens" in md
    assert "1 failed" in md


def test_unknown_baseline_backend_lists_those_present(
        sweep: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(sweep), "--baseline-backend", "fp9", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "'fp9'" in err and "backends present: contiguous, paged" in err


def test_no_runs_names_the_folders_searched(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty" / "deeper").mkdir(parents=True)
    assert main([str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert "no runs found" in err and str(tmp_path / "empty") in err


# Hand-written runs: a block-size sweep of paged and a reserve sweep of contiguous.

def write_run(folder: Path, backend: dict[str, Any], metrics: dict[str, Any],
              workload: str = "random") -> None:
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(
        {"backend": backend, "workload": {"name": workload, "num_requests": 4},
         "cache": {"kv_budget": "1MiB"}, "out_dir": str(folder)}))
    full = {"run.backend": backend["name"], "run.workload": workload, **metrics}
    (folder / "metrics.json").write_text(json.dumps(full))
    pd.DataFrame({"time_s": [0.1, 0.2, 0.3], "reserved_bytes": [100, 300, 200],
                  "used_bytes": [50, 250, 200], "running": [1, 2, 1],
                  "external_frag_bytes": [0, 10, 0]}).to_csv(folder / "steps.csv", index=False)
    pd.DataFrame({"status": ["finished"] * 3, "ttft_ms": [1.0, 2.0, 4.0],
                  "e2e_ms": [5.0, 9.0, 7.0]}).to_csv(folder / "requests.csv", index=False)


@pytest.fixture
def block_sweep(tmp_path: Path) -> Path:
    def m(tps: float, waste: float, kl: float) -> dict[str, Any]:
        return {"throughput.output_tokens_per_s": tps, "memory.waste_pct": waste,
                "quality.kl_mean": kl, "requests.finished": 4, "sched.preemptions_recompute": 0}

    write_run(tmp_path / "0", {"name": "paged", "block_size": 8}, m(100.0, 2.0, 0.0))
    write_run(tmp_path / "1", {"name": "paged", "block_size": 16}, m(200.0, 4.0, 0.0))
    write_run(tmp_path / "2", {"name": "contiguous", "block_size": 16, "reserve": "max"},
              m(50.0, 40.0, 0.0))
    write_run(tmp_path / "3", {"name": "contiguous", "block_size": 16, "reserve": "exact"},
              m(100.0, 20.0, 0.0))
    return tmp_path


def test_variant_columns_and_the_baseline_run_they_pick(block_sweep: Path) -> None:
    runs = find_runs([block_sweep])
    keys = variant_keys(runs)
    # block_size differs among paged runs, reserve among contiguous; out_dir never counts.
    assert keys == ["backend.block_size", "backend.reserve"]
    assert run_key(runs[2], keys) == "contiguous/random/backend.block_size=16,backend.reserve=max"
    files = build_report([block_sweep])
    t = pd.read_csv(files.comparison_csv).set_index("path")
    tps = "throughput.output_tokens_per_s" + RATIO
    # The paged run that agrees most with a contiguous run: block_size=16 (200 tok/s).
    assert t.loc[str(block_sweep / "2"), tps] == 0.25
    assert t.loc[str(block_sweep / "3"), "memory.waste_pct" + RATIO] == 5.0
    assert t.loc[str(block_sweep / "0"), tps] == 1.0  # a baseline-backend run is its own
    assert t.loc[str(block_sweep / "2"), "baseline"] == "paged/random/backend.block_size=16"
    md = files.markdown.read_text()
    assert "| run | backend.block_size | backend.reserve | baseline |" in md
    # quality.kl_mean is present: the quality plot is drawn. KL already compares with the
    # reference: no ratio. 0 preemptions against 0 is a ratio of 1.
    assert (files.out / "quality_vs_memory.png").read_bytes()[:8] == PNG
    assert "quality.kl_mean" in t and "quality.kl_mean" + RATIO not in t
    assert t.loc[str(block_sweep / "3"), "sched.preemptions_recompute" + RATIO] == 1.0


def test_where_pins_the_baseline_run(block_sweep: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    t = compare(find_runs([block_sweep]), where={"backend.block_size": "8"}).frame
    t = t.set_index("path")
    assert t.loc[str(block_sweep / "2"), "throughput.output_tokens_per_s" + RATIO] == 0.5
    assert t.loc[str(block_sweep / "1"), "throughput.output_tokens_per_s" + RATIO] == 2.0
    assert main([str(block_sweep), "--where", "backend.nope=1"]) == 2
    assert "variant keys here: backend.block_size, backend.reserve" in capsys.readouterr().err


# Unlike runs, stale runs, jobs never started (docs/errors.md).

def _run(folder: Path, backend: str, config: dict[str, Any], tps: float,
         overrides: list[str] | None = None) -> None:
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(
        {"backend": {"name": backend}, "workload": {"name": "multiturn"}, **config}))
    (folder / "metrics.json").write_text(json.dumps(
        {"run.backend": backend, "run.workload": "multiturn",
         "throughput.output_tokens_per_s": tps}))
    if overrides is not None:
        (folder / ".hydra").mkdir()
        (folder / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))


def test_runs_whose_config_differs_outside_backend_are_not_compared(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # paged at 3 conversations must not be the 1.00x baseline of contiguous at 2.
    _run(tmp_path / "0", "paged", {"workload": {"name": "multiturn", "conversations": 3}}, 100)
    _run(tmp_path / "1", "contiguous",
         {"workload": {"name": "multiturn", "conversations": 2}}, 50)
    _run(tmp_path / "2", "contiguous",
         {"workload": {"name": "multiturn", "conversations": 3}}, 25)
    runs = find_runs([tmp_path])
    assert variant_keys(runs) == ["workload.conversations"]
    t = compare(runs).frame.set_index("path")
    tps = "throughput.output_tokens_per_s" + RATIO
    assert pd.isna(t.loc[str(tmp_path / "1"), tps])
    assert t.loc[str(tmp_path / "2"), tps] == 0.25
    assert main([str(tmp_path), "--out", str(tmp_path / "rep")]) == 0
    out = capsys.readouterr().out
    assert "warning: not compared" in out
    assert "workload.conversations=2 (baseline runs: 3)" in out
    assert "**Not compared:**" in (tmp_path / "rep" / "report.md").read_text()


def test_a_reused_sweep_folder_stale_runs_and_jobs_never_started(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # multirun.yaml (the latest sweep into the folder) launched paged and contiguous; fp8 is
    # an earlier sweep's; contiguous never started.
    (tmp_path / "multirun.yaml").write_text(yaml.safe_dump({"hydra": {
        "sweeper": {"_target_": "hydra._internal.core_plugins.basic_sweeper.BasicSweeper",
                    "params": {"backend": "paged,contiguous"}},
        "overrides": {"task": ["model=tiny"]}}}))
    _run(tmp_path / "0-paged", "paged", {}, 100, ["backend=paged", "model=tiny"])
    _run(tmp_path / "1-fp8", "fp8", {}, 400, ["model=tiny", "backend=fp8"])
    assert main([str(tmp_path), "--out", str(tmp_path / "rep")]) == 0
    out = capsys.readouterr().out
    assert "1 finished run(s), 0 failed, 1 never started, 1 stale (left out)" in out
    assert "never started" in out and "backend=contiguous model=tiny" in out
    assert f"stale (left out; --include-stale compares it): {tmp_path / '1-fp8'}" in out
    assert len(pd.read_csv(tmp_path / "rep" / "comparison.csv")) == 1
    assert main([str(tmp_path), "--out", str(tmp_path / "rep2"), "--include-stale"]) == 0
    assert len(pd.read_csv(tmp_path / "rep2" / "comparison.csv")) == 2


@pytest.mark.parametrize("multirun", [
    "hydra: {sweeper: [unclosed\n",  # not YAML
    "- just\n- a list\n",  # not Hydra's layout
    None,  # lost: the sweep's claim says it was one
    "a folder",  # unreadable as a file
], ids=["not-yaml", "not-a-mapping", "missing", "unreadable"])
def test_a_sweep_whose_multirun_yaml_is_unreadable_says_jobs_never_started_are_unknown(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], multirun: str | None) -> None:
    """Issue #55: the report over a sweep whose multirun.yaml could not be read listed no
    job never started, as if none had been: it says it could not read the file, and that
    such jobs cannot be listed, on the terminal and in report.md."""
    from harness.results import SWEEP_CLAIM

    sweep = tmp_path / "sweep"
    _run(sweep / "0-paged", "paged", {}, 100, ["backend=paged", "model=tiny"])
    (sweep / SWEEP_CLAIM).write_text("{}\n")
    if multirun == "a folder":
        (sweep / "multirun.yaml").mkdir()
    elif multirun is not None:
        (sweep / "multirun.yaml").write_text(multirun)
    assert main([str(sweep), "--out", str(tmp_path / "rep")]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "multirun.yaml" in x)
    assert line.startswith(f"  warning: sweep {sweep.resolve()}: could not read its "
                           f"multirun.yaml ({sweep.resolve() / 'multirun.yaml'}")
    assert "so jobs it never started cannot be listed" in line
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "**Warning:** sweep" in md and "cannot be listed" in md


def test_a_sweep_of_another_sweeper_lists_nothing_and_warns_of_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "multirun.yaml").write_text(yaml.safe_dump({"hydra": {
        "sweeper": {"_target_": "hydra_plugins.optuna.OptunaSweeper"}}}))
    _run(tmp_path / "0-paged", "paged", {}, 100, ["backend=paged"])
    assert main([str(tmp_path), "--out", str(tmp_path / "rep")]) == 0
    assert "multirun.yaml" not in capsys.readouterr().out


def test_roofline_runs_are_labelled_by_their_roofline_model(tmp_path: Path) -> None:
    # Issue 27: a sweep of roofline runs over model=smollm2,tiny (which they never load)
    # and roofline.model was labelled "source=smollm2"; the model they modelled is
    # roofline.model, and model.* did not shape them.
    for i, (src, arch) in enumerate((("smollm2", "Llama-3.1-8B"), ("tiny", "Qwen2.5-7B"))):
        f = tmp_path / f"{i}-paged-random"
        write_run(f, {"name": "paged", "block_size": 16}, {"requests.finished": 4})
        cfg = yaml.safe_load((f / "config.yaml").read_text())
        cfg |= {"executor": "roofline", "model": {"source": src},
                "roofline": {"model": arch, "tp": 1}}
        (f / "config.yaml").write_text(yaml.safe_dump(cfg))
    runs = find_runs([tmp_path])
    keys = variant_keys(runs)
    assert keys == ["roofline.model"]
    assert sorted(label(r, keys) for r in runs) == ["paged model=Llama-3.1-8B",
                                                    "paged model=Qwen2.5-7B"]
    # A model run beside them: its roofline.* defaults did not shape it either.
    f = tmp_path / "2-paged-random"
    write_run(f, {"name": "paged", "block_size": 16}, {"requests.finished": 4})
    cfg = yaml.safe_load((f / "config.yaml").read_text())
    cfg |= {"executor": "model", "model": {"source": "tiny"},
            "roofline": {"model": "Llama-3.1-8B", "tp": 1}}
    (f / "config.yaml").write_text(yaml.safe_dump(cfg))
    runs = find_runs([tmp_path])
    by = {r.path.name: r for r in runs}
    keys = variant_keys(runs)
    assert keys == ["executor", "roofline.model"]
    assert label(by["0-paged-random"], keys) == "paged executor=roofline,model=Llama-3.1-8B"
    assert label(by["2-paged-random"], keys) == "paged executor=model"


@pytest.mark.parametrize("damage", [b"\xff\xfe\x00\x01garbage", b'a,b\n1,"unterminated\n'])
def test_a_corrupt_records_file_is_named_and_the_report_goes_on(
        sweep: Path, tmp_path: Path, damage: bytes,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Issue #55: one corrupt steps.csv aborted the whole report without naming it."""
    copy = tmp_path / "s"
    shutil.copytree(sweep, copy)
    bad = next(copy.glob("*/steps.csv"))
    bad.write_bytes(damage)
    files = build_report([copy], out=tmp_path / "rep")
    assert (tmp_path / "rep" / "report.md").is_file() and files.plots
    err = capsys.readouterr().err
    assert f"cannot read {bad}" in err and "its plots leave this run out" in err


def test_a_plot_says_which_runs_it_leaves_out(sweep: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Issue #55: a run without requests.csv was left out of the latency plot silently."""
    copy = tmp_path / "s"
    shutil.copytree(sweep, copy)
    gone = next(copy.glob("*/requests.csv"))
    gone.unlink()
    build_report([copy], out=tmp_path / "rep")
    err = capsys.readouterr().err
    assert (f"latency_cdf.png leaves out 1 run(s) without readable requests records: "
            f"{gone.parent}") in err
