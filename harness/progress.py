"""Progress of a run, so that no run looks hung: the engine's ``progress(done, total, tps)``
callback (harness.engine.engine.ProgressFn) drawn as

- a progress bar on a terminal (stderr is a TTY), rendered by tqdm (``format_meter``:
  requests done / known, tokens/s, elapsed, ETA) from this tracker's own clock and counts;
  redrawn at most 10 times a second;
- one status line on stderr every ``KVBENCH_STATUS_INTERVAL`` seconds (default 10) when
  stderr is not a terminal (sweeps, CI logs), each line naming its run, plus one at the
  first step and one at the end.

The tracker also remembers what was done (steps, requests), which is what an interrupted
run's ``INTERRUPTED`` marker reports (:func:`current`). ``progress=false`` turns the
display off; the counting stays.

A backlog that grows without bound (arrivals faster than the deployment completes them:
a trace far beyond its capacity, a huge ``workload.rate``) is said once, with the numbers
(:meth:`Progress.watch_backlog`): the requests waiting, and the arrival and completion
rates, instead of the run silently growing its memory with the queue (issue #55). It looks
every :data:`BACKLOG_EVERY` steps, so a step pays one counter test.

The requests known grow in a multi-turn workload (each next turn when the previous answer is
done): the total shown is the workload's ``expected_requests`` when it has one (multiturn:
conversations x turns; a trace: its rows), and the ETA counts to it; a workload whose
requests grow without one shows ``ETA n/a`` once its total has grown (the known total
would make the ETA too short).
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

REDRAW_S = 0.1  # the bar's redraw limit: the engine calls back once per step
DEFAULT_INTERVAL_S = 10.0
# tqdm puts ", " before the postfix; the bar takes the width that is left.
BAR_FORMAT = ("{percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} requests{postfix} "
              "[{elapsed} elapsed, ETA {remaining}]")

# Waiting requests past which a backlog that grows is reported (a what-if benchmark of
# 10,000 requests at 100/s peaks below it), and the steps between looks at the queue: a
# look costs one probe (over every replica of a cluster), a step only a counter test.
BACKLOG_WAITING = 10_000
BACKLOG_EVERY = 256

_label = ""  # the run's name on status lines (set by the CLI: the results folder's name)
_current: Progress | None = None


def configure(label: str) -> None:
    """A new run starts in this process: name it on status lines (a sweep's job folder,
    say) and forget the previous run's tracker."""
    global _label, _current
    _label, _current = label, None


def current() -> Progress | None:
    """The latest tracker made in this process (None before the workload started)."""
    return _current


def _interval() -> float:
    try:
        return max(0.0, float(os.environ.get("KVBENCH_STATUS_INTERVAL", DEFAULT_INTERVAL_S)))
    except ValueError:
        return DEFAULT_INTERVAL_S


def clock(seconds: float) -> str:
    """``73.4`` -> ``1:13``; ``3725`` -> ``1:02:05``."""
    s = int(seconds)
    h, rest = divmod(s, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


@dataclass(slots=True)
class Snapshot:
    """What a run had done when last heard of."""

    steps: int
    done: int
    total: int
    tokens_per_s: float
    elapsed_s: float
    finished: bool  # the workload ended (a later phase: quality, writing results)


@dataclass(slots=True)
class Backlog:
    """The deployment's queue now, as :meth:`Progress.watch_backlog`'s probe reads it."""

    waiting: int  # requests waiting to run (queued, or swapped out)
    in_flight: int  # requests arrived and not done: waiting or running
    clock_s: float  # seconds into the workload on the run's clock (modelled: the what-if)


class Progress:
    """A :data:`ProgressFn` that counts, and draws when ``show``."""

    def __init__(self, show: bool, stream: TextIO | None = None, label: str = "",
                 tty: bool | None = None, interval_s: float | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.show = show
        self.tty = self.stream.isatty() if tty is None else tty
        self.label = label
        self.interval_s = _interval() if interval_s is None else interval_s
        self.start = time.monotonic()
        self.steps = self.done = self.total = 0
        # The requests the workload will make in all, when it knows (expected_requests,
        # read at each draw: a rejection can end a conversation); whether the known total
        # grew during the run (follow-ups).
        self._expected: Callable[[], int] | None = None
        self.grew = False
        self.tps = 0.0
        self.finished = False
        self._last_draw = -1e9
        self._drawn = False
        self._width = 0  # of the bar's last line
        self._backlog: Callable[[], Backlog] | None = None
        self._backlog_hint = self._backlog_clock = ""
        # arrived, done, clock at the previous look (None: not looked yet)
        self._last_look: tuple[int, int, float] | None = None
        self.backlog_warned: str | None = None  # the warning, once given

    def __call__(self, done: int, total: int, tokens_per_s: float) -> None:
        self.steps += 1
        self.grew = self.grew or (self.steps > 1 and total > self.total)
        self.done, self.total, self.tps = done, total, tokens_per_s
        if self._backlog is not None and self.steps % BACKLOG_EVERY == 0:
            self._look_at_backlog(self._backlog)
        if not self.show:
            return
        now = time.monotonic()
        wait = REDRAW_S if self.tty else self.interval_s
        if now - self._last_draw >= wait or not self._drawn:
            self._last_draw = now
            self._draw(now)

    def watch_backlog(self, probe: Callable[[], Backlog], hint: str = "",
                      modelled: bool = False) -> None:
        """Every :data:`BACKLOG_EVERY` steps read the queue through ``probe``; once at least
        :data:`BACKLOG_WAITING` requests wait while requests arrive faster than they are
        done (since the previous look), warn, once, with those numbers and ``hint`` (what to
        change), whether or not progress is shown. ``modelled``: the probe's clock is the
        what-if's (said with its seconds)."""
        self._backlog, self._backlog_hint = probe, hint
        self._backlog_clock = " (modelled)" if modelled else ""

    def _look_at_backlog(self, probe: Callable[[], Backlog]) -> None:
        # The rates since the previous look: a queue that drains (arrivals over, or a burst
        # absorbed) is not one that grows. The first look only sets the baseline: an
        # offline batch (workload.rate=0) arrives whole before it and then only drains.
        b = probe()
        arrived = self.done + b.in_flight
        last, self._last_look = self._last_look, (arrived, self.done, b.clock_s)
        if last is None:
            return
        arrived0, done0, t0 = last
        dt = b.clock_s - t0
        if b.waiting < BACKLOG_WAITING or dt <= 0:
            return
        came, went = arrived - arrived0, self.done - done0
        if went >= came:
            return
        self._backlog = None  # once
        self.backlog_warned = (
            f"{self._prefix()}warning: a backlog beyond this deployment's capacity: "
            f"{b.waiting:,} requests wait after {b.clock_s:,.1f} s{self._backlog_clock} of "
            f"the workload; in the last {dt:,.1f} s {came:,} arrived ({came / dt:,.1f}/s) "
            f"and {went:,} were done ({went / dt:,.1f}/s), so the queue, and the memory "
            "that holds it, grows for as long as requests arrive faster than they are "
            "served (latencies will measure the queue)"
            + (f"; {self._backlog_hint}" if self._backlog_hint else ""))
        if self.tty and self._drawn:
            self.stream.write("\n")  # off the bar's line
        self.stream.write(self.backlog_warned + "\n")
        self.stream.flush()

    def snapshot(self) -> Snapshot:
        return Snapshot(self.steps, self.done, self.total, self.tps,
                        time.monotonic() - self.start, self.finished)

    def close(self) -> None:
        """The workload is done: finish the bar's line / print the last status line."""
        self.finished = True
        if not self.show or not self._drawn:
            return
        if self.tty:
            self._draw(time.monotonic())
            self.stream.write("\n")
        else:
            total = self.shown_total
            self.stream.write(f"{self._prefix()}done: {self.done}/{total} requests in "
                              f"{time.monotonic() - self.start:.1f} s ({self.tps:.1f} tok/s)\n")
        self.stream.flush()

    def _prefix(self) -> str:
        return f"kvbench [{self.label}]: " if self.label else "kvbench: "

    def expect(self, expected: Callable[[], int]) -> None:
        """The workload's count of the requests it will make in all (its
        ``expected_requests``): the total shown and counted to."""
        self._expected = expected

    @property
    def expected(self) -> int | None:
        return self._expected() if self._expected is not None else None

    @property
    def shown_total(self) -> int:
        """The total the bar and the status lines show: the workload's expected requests
        when it has them, else those known so far."""
        return max(self.total, self.expected or 0, self.done)

    def _eta(self, elapsed: float) -> str:
        total = self.shown_total
        if self.grew and self.expected is None and self.done < total:
            return "n/a"  # the total grows as the run goes: an ETA would be too short
        if self.done <= 0 or self.done >= total:
            return "?" if self.done < total else clock(0)
        return clock(elapsed * (total - self.done) / self.done)

    def _draw(self, now: float) -> None:
        elapsed = now - self.start
        eta = self._eta(elapsed)
        total = self.shown_total
        stats = (f"{self.done}/{total} requests  {self.tps:7.1f} tok/s  "
                 f"{clock(elapsed)} elapsed  ETA {eta}")
        if self.tty:
            from tqdm import tqdm  # the bar: tqdm's meter, our clock (an engine step is a tick)

            cols = shutil.get_terminal_size((80, 24)).columns
            line = "  " + tqdm.format_meter(
                self.done, total, elapsed, ncols=cols - 3, postfix=f"{self.tps:.1f} tok/s",
                bar_format=BAR_FORMAT if eta != "n/a" else BAR_FORMAT.replace(
                    "{remaining}", eta)) + " "
            # Pad over a longer previous line ("\r" only moves the cursor back).
            self.stream.write(f"\r{line}{' ' * max(0, self._width - len(line))}")
            self._width = len(line)
        else:
            self.stream.write(f"{self._prefix()}{' '.join(stats.split())}\n")
        self.stream.flush()
        self._drawn = True


def make_progress(enabled: bool) -> Progress:
    """The engine's progress callback for one run (drawn when ``enabled``); also becomes
    :func:`current`, for the marker of an interrupted run."""
    global _current
    _current = Progress(enabled, label=_label)
    return _current


def describe(snap: Snapshot | None) -> str:
    """What was done, for INTERRUPTED and the terminal, e.g. ``42 engine steps, 3 of 16
    requests done`` (a request is done when it finished or was rejected)."""
    if snap is None:
        return "before the workload started (model loading or set-up)"
    text = (f"{snap.steps} engine steps, {snap.done} of {snap.total} requests done, "
            f"{snap.elapsed_s:.1f} s into the workload")
    return text + ("; the workload had finished (interrupted in a later phase: quality "
                   "evaluation or writing results)" if snap.finished else "")
