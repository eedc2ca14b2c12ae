"""W&B run names and groups that say what ran (issue #54, item 7: ``0-paged-multiturn``,
grouped by a timestamp folder), and a report logged to W&B (``--wandb``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.app.report import main as report_main
from harness.sinks.names import model_name, run_name, sweep_group, swept_keys, variant
from tests.app.test_wandb_sink import wait_until_complete
from tests.e2e.test_cli import SMALL, harness
from tests.wandb_reader import read_run

CFG = {"executor": "model", "model": {"source": "tiny", "path": None},
       "backend": {"name": "paged"}, "workload": {"name": "multiturn"},
       "roofline": {"model": "Llama-3.1-8B"}}


def test_the_model_is_the_one_served_or_modelled() -> None:
    assert model_name(CFG) == "tiny"
    assert model_name({**CFG, "model": {"source": "gguf", "path": "/m/qwen-0.5b.gguf"}}) \
        == "qwen-0.5b"
    assert model_name({**CFG, "executor": "roofline"}) == "Llama-3.1-8B"
    assert model_name({**CFG, "executor": "roofline",
                       "roofline": {"model": "/specs/Mistral-7B/config.json"}}) == "Mistral-7B"


def test_run_names_carry_model_backend_workload_and_variant() -> None:
    assert run_name(CFG) == "tiny / paged / multiturn"
    assert run_name(CFG, "block_size=8") == "tiny / paged / multiturn / block_size=8"
    assert run_name({**CFG, "run_name": "mine"}, "block_size=8") == "mine"
    assert run_name({**CFG, "repeats": 3, "repeat": 2}) == "tiny / paged / multiturn / repeat 2"
    assert len(run_name(CFG, "x" * 300)) == 128


def test_the_variant_of_a_sweep_job_is_its_swept_values() -> None:
    jobs = [["model=tiny", "backend=paged", "backend.block_size=8", "logger=wandb"],
            ["model=tiny", "backend=paged", "backend.block_size=16", "logger=wandb"],
            ["model=tiny", "backend=fp8", "backend.block_size=8", "logger=wandb"]]
    assert swept_keys(jobs) == ["backend", "backend.block_size"]
    swept = swept_keys(jobs)
    # backend is in the name already; logger never describes what ran.
    assert variant(jobs[1], {}, swept) == "block_size=16"
    assert variant(jobs[1], {"variant": "paged_16"}, swept) == "paged_16,block_size=16"
    # A single run: its own overrides beyond model / backend / workload.
    assert variant(["model=tiny", "scheduler.max_num_seqs=4", "device=cpu",
                    "logger.mode=offline"], {}, None) == "max_num_seqs=4"


def test_a_sweep_is_grouped_by_what_it_sweeps() -> None:
    stamp = Path("results/sweeps/20261129-125918-123456")
    assert sweep_group(stamp, CFG, {}, ["backend.block_size"]) == \
        "sweep backend.block_size / tiny / 20261129-125918"
    assert sweep_group(stamp, CFG, {"experiment": "memory_waste"}, ["backend"]) == \
        "experiment memory_waste / tiny / 20261129-125918"
    assert sweep_group(Path("results/sweeps/nightly"), CFG, {}, ["x"]) == "nightly"


def test_a_sweep_logs_named_runs_in_one_group_and_its_report(tmp_path: Path) -> None:
    p = harness("-m", *SMALL, "device=cpu", "backend.block_size=8,16", "logger=wandb",
                f"results_dir={tmp_path}", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    (sweep,) = (tmp_path / "sweeps").iterdir()
    groups, names = set(), []
    for job in sorted(d for d in sweep.iterdir() if d.is_dir()):
        (run_dir,) = (job / "wandb").glob("offline-run-*")
        wait_until_complete(run_dir)
        rec = read_run(run_dir)
        groups.add(rec.group)
        names.append(rec.name)
    assert groups == {f"sweep backend.block_size / tiny / {sweep.name[:15]}"}
    assert names == ["tiny / paged / multiturn / block_size=8",
                     "tiny / paged / multiturn / block_size=16"]
    # The report, logged to W&B in the same group: its figures and its table.
    assert report_main([str(sweep), "--wandb", "offline"]) == 0
    (run_dir,) = (sweep / "report" / "wandb").glob("offline-run-*")
    wait_until_complete(run_dir)
    rec = read_run(run_dir)
    assert rec.group == groups.pop() and rec.job_type == "report"
    (row,) = rec.history
    assert row["report/kv_memory_over_time._type"] == "image-file"
    assert row["report/throughput_vs_waste._type"] == "image-file"
    assert row["report/comparison._type"] == "table-file"
    table = json.loads((run_dir / "files" / row["report/comparison.path"]).read_text())
    assert len(table["data"]) == 2 and "throughput.output_tokens_per_s" in table["columns"]
    assert (run_dir / "files" / "report.md").is_file()


def test_a_report_that_cannot_log_to_wandb_exits_3_and_keeps_its_files(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.app.test_report import write_run

    write_run(tmp_path / "0", {"name": "paged", "block_size": 16}, {"requests.finished": 4})
    assert report_main([str(tmp_path), "--wandb", "offline", "--wandb-project", "bad/name"]) == 3
    assert "logging it to W&B failed" in capsys.readouterr().err
    assert (tmp_path / "report" / "report.md").is_file()
