"""How a run ends when it is stopped or killed: signals, and one process per sweep job.

Signals. SIGINT (Ctrl-C) and SIGTERM raise :class:`Interrupted` in the main thread, so the
run unwinds, writes ``INTERRUPTED`` and exits 128 + the signal (130, 143) with one line
instead of a traceback. A second signal while that marker is being written is ignored.

Sweep jobs. In a multirun every job runs in a forked child of the process the launcher
gave it (the basic launcher's own process, a joblib worker, a submitit job); that process
only waits. A child that dies by a signal (the kernel's OOM killer sends SIGKILL; a crash
in native code, SIGSEGV) cannot write a marker, so its parent does (``FAILED``, naming the
signal) and returns normally: the launcher sees a job that ended, never a dead worker, and
the sweep goes on. Why a fork, and not a custom launcher or a subprocess:

- it works under every launcher (basic, joblib, submitit, ray) with no Hydra plugin: a
  joblib worker that died would break joblib's whole pool (TerminatedWorkerError, the
  sweep and its healthy jobs gone), but the worker never dies now, only its child;
- the child holds the model and the KV cache, its parent nothing of its own (pages shared
  until written), so an out-of-memory kill picks the child, never the parent;
- a fork costs milliseconds (a fresh ``python -m`` would import torch again, ~1.5 s a
  job), and each job still gets a fresh address space (no memory carried between jobs).

The child asks the kernel for SIGTERM when its parent dies (PR_SET_PDEATHSIG), so killing
the sweep never leaves orphaned jobs running: they are interrupted and marked. Where fork
is unavailable (not Linux), or would be unsafe (this process holds a CUDA context), jobs
run in-process, as before. Nothing in the launching process may initialize CUDA (not
even ``torch.cuda.is_available()``, whose cuInit makes CUDA unusable in forked children):
device checks belong to the run (harness/runner.py), which runs in the child.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import NoReturn

from harness.results import (
    ALIVE,
    ATTEMPTS,
    CLAIM,
    FAILED,
    INTERRUPTED,
    METRICS,
    UNKNOWN,
    FolderTaken,
    new_owner_token,
    outcome,
    owner_state,
    pid_alive,
    read_claim,
    record_interrupted,
    set_aside,
    unmarked_claims,
    write_failure,
    write_interrupted,
)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
STOP_WAIT_S = 10.0  # how long a stopping sweep waits for its running jobs' markers
_PR_SET_PDEATHSIG = 1
# Signals by which a process is killed without a word, and what usually sent them.
_CAUSES: dict[int, str] = {
    signal.SIGKILL: "SIGKILL with no other message is most often the kernel's out-of-memory "
                    "killer (see `dmesg`): give the job less memory (a smaller cache.kv_budget"
                    ", a smaller model) or run fewer jobs at once (hydra.launcher.n_jobs)",
    signal.SIGSEGV: "a crash in native code (torch, Triton, a driver)",
    signal.SIGBUS: "a crash in native code, or a file it had mapped (a model) shrank",
    signal.SIGABRT: "an abort in native code (torch, Triton, a driver)",
}


def signal_name(signum: int) -> str:
    """``SIGINT (Ctrl-C)``, ``SIGTERM``, ``SIGKILL``..."""
    try:
        name = signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
    return f"{name} (Ctrl-C)" if signum == signal.SIGINT else name


class Interrupted(KeyboardInterrupt):
    """The run was asked to stop by a signal (a KeyboardInterrupt, so that library code
    cleans up as it does for Ctrl-C)."""

    def __init__(self, signum: int = signal.SIGINT) -> None:
        super().__init__(signal_name(signum))
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


_stopping = False
_sweep: Path | None = None  # set in the process that launches a sweep's jobs


def _raise_interrupted(signum: int, frame: FrameType | None) -> None:
    global _stopping
    if _stopping:  # already unwinding: let the marker be written
        return
    _stopping = True
    if _sweep is not None:
        stop_jobs(_sweep, signum)
    raise Interrupted(signum)


_ignored: frozenset[int] = frozenset()  # stop signals this program was started ignoring


def install_handlers(top_level: bool = False) -> None:
    """SIGINT and SIGTERM raise :class:`Interrupted` (main thread only; else a no-op).

    ``top_level`` (the CLI's own process): a signal it was started ignoring stays ignored,
    in it and in its jobs (``cmd &`` in a script ignores SIGINT, so that the script's
    Ctrl-C spares it)."""
    global _stopping, _sweep, _ignored
    _stopping, _sweep = False, None
    if top_level:
        _ignored = frozenset(s for s in STOP_SIGNALS if signal.getsignal(s) is signal.SIG_IGN)
    with contextlib.suppress(ValueError):  # not the main thread
        for s in STOP_SIGNALS:
            if s not in _ignored:
                signal.signal(s, _raise_interrupted)


def coordinate(sweep: Path) -> None:
    """This process launches the jobs of ``sweep``: on a stop signal, pass it to the jobs
    still running and wait for their markers before stopping. (A launcher's own clean-up
    may SIGKILL its workers' process trees, as joblib's does, which leaves no marker.)"""
    global _sweep
    _sweep = sweep


def _alive(pid: int) -> bool:
    return pid_alive(pid)


def _claims(sweep: Path) -> list[Path]:
    """The job claims of ``sweep``, outside hidden folders (a resumed sweep's earlier
    attempts, set aside in .kvbench-attempts/)."""
    return [c for c in sweep.rglob(CLAIM)
            if not any(p.startswith(".") for p in c.parent.relative_to(sweep).parts)]


def running_jobs(sweep: Path) -> dict[Path, int]:
    """Job folders of ``sweep`` claimed by a live process of this host, without outcome."""
    me, host = os.getpid(), socket.gethostname()
    jobs = {}
    for claim in _claims(sweep):
        owner = read_claim(claim.parent) or {}
        pid = owner.get("pid")
        if (isinstance(pid, int) and pid != me and owner.get("host") == host
                and outcome(claim.parent) is None and _alive(pid)):
            jobs[claim.parent] = pid
    return jobs


def sweep_in_progress() -> Path | None:
    """The sweep this process launches (see :func:`coordinate`), if any."""
    return _sweep


def mark_abandoned(sweep: Path, why: str, interrupted: bool) -> int:
    """Mark the job folders of ``sweep`` whose process is gone without a word (killed
    with its launcher's workers); returns how many were marked."""
    me, n = os.getpid(), 0
    for claim in _claims(sweep):
        folder, owner = claim.parent, read_claim(claim.parent) or {}
        pid = owner.get("pid")
        if outcome(folder) is not None or pid == me or (isinstance(pid, int) and _alive(pid)):
            continue
        text = f"stopped with its sweep ({why}) before it wrote its results or a marker"
        with contextlib.suppress(OSError):
            (write_interrupted if interrupted else write_failure)(folder, text)
            n += 1
    return n


def stop_jobs(sweep: Path, signum: int, wait_s: float = STOP_WAIT_S) -> None:
    """Send ``signum`` to the running jobs of ``sweep`` (and to any started meanwhile) and
    wait, up to ``wait_s``, until each has written its marker or ended."""
    signalled: set[int] = set()
    deadline = time.monotonic() + wait_s
    while (jobs := running_jobs(sweep)) and time.monotonic() < deadline:
        for pid in jobs.values():
            if pid not in signalled:
                if not signalled:
                    print(f"\nkvbench: stopping the sweep's running jobs (up to {wait_s:.0f} s "
                          "for their INTERRUPTED markers)", file=sys.stderr)
                signalled.add(pid)
                with contextlib.suppress(OSError):
                    os.kill(pid, signum)
        time.sleep(0.05)


# An interrupted run's exception, kept until the process exits (:func:`hold_until_exit`).
_held: list[BaseException] = []


def hold_until_exit(e: BaseException) -> None:
    """Keep ``e`` (an interrupted run's exception: its traceback holds the run's frames,
    and through them the run's stacks and records) alive until :func:`exit_promptly`.
    Let go, the run would be freed object by object after its marker was written: seconds
    for a large run (issue #55: 50,000 replicas took 4 s to free, during which a second
    Ctrl-C is ignored so that the marker can be written)."""
    _held.append(e)


def exit_promptly(code: int) -> NoReturn:
    """Exit with ``code`` now, without freeing the heap one object at a time: the
    interpreter's own exit would free every object of a large run first (seconds to
    minutes, issue #55). What exit does that matters runs: the ``atexit`` handlers (log
    files flushed, temporary folders removed: a spilled step log's, a disk tier's), then
    stdout and stderr flushed."""
    import atexit

    with contextlib.suppress(Exception):
        atexit._run_exitfuncs()  # also runs weakref.finalize's exit-time finalizers
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def mark_unstarted(stop: Interrupted) -> None:
    """Mark INTERRUPTED the run folders this process claimed and left without results or a
    marker (``stop`` came after the claim and before the run's own handling began: Hydra
    sets up the run between the two), and say so on the terminal."""
    for folder in unmarked_claims():
        text = (f"interrupted by {stop} after its folder was claimed, before the run "
                "started: nothing was run; rerun it into a new folder")
        print(f"kvbench: {folder}: {text}; {record_interrupted(folder, text)}",
              file=sys.stderr)


def as_interrupted(e: KeyboardInterrupt) -> Interrupted:
    """A plain KeyboardInterrupt (raised before our handlers) is Ctrl-C."""
    return e if isinstance(e, Interrupted) else Interrupted(signal.SIGINT)


@dataclass(slots=True)
class JobEnd:
    """How a supervised job ended: its exit code, and the stop signal its parent got (the
    sweep should stop) if any."""

    code: int
    stop: Interrupted | None


def can_fork() -> bool:
    """Whether jobs can run in forked children here: Linux, and no CUDA context in this
    process (a child of a process that initialized CUDA cannot use it). The processes
    that launch jobs never touch CUDA; the jobs do, each in its own child."""
    if not (sys.platform.startswith("linux") and hasattr(os, "fork")):
        return False
    torch = sys.modules.get("torch")
    return not (torch is not None and torch.cuda.is_initialized())


_parent: int | None = None  # in a job process: the pid of the process that forked it


def parent_died() -> bool:
    """In a job process: whether the process that forked it is gone."""
    return _parent is not None and os.getppid() != _parent


def _die_with_parent(parent: int) -> None:
    """Ask for SIGTERM when the parent dies (Linux; best effort)."""
    global _parent
    _parent = parent
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it died before prctl: stop now
        os.kill(os.getpid(), signal.SIGTERM)


def _exit_code(e: SystemExit) -> int:
    return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)


def _child(job: Callable[[], int], parent: int) -> None:
    code = 1
    try:
        install_handlers()
        new_owner_token()  # this process claims its own folder
        _die_with_parent(parent)
        code = job()
    except SystemExit as e:
        code = _exit_code(e)
    except KeyboardInterrupt as e:
        stop = as_interrupted(e)
        mark_unstarted(stop)  # its folder claimed, the run not started yet
        code = stop.exit_code
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def mark_killed(out: Path, signum: int, elapsed_s: float, pid: int) -> str:
    """Record a job process that died by ``signum``; return the line for the terminal."""
    killed = f"killed by {signal_name(signum)} after {elapsed_s:.1f} s (job process {pid})"
    if (done := outcome(out)) is not None:  # its results (then W&B died) or its own marker
        return f"kvbench: job {out} was {killed}; it had written {done}"
    cause = _CAUSES.get(signum, "")
    text = f"{killed}, before it could write its results" + (f": {cause}" if cause else "")
    try:
        where = f"recorded in {write_failure(out, text)}"
    except OSError as e:
        where = f"and even the FAILED marker could not be written there: {e.strerror or e}"
    return f"kvbench: job {out} was {text}; {where}; the sweep goes on"


def run_supervised(job: Callable[[], int], out: Path) -> JobEnd:
    """Run ``job`` (returns an exit code) in a forked child and wait for it.

    A child killed by a signal gets ``FAILED`` in ``out`` (unless it had written its own
    marker). SIGINT/SIGTERM sent to this process are passed on to the child, which writes
    INTERRUPTED; they come back in ``JobEnd.stop`` so the caller can stop the sweep.
    """
    if not can_fork():  # in-process, as before: a stop signal reached this very process
        code = job()
        return JobEnd(code, Interrupted(code - 128) if code - 128 in STOP_SIGNALS else None)
    got: list[int] = []
    child: list[int] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        got.append(signum)
        if child:  # a duplicate of the terminal's Ctrl-C is ignored by the child
            with contextlib.suppress(ProcessLookupError):
                os.kill(child[0], signum)

    old = {s: signal.signal(s, forward) for s in STOP_SIGNALS if s not in _ignored}
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        parent, start = os.getpid(), time.monotonic()
        pid = os.fork()
        if pid == 0:
            _child(job, parent)  # never returns
        child.append(pid)
        _, status = os.waitpid(pid, 0)  # retried after a handled signal (PEP 475)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    stop = Interrupted(got[0]) if got else None
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        print(mark_killed(out, sig, time.monotonic() - start, pid), file=sys.stderr)
        return JobEnd(128 + sig, stop)
    return JobEnd(os.waitstatus_to_exitcode(status), stop)


# --- a sweep's end, and resuming it (issue #54) ------------------------------------------------
# A sweep whose jobs did not all finish exits 1 after one summary block (finished, failed,
# not started; the failed jobs' folders). Rerun into the same hydra.sweep.dir, it resumes:
# the sweep folder's claim is taken over from a process that is gone
# (harness.results.claim_sweep), the jobs that finished are kept and not launched again, and
# the others (failed, interrupted, killed: a claim whose process is gone) are set aside in
# .kvbench-attempts/ and rerun (the sweeper: hydra_plugins/kvbench_sweeper).

WANDB_FAILED = "WANDB_FAILED"  # harness.sinks.wandb_sink.FAILED_FILE (not imported: W&B)
KEEP, RERUN, NEW = "keep", "rerun", "new"


def job_folders(sweep: Path) -> list[Path]:
    """Job folders of ``sweep`` from an earlier attempt (a claim, an outcome, or Hydra's
    .hydra/), hidden folders left out."""
    found = {f.parent for n in (CLAIM, METRICS, FAILED, INTERRUPTED) for f in sweep.rglob(n)}
    found |= {f.parent.parent for f in sweep.rglob(".hydra/overrides.yaml")}
    return sorted(d for d in found if d != sweep and
                  not any(p.startswith(".") for p in d.relative_to(sweep).parts))


def _ran(folder: Path) -> list[str] | None:
    """The overrides Hydra recorded for the job run in ``folder`` (None: none recorded)."""
    import yaml

    try:
        got = yaml.safe_load((folder / ".hydra" / "overrides.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return None
    return [str(o) for o in got] if isinstance(got, list) else None


def job_state(folder: Path, overrides: list[str]) -> tuple[str, str]:
    """What a resumed sweep does with its job ``overrides`` whose folder is ``folder``:
    (KEEP, "") finished (metrics.json, no FAILED / INTERRUPTED marker); (RERUN, why) failed,
    interrupted, or claimed by a process that is gone; (NEW, "") never started. Raises
    FolderTaken for a folder another job ran, or one whose process runs (or may: another
    host's)."""
    if not folder.is_dir() or not any(folder.iterdir()):
        return NEW, ""
    ran = _ran(folder)
    if ran is not None and ran != list(overrides):
        raise FolderTaken(f"job folder {folder} holds a run of {' '.join(ran) or 'no overrides'}"
                          f", not of this sweep's job {' '.join(overrides)}; kvbench never "
                          "writes into another run's folder: choose a new hydra.sweep.dir")
    marks = [n for n in (FAILED, INTERRUPTED) if (folder / n).is_file()]
    if (folder / METRICS).is_file() and not marks:
        return KEEP, ""
    if marks:
        return RERUN, _first_line(folder, marks[0])
    owner = read_claim(folder)
    if owner is None:
        return RERUN, "started, never claimed"
    state = owner_state(owner)
    if state in (ALIVE, UNKNOWN):
        who = ", ".join(f"{k} {owner[k]}" for k in ("pid", "host") if k in owner)
        how = ("still runs it" if state == ALIVE else "is on another host (or its claim is "
               "unreadable): kvbench cannot tell whether it still runs; if not, remove the "
               "folder to rerun it")
        raise FolderTaken(f"job folder {folder}: its process ({who}) {how}")
    return RERUN, f"no outcome: its process (pid {owner.get('pid')}) is gone"


@dataclass(slots=True)
class ResumePlan:
    kept: dict[int, Path]  # job index -> its finished folder
    rerun: list[tuple[Path, str]]  # (folder, why), set aside
    new: int


def resume_plan(sweep: Path, jobs: list[tuple[list[str], Path]]) -> ResumePlan:
    """Decide each job of a resumed sweep (:func:`job_state`) and set aside the folders of
    those to rerun; nothing is moved if any folder is refused (FolderTaken)."""
    states = [(i, folder, *job_state(folder, overrides))
              for i, (overrides, folder) in enumerate(jobs)]
    plan = ResumePlan({i: f for i, f, what, _ in states if what == KEEP}, [],
                      sum(what == NEW for _, _, what, _ in states))
    for _, folder, what, why in states:
        if what == RERUN:
            set_aside(folder, sweep)
            plan.rerun.append((folder, why))
    print(f"kvbench: resuming sweep {sweep}: {len(plan.kept)} finished job(s) kept, "
          f"{len(plan.rerun)} to rerun, {plan.new} not started before"
          + "".join(f"\n  rerun: {f} ({why})" for f, why in plan.rerun)
          + (f"\n  (earlier attempts set aside in {sweep / ATTEMPTS})" if plan.rerun else ""),
          file=sys.stderr)
    return plan


def _first_line(folder: Path, name: str) -> str:
    try:
        text = (folder / name).read_text(errors="replace").strip().splitlines()
    except OSError:
        return name
    line = text[0] if text else ""
    return f"{name}: {line[:160]}{'...' if len(line) > 160 else ''}" if line else name


_sweep_exit = 0


def sweep_exit_code() -> int:
    """The exit code of the sweep this process launched and summarized (0: none, or every
    job finished)."""
    return _sweep_exit


def summarize_sweep(sweep: Path, folders: list[Path | None], kept: int = 0) -> int:
    """Print the sweep's end (one block on stderr) and return its exit code, kept for the
    CLI (:func:`sweep_exit_code`): 0 every job finished; 1 a job failed, was interrupted,
    ended without an outcome, or never started; 3 every job finished but logging one to
    W&B failed. ``folders``: each job's folder (None: never started); ``kept``: how many
    of the finished were kept from an earlier attempt."""
    global _sweep_exit
    finished, wandb, failed, never = [], [], [], 0
    for f in folders:
        if f is None:
            never += 1
            continue
        marks = [n for n in (FAILED, INTERRUPTED) if (f / n).is_file()]
        if (f / METRICS).is_file() and not marks:
            finished.append(f)
            if (f / WANDB_FAILED).is_file():
                wandb.append(f)
        else:
            failed.append((f, _first_line(f, marks[0]) if marks else
                           "no outcome: its process ended without results or a marker"))
    code = 1 if failed or never else (3 if wandb else 0)
    lines = [f"kvbench: sweep {sweep}: {len(finished)} finished"
             + (f" ({kept} kept from an earlier attempt)" if kept else "")
             + f", {len(failed)} failed, {never} not started"]
    lines += [f"  failed: {f} ({why})" for f, why in failed]
    lines += [f"  W&B logging failed: {f / WANDB_FAILED}" for f in wandb]
    if failed or never:
        lines.append("  rerun the same command (the same hydra.sweep.dir) to run only these "
                     "again")
    print("\n" + "\n".join(lines), file=sys.stderr)
    _sweep_exit = code
    return code
