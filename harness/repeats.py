"""``repeats=N``: one configuration run N times, and where the repeats go.

A single run with ``repeats=N`` is a *group* folder holding ``repeat-0/`` ..
``repeat-<N-1>/`` (each a complete run folder, its config with ``repeat=k``) and
``repeats.json``, the summary (harness/metrics/repeats.py: speed as the median with a 95%
interval, the rest stated once). In a sweep, :func:`expand_repeats` (the sweeper's,
harness/sweeper.py) interleaves the repeats across the sweep's configurations: repeat 0 of
every configuration, then repeat 1 of every one, ..., so that the machine's drift lands on
all of them alike; configuration ``c``'s repeat ``k`` is the job folder
``<c>-<backend>-<workload>/repeat-<k>`` (:func:`job_number`, :func:`repeat_tail`: an
experiment's own ``hydra.sweep.subdir`` uses them too), and each job refreshes its
group's summary when it ends (under a lock: jobs of a parallel launcher end together).
The report and the gate read a group as one run (harness.reporting.runs.merge_repeats).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from harness.metrics.repeats import RepeatSummary, summarize_repeats
from harness.results import METRICS, atomic_write, json_null_nonfinite, outcome

GROUP_MARK = ".kvbench-repeats"  # JSON {"repeats": N}: this folder holds one config's repeats
SUMMARY = "repeats.json"
_LOCK = ".repeats.lock"
_REPEAT_DIR = re.compile(r"^repeat-(\d+)$")
REPEAT_KEYS = ("repeat", "repeat_of")  # set by kvbench, never a difference between configs


def repeat_dir(group: Path, k: int) -> Path:
    return group / f"repeat-{k}"


def repeat_index(folder: Path) -> int | None:
    """``k`` for a folder named ``repeat-<k>``, else None."""
    m = _REPEAT_DIR.match(folder.name)
    return int(m.group(1)) if m else None


def job_number(num: int, repeat_of: int | None) -> str:
    """The number of a sweep job's folder (resolver ``kvbench_job`` of conf/config.yaml's
    ``hydra.sweep.subdir``): Hydra's job number, or in a sweep with repeats the
    configuration's, shared by its repeats."""
    return str(num if repeat_of is None else repeat_of)


def repeat_tail(repeat_of: int | None, repeat: int) -> str:
    """What follows a sweep job's folder name (resolver ``kvbench_repeat``): nothing, or
    ``/repeat-<k>`` for a repeat, so that a configuration's repeats share one folder."""
    return "" if repeat_of is None else f"/repeat-{repeat}"


def expand_repeats(jobs: list[list[str]], counts: list[int]) -> list[list[str]]:
    """The sweep's jobs with their repeats, interleaved: for k in 0.., every configuration
    that has a k-th repeat, in sweep order, with ``repeat=k repeat_of=<c>`` appended.
    ``counts[c]``: configuration c's ``repeats``. No repeats anywhere: ``jobs`` as given."""
    if max(counts, default=1) <= 1:
        return jobs
    return [[*job, f"repeat={k}", f"repeat_of={c}"]
            for k in range(max(counts)) for c, (job, n) in enumerate(zip(jobs, counts))
            if k < n]


def mark_group(group: Path, repeats: int) -> None:
    """Mark ``group`` as the folder of one configuration's ``repeats`` repeats (idempotent:
    every repeat job of a sweep calls it)."""
    group.mkdir(parents=True, exist_ok=True)
    if not (group / GROUP_MARK).is_file():
        atomic_write(group / GROUP_MARK, json.dumps({"repeats": repeats}) + "\n")


def is_group(folder: Path) -> bool:
    return (folder / GROUP_MARK).is_file()


def group_repeats(group: Path) -> int | None:
    """The ``repeats`` the group was started with (None: unreadable or not a group)."""
    try:
        n = json.loads((group / GROUP_MARK).read_text()).get("repeats")
    except (OSError, ValueError, AttributeError):
        return None
    return n if isinstance(n, int) else None


@contextlib.contextmanager
def _locked(group: Path) -> Iterator[None]:
    with open(group / _LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def finished_repeats(group: Path) -> list[tuple[int, dict[str, Any]]]:
    """(k, metrics) of every finished ``repeat-<k>/`` in ``group``, by k."""
    found = []
    for d in group.iterdir():
        k = repeat_index(d)
        if k is None or not d.is_dir() or outcome(d) != METRICS:
            continue
        try:
            m = json.loads((d / METRICS).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(m, dict):
            found.append((k, m))
    return sorted(found, key=lambda x: x[0])


def write_summary(group: Path) -> RepeatSummary | None:
    """Summarize the finished repeats of ``group`` into ``repeats.json`` (None: none has
    finished yet). Raises OSError when the file cannot be written."""
    with _locked(group):
        done = finished_repeats(group)
        if not done:
            return None
        s = summarize_repeats([m for _, m in done], [k for k, _ in done])
        atomic_write(group / SUMMARY, json.dumps(json_null_nonfinite(
            {"repeats": group_repeats(group), "finished": s.repeats, "varied": s.varied,
             "metrics": s.metrics}), indent=2, sort_keys=True, default=str,
            allow_nan=False) + "\n")
        return s
