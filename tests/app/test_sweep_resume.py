"""A sweep's end and its resumption (issue #54): a sweep with a job that did not finish
says so in one block and exits 1; rerun into the same hydra.sweep.dir it keeps the jobs that
finished and reruns the rest; a folder that is not this sweep's stays refused."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from harness.app.hydra_callbacks import earlier_sweep
from harness.app.supervisor import job_state, summarize_sweep
from harness.results import CLAIM, SWEEP_CLAIM, FolderTaken, claim_sweep, read_claim

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["model=tiny", "workload.conversations=2", "workload.turns=1",
         "workload.system_words=10", "workload.user_words=4", "progress=false"]


def harness(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "harness", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    q = subprocess.Popen(["true"])
    q.wait()
    return q.pid


def claim(folder: Path, name: str = CLAIM, **owner: object) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(json.dumps({"token": "x", "host": socket.gethostname(),
                                           "started_at": "then", **owner}) + "\n")


def test_a_rerun_keeps_finished_jobs_and_reruns_failed_and_killed_ones(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    args = ["-m", *SMALL, "workload.answer_tokens=2,3,4", f"hydra.sweep.dir={sweep}"]
    p = harness(*args)
    assert p.returncode == 0, p.stderr
    assert f"kvbench: sweep {sweep}: 3 finished, 0 failed, 0 not started" in p.stderr
    done, failed, killed = (sweep / f"{i}-paged-multiturn" for i in range(3))
    # Job 1 failed; job 2's process was killed with no marker (its claim names a dead pid);
    # the sweep's own process is gone (it exited).
    (failed / "metrics.json").unlink()
    (failed / "FAILED").write_text("RuntimeError: out of luck\n")
    (killed / "metrics.json").unlink()
    claim(killed, pid=dead_pid())
    kept = (done / "metrics.json").stat().st_mtime_ns, (done / ".hydra" / "config.yaml").stat()
    p = harness(*args)
    assert p.returncode == 0, p.stderr
    assert f"kvbench: resuming sweep {sweep}: 1 finished job(s) kept, 2 to rerun, 0 not " \
           "started before" in p.stderr
    assert f"rerun: {failed} (FAILED: RuntimeError: out of luck)" in p.stderr
    assert f"rerun: {killed} (no outcome: its process (pid" in p.stderr
    assert "3 finished (1 kept from an earlier attempt), 0 failed, 0 not started" in p.stderr
    # The finished job was not launched again (not even Hydra's files rewritten).
    assert (done / "metrics.json").stat().st_mtime_ns == kept[0]
    assert (done / ".hydra" / "config.yaml").stat().st_mtime_ns == kept[1].st_mtime_ns
    for job in (failed, killed):
        assert (job / "metrics.json").is_file() and not (job / "FAILED").exists()
    # The earlier attempts are kept aside, hidden from the report and from the next resume.
    (attempt,) = (sweep / ".kvbench-attempts").iterdir()
    assert sorted(d.name for d in attempt.iterdir()) == [failed.name, killed.name]
    assert (attempt / failed.name / "FAILED").is_file()
    assert (read_claim(sweep, SWEEP_CLAIM) or {}).get("pid") != os.getpid()

    # Another sweep's jobs into this folder: refused before anything is written.
    before = sorted(p.relative_to(sweep) for p in sweep.rglob("*"))
    p = harness("-m", *SMALL, "workload.answer_tokens=2,5", f"hydra.sweep.dir={sweep}")
    assert p.returncode == 2, p.stderr
    assert "holds an earlier sweep" in p.stderr and "of other jobs" in p.stderr
    assert sorted(p.relative_to(sweep) for p in sweep.rglob("*")) == before


def test_a_sweep_folder_is_resumed_only_from_a_process_that_is_gone(tmp_path: Path) -> None:
    # Not a kvbench sweep: runs, no sweep claim.
    user = tmp_path / "user"
    (user / "0-old").mkdir(parents=True)
    (user / "0-old" / "metrics.json").write_text("{}")
    with pytest.raises(FolderTaken, match="is not a kvbench sweep's"):
        claim_sweep(user, earlier=lambda f: None)
    assert not (user / SWEEP_CLAIM).exists()
    # A sweep whose process runs (this test's own pid), or may (another host's).
    live = tmp_path / "live"
    claim(live, SWEEP_CLAIM, pid=os.getpid())
    with pytest.raises(FolderTaken, match="still running"):
        claim_sweep(live, earlier=lambda f: None)
    far = tmp_path / "far"
    claim(far, SWEEP_CLAIM, pid=1, host="elsewhere")
    with pytest.raises(FolderTaken, match="on another host"):
        claim_sweep(far, earlier=lambda f: None)
    # Gone, but another sweep: refused with the reason, the claim left as it was.
    gone = tmp_path / "gone"
    claim(gone, SWEEP_CLAIM, pid=dead_pid())
    text = (gone / SWEEP_CLAIM).read_text()
    with pytest.raises(FolderTaken, match=r"holds an earlier sweep .* of other jobs"):
        claim_sweep(gone, earlier=lambda f: "of other jobs")
    assert (gone / SWEEP_CLAIM).read_text() == text
    # Gone, the same sweep: taken over.
    assert claim_sweep(gone, earlier=lambda f: None) is True
    assert (read_claim(gone, SWEEP_CLAIM) or {}).get("pid") == os.getpid()
    assert sorted(p.name for p in gone.iterdir()) == [SWEEP_CLAIM]


def test_an_earlier_sweep_is_the_same_only_with_the_same_jobs(tmp_path: Path) -> None:
    def multirun(target: str, params: dict[str, str], task: list[str]) -> None:
        (tmp_path / "multirun.yaml").write_text(json.dumps({"hydra": {
            "sweeper": {"_target_": target, "params": params}, "overrides": {"task": task}}}))

    ours = "hydra_plugins.kvbench_sweeper.sweeper.RepeatSweeper"
    multirun(ours, {"backend": "paged,contiguous"}, ["model=tiny"])
    assert earlier_sweep(tmp_path, ["backend=paged,contiguous", "model=tiny"]) is None
    assert "of other jobs" in str(earlier_sweep(tmp_path, ["backend=paged,fp8", "model=tiny"]))
    multirun("hydra._internal.core_plugins.basic_sweeper.BasicSweeper", {}, ["seed=1,2"])
    assert "not run by kvbench's sweeper" in str(earlier_sweep(tmp_path, ["seed=1,2"]))


def test_a_job_folder_of_a_live_process_or_another_job_is_refused(tmp_path: Path) -> None:
    job = tmp_path / "0-paged-multiturn"
    claim(job, pid=os.getpid())
    with pytest.raises(FolderTaken, match="still runs it"):
        job_state(job, ["seed=1"])
    (job / ".hydra").mkdir()
    (job / ".hydra" / "overrides.yaml").write_text("- seed=2\n")
    with pytest.raises(FolderTaken, match="holds a run of seed=2, not of this sweep's job "
                                          "seed=1"):
        job_state(job, ["seed=1"])


def test_the_summary_counts_jobs_never_started(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    ok, bad = tmp_path / "0-a", tmp_path / "1-b"
    ok.mkdir()
    (ok / "metrics.json").write_text("{}")
    claim(bad, pid=dead_pid())  # killed before any marker
    assert summarize_sweep(tmp_path, [ok, bad, None]) == 1
    err = capsys.readouterr().err
    assert f"kvbench: sweep {tmp_path}: 1 finished, 1 failed, 1 not started\n" \
           f"  failed: {bad} (no outcome" in err
    assert summarize_sweep(tmp_path, [ok]) == 0
