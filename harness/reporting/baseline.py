"""The gate's baseline file (results/baselines/<name>.json) and how one is taken from runs.

```
{"format": "kvbench-gate-baseline/1",
 "key_fields": [...],                 config keys in the run keys (runs.variant_keys)
 "spec": {metric: {"direction": "higher|lower|match", "rel_tol": r, "abs_floor": a}},
 "runs": {run key: {metric: value}},  what is gated
 "configs": {run key: {config key: value}},   what ran (a mismatch is reported)
 "source": {"git_sha": [...], "runs": {run key: folder name}}}
```
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from harness.reporting.runs import (
    Run,
    comparable,
    one_line,
    per_repeat,
    run_key,
    variant_keys,
)

FORMAT = "kvbench-gate-baseline/1"
# Which way is better; "match": neither, any change beyond the tolerance fails (accounting
# that should not drift either way, such as peak bytes used for the same work).
Direction = Literal["higher", "lower", "match"]


@dataclass(frozen=True, slots=True)
class MetricSpec:
    direction: Direction
    rel_tol: float  # allowed worsening, as a share of |baseline|
    abs_floor: float  # ... but never less than this (numbers near 0: counts, small %)

    def allowed(self, base: float) -> float:
        return max(self.rel_tol * abs(base), self.abs_floor)


def make_spec(direction: str, rel_tol: float, abs_floor: float) -> MetricSpec:
    if direction not in ("higher", "lower", "match"):
        raise ValueError(f"direction {direction!r}: expected higher, lower or match")
    for name, x in (("rel_tol", rel_tol), ("abs_floor", abs_floor)):
        # NaN compares false with everything: a NaN tolerance would pass any change.
        if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x) \
                or x < 0:
            raise ValueError(f"{name}={x!r}: must be a finite number >= 0")
    return MetricSpec(direction, float(rel_tol), float(abs_floor))  # type: ignore[arg-type]


@dataclass(slots=True)
class Baseline:
    key_fields: list[str]
    spec: dict[str, MetricSpec]
    runs: dict[str, dict[str, float]]  # run key -> metric -> value
    configs: dict[str, dict[str, str]] = field(default_factory=dict)
    source: dict[str, Any] = field(default_factory=dict)
    # Runs written from repeats (repeats=N): run key -> metric -> each repeat's value, by
    # repeat index; the gated value of such a run is their median (``runs``).
    repeats: dict[str, dict[str, list[float]]] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path) -> Baseline:
        """Raises ValueError (with what to do) for a missing or malformed file."""
        if path.is_dir():
            raise ValueError(f"baseline {path} is a folder, not a baseline file (give the "
                             f"file, e.g. {path / 'cpu-tiny.json'})")
        try:
            d = json.loads(path.read_text())
        except OSError as e:
            raise ValueError(f"cannot read baseline {path}: {e.strerror}; write one with "
                             f"--write-baseline {path} <runs>") from e
        except json.JSONDecodeError as e:
            raise ValueError(f"baseline {path} is not JSON: {e}") from e
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ValueError(f"baseline {path}: expected \"format\": \"{FORMAT}\"")
        try:
            spec = {m: make_spec(**s) for m, s in d["spec"].items()}
            base = cls(list(d["key_fields"]), spec, d["runs"], d.get("configs", {}),
                       d.get("source", {}), d.get("repeats", {}))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"baseline {path}: malformed ({e})") from e
        for key, values in base.runs.items():
            if not isinstance(values, dict):
                raise ValueError(f"baseline {path}: run {key} is not an object of metrics")
            for m, v in values.items():
                if number(v) is None or not math.isfinite(v):
                    raise ValueError(f"baseline {path}: run {key}: {m}={v!r} is not a "
                                     "finite number (a NaN baseline passes every value); "
                                     "refresh it with --write-baseline")
            if unknown := set(values) - set(spec):
                raise ValueError(f"baseline {path}: run {key} has values for "
                                 f"{sorted(unknown)} but its spec does not gate them")
        return base

    def dump(self, path: Path) -> None:
        d = {"format": FORMAT, "written_by": "python -m harness.gate --write-baseline",
             "key_fields": self.key_fields,
             "spec": {m: asdict(s) for m, s in self.spec.items()},
             "runs": self.runs, "configs": self.configs, "source": self.source,
             **({"repeats": self.repeats} if self.repeats else {})}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(d, indent=2) + "\n")


def number(x: Any) -> float | None:
    """A metric value as a float; None for missing, null, NaN or non-numbers."""
    if isinstance(x, bool) or not isinstance(x, int | float) or math.isnan(x):
        return None
    return float(x)


def keyed(runs: list[Run], fields: list[str]) -> dict[str, Run]:
    """Runs by run key; ValueError when two runs share one."""
    out: dict[str, Run] = {}
    for r in runs:
        k = run_key(r, fields)
        if k in out:
            raise ValueError(f"{out[k].path} and {r.path} share the run key {k}: the key "
                             f"fields {fields} do not tell them apart; gate them separately "
                             "or refresh the baseline with --write-baseline")
        out[k] = r
    return out


def comparable_config(run: Run) -> dict[str, str]:
    return comparable(run.config)


def config_diffs(base: Baseline, current: dict[str, Run]) -> list[str]:
    """``key: config.key baseline -> current`` for every run the baseline also has, over
    the keys the baseline recorded: a key added since (a new option at its default) is not
    a difference; one the baseline has and the run lacks is (``(not in this run)``)."""
    out = []
    for k, r in current.items():
        if k not in base.configs:
            continue
        old, new = base.configs[k], comparable_config(r)
        for ck in sorted(old):
            if old[ck] != new.get(ck):
                out.append(f"{k}: {ck} {old[ck]} -> {new.get(ck, '(not in this run)')}")
    return out


def take_baseline(runs: list[Run], spec: dict[str, MetricSpec],
                  require_all: bool = False) -> Baseline:
    """A baseline from finished runs under ``spec``; values only for the metrics a run has
    (quality.* only where present). ``require_all``: a spec metric no run has is an error
    (a name typed on the command line)."""
    if failed := [r for r in runs if r.metrics is None]:
        raise ValueError("cannot take a baseline from runs that did not finish: " + "; ".join(
            f"{r.path} ({r.status}): {one_line(r.failure)}" for r in failed))
    if partial := [r for r in runs if r.repeats and r.failure]:
        # A group of repeats short of some (interrupted, killed, never started): its
        # medians and intervals are of fewer runs than it was taken for (issue #55).
        raise ValueError("cannot take a baseline from a partial group of repeats: " + "; ".join(
            f"{r.path}: {one_line(r.failure)}" for r in partial) + "; run the missing "
            "repeats (rerun the sweep into its folder) first")
    fields = variant_keys(runs)
    by_key = keyed(runs, fields)
    values: dict[str, dict[str, float]] = {}
    for k, r in by_key.items():
        m = r.metrics or {}
        values[k] = {name: m[name] for name in spec
                     if (x := number(m.get(name))) is not None and math.isfinite(x)}
    if require_all and (absent := [m for m in spec if not any(m in v for v in values.values())]):
        raise ValueError(f"no run has {', '.join(absent)}")
    shas = sorted({str((r.metrics or {}).get("run.git_sha")) for r in runs})
    repeats = {k: {name: [v for _, v in sorted(per_repeat(r, name).items())]
                   for name in values[k]} for k, r in by_key.items() if r.repeats}
    return Baseline(fields, dict(spec), values,
                    {k: comparable_config(r) for k, r in by_key.items()},
                    {"git_sha": shas, "runs": {k: r.path.name for k, r in by_key.items()}},
                    repeats)
