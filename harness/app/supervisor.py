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

from harness.results import (
    CLAIM,
    new_owner_token,
    outcome,
    read_claim,
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
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")  # an exited child not yet reaped is a zombie


def running_jobs(sweep: Path) -> dict[Path, int]:
    """Job folders of ``sweep`` claimed by a live process of this host, without outcome."""
    me, host = os.getpid(), socket.gethostname()
    jobs = {}
    for claim in sweep.rglob(CLAIM):
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
    for claim in sweep.rglob(CLAIM):
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
        code = as_interrupted(e).exit_code
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
