"""The names a W&B run and its group get (issue #54: ``0-paged-multiturn`` carried neither
the model nor the variant, and ad-hoc sweeps were grouped by a timestamp folder name).

- run name: ``run_name`` when set, else ``<model> / <backend> / <workload>[ / <variant>]``
  (``/ repeat <k>`` for one of ``repeats=N``):
  the model the run served or modelled (``roofline.model`` under executor=roofline), and
  the variant: the ``+variant=`` preset, and in a sweep the swept keys' values of this job
  (``block_size=8``), or in a single run its own overrides beyond those three
  (``max_num_seqs=64``), shortened to the keys' last parts and cut at :data:`MAX_NAME`;
- group (``logger.group`` unset, in a sweep): what the sweep is, the experiment
  (``+experiment=memory_waste``) or ``sweep <swept keys>``, then the model and the sweep's
  start (``sweep backend.block_size / tiny / 20261129-125918``); a sweep folder the user
  named (``hydra.sweep.dir=results/sweeps/nightly``) keeps its name.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

MAX_NAME = 128  # W&B shows about this much of a name; longer ones are cut with "..."
# conf/config.yaml's sweep folder: ${now:%Y%m%d-%H%M%S-%f}
STAMP = re.compile(r"^(\d{8}-\d{6})(-\d+)?$")
# Overrides that are in the name already, or never describe what ran.
NAMED = ("backend", "workload", "model", "variant", "experiment", "executor", "roofline.model")
SKIPPED = ("logger", "hydra", "out_dir", "results_dir", "progress", "run_name", "repeat",
           "repeat_of", "repeats", "device", "cpu_threads")


def model_name(cfg: Mapping[str, Any]) -> str:
    """The model a run served (``model.path``'s stem, else ``model.source``) or, under
    executor=roofline, modelled (``roofline.model``, a config.json path by its folder)."""
    if cfg.get("executor") == "roofline":
        m = str((cfg.get("roofline") or {}).get("model") or "?")
        p = Path(m)
        return p.parent.name if p.name == "config.json" else p.name
    model = cfg.get("model") or {}
    path = model.get("path")
    return Path(str(path)).stem if path else str(model.get("source") or "?")


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def _short(override: str) -> str:
    """``backend.block_size=8`` -> ``block_size=8``."""
    key, _, value = override.partition("=")
    return f"{key.lstrip('+~').rsplit('.', 1)[-1]}={value}"


def _kept(key: str) -> bool:
    return key not in NAMED and not key.startswith(tuple(f"{s}." for s in SKIPPED)) \
        and key not in SKIPPED


def swept_keys(jobs: Iterable[list[str]]) -> list[str]:
    """The override keys whose values differ between a sweep's jobs, in first-seen order."""
    values: dict[str, set[str]] = {}
    jobs = list(jobs)
    for job in jobs:
        for o in job:
            values.setdefault(_key(o), set()).add(o.split("=", 1)[-1])
    present = {k for k in values if all(any(_key(o) == k for o in j) for j in jobs)}
    return [k for k, v in values.items() if len(v) > 1 or k not in present]


def variant(overrides: list[str], choices: Mapping[str, Any], swept: list[str] | None) -> str:
    """The run's variant: its ``+variant=`` preset, then (``swept``: a sweep's varying
    keys) those keys' values in this job, or (a single run) its other overrides."""
    parts = [str(choices["variant"])] if choices.get("variant") else []
    for o in overrides:
        k = _key(o)
        if "=" in o and _kept(k) and (swept is None or k in swept):
            parts.append(_short(o))
    return ",".join(parts)


def run_name(cfg: Mapping[str, Any], var: str = "") -> str:
    """``run_name``, else ``<model> / <backend> / <workload>[ / <variant>]``."""
    if cfg.get("run_name"):
        return str(cfg["run_name"])
    backend = (cfg.get("backend") or {}).get("name", "?")
    workload = (cfg.get("workload") or {}).get("name", "?")
    repeat = f"repeat {cfg.get('repeat', 0)}" if int(cfg.get("repeats") or 1) > 1 else ""
    name = " / ".join(x for x in (model_name(cfg), str(backend), str(workload), var, repeat)
                      if x)
    return name if len(name) <= MAX_NAME else name[:MAX_NAME - 3] + "..."


def sweep_group(folder: Path, cfg: Mapping[str, Any], choices: Mapping[str, Any],
                swept: list[str]) -> str:
    """The W&B group of a sweep's runs (module docstring)."""
    m = STAMP.match(folder.name)
    if m is None:  # the user named the sweep's folder: that is its name
        return folder.name
    what = f"experiment {choices['experiment']}" if choices.get("experiment") else \
        "sweep " + (",".join(swept) if swept else "(one job)")
    return " / ".join((what, model_name(cfg), m.group(1)))[:MAX_NAME]
