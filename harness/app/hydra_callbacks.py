"""Hydra hooks of the CLI: claim a run's or sweep's folder before Hydra writes into it, and
keep the internal ``*_schema`` configs out of sight.

Hydra creates the output folder and writes ``.hydra/`` and its log into it before the task
function runs, so a check there would come after another run's folder had been written
into. :class:`FolderGuard` (``hydra.callbacks`` in conf/config.yaml) claims the folder
first, in ``on_run_start`` / ``on_multirun_start``. Hydra turns a callback's exceptions
into warnings, so a refusal prints its message and exits 2 itself.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from harness.app.supervisor import coordinate
from harness.errors import UserError
from harness.results import claim_folder, claim_sweep

# harness/config.py registers the schemas as <group>/<name>_schema, or as schema/<group>/<name>
SCHEMA_SUFFIX, SCHEMA_GROUP = "_schema", "schema"


def _exit(e: Exception) -> None:
    if isinstance(e, OSError):  # a folder that cannot be created: the user's to change
        e = UserError(f"cannot claim the results folder {e.filename or ''}: "
                      f"{e.strerror or e}; choose another (results_dir=..., hydra.run.dir=... "
                      "or hydra.sweep.dir=...)")
    print(f"kvbench: {e}", file=sys.stderr)
    sys.exit(2)


def refuse_schema_choices(choices: Mapping[str, Any]) -> None:
    """UserError for a group set to an internal schema (``backend=paged_schema``)."""
    for group, option in choices.items():
        if str(option).endswith(SCHEMA_SUFFIX) and not str(group).startswith("hydra/"):
            raise UserError(f"{group}={option} is an internal schema, not an option; use "
                            f"{group}={str(option).removesuffix(SCHEMA_SUFFIX)} (python -m "
                            "harness --help lists the options)")


def schema_overrides(overrides: Iterable[str]) -> dict[str, str]:
    """Group choices among sweep overrides (``backend=paged,paged_schema``) that name a
    schema, as {group: option}. Dotted keys set values, not choices: skipped."""
    found = {}
    for o in overrides:
        key, sep, values = o.partition("=")
        key = key.lstrip("+~")
        if not sep or "." in key or key.startswith("hydra/"):
            continue
        for v in values.split(","):
            if v.strip().endswith(SCHEMA_SUFFIX):
                found[key] = v.strip()
    return found


class FolderGuard(Callback):
    """Claims ``hydra.run.dir`` (a run) or ``hydra.sweep.dir`` (a sweep) for this process,
    refusing one that holds another run; refuses schema choices before anything starts."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        HydraConfig.instance().set_config(config)  # the dir may use ${hydra:...}
        try:
            refuse_schema_choices(config.hydra.runtime.choices)
            claim_folder(Path(str(config.hydra.run.dir)).absolute(), empty=True)
        except (UserError, OSError) as e:
            _exit(e)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        HydraConfig.instance().set_config(config)
        params = config.hydra.sweeper.get("params") or {}
        overrides = [*(f"{k}={v}" for k, v in params.items()), *config.hydra.overrides.task]
        try:
            if bad := schema_overrides(overrides):
                refuse_schema_choices(bad)
            check_every_job(config, overrides)
            sweep = Path(str(config.hydra.sweep.dir)).absolute()
            claim_sweep(sweep, earlier=lambda folder: earlier_sweep(folder, overrides))
        except (UserError, OSError) as e:
            _exit(e)
        coordinate(sweep)  # a stop signal reaches the running jobs before the launcher's


def check_every_job(config: DictConfig, overrides: list[str]) -> None:
    """Compose and check every job's config before any job starts (docs/errors.md): a
    value the schema allows but a check refuses (``workload.rate=1,-1``) fails the sweep
    with exit 2 and a message naming the job, instead of failing its job after the others
    ran. The jobs are split as the basic sweeper splits them (a later override of a key
    wins over the sweeper's params)."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import open_dict

    from harness.config import run_config

    parsed = OverridesParser.create().parse_overrides(overrides)
    jobs = sweep_jobs(overrides)
    if len(jobs) < 2:
        return  # one job: it is checked where it runs, as a single run is
    loader = GlobalHydra.instance().config_loader()
    swept = {o.key_or_group for o in parsed if o.is_sweep_override()}
    for i, job in enumerate(jobs):
        cfg = loader.load_sweep_config(config, list(job))
        with open_dict(cfg):
            del cfg["hydra"]
        try:
            run_config(cfg)
        except UserError as e:
            which = " ".join(o for o in job if o.split("=", 1)[0].lstrip("+~") in swept)
            raise UserError(f"sweep job #{i} ({which or ' '.join(job)}): {e}; no job was "
                            "started") from None


def sweep_jobs(overrides: list[str]) -> list[list[str]]:
    """The jobs of a sweep given ``overrides`` (the sweeper's params, then the command
    line's), as the basic sweeper splits them, before repeats are interleaved."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    return [list(job) for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


SWEEPER = "RepeatSweeper"  # hydra_plugins/kvbench_sweeper: what a kvbench sweep ran under


def earlier_sweep(folder: Path, overrides: list[str]) -> str | None:
    """Why the earlier sweep in ``folder`` (its claim's process gone) cannot be resumed by
    a sweep of ``overrides``: None when it is the same sweep (its multirun.yaml, written by
    kvbench's sweeper, has the same jobs) or never got to write one (and ran no job)."""
    from omegaconf import OmegaConf

    from harness.app.supervisor import job_folders

    multirun = folder / "multirun.yaml"
    if not multirun.is_file():
        return None if not job_folders(folder) else "with jobs but no multirun.yaml"
    try:
        saved = OmegaConf.load(multirun)
        target = str(OmegaConf.select(saved, "hydra.sweeper._target_", default=""))
        params = OmegaConf.select(saved, "hydra.sweeper.params", default=None) or {}
        task = OmegaConf.select(saved, "hydra.overrides.task", default=None) or []
        before = [*(f"{k}={v}" for k, v in params.items()), *map(str, task)]
        if not target.endswith(SWEEPER):
            return f"not run by kvbench's sweeper ({target or 'none'})"
        if sweep_jobs(before) != sweep_jobs(overrides):
            return f"of other jobs ({' '.join(before) or 'no overrides'})"
    except Exception as e:  # what Hydra or OmegaConf refuse to read: not resumable
        return f"whose multirun.yaml cannot be read ({type(e).__name__}: {e})"
    return None


def hide_schemas() -> None:
    """Leave the internal schemas out of Hydra's option lists (--help, "Available options"
    in errors, shell completion, glob sweeps): ``<name>_schema`` options inside a group,
    and a top-level ``schema`` group (``schema/backend/paged``). They stay loadable, as
    the YAMLs' defaults."""
    from hydra._internal.config_repository import ConfigRepository

    if getattr(ConfigRepository.get_group_options, "_kvbench", False):
        return
    original = ConfigRepository.get_group_options

    def get_group_options(self: ConfigRepository, *args: Any, **kwargs: Any) -> list[str]:
        group = args[0] if args else kwargs.get("group_name", "")
        return [o for o in original(self, *args, **kwargs)
                if not o.endswith(SCHEMA_SUFFIX) and not (group == "" and o == SCHEMA_GROUP)]

    get_group_options._kvbench = True  # type: ignore[attr-defined]
    ConfigRepository.get_group_options = get_group_options  # type: ignore[method-assign]
