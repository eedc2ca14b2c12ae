"""logger=wandb: what the offline W&B run holds, read back from its run file, and what a
W&B failure leaves behind (the local results intact, WANDB_FAILED, exit status 3).

conftest.py sets WANDB_MODE=disabled; these runs ask for logger.mode=offline, which the
sink passes to wandb.init explicitly, so it wins over the environment.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import wandb

from harness.runner import RunResult, run
from harness.sinks import FAILED_FILE, WandbLogError, log_run_to_wandb, record_wandb_failure
from tests.compose import tiny
from tests.e2e.test_cli import SMALL, harness
from tests.wandb_reader import read_run


@pytest.fixture(scope="module")
def logged(tmp_path_factory: pytest.TempPathFactory) -> tuple[RunResult, Path]:
    out = tmp_path_factory.mktemp("run")
    cfg = tiny("logger=wandb", "logger.tags=[nightly]", out_dir=out)
    result = run(cfg)
    run_dir = log_run_to_wandb(cfg, result, cfg.logger, default_group="sweep-x")
    assert run_dir is not None
    wait_until_complete(Path(run_dir))
    return result, Path(run_dir)


def wait_until_complete(run_dir: Path, timeout_s: float = 120.0) -> None:
    """Until the offline run file ends with its exit record: W&B's service process may
    still be flushing it after ``finish`` returns (read early under load, the run record
    came back empty). An event, not a sleep: the file is re-read until it is whole."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if read_run(run_dir).exit_code is not None:
                return
        except Exception:  # a record cut short mid-write
            pass
        assert time.monotonic() < deadline, f"{run_dir}: no exit record after {timeout_s} s"
        time.sleep(0.05)


def test_offline_run_lands_in_the_results_folder(logged: tuple[RunResult, Path]) -> None:
    result, run_dir = logged
    assert result.out_dir is not None
    assert run_dir.parent == result.out_dir / "wandb"
    assert run_dir.name.startswith("offline-run-")
    assert (result.out_dir / "metrics.json").is_file()
    assert not (result.out_dir / FAILED_FILE).exists()


def test_config_tags_group_and_job_type(logged: tuple[RunResult, Path]) -> None:
    result, run_dir = logged
    rec = read_run(run_dir)
    assert rec.project == "kvbench" and rec.job_type == "benchmark"
    assert rec.group == "sweep-x"  # logger.group unset: the caller's default
    assert rec.name == "tiny / paged / multiturn"  # model / backend / workload (names.py)
    # Flattened with dotted keys: one W&B config key per leaf of the composed config.
    assert rec.config["backend.name"] == "paged"
    assert rec.config["workload.conversations"] == 3
    assert rec.config["cache.kv_budget"] == "256KiB"
    assert rec.config["model.source"] == "tiny"
    assert rec.config["logger.mode"] == "offline"
    m = result.metrics
    assert rec.tags == ["backend:paged", "workload:multiturn", "model:tiny",
                        f"kernel:{m['run.kernel']}", f"device:{m['run.device']}", "nightly"]
    assert rec.exit_code == 0


def test_history_is_one_row_per_engine_step(logged: tuple[RunResult, Path]) -> None:
    result, run_dir = logged
    rec = read_run(run_dir)
    metrics = json.loads((result.out_dir / "metrics.json").read_text())  # type: ignore[operator]
    assert len(rec.history) == metrics["sched.steps"] == len(result.steps) > 0
    assert [h["step"] for h in rec.history] == [s.step for s in result.steps]
    for h, s in zip(rec.history, result.steps):
        assert h["reserved_bytes"] == s.reserved_bytes and h["used_bytes"] == s.used_bytes
        assert h["batch_tokens"] == s.batch_tokens
    # The step axis is "step" for every other key.
    assert rec.metrics["*"]["step_metric"] == "step"
    assert rec.metrics["used_bytes"] == {"step_metric": "step", "summary_none": True}
    # The request table and the chart's data ride on the last row, not a row of their own.
    last = rec.history[-1]
    assert last["requests_table._type"] == "table-file"
    assert last["requests_table.nrows"] == len(result.requests)
    assert last["kv_bytes_table.nrows"] == 2 * len(result.steps)  # reserved + used
    table = json.loads((run_dir / "files" / last["requests_table.path"]).read_text())
    assert table["columns"] == list(result.requests[0])
    assert len(table["data"]) == len(result.requests)


def test_summary_is_metrics_json(logged: tuple[RunResult, Path]) -> None:
    result, run_dir = logged
    rec = read_run(run_dir)
    metrics = json.loads((result.out_dir / "metrics.json").read_text())  # type: ignore[operator]
    for key in ("sched.steps", "requests.finished", "memory.waste_pct",
                "memory.peak_reserved_bytes", "throughput.output_tokens_per_s",
                "latency.ttft_ms.p50", "run.backend", "run.git_sha"):
        assert rec.summary[key] == metrics[key], key
    # Nothing else but W&B's own keys and the two tables: no step column's last value.
    extra = {k for k in rec.summary if not k.startswith("_")} - set(metrics)
    assert extra == {"requests_table", "kv_bytes_table"}
    # The native chart: a line-series panel over the chart table, in the config.
    panel = rec.config["_wandb"]["visualize"]["kv_bytes"]["panel_config"]
    assert panel["panelDefId"] == "wandb/lineseries/v0"
    assert panel["stringSettings"]["xname"] == "step"


def test_disabled_writes_nothing(tmp_path: Path, logged: tuple[RunResult, Path]) -> None:
    result, _ = logged
    cfg = tiny("logger=wandb", "logger.mode=disabled", f"logger.dir={tmp_path}")
    assert log_run_to_wandb(cfg, result, cfg.logger) is None
    assert list(tmp_path.iterdir()) == []


def test_failure_mid_logging_closes_the_run_and_names_the_sync_dir(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        logged: tuple[RunResult, Path]) -> None:
    result, _ = logged

    def full_disk(*args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(wandb, "Table", full_disk)
    cfg = tiny("logger=wandb", f"logger.dir={tmp_path}")
    with pytest.raises(WandbLogError) as e:
        log_run_to_wandb(cfg, result, cfg.logger)
    assert "No space left on device" in str(e.value)
    assert e.value.run_dir is not None and e.value.run_dir.parent == tmp_path / "wandb"
    wait_until_complete(e.value.run_dir)  # the failed run's file, too, is flushed late
    assert read_run(e.value.run_dir).exit_code == 1  # closed as failed, not left open

    msg = record_wandb_failure(tmp_path, e.value)
    assert f"wandb sync {e.value.run_dir}" in msg
    assert f"local results are safe in {tmp_path}" in msg
    assert "No space left on device" in (tmp_path / FAILED_FILE).read_text()


def _run_files(d: Path) -> set[str]:
    return {p.name for p in d.iterdir()}


def test_cli_exit_3_when_wandb_fails_and_results_stay(tmp_path: Path) -> None:
    # A real W&B error, offline: wandb.init rejects the project name.
    out = tmp_path / "run"
    p = harness(*SMALL, "logger=wandb", "logger.project=bad/name", f"hydra.run.dir={out}",
                cwd=tmp_path)
    assert p.returncode == 3, p.stderr
    assert "logging it to W&B failed" in p.stderr and "Invalid project name" in p.stderr
    assert f"local results are safe in {out}" in p.stderr
    assert "requests finished / rejected" in p.stdout  # the summary came first
    assert {"config.yaml", "metrics.json", "steps.csv", "requests.csv",
            FAILED_FILE} <= _run_files(out)
    assert "FAILED" not in _run_files(out)
    assert json.loads((out / "metrics.json").read_text())["requests.finished"] == 4


def test_cli_sweep_records_a_wandb_failure_and_goes_on(tmp_path: Path) -> None:
    # Job 0 cannot create its W&B folder; job 1 logs offline into its run folder, grouped
    # under the sweep folder's name (one the user chose: not a timestamp).
    sweep = tmp_path / "sweep-7"
    p = harness("-m", *SMALL, "logger=wandb", "logger.dir=/proc/nope,null",
                f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert p.returncode == 3, p.stderr  # every job finished, one not logged: as a run's 3
    assert "2 finished, 0 failed, 0 not started" in p.stderr and "W&B logging failed" in p.stderr
    jobs = sorted(d for d in sweep.iterdir() if d.is_dir())
    assert len(jobs) == 2
    assert (jobs[0] / FAILED_FILE).is_file() and (jobs[0] / "metrics.json").is_file()
    assert "/proc/nope" in (jobs[0] / FAILED_FILE).read_text()
    assert not (jobs[1] / FAILED_FILE).exists()
    (run_dir,) = (jobs[1] / "wandb").glob("offline-run-*")
    rec = read_run(run_dir)
    assert rec.group == "sweep-7" and rec.name == "tiny / paged / multiturn"
    assert len(rec.history) == json.loads((jobs[1] / "metrics.json").read_text())["sched.steps"]


def test_reader_follows_records_across_blocks(tmp_path: Path) -> None:
    # Our runs' files stay under one 32 KiB block; this one has a record split over three
    # blocks (first / middle / last chunks) and many block boundaries with padding.
    big = "x" * 70_000
    with wandb.init(mode="offline", project="reader", dir=str(tmp_path), config={"big": big},
                    settings=wandb.Settings(quiet=True)) as r:
        for i in range(600):
            r.log({"i": i, "sq": i * i})
        run_dir = Path(r.settings.sync_dir)
    wait_until_complete(run_dir)  # (read at once under load: 548 of the 600 rows)
    (f,) = run_dir.glob("run-*.wandb")
    assert f.stat().st_size > 3 * 32 * 1024
    rec = read_run(run_dir)
    assert rec.config["big"] == big
    assert [(h["i"], h["sq"]) for h in rec.history] == [(i, i * i) for i in range(600)]


def test_online_says_so_first_and_gives_up_sooner_than_wandb(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        logged: tuple[RunResult, Path]) -> None:
    result, _ = logged
    seen: dict[str, Any] = {}

    def no_network(**kwargs: Any) -> None:
        seen["timeout"] = kwargs["settings"].init_timeout
        raise wandb.errors.CommError("Run initialization has timed out")

    monkeypatch.setattr(wandb, "init", no_network)
    monkeypatch.delenv("WANDB_INIT_TIMEOUT", raising=False)
    cfg = tiny("logger=wandb", "logger.mode=online", f"logger.dir={tmp_path}")
    with pytest.raises(WandbLogError) as e:
        log_run_to_wandb(cfg, result, cfg.logger)
    assert seen["timeout"] == 30.0  # W&B's own default: 90 s, per run of a sweep
    assert "W&B online: connecting (up to 30 s" in capsys.readouterr().out
    assert "logger.mode=offline" in record_wandb_failure(tmp_path, e.value)


def test_an_offline_failure_does_not_suggest_offline_mode(tmp_path: Path) -> None:
    msg = record_wandb_failure(tmp_path, WandbLogError("UsageError: bad project", None,
                                                        "offline"))
    assert "to retry: fix the cause and run again" in msg and "logger.mode" not in msg
