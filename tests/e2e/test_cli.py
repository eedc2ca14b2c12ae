"""`python -m harness` as a user runs it: a single run, and a sweep that survives a failure."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SMALL = ["model=tiny", "workload.conversations=2", "workload.turns=2",
         "workload.system_words=10", "workload.user_words=4", "workload.answer_tokens=4"]


def harness(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "harness", *args], capture_output=True,
                          text=True, cwd=Path(__file__).resolve().parents[2], timeout=300)


def test_single_run_prints_summary_and_writes_folder(tmp_path: Path) -> None:
    p = harness(*SMALL, f"hydra.run.dir={tmp_path}/run", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "requests finished / rejected" in p.stdout and "4 / 0" in p.stdout
    assert (tmp_path / "run" / "metrics.json").is_file()


def test_bad_budget_exits_2_with_the_fix(tmp_path: Path) -> None:
    p = harness(*SMALL, "cache.kv_budget=1KiB", f"hydra.run.dir={tmp_path}/run", cwd=tmp_path)
    assert p.returncode == 2
    assert "set cache.kv_budget=" in p.stderr
    assert (tmp_path / "run" / "FAILED").is_file()


def test_sweep_goes_on_past_a_failed_job(tmp_path: Path) -> None:
    p = harness("-m", *SMALL, "cache.kv_budget=1KiB,512KiB", f"hydra.sweep.dir={tmp_path}",
                cwd=tmp_path)
    # Issue #54: it went on, then exited 0; it still goes on, and says so and exits 1.
    assert p.returncode == 1, p.stderr
    jobs = sorted(d for d in tmp_path.iterdir() if d.is_dir())
    assert len(jobs) == 2
    assert (jobs[0] / "FAILED").is_file() and not (jobs[0] / "metrics.json").exists()
    assert (jobs[1] / "metrics.json").is_file()
    assert f"kvbench: sweep {tmp_path}: 1 finished, 1 failed, 0 not started\n" \
           f"  failed: {jobs[0]} (FAILED: UserError: cache.kv_budget=1.00KiB" in p.stderr


def test_sweep_through_separate_processes(tmp_path: Path) -> None:
    # submitit's local mode: the Slurm launcher's code path, each run its own process.
    p = harness("-m", "hydra/launcher=slurm_local", *SMALL, "backend=paged,contiguous",
                f"hydra.sweep.dir={tmp_path}", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    runs = sorted(m.parent.name for m in tmp_path.rglob("metrics.json"))
    assert runs == ["0-paged-multiturn", "1-contiguous-multiturn"]


def test_a_moved_option_names_its_new_key(tmp_path: Path) -> None:
    p = harness(*SMALL, "roofline.kv_groups=uniform", f"hydra.run.dir={tmp_path}/run",
                cwd=tmp_path)
    assert p.returncode == 2
    assert "roofline.kv_groups is now cache.kv_groups" in p.stderr
