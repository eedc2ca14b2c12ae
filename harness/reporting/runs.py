"""Run folders on disk -> :class:`Run` records, and the names report and gate give them.

A run folder (DESIGN.md, Results) holds config.yaml, metrics.json, steps.csv and
requests.csv; a failed one holds FAILED instead (and no config.yaml: the runner writes
results only at the end, so a failed run's config comes from Hydra's .hydra/config.yaml).
A sweep is any folder above run folders, however deep.

Runs are told apart by their *variant keys*: the config keys whose values differ between
runs of the same backend and workload (``backend.reserve``, ``backend.block_size``,
``workload.n``...). A run's key is ``<backend>/<workload>[/k=v,...]`` over those keys.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

# Config keys that never describe what ran (where it was written, how it was shown).
IGNORED_CONFIG_PREFIXES = ("out_dir", "run_name", "results_dir", "progress", "logger.")


@dataclass(slots=True)
class Run:
    """One run folder. ``metrics`` is None exactly when the run failed."""

    path: Path
    config: dict[str, Any]  # config.yaml flattened to dotted keys
    metrics: dict[str, Any] | None
    failure: str | None  # the text of FAILED

    @property
    def backend(self) -> str:
        return str(self.config.get("backend.name")
                   or (self.metrics or {}).get("run.backend") or "?")

    @property
    def workload(self) -> str:
        return str(self.config.get("workload.name")
                   or (self.metrics or {}).get("run.workload") or "?")

    def steps(self) -> pd.DataFrame:
        """steps.csv (columns: harness.metrics.collector.StepRow); empty if absent."""
        return _read_csv(self.path / "steps.csv")

    def requests(self) -> pd.DataFrame:
        """requests.csv (harness.metrics.summary.request_rows); empty if absent."""
        return _read_csv(self.path / "requests.csv")


def _read_csv(path: Path) -> pd.DataFrame:
    if not path.is_file() or path.stat().st_size == 0:
        return pd.DataFrame()
    return pd.read_csv(path)


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


def _load(folder: Path) -> Run:
    metrics_file, failed_file = folder / "metrics.json", folder / "FAILED"
    # A folder rerun after a failure keeps its old FAILED: the newer file tells.
    failed = failed_file.is_file() and not (
        metrics_file.is_file() and metrics_file.stat().st_mtime >= failed_file.stat().st_mtime)
    config: dict[str, Any] = {}
    for name in ("config.yaml", ".hydra/config.yaml"):
        if (folder / name).is_file():
            config = flatten(yaml.safe_load((folder / name).read_text()) or {})
            break
    if failed:
        return Run(folder, config, None, failed_file.read_text().strip())
    return Run(folder, config, json.loads(metrics_file.read_text()), None)


def find_runs(paths: list[Path]) -> list[Run]:
    """Every run folder at or below ``paths`` (finished or failed), in natural path order.

    Raises ValueError naming the folders searched when there is none.
    """
    folders: set[Path] = set()
    for p in paths:
        if not p.is_dir():
            raise ValueError(f"{p} is not a folder (give run folders or sweep folders)")
        for marker in ("metrics.json", "FAILED"):
            for f in p.rglob(marker):
                rel = f.relative_to(p).parts
                if f.is_file() and not any(part.startswith(".") for part in rel):
                    folders.add(f.parent.resolve())
    if not folders:
        raise ValueError("no runs found (no metrics.json or FAILED) under: "
                         + ", ".join(str(p) for p in paths))
    return [_load(f) for f in sorted(folders, key=_natural)]


def fmt_value(v: Any) -> str:
    """A config value as Hydra's override syntax spells it (true, null, 16, max)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    return "null" if v is None else str(v)


def variant_keys(runs: list[Run]) -> list[str]:
    """Config keys whose values differ between runs of the same backend and workload (runs
    without the key, written before it existed, do not count)."""
    groups: dict[tuple[str, str], list[Run]] = defaultdict(list)
    for r in runs:
        groups[(r.backend, r.workload)].append(r)
    keys: set[str] = set()
    for members in groups.values():
        names = set().union(*(r.config for r in members))
        for k in names:
            if k.startswith(IGNORED_CONFIG_PREFIXES) or k in ("backend.name", "workload.name"):
                continue
            if len({fmt_value(r.config[k]) for r in members if k in r.config}) > 1:
                keys.add(k)
    return sorted(keys)


def variant(run: Run, keys: list[str]) -> dict[str, str]:
    """The run's values of ``keys`` (those its config has)."""
    return {k: fmt_value(run.config[k]) for k in keys if k in run.config}


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
