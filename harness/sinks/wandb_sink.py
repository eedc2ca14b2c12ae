"""One Weights & Biases run per harness run, logged from a finished :class:`RunResult`.

Called only after the run's local folder is complete (metrics.json written), so a W&B
failure can never lose a run: the caller reports it and writes ``WANDB_FAILED`` (see
:func:`record_wandb_failure`). What the W&B run holds:

- config: the composed run config, flattened to dotted keys (``backend.name``, ...);
- its name (``run_name``, else ``<model> / <backend> / <workload>[ / <variant>]``) and group
  (``logger.group``, else in a sweep what the sweep is: harness/sinks/names.py);
- tags ``backend:<name>``, ``workload:``, ``model:``, ``kernel:``, ``device:`` plus
  ``logger.tags``; the job type;
- history: one row per engine step (StepRow's columns) on the ``step`` axis;
- ``requests_table``: the per-request rows (requests.csv) as a wandb.Table; ``kv_bytes``:
  a native line chart of reserved vs used KV bytes over steps (its data: ``kv_bytes_table``);
- summary: metrics.json, key for key (step columns are kept out of it).

:func:`log_report_to_wandb` logs a report (``python -m harness.report --wandb``): its
figures as images, its comparison as a table and report.md as a file, in a run of job type
``report`` in the sweep's group.
"""

from __future__ import annotations

import os
from dataclasses import asdict, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from harness.metrics.collector import StepRow
from harness.results import atomic_write
from harness.sinks.names import run_name

if TYPE_CHECKING:
    from harness.runner import RunResult

FAILED_FILE = "WANDB_FAILED"
TAG_KEYS = ("backend", "workload", "model", "kernel", "device")
MAX_TAG_LEN = 64  # W&B rejects longer tags
STEP_COLUMNS = tuple(f.name for f in fields(StepRow))


# W&B's own wandb.init timeout is 90 s: a sweep without a network would wait that long per
# job before failing. 30 s is ample for a reachable server; WANDB_INIT_TIMEOUT overrides.
DEFAULT_INIT_TIMEOUT_S = 30.0


class WandbLogError(RuntimeError):
    """Logging to W&B failed; ``run_dir`` is the W&B run's local folder if one was made,
    ``mode`` the W&B mode that was tried (the retry hint depends on it)."""

    def __init__(self, message: str, run_dir: Path | None, mode: str | None = None) -> None:
        super().__init__(message)
        self.run_dir = run_dir
        self.mode = mode


def init_timeout() -> float:
    """Seconds wandb.init may wait for the server (online mode)."""
    try:
        return float(os.environ.get("WANDB_INIT_TIMEOUT", DEFAULT_INIT_TIMEOUT_S))
    except ValueError:
        return DEFAULT_INIT_TIMEOUT_S


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}, "c": [1, 2]}`` -> ``{"a.b": 1, "c": [1, 2]}`` (lists kept whole)."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def run_tags(cfg: DictConfig, metrics: dict[str, Any], extra: list[str]) -> list[str]:
    """``backend:paged``, ``workload:...``, ``model:...``, ``kernel:...``, ``device:...``,
    then ``extra``. The model tag is the config's short name (``run.model`` is a sentence)."""
    model = cfg.model.get("path")
    values = {k: metrics.get(f"run.{k}") for k in TAG_KEYS}
    values["model"] = Path(model).stem if model else cfg.model.get("source")
    tags = [f"{k}:{v}" for k, v in values.items() if v]
    return [t[:MAX_TAG_LEN] for t in [*tags, *extra]]


def _writable_dir(path: Path) -> Path:
    """Create ``path``; fail if it cannot hold files. W&B itself would fall back to the
    system temp folder with only a warning, leaving the offline run where nobody looks."""
    path.mkdir(parents=True, exist_ok=True)
    if not os.access(path, os.W_OK | os.X_OK):
        raise PermissionError(f"cannot write W&B files into {path}")
    return path


def log_run_to_wandb(cfg: DictConfig, result: RunResult, logger_cfg: DictConfig,
                     default_group: str | None = None, name: str | None = None) -> str | None:
    """Log one finished run to W&B; return the W&B run's local folder (None: disabled).

    ``logger_cfg`` is a WandbLoggerSpec node; its ``mode`` is passed to ``wandb.init``
    explicitly, so it wins over a WANDB_MODE in the environment. ``default_group`` names
    the group when ``logger_cfg.group`` is unset (the CLI passes the sweep's:
    harness.sinks.names.sweep_group). ``name``: the run's name when ``run_name`` is unset
    (the CLI's carries the variant), else ``<model> / <backend> / <workload>``
    (harness.sinks.names.run_name). Raises :class:`WandbLogError` on any failure, after
    closing the W&B run.
    """
    mode = getattr(logger_cfg.mode, "value", logger_cfg.mode)
    if mode == "disabled":
        return None
    run_dir: Path | None = None
    timeout = init_timeout()
    if mode == "online":  # say so before the wait, not after it
        print(f"  W&B online: connecting (up to {timeout:.0f} s without a network; "
              "logger.mode=offline needs none, `wandb sync` uploads later)", flush=True)
    try:
        import wandb

        base = logger_cfg.dir or result.out_dir or cfg.get("out_dir")
        tree = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
        assert isinstance(tree, dict)
        config = flatten({str(k): v for k, v in tree.items()})
        with wandb.init(
            mode=mode, project=logger_cfg.project, entity=logger_cfg.entity,
            group=logger_cfg.group or default_group, job_type=logger_cfg.job_type,
            name=cfg.get("run_name") or name or run_name({str(k): v for k, v in tree.items()}),
            tags=run_tags(cfg, result.metrics, list(logger_cfg.tags)), config=config,
            dir=str(_writable_dir(Path(base))) if base else None,
            # quiet: no sparklines per run (a sweep prints one block per job); the line
            # below says where the run went.
            settings=wandb.Settings(quiet=True, init_timeout=timeout),
        ) as run:
            run_dir = Path(run.settings.sync_dir)
            url = run.url if mode == "online" else None
            _log_history(run, result)
            run.summary.update(result.metrics)
    except Exception as e:  # wandb raises many types (UsageError, CommError, OSError...)
        raise WandbLogError(f"{type(e).__name__}: {e}", run_dir, mode) from e
    print(f"  W&B run: {url}" if url else
          f"  W&B run (offline): {run_dir}\n  upload it with: wandb sync {run_dir}")
    return str(run_dir)


def _log_history(run: Any, result: RunResult) -> None:
    import wandb

    run.define_metric("step", summary="none")
    run.define_metric("*", step_metric="step")
    # The summary is metrics.json: keep each step column's last value out of it (not "*":
    # the chart reads its table from the summary).
    for col in STEP_COLUMNS:
        if col != "step":
            run.define_metric(col, step_metric="step", summary="none")
    rows = [asdict(r) for r in result.steps]
    steps = [r["step"] for r in rows]
    extra: dict[str, Any] = {"kv_bytes": wandb.plot.line_series(
        xs=steps, ys=[[r["reserved_bytes"] for r in rows], [r["used_bytes"] for r in rows]],
        keys=["reserved", "used"], title="KV cache bytes: reserved vs used", xname="step")}
    if result.requests:
        # Every key any row has (a task workload's scores only on the requests that ran):
        # a row without one gets None there, in its column.
        keys = list(dict.fromkeys(k for r in result.requests for k in r))
        cols: list[str | int] = list(keys)
        extra["requests_table"] = wandb.Table(
            columns=cols, data=[[r.get(k) for k in keys] for r in result.requests])
    # The table and chart ride on the last step's row: one history row per engine step.
    for i, row in enumerate(rows):
        run.log({**row, **extra} if i == len(rows) - 1 else row)
    if not rows:
        run.log(extra)


def record_wandb_failure(out: Path, error: BaseException) -> str:
    """Write ``WANDB_FAILED`` into the run folder; return the message for the terminal."""
    run_dir = getattr(error, "run_dir", None)
    if run_dir is not None and Path(run_dir).is_dir():
        retry = f"W&B's files (complete or not) are in {run_dir}: `wandb sync {run_dir}`"
    elif getattr(error, "mode", None) == "online":
        retry = "fix the cause and run again (or use logger.mode=offline, no network needed)"
    else:  # offline already: the network is not the cause
        retry = "fix the cause and run again"
    msg = (f"kvbench: the run finished, but logging it to W&B failed: {error}\n"
           f"  local results are safe in {out}\n  to retry: {retry}")
    try:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write(out / FAILED_FILE, msg.removeprefix("kvbench: ") + "\n")
    except OSError as e:  # the terminal still gets the whole story
        msg += f"\n  ({FAILED_FILE} could not be written into {out}: {e.strerror or e})"
    return msg


def log_report_to_wandb(out: Path, plots: list[Path], comparison: Any, markdown: Path,
                        mode: str = "offline", project: str = "kvbench",
                        entity: str | None = None, group: str | None = None,
                        name: str | None = None) -> str | None:
    """Log a report's files to one W&B run (job type ``report``): each figure as an image
    (``report/<file stem>``), ``comparison`` (a DataFrame: comparison.csv's rows) as the
    table ``report/comparison``, report.md as a file; the W&B files go under ``out``.
    Returns the W&B run's local folder (None: ``mode=disabled``); raises
    :class:`WandbLogError`."""
    if mode == "disabled":
        return None
    run_dir: Path | None = None
    try:
        import wandb

        wmode: Any = mode  # offline | online (checked by argparse)
        with wandb.init(mode=wmode, project=project, entity=entity, group=group,
                        job_type="report", name=name or f"report: {group or out.parent.name}",
                        dir=str(_writable_dir(out)),
                        settings=wandb.Settings(quiet=True, init_timeout=init_timeout()),
                        ) as run:
            run_dir = Path(run.settings.sync_dir)
            url = run.url if mode == "online" else None
            logged: dict[str, Any] = {f"report/{p.stem}": wandb.Image(str(p))
                                      for p in plots if p.suffix == ".png"}
            if comparison is not None and len(comparison):
                frame = comparison.astype(object).where(comparison.notna(), None)
                logged["report/comparison"] = wandb.Table(dataframe=frame)
            run.log(logged)
            run.save(str(markdown), base_path=str(markdown.parent), policy="now")
    except Exception as e:  # wandb raises many types (UsageError, CommError, OSError...)
        raise WandbLogError(f"{type(e).__name__}: {e}", run_dir, mode) from e
    print(f"  W&B report run: {url}" if url else
          f"  W&B report run (offline): {run_dir}\n  upload it with: wandb sync {run_dir}")
    return str(run_dir)
