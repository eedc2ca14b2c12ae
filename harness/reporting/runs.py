"""Run folders on disk -> :class:`Run` records, and the names report and gate give them.

A run folder (DESIGN.md, Results) holds config.yaml, metrics.json, steps.csv and
requests.csv when the run finished; one that did not holds a marker instead (``FAILED``,
``INTERRUPTED``), or nothing but its claim (``.kvbench-run``) or Hydra's ``.hydra/`` when
its process was killed before it could write one (or it is still running). A sweep is any
folder above run folders, however deep; a sweep folder with Hydra's ``multirun.yaml`` also
says which jobs it launched, so jobs never started and stale jobs from an earlier sweep
into the same folder are told apart (:func:`check_sweeps`). A folder of repeats
(``repeats=N``: harness/repeats.py) is read as one run whose speed metrics are medians with
95% intervals (:func:`merge_repeats`).

Runs are told apart by their *variant keys*: config keys whose values differ between the
finished runs of one workload (outside ``backend.*``: ``workload.n``, ``cache.kv_budget``,
``seed``...), or between the runs of one backend on one workload (``backend.reserve``,
``backend.block_size``...). A run's key is ``<backend>/<workload>[/k=v,...]`` over those
keys.
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from harness.metrics.repeats import summarize_repeats
from harness.repeats import REPEAT_KEYS, group_repeats, is_group, repeat_index
from harness.results import CLAIM, FAILED, METRICS, OUTCOMES, SWEEP_CLAIM, outcome, read_claim

# Config keys that never describe what ran (where it was written, how it was shown).
# ``repeat*``: how often a configuration ran, and which repeat a folder is (harness/repeats.py).
IGNORED_CONFIG_PREFIXES = ("out_dir", "run_name", "results_dir", "progress", "logger.",
                           "repeat")
FINISHED, FAILED_RUN, INTERRUPTED_RUN = "finished", "failed", "interrupted"
NO_OUTCOME, UNREADABLE = "no outcome", "unreadable"


@dataclass(slots=True)
class Run:
    """One run folder. ``metrics`` is None exactly when the run did not finish (or its
    metrics.json cannot be read): ``status`` says which, ``failure`` why."""

    path: Path
    config: dict[str, Any]  # config.yaml flattened to dotted keys
    metrics: dict[str, Any] | None
    failure: str | None  # the text of FAILED / INTERRUPTED, or what is wrong
    status: str = FINISHED  # finished | failed | interrupted | no outcome | unreadable
    overrides: list[str] | None = None  # Hydra's .hydra/overrides.yaml, if any
    stale: bool = False  # from an earlier sweep into the same folder (check_sweeps)
    # A group of repeats read as one run (merge_repeats): its repeat runs, by repeat
    # index, finished or not; the non-speed keys they disagree on; the repeats it was
    # started with. Empty for a plain run.
    repeats: list[Run] = field(default_factory=list)
    varied: list[str] = field(default_factory=list)
    repeats_planned: int | None = None

    @property
    def backend(self) -> str:
        return str(self.config.get("backend.name")
                   or (self.metrics or {}).get("run.backend") or "?")

    @property
    def workload(self) -> str:
        return str(self.config.get("workload.name")
                   or (self.metrics or {}).get("run.workload") or "?")

    @property
    def files(self) -> Path:
        """Where its steps.csv and requests.csv are: the run's folder, or for a group of
        repeats its first finished repeat's (the series of one repeat; the summary has no
        series of its own)."""
        done = [r for r in self.repeats if r.metrics is not None]
        return done[0].path if done else self.path

    def steps(self) -> pd.DataFrame:
        """steps.csv or steps.parquet (records.format; columns: harness.metrics.rows
        .StepRow); empty if absent."""
        return _read_records(self.files, "steps")

    def requests(self) -> pd.DataFrame:
        """requests.csv or requests.parquet (harness.metrics.collector.request_row);
        empty if absent."""
        return _read_records(self.files, "requests")


def _read_records(folder: Path, name: str) -> pd.DataFrame:
    """A run's records; empty if absent, and empty with a line on stderr naming the file
    when it cannot be read (a corrupt CSV or Parquet file once aborted the whole report
    without saying which: issue #55). Its plots then leave the run out."""
    pq = folder / f"{name}.parquet"
    path = pq if pq.is_file() else folder / f"{name}.csv"
    if not path.is_file() or path.stat().st_size == 0:
        return pd.DataFrame()
    try:
        return pd.read_parquet(path) if path.suffix == ".parquet" else pd.read_csv(path)
    except (ValueError, OSError, UnicodeDecodeError) as e:  # pandas' and pyarrow's parse
        # errors are ValueErrors (ParserError, ArrowInvalid)
        print(f"kvbench report: cannot read {path} ({one_line(str(e))}); its plots leave "
              "this run out", file=sys.stderr)
        return pd.DataFrame()


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts -> one level with dotted keys (``{"a": {"b": 1}}`` -> ``{"a.b": 1}``)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, f"{key}."))
        else:
            out[key] = v
    return out


def _natural(path: Path) -> list[Any]:
    # Hydra numbers a sweep's jobs 0, 1, ... 10: sort "10-x" after "9-x".
    return [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", str(path))]


class Unreadable(Exception):
    """A run's file is not what it should be; the message names the file and the fault."""


def _read_json_object(path: Path) -> dict[str, Any]:
    try:
        d = json.loads(path.read_text())
    except OSError as e:
        raise Unreadable(f"{path}: cannot read it ({e.strerror or e})") from e
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise Unreadable(f"{path}: not valid JSON ({e})") from e
    if not isinstance(d, dict):
        raise Unreadable(f"{path}: holds a JSON {type(d).__name__}, not an object of metrics")
    return d


def _read_metrics(path: Path) -> dict[str, Any]:
    """metrics.json: an object whose values are numbers (or null), ``run.*`` aside (what
    ran: names, shas, notes). A number stored as a string would otherwise be left out of
    every table and gate without a word."""
    d = _read_json_object(path)
    bad = [(k, v) for k, v in d.items() if not str(k).startswith("run.") and v is not None
           and (isinstance(v, bool) or not isinstance(v, int | float))]
    if bad:
        k, v = bad[0]
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise Unreadable(f"{path}: {k}={v!r} is stored as a {type(v).__name__}, not a "
                         f"number{more}")
    return d


def _read_yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text())
    except OSError as e:
        raise Unreadable(f"{path}: cannot read it ({e.strerror or e})") from e
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise Unreadable(f"{path}: not valid YAML ({e})") from e


def _config(folder: Path) -> dict[str, Any]:
    for name in ("config.yaml", ".hydra/config.yaml"):
        if (folder / name).is_file():
            d = _read_yaml(folder / name) or {}
            if not isinstance(d, dict):
                raise Unreadable(f"{folder / name}: not a mapping of config keys")
            return flatten(d)
    return {}


def _no_outcome(folder: Path) -> str:
    owner = read_claim(folder) or {}
    pid, host = owner.get("pid"), owner.get("host")
    since = f" since {owner['started_at']}" if "started_at" in owner else ""
    if isinstance(pid, int) and host == socket.gethostname():
        try:
            os.kill(pid, 0)
            return f"no results or marker yet: still running (pid {pid}{since})"
        except (ProcessLookupError, PermissionError):
            pass
    return ("no results and no marker: its process was killed before it could write one "
            f"(SIGKILL, power loss){since}; or it runs on another machine")


def _load(folder: Path) -> Run:
    overrides = None
    try:
        if (folder / ".hydra" / "overrides.yaml").is_file():
            o = _read_yaml(folder / ".hydra" / "overrides.yaml")
            overrides = [str(x) for x in o] if isinstance(o, list) else None
        config = _config(folder)
    except Unreadable as e:
        return Run(folder, {}, None, str(e), UNREADABLE, overrides)
    end = outcome(folder)
    if end is None:
        return Run(folder, config, None, _no_outcome(folder), NO_OUTCOME, overrides)
    if end != METRICS:
        try:
            text = (folder / end).read_text(errors="replace").strip()
        except OSError as e:
            text = f"cannot read {folder / end}: {e.strerror or e}"
        status = FAILED_RUN if end == FAILED else INTERRUPTED_RUN
        return Run(folder, config, None, text, status, overrides)
    try:
        return Run(folder, config, _read_metrics(folder / METRICS), None, FINISHED,
                   overrides)
    except Unreadable as e:
        return Run(folder, config, None, str(e), UNREADABLE, overrides)


def _run_folders(p: Path) -> set[Path]:
    """Folders at or below ``p`` that hold a run: a result or marker, a claim, or Hydra's
    .hydra/ (a job killed before it claimed its folder). Hidden folders are skipped (W&B's
    files, .hydra itself)."""
    found: set[Path] = set()
    for name in (*OUTCOMES, CLAIM, ".hydra/config.yaml"):
        for f in p.rglob(name):
            folder = f.parent.parent if name.startswith(".hydra/") else f.parent
            rel = folder.relative_to(p).parts
            if f.is_file() and not any(part.startswith(".") for part in rel) \
                    and not is_group(folder):  # a group's runs are its repeat-<k>/
                found.add(folder.resolve())
    return found


def find_runs(paths: list[Path]) -> list[Run]:
    """Every run folder at or below ``paths`` (whatever its outcome), in natural path order.

    Raises ValueError naming the folders searched when there is none, and for a path that
    does not exist or is not a folder.
    """
    folders: set[Path] = set()
    for p in paths:
        if not p.exists():
            raise ValueError(f"{p} does not exist (give run folders or sweep folders)")
        if not p.is_dir():
            raise ValueError(f"{p} is a file, not a folder (give run folders or sweep folders)")
        folders |= _run_folders(p)
    if not folders:
        raise ValueError(f"no runs found (no {', '.join(OUTCOMES)}) under: "
                         + ", ".join(str(p) for p in paths))
    return merge_repeats([_load(f) for f in sorted(folders, key=_natural)])


def merge_repeats(runs: list[Run]) -> list[Run]:
    """Each group of repeats (harness/repeats.py: ``repeat-<k>/`` folders in a folder
    marked as a group) as one :class:`Run` at the group's folder: its metrics the summary
    of the repeats that finished (speed medians with ``_ci95_low`` / ``_ci95_high``,
    :func:`~harness.metrics.repeats.summarize_repeats`), its config theirs without the
    ``repeat*`` keys, its ``repeats`` every repeat run. A group where no repeat finished
    is a run that did not finish (the last repeat's status, and why)."""
    groups: dict[Path, list[Run]] = defaultdict(list)
    out: list[Run] = []
    for r in runs:
        if repeat_index(r.path) is not None and is_group(r.path.parent):
            groups[r.path.parent].append(r)
        else:
            out.append(r)
    out += [_merged(g, members) for g, members in groups.items()]
    return sorted(out, key=lambda r: _natural(r.path))


def per_repeat(run: Run, key: str) -> dict[int, float]:
    """{repeat index: value of ``key``} over a group's finished repeats ({} for a run)."""
    out = {}
    for x in run.repeats:
        k, v = repeat_index(x.path), (x.metrics or {}).get(key)
        if k is not None and isinstance(v, int | float) and not isinstance(v, bool):
            out[k] = float(v)
    return out


def _merged(group: Path, members: list[Run]) -> Run:
    members.sort(key=lambda r: repeat_index(r.path) or 0)
    done = [r for r in members if r.metrics is not None]
    first = done[0] if done else members[0]
    # A repeat of another configuration (a folder copied or run by hand into the group)
    # is not one of its repeats: left out of its figures, and said (issue #55: it was
    # merged and widened the interval).
    mine = {k: v for k, v in comparable(first.config).items() if k not in REPEAT_KEYS}
    strangers = [r for r in members if r.config and
                 {k: v for k, v in comparable(r.config).items() if k not in REPEAT_KEYS}
                 != mine]
    if strangers:
        members = [r for r in members if not any(r is x for x in strangers)]
        done = [r for r in members if r.metrics is not None]
    config = {k: v for k, v in first.config.items() if k not in REPEAT_KEYS}
    overrides = None if first.overrides is None else [
        o for o in first.overrides if o.split("=", 1)[0].lstrip("+~") not in REPEAT_KEYS]
    planned = group_repeats(group)
    missing = [r for r in members if r.metrics is None]
    why = "; ".join(f"repeat {repeat_index(r.path)}: {r.status}: {one_line(r.failure)}"
                    for r in missing)
    short = (planned or 0) - len(members) - len(strangers)
    if short > 0:
        why = "; ".join(x for x in (why, f"{short} repeat(s) never started") if x)
    if strangers:
        why = "; ".join(x for x in (why, *(
            f"{r.path.name} is another configuration's run (left out)"
            for r in strangers)) if x)
    if not done:
        return Run(group, config, None, f"no repeat finished: {why}", first.status, overrides,
                   repeats=members, repeats_planned=planned)
    s = summarize_repeats([r.metrics or {} for r in done],
                          [repeat_index(r.path) or 0 for r in done])
    failure = f"{len(done)} of {planned or len(members)} repeats finished: {why}" if why \
        else None
    return Run(group, config, s.metrics, failure, FINISHED, overrides, repeats=members,
               varied=s.varied, repeats_planned=planned)


@dataclass(slots=True)
class SweepCheck:
    """What the sweeps' multirun.yaml files say beyond the run folders."""

    never_started: list[tuple[Path, list[str]]] = field(default_factory=list)  # (sweep, job)
    stale: list[Run] = field(default_factory=list)
    # (sweep, why) for each sweep whose multirun.yaml could not be read: its jobs never
    # started cannot be listed, which a report must say rather than list none (issue #55)
    unlisted: list[tuple[Path, str]] = field(default_factory=list)


def sweep_jobs(multirun: Path) -> list[list[str]] | None:
    """The jobs (override lists) a Hydra sweep launched, from its multirun.yaml; None when
    it cannot tell (another sweeper than Hydra's basic one, an unreadable file)."""
    return read_sweep_jobs(multirun)[0]


def read_sweep_jobs(multirun: Path) -> tuple[list[list[str]] | None, str]:
    """:func:`sweep_jobs`, and when it gives None because ``multirun`` could not be read
    (missing, unreadable, not YAML, not Hydra's layout, overrides Hydra refuses) why; ""
    for a sweep run by another sweeper than Hydra's basic one (no job list to expect)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        saved = _read_yaml(multirun)
        if not isinstance(saved, dict) or not isinstance(saved.get("hydra"), dict):
            return None, f"{multirun}: not a Hydra multirun.yaml (no hydra: mapping)"
        hydra = saved["hydra"]
        sweeper = hydra.get("sweeper", {})
        if not str(sweeper.get("_target_", "")).endswith(("BasicSweeper", "RepeatSweeper")):
            return None, ""  # the repeat sweeper's base jobs are the basic one's
        params = [f"{k}={v}" for k, v in (sweeper.get("params") or {}).items()]
        parsed = OverridesParser.create().parse_overrides(
            [*params, *hydra.get("overrides", {}).get("task", [])])
        return [job for batch in BasicSweeper.split_arguments(parsed, None)
                for job in batch], ""
    except Unreadable as e:  # a YAML error spans lines: one, for a report's line
        return None, one_line(str(e))
    except Exception as e:  # what Hydra itself would refuse: no verdict, never a crash
        return None, f"{multirun}: {type(e).__name__}: {one_line(str(e))}"


def check_sweeps(paths: list[Path], runs: list[Run]) -> SweepCheck:
    """Compare each sweep folder's runs (those with .hydra/overrides.yaml) with the jobs its
    multirun.yaml launched: jobs without a folder were never started (a sweep stopped
    early); folders of no job are stale (an earlier sweep into the same folder) and get
    ``stale = True``."""
    check = SweepCheck()
    # A sweep folder: its multirun.yaml, or kvbench's sweep claim (a multirun.yaml lost or
    # removed, which leaves the jobs never started unknown).
    sweeps = {f.parent.resolve() for p in paths
              for f in [*p.rglob("multirun.yaml"), *p.rglob(SWEEP_CLAIM)]
              if not any(part.startswith(".") for part in f.parent.relative_to(p).parts)}
    for sweep in sorted(sweeps, key=_natural):
        jobs, why = read_sweep_jobs(sweep / "multirun.yaml")
        if jobs is None:
            if why:
                check.unlisted.append((sweep, why))
            continue
        expected = {frozenset(j): j for j in jobs}
        mine = [r for r in runs if r.overrides is not None and sweep in r.path.parents]
        seen = {frozenset(r.overrides or []) for r in mine}
        for r in mine:
            if frozenset(r.overrides or []) not in expected:
                r.stale = True
                check.stale.append(r)
        check.never_started += [(sweep, j) for k, j in expected.items() if k not in seen]
        for r in mine:  # a group's repeats the sweep stopped before
            have = {repeat_index(x.path) for x in r.repeats}
            check.never_started += [(sweep, [*(r.overrides or []), f"repeat={k}"])
                                    for k in range(r.repeats_planned or 0) if k not in have]
    return check


def one_line(text: str | None) -> str:
    """A marker's text on one line (its lines joined with "; ")."""
    return "; ".join(ln.strip() for ln in str(text).splitlines() if ln.strip())


def fmt_value(v: Any) -> str:
    """A config value as Hydra's override syntax spells it (true, null, 16, max)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    return "null" if v is None else str(v)


def relevant(run: Run, key: str) -> bool:
    """Whether ``key`` of the run's config shaped it: a roofline run loads no model (its
    model is ``roofline.model``), a model run reads no ``roofline.*``."""
    roofline = run.config.get("executor") == "roofline"
    return not key.startswith("roofline." if not roofline else "model.")


def comparable(config: dict[str, Any]) -> dict[str, str]:
    """A flattened config as runs are compared by it (the gate's baseline, the SLA search's
    probe reuse): each value as Hydra spells it, the keys that never shape a run (out_dir,
    progress, logger, ...) left out."""
    return {k: fmt_value(v) for k, v in sorted(config.items())
            if not k.startswith(IGNORED_CONFIG_PREFIXES)}


def _differing(members: list[Run], keep: Any) -> set[str]:
    names = set().union(*(r.config for r in members))
    return {k for k in names
            if keep(k) and not k.startswith(IGNORED_CONFIG_PREFIXES)
            and k not in ("backend.name", "workload.name")
            and len({fmt_value(r.config[k]) for r in members
                     if k in r.config and relevant(r, k)}) > 1}


def variant_keys(runs: list[Run]) -> list[str]:
    """Config keys whose values differ between the finished runs of one workload (outside
    ``backend.*``: whatever the backend, runs that differ there are different experiments),
    or between the finished runs of one backend on one workload (``backend.*``: each
    backend has its own options). Runs without a key, written before it existed, do not
    count."""
    done = [r for r in runs if r.metrics is not None]
    by_workload: dict[str, list[Run]] = defaultdict(list)
    by_backend: dict[tuple[str, str], list[Run]] = defaultdict(list)
    for r in done:
        by_workload[r.workload].append(r)
        by_backend[(r.backend, r.workload)].append(r)
    keys: set[str] = set()
    for members in by_workload.values():
        keys |= _differing(members, lambda k: not k.startswith("backend."))
    for members in by_backend.values():
        keys |= _differing(members, lambda k: k.startswith("backend."))
    return sorted(keys)


def variant(run: Run, keys: list[str]) -> dict[str, str]:
    """The run's values of ``keys`` (those its config has and that shaped it)."""
    return {k: fmt_value(run.config[k]) for k in keys if k in run.config and relevant(run, k)}


def run_key(run: Run, keys: list[str]) -> str:
    """``<backend>/<workload>[/k=v,...]``: stable across reruns of the same config."""
    v = variant(run, keys)
    tail = "/" + ",".join(f"{k}={x}" for k, x in v.items()) if v else ""
    return f"{run.backend}/{run.workload}{tail}"


def label(run: Run, keys: list[str]) -> str:
    """A short name for plots and tables: the backend and its variant values."""
    v = variant(run, keys)
    return run.backend + (" " + ",".join(f"{k.rsplit('.', 1)[-1]}={x}" for k, x in v.items())
                          if v else "")
