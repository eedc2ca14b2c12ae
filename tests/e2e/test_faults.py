"""Faults, as a user's machine produces them: runs started together, a signal mid-run, a
full disk at the end, a sweep job killed outright (the OOM killer), a sweep stopped.

Each checks that nothing already written is lost and that every run folder ends complete
(metrics.json and its files) or marked (FAILED / INTERRUPTED). Runs are the tiny model;
the ones to interrupt have their requests arrive over seconds (``workload.rate``), so they
last while costing little CPU.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from harness.app.cli import _write_failed
from harness.app.report import main as report
from harness.results import CLAIM, ResultsWriteError, atomic_write

ROOT = Path(__file__).resolve().parents[2]
QUICK = ["model=tiny", "device=cpu", "workload=shared_prefix", "workload.prefix_tokens=32",
         "workload.suffix_tokens=8", "workload.output_tokens=8"]
SLOW = ["workload.num_requests=20", "workload.rate=4"]  # arrivals over ~5 s


def _default_sigint() -> None:
    # A suite started in the background by a shell without job control (nohup ... &)
    # inherits SIGINT ignored, and so would every run it starts: Ctrl-C's tests then saw
    # a run finish untouched. A user's kvbench gets SIGINT as the terminal sends it.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start(*args: str, preexec_fn: Callable[[], None] | None = None,
          **kw: Any) -> subprocess.Popen[str]:
    def before() -> None:
        _default_sigint()
        if preexec_fn is not None:
            preexec_fn()

    return subprocess.Popen([sys.executable, "-m", "harness", *args], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=before,
                            **kw)


def finish(p: subprocess.Popen[str]) -> tuple[int, str, str]:
    out, err = p.communicate(timeout=240)
    return p.returncode, out, err


def owner_pid(folder: Path, name: str = CLAIM, timeout: float = 120) -> int:
    """The pid in a folder's claim, once the run (or sweep) has claimed it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return int(json.loads((folder / name).read_text())["pid"])
        except (OSError, ValueError, KeyError):
            time.sleep(0.05)
    raise AssertionError(f"{folder} was never claimed")


def assert_complete_or_marked(root: Path) -> dict[str, str]:
    """Every run folder under ``root`` is complete or marked, and no temporary file is
    left; returns {folder name: outcome}."""
    assert not list(root.rglob("*.tmp")), list(root.rglob("*.tmp"))
    seen = {}
    for claim in root.rglob(CLAIM):
        d = claim.parent
        names = {p.name for p in d.iterdir()}
        if "metrics.json" in names:
            assert {"config.yaml", "steps.csv", "requests.csv"} <= names, names
            seen[d.name] = "finished"
        else:
            marks = names & {"FAILED", "INTERRUPTED"}
            assert marks, f"{d} is neither complete nor marked: {sorted(names)}"
            seen[d.name] = marks.pop()
    return seen


def test_runs_started_together_never_share_a_folder(tmp_path: Path) -> None:
    procs = [start(*QUICK, f"workload.num_requests={n}", f"results_dir={tmp_path}",
                   "progress=false") for n in (2, 5)]
    assert [finish(p)[0] for p in procs] == [0, 0]
    runs = sorted(tmp_path.iterdir())
    assert len(runs) == 2
    finished = sorted(json.loads((r / "metrics.json").read_text())["requests.finished"]
                      for r in runs)
    assert finished == [2, 5]
    assert set(assert_complete_or_marked(tmp_path).values()) == {"finished"}


def test_a_folder_that_holds_another_run_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "run"
    procs = {n: start(*QUICK, f"workload.num_requests={n}", f"hydra.run.dir={out}",
                      "progress=false") for n in (2, 5)}
    ends = {n: finish(p) for n, p in procs.items()}
    codes = sorted(e[0] for e in ends.values())
    assert codes == [0, 2], ends
    (winner,) = (n for n, e in ends.items() if e[0] == 0)
    (loser,) = (e for e in ends.values() if e[0] == 2)
    assert "never writes into another run's folder" in loser[2]
    # The winner's files, Hydra's included, are the winner's alone.
    assert json.loads((out / "metrics.json").read_text())["requests.finished"] == winner
    assert f"workload.num_requests={winner}" in yaml.safe_load(
        (out / ".hydra" / "overrides.yaml").read_text())
    assert not (out / "FAILED").exists()

    # A sweep into a folder that holds runs is refused before anything is written.
    sweep = tmp_path / "sweep"
    (sweep / "0-old").mkdir(parents=True)
    (sweep / "0-old" / "metrics.json").write_text("{}")
    rc, _, err = finish(start("-m", *QUICK, "backend=paged,contiguous",
                              f"hydra.sweep.dir={sweep}"))
    assert rc == 2 and "already holds 1 run(s)" in err, err
    assert sorted(p.name for p in sweep.iterdir()) == ["0-old"]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_mid_run_leaves_interrupted_and_one_line(tmp_path: Path,
                                                          sig: signal.Signals) -> None:
    out = tmp_path / "run"
    p = start(*QUICK, *SLOW, f"hydra.run.dir={out}",
              env={**os.environ, "KVBENCH_STATUS_INTERVAL": "60"})
    assert p.stderr is not None
    for line in p.stderr:  # the first status line: the workload is running
        if "requests" in line:
            break
    time.sleep(0.3)
    p.send_signal(sig)
    rc, _, err = finish(p)
    assert rc == 128 + sig, err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"kvbench: interrupted by {sig.name}") and "INTERRUPTED" in last
    text = (out / "INTERRUPTED").read_text()
    assert f"interrupted by {sig.name}" in text
    assert "engine steps" in text and "of 20 requests done" in text
    assert assert_complete_or_marked(tmp_path) == {"run": "INTERRUPTED"}
    assert (out / "config.yaml").is_file() and not (out / "metrics.json").exists()


def test_a_write_failure_at_the_end_keeps_the_summary_and_marks_the_folder(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A 16 KiB file-size limit: steps.csv cannot be written, the small files can. (A full
    # disk, as root can still write into a read-only folder.)
    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (16384, 16384))

    out = tmp_path / "run"
    rc, stdout, err = finish(start("model=tiny", "workload.conversations=8", "workload.turns=3",
                                   f"hydra.run.dir={out}", "progress=false",
                                   preexec_fn=small_files))
    assert rc == 4, err
    assert "requests finished / rejected" in stdout  # the summary is not lost
    assert f"could not write {out / 'steps.csv'}: File too large" in err
    assert "steps.csv" in (out / "FAILED").read_text()
    assert "Traceback" not in err
    assert assert_complete_or_marked(tmp_path) == {"run": "FAILED"}
    assert yaml.safe_load((out / "config.yaml").read_text())["workload"]["conversations"] == 8
    assert report([str(tmp_path), "--out", str(tmp_path / "rep")]) == 0
    assert "1 failed" in capsys.readouterr().out


def test_even_a_marker_that_cannot_be_written_is_said(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    def full(path: Path, text: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("harness.results.atomic_write", full)
    e = ResultsWriteError(tmp_path / "metrics.json", OSError(28, "No space left on device"),
                          None, ["config.yaml", "steps.csv"])
    assert _write_failed(tmp_path, e) == 4
    err = capsys.readouterr().err
    assert f"could not write {tmp_path / 'metrics.json'}: No space left on device" in err
    assert "config.yaml, steps.csv had been written" in err
    assert f"even the FAILED marker could not be written into {tmp_path}" in err


def test_a_failed_write_leaves_the_old_file_and_no_temporary(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "metrics.json"
    atomic_write(f, "old\n")

    def boom(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        atomic_write(f, "new\n")
    assert f.read_text() == "old\n" and sorted(p.name for p in tmp_path.iterdir()) == [f.name]


def test_a_killed_job_does_not_stop_a_parallel_sweep(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sweep = tmp_path / "sweep"
    p = start("-m", "hydra/launcher=parallel", *QUICK, "workload.num_requests=8",
              "workload.rate=0,2,0", f"hydra.sweep.dir={sweep}", "progress=false")
    victim = sweep / "1-paged-shared_prefix"
    pid = owner_pid(victim)  # the job's own process: the one the OOM killer would pick
    time.sleep(0.3)
    os.kill(pid, signal.SIGKILL)
    rc, _, err = finish(p)
    assert rc == 1, err  # the sweep went on, and ends saying a job failed (issue #54)
    assert "2 finished, 1 failed, 0 not started" in err and f"failed: {victim}" in err
    assert "killed by SIGKILL" in (victim / "FAILED").read_text()
    assert assert_complete_or_marked(sweep) == {
        "0-paged-shared_prefix": "finished", "1-paged-shared_prefix": "FAILED",
        "2-paged-shared_prefix": "finished"}
    assert report([str(sweep)]) == 0
    assert "2 finished run(s), 1 failed" in capsys.readouterr().out


def test_a_stopped_sweep_marks_its_running_job_and_lists_those_never_started(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sweep = tmp_path / "sweep"
    p = start("-m", *QUICK, *SLOW, "backend=paged,contiguous,fp8", f"hydra.sweep.dir={sweep}",
              "progress=false")
    owner_pid(sweep / "0-paged-shared_prefix")
    time.sleep(0.5)
    p.send_signal(signal.SIGINT)  # to the sweep's own process: the basic launcher's
    rc, _, err = finish(p)
    assert rc == 130, err
    assert "Traceback" not in err and "sweep stopped by SIGINT" in err
    assert assert_complete_or_marked(sweep) == {"0-paged-shared_prefix": "INTERRUPTED"}
    assert report([str(sweep)]) == 0
    out = capsys.readouterr().out
    assert "1 interrupted, 2 never started" in out
    assert "never started" in out and "backend=contiguous" in out and "backend=fp8" in out


def test_a_stopped_parallel_sweep_marks_every_running_job(tmp_path: Path) -> None:
    # joblib's own clean-up SIGKILLs its workers' processes: the sweep's process stops its
    # running jobs first, and waits for their markers.
    sweep = tmp_path / "sweep"
    p = start("-m", "hydra/launcher=parallel", *QUICK, *SLOW, "backend=paged,contiguous,fp8",
              f"hydra.sweep.dir={sweep}", "progress=false")
    # Both parallel jobs running (each has claimed its folder; under load the first may
    # claim after the second), then the signal.
    owner_pid(sweep / "0-paged-shared_prefix")
    owner_pid(sweep / "1-contiguous-shared_prefix")
    time.sleep(0.5)
    p.send_signal(signal.SIGTERM)
    rc, _, err = finish(p)
    assert rc == 143, err
    assert "Traceback" not in err
    seen = assert_complete_or_marked(sweep)
    assert seen["0-paged-shared_prefix"] == seen["1-contiguous-shared_prefix"] == "INTERRUPTED"


def test_ctrl_c_while_starting_is_one_line_and_130(tmp_path: Path) -> None:
    # Issue 27: Ctrl-C during the start-up imports printed a traceback. The interrupt is
    # raised by an import hook at the moment hydra is imported (no timing involved).
    (tmp_path / "sitecustomize.py").write_text(
        "import builtins\n_imp = builtins.__import__\n"
        "def _hook(name, *a, **k):\n"
        "    if name == 'hydra':\n        raise KeyboardInterrupt\n"
        "    return _imp(name, *a, **k)\n"
        "builtins.__import__ = _hook\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    p = subprocess.run([sys.executable, "-m", "harness"], capture_output=True, text=True,
                       cwd=tmp_path, env=env, timeout=120)
    assert p.returncode == 130, p.stderr
    assert p.stderr.strip() == "kvbench: stopped by SIGINT (Ctrl-C) while starting; " \
                               "nothing was run"


def start_patched(patch: str, *args: str) -> subprocess.Popen[str]:
    """``python -m harness *args`` with ``patch`` (Python source) run first, in the same
    process: a hook that holds the run at the moment a test needs to signal it."""
    code = ("import runpy, sys, time\n" + patch +
            f"\nsys.argv = ['harness', *{list(args)!r}]\n"
            "runpy.run_module('harness', run_name='__main__', alter_sys=True)\n")
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=_default_sigint)


def wait_for_line(p: subprocess.Popen[str], text: str) -> None:
    assert p.stderr is not None
    for line in p.stderr:
        if text in line:
            return
    raise AssertionError(f"the process ended (rc {p.wait()}) before printing {text!r}")


def test_sigint_exits_without_freeing_the_run_first(tmp_path: Path) -> None:
    """Issue #55: a what-if of 100,000 replicas wrote INTERRUPTED, then spent seconds
    freeing its replicas object by object (and ignored a second Ctrl-C meanwhile: the
    marker is protected). Here an object whose freeing takes a minute stands for a large
    run: the process exits 130 right after the marker, its frames never freed."""
    patch = ("import harness.runner\n"
             "class SlowToFree:\n"
             "    def __del__(self):\n"
             "        time.sleep(60)\n"
             "def run(cfg):\n"
             "    held = SlowToFree()\n"
             "    print('kvbench-test: running', file=sys.stderr, flush=True)\n"
             "    while held:\n"
             "        time.sleep(0.05)\n"
             "harness.runner.run = run\n")
    out = tmp_path / "run"
    p = start_patched(patch, *QUICK, f"hydra.run.dir={out}", "progress=false")
    wait_for_line(p, "kvbench-test: running")
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=30)  # not the minute of freeing
    assert p.returncode == 130, err
    assert "Traceback" not in err and "interrupted by SIGINT" in err
    assert "interrupted by SIGINT" in (out / "INTERRUPTED").read_text()


def test_sigint_between_the_claim_and_the_run_leaves_interrupted(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue #55: Ctrl-C after the run's folder was claimed (Hydra's FolderGuard) and
    before the run began left a claim with no marker, which the report calls a process
    killed before it could write one. It is marked INTERRUPTED."""
    patch = ("import harness.app.hydra_callbacks as guard\n"
             "claim = guard.claim_folder\n"
             "def claim_and_wait(folder, empty=False):\n"
             "    claim(folder, empty)\n"
             "    print('kvbench-test: claimed', file=sys.stderr, flush=True)\n"
             "    while True:\n"
             "        time.sleep(0.05)\n"
             "guard.claim_folder = claim_and_wait\n")
    out = tmp_path / "run"
    p = start_patched(patch, *QUICK, f"hydra.run.dir={out}", "progress=false")
    wait_for_line(p, "kvbench-test: claimed")
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    assert "Traceback" not in err
    text = (out / "INTERRUPTED").read_text()
    assert "interrupted by SIGINT (Ctrl-C) after its folder was claimed, before the run " \
           "started" in text
    assert assert_complete_or_marked(tmp_path) == {"run": "INTERRUPTED"}
    assert report([str(tmp_path)]) == 0
    shown = capsys.readouterr().out
    assert "killed before it could write one" not in shown and "1 interrupted" in shown
