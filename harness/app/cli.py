"""What ``python -m harness`` does (harness/__main__.py holds only Hydra's decorated entry
point, which finds conf/ relative to its own file): jobs around :func:`harness.runner.run`.

Every run folder ends complete (metrics.json) or marked: ``FAILED`` (the error),
``INTERRUPTED`` (Ctrl-C or SIGTERM, with what was done); with ``logger=wandb`` a finished
run is then logged to W&B, and ``WANDB_FAILED`` joins the results if that fails. In a
multirun each job runs in a process of its own (harness/app/supervisor.py), so a job that
fails, or whose process is killed, never stops the sweep (it is marked ``FAILED``). A run
exits with (the full list, and what each marker holds: docs/errors.md):

- 0: the run finished (and was logged, if a logger was chosen);
- 1: the run crashed (a bug or an environment problem; the traceback is printed);
- 2: a configuration or capacity error, or a results folder that holds another run (the
  message says what to change);
- 3: the run finished and its results are on disk, but logging to W&B failed;
- 4: the run finished but its results could not be written (the summary is printed, and
  the message names the file and the error);
- 130 / 143: interrupted by SIGINT (Ctrl-C) / SIGTERM.

A sweep (``-m``) runs every job, then prints one summary block (how many finished, failed
and never started, with the failed jobs' folders) and exits 0 when every job finished, 1
when one did not (failed, interrupted, killed, never started: harness/app/supervisor.py's
``summarize_sweep``), 3 when all finished but logging one to W&B failed; 2 for a
configuration error before any job starts (every job's config is checked first), 130 / 143
when it was interrupted (jobs not started yet are listed by ``python -m harness.report
<sweep>``), 1 when its launcher failed. Rerun into the same ``hydra.sweep.dir``, a sweep
whose process is gone resumes: its finished jobs are kept, the others run (docs/errors.md).
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.checkout_path import unshadow

unshadow()  # before anything imports transformers (harness/checkout_path.py)

try:  # Ctrl-C while the imports run (seconds: Hydra, torch): one line, exit 130
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import DictConfig, OmegaConf, open_dict

    from harness.config import register_configs

    register_configs()

    def _find_our_plugins() -> None:
        # Hydra loads plugins (our sweeper) only from the hydra_plugins namespace, which
        # an editable install does not list from another working directory.
        import hydra_plugins

        ours = str(Path(__file__).resolve().parents[2] / "hydra_plugins")
        if Path(ours).is_dir() and ours not in list(hydra_plugins.__path__):
            hydra_plugins.__path__.append(ours)

    _find_our_plugins()
except KeyboardInterrupt:
    print("\nkvbench: stopped by SIGINT (Ctrl-C) while starting; nothing was run",
          file=sys.stderr)
    sys.exit(130)

if TYPE_CHECKING:
    from harness.app.supervisor import Interrupted
    from harness.results import ResultsWriteError
    from harness.runner import RunResult

EXIT_CRASH, EXIT_USER, EXIT_WANDB, EXIT_WRITE = 1, 2, 3, 4
STOPPED = (130, 143)  # the exit codes of a run or sweep stopped by SIGINT / SIGTERM


def main(cfg: DictConfig) -> None:
    """The job Hydra runs (``harness.__main__.main`` is its decorated wrapper): one run,
    or in a multirun one job under its supervisor."""
    from harness.app.supervisor import run_supervised

    hc = HydraConfig.get()
    out = Path(hc.runtime.output_dir)
    with open_dict(cfg):
        cfg.out_dir = str(out)
    if hc.mode != RunMode.MULTIRUN:
        if code := run_job(cfg, out, multirun=False):
            sys.exit(code)
        return
    end = run_supervised(lambda: run_job(cfg, out, multirun=True), out)
    # Asked to stop, the process that launches the jobs (the basic launcher's) stops the
    # sweep; a launcher's worker (joblib) leaves that to its launcher.
    if end.stop is not None and _launches(Path(hc.sweep.dir)):
        print(f"kvbench: sweep stopped by {end.stop} in job {out.name}; the jobs not started "
              f"are listed by: python -m harness.report {out.parent}", file=sys.stderr)
        sys.exit(end.stop.exit_code)


def _launches(sweep: Path) -> bool:
    from harness.results import SWEEP_CLAIM, read_claim

    return (read_claim(sweep, SWEEP_CLAIM) or {}).get("pid") == os.getpid()


def run_job(cfg: DictConfig, out: Path, multirun: bool) -> int:
    """One job into ``out``: a run, or with ``repeats=N`` its N repeats (harness/repeats.py).
    Returns the exit code (module docstring)."""
    if cfg.get("repeat_of") is not None:  # one repeat of a sweep's configuration
        from harness.errors import UserError
        from harness.repeats import repeat_index

        if not multirun or repeat_index(out) is None:
            # Set by hand, it marked the run's parent (results/) as a group of repeats
            # (issue #55): only kvbench's sweeper sets it, on a job folder repeat-<k>.
            e = UserError("repeat_of (and repeat) are set by kvbench's sweeper for the jobs "
                          "of a sweep with repeats=N; drop them, and give repeats=N")
            print(f"\nkvbench: run failed: {e}\n  ({_mark_failed(out, e)})", file=sys.stderr)
            return EXIT_USER
        return _sweep_repeat(cfg, out, multirun)
    if int(cfg.get("repeats", 1)) > 1:
        return _repeats(cfg, out, multirun)
    return _run_one(cfg, out, multirun)


def _repeats(cfg: DictConfig, out: Path, multirun: bool) -> int:
    """``repeats=N`` in one folder: ``out`` becomes the group of ``repeat-0/`` ..
    ``repeat-<N-1>/``, run one after the other, and their summary ``repeats.json``. A
    repeat that fails or is interrupted ends the group; what finished is summarized."""
    import copy

    from harness.config import run_config
    from harness.errors import UserError
    from harness.repeats import mark_group, repeat_dir

    try:
        run_config(cfg)  # a refused config fails here, as a run, before any repeat exists
    except UserError as e:
        print(f"\nkvbench: run failed: {e}\n  ({_mark_failed(out, e)})", file=sys.stderr)
        return EXIT_USER
    n = int(cfg.repeats)
    mark_group(out, n)
    code = 0
    for k in range(n):
        sub = repeat_dir(out, k)
        one = copy.deepcopy(cfg)
        with open_dict(one):
            one.repeat, one.out_dir = k, str(sub)
        print(f"kvbench: repeat {k + 1} of {n} into {sub}", file=sys.stderr)
        code = _run_one(one, sub, multirun, quiet=True)
        if code not in (0, EXIT_WANDB):
            break
    _summarize_group(out, show=True)
    return code


def _sweep_repeat(cfg: DictConfig, out: Path, multirun: bool) -> int:
    """Repeat ``cfg.repeat`` of the sweep's configuration ``cfg.repeat_of``: a run into
    ``out`` (``<c>-<backend>-<workload>/repeat-<k>``), then its group's summary."""
    from harness.repeats import mark_group

    mark_group(out.parent, int(cfg.repeats))
    code = _run_one(cfg, out, multirun)
    _summarize_group(out.parent, show=False)
    return code


def _summarize_group(group: Path, show: bool) -> None:
    from harness.repeats import SUMMARY, write_summary
    from harness.runner import print_summary

    try:
        s = write_summary(group)
    except OSError as e:
        print(f"kvbench: could not write {group / SUMMARY}: {e.strerror or e}", file=sys.stderr)
        return
    if s is None:
        return
    if s.varied:
        print(f"kvbench: warning: the repeats disagree on {', '.join(s.varied)}: with every "
              "arrival at t=0 a run is deterministic and this is a bug to report; with "
              "arrivals on the clock (workload.rate) batching follows the machine's speed",
              file=sys.stderr)
    if show:
        print(f"\n  {len(s.repeats)} repeat(s): medians, [95% interval] of speed metrics")
        print_summary(s.metrics, group)


def _run_one(cfg: DictConfig, out: Path, multirun: bool, quiet: bool = False) -> int:
    """One run into ``out``: claim the folder, run, write results or a marker, log to W&B.
    Returns the exit code (module docstring) and prints what went wrong; once the results
    are complete, a signal simply stops it (nothing more needs a marker). ``quiet``: no
    summary table (a repeat's; the group's is printed)."""
    from harness import progress
    from harness.app.hydra_callbacks import refuse_schema_choices
    from harness.app.supervisor import as_interrupted, hold_until_exit
    from harness.errors import UserError
    from harness.results import FolderTaken, ResultsWriteError, claim_folder, write_config
    from harness.runner import print_summary, run

    try:
        refuse_schema_choices(HydraConfig.get().runtime.choices)
        claim_folder(out)  # done already by the FolderGuard callback for a single run
    except UserError as e:  # never mark a folder that is not ours
        print(f"kvbench: {e}", file=sys.stderr)
        return EXIT_USER
    except OSError as e:
        print(f"kvbench: cannot claim the results folder {out}: {e.strerror or e}",
              file=sys.stderr)
        return EXIT_USER
    progress.configure(out.name if multirun else "")
    try:
        try:
            write_config(out, OmegaConf.to_yaml(cfg, resolve=True))
        except OSError as e:
            raise ResultsWriteError(out / "config.yaml", e, None, []) from e
        result = run(cfg)
    except KeyboardInterrupt as e:
        hold_until_exit(e)  # the run is freed by the process's exit, not object by object
        return _interrupted(out, as_interrupted(e))
    except ResultsWriteError as e:
        return _write_failed(out, e)
    except FolderTaken as e:
        print(f"\nkvbench: {e}", file=sys.stderr)
        return EXIT_USER
    except Exception as e:  # recorded in the run's folder, then reported
        user_error = isinstance(e, ValueError)  # UserError, and library ValueErrors
        if not user_error:
            traceback.print_exc()
        print(f"\nkvbench: run failed: {e}\n  ({_mark_failed(out, e)})", file=sys.stderr)
        return EXIT_USER if user_error else EXIT_CRASH
    if not quiet:
        print_summary(result.metrics, result.out_dir)
    return _log_to_wandb(cfg, result, out, multirun)


def _mark_failed(out: Path, error: BaseException | str) -> str:
    from harness.results import write_failure

    try:
        return f"recorded in {write_failure(out, error)}"
    except OSError as e:
        return f"even the FAILED marker could not be written into {out}: {e.strerror or e}"


def _interrupted(out: Path, e: Interrupted) -> int:
    from harness import progress
    from harness.app.supervisor import parent_died
    from harness.results import record_interrupted

    done = progress.describe(snap.snapshot() if (snap := progress.current()) else None)
    if parent_died():  # PR_SET_PDEATHSIG: the process that launched this job is gone
        done += "; the process that launched this job had died"
    text = (f"interrupted by {e}: {done}\nits results are incomplete (metrics.json, "
            "written last, is not there); rerun it into a new folder")
    print(f"\nkvbench: interrupted by {e}: {done}; {record_interrupted(out, text)}",
          file=sys.stderr)
    return e.exit_code


def _write_failed(out: Path, e: ResultsWriteError) -> int:
    from harness.runner import print_summary

    if e.metrics is not None:  # the run finished: its summary is not lost with the files
        print_summary(e.metrics, None)
    written = f" ({', '.join(e.written)} had been written)" if e.written else ""
    print(f"\nkvbench: the run's results could not be written: {e}{written}\n"
          f"  {_mark_failed(out, f'ResultsWriteError: {e}{written}')}", file=sys.stderr)
    return EXIT_WRITE


def _log_to_wandb(cfg: DictConfig, result: RunResult, out: Path, multirun: bool) -> int:
    if cfg.logger.name != "wandb":
        return 0
    from harness.sinks import log_run_to_wandb, record_wandb_failure

    try:
        name, group = wandb_names(cfg, multirun)
        log_run_to_wandb(cfg, result, cfg.logger, default_group=group, name=name)
    except Exception as e:  # local results are complete: report, record, exit 3
        print(f"\n{record_wandb_failure(out, e)}", file=sys.stderr)
        return EXIT_WANDB
    return 0


def wandb_names(cfg: DictConfig, multirun: bool) -> tuple[str, str | None]:
    """The W&B run's name and, in a sweep, its group (harness/sinks/names.py): the swept
    keys are read from the sweep's multirun.yaml."""
    from harness.reporting.runs import sweep_jobs
    from harness.sinks.names import run_name, sweep_group, swept_keys, variant

    hc = HydraConfig.get()
    choices = {str(k): v for k, v in hc.runtime.choices.items()}
    tree = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(tree, dict)
    config = {str(k): v for k, v in tree.items()}
    swept, group = None, None
    if multirun:
        folder = Path(hc.sweep.dir)
        swept = swept_keys(sweep_jobs(folder / "multirun.yaml") or [])
        group = sweep_group(folder, config, choices, swept)
    return run_name(config, variant(list(hc.overrides.task), choices, swept)), group


def _is_config_error(e: BaseException) -> bool:
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    # Hydra's composition and override errors, OmegaConf's type checks, the CLI's own
    # ValueErrors ("Only one of --run, --multirun..."): all the user's to fix.
    return isinstance(e, HydraException | OmegaConfBaseException | ValueError)


def _end_sweep(why: str, interrupted: bool) -> None:
    """The sweep this process launches ends abnormally: stop its running jobs (each writes
    INTERRUPTED) and mark those already gone without a word."""
    import signal

    from harness.app.supervisor import mark_abandoned, stop_jobs, sweep_in_progress

    if (sweep := sweep_in_progress()) is None:
        return
    stop_jobs(sweep, signal.SIGTERM)  # a no-op once a stop signal has done it
    if n := mark_abandoned(sweep, why, interrupted):
        print(f"kvbench: {n} job(s) of {sweep} ended with the sweep: marked "
              f"{'INTERRUPTED' if interrupted else 'FAILED'}", file=sys.stderr)


def cli(main: Callable[[], None]) -> None:
    """``python -m harness``: Hydra's ``main`` (harness/__main__.py), with kvbench's exit
    codes and signals."""
    from harness.app.hydra_callbacks import hide_schemas
    from harness.app.supervisor import (
        as_interrupted,
        exit_promptly,
        install_handlers,
        mark_unstarted,
    )

    install_handlers(top_level=True)
    hide_schemas()
    full_error = bool(os.environ.get("HYDRA_FULL_ERROR"))
    # Hydra prints its errors and exits 1; asked for full errors it raises them instead,
    # and they are sorted here: configuration errors exit 2, as documented.
    os.environ["HYDRA_FULL_ERROR"] = "1"
    from harness.app.supervisor import sweep_exit_code

    try:
        main()
        if code := sweep_exit_code():  # a sweep where not every job finished
            sys.exit(code)
    except KeyboardInterrupt as e:
        stop = as_interrupted(e)
        _end_sweep(str(stop), interrupted=True)
        print(f"\nkvbench: stopped by {stop}", file=sys.stderr)
        mark_unstarted(stop)  # a run's folder claimed (FolderGuard), the run not started
        exit_promptly(stop.exit_code)
    except SystemExit as e:
        if e.code in STOPPED:  # interrupted: its marker is written, nothing is left to do
            exit_promptly(e.code)
        raise
    except Exception as e:
        _fail(e, full_error)


# Options that moved: an old override names its new key in the error.
MOVED = {"roofline.kv_groups": "cache.kv_groups (it applies to both executors)"}


def _fail(e: Exception, full_error: bool) -> None:
    """Report an error that reached the top (Hydra's, or a launcher's) and exit."""
    from omegaconf.errors import OmegaConfBaseException

    # A launcher that failed (a joblib worker killed outright: TerminatedWorkerError) took
    # its running jobs with it: they are marked, so that no folder is left unexplained.
    dead_worker = type(e).__name__ == "TerminatedWorkerError"
    _end_sweep("a worker process of its launcher was killed (TerminatedWorkerError)"
               if dead_worker else type(e).__name__, interrupted=False)
    if dead_worker and not full_error:
        print(f"kvbench: the sweep stopped: {str(e).splitlines()[0]}\n  (a worker process "
              "of the launcher was killed; every job folder is complete or marked)",
              file=sys.stderr)
        sys.exit(EXIT_CRASH)
    if full_error or not _is_config_error(e):
        traceback.print_exc()
        sys.exit(EXIT_USER if _is_config_error(e) else EXIT_CRASH)
    cause = e.__cause__
    extra = f"\n{cause}" if isinstance(cause, OmegaConfBaseException) else ""
    moved = [f"\n{old} is now {new}" for old, new in MOVED.items() if old in f"{e}{extra}"]
    text = _instead_of_append_hint(f"{e}{extra}", sys.argv[1:])
    print(f"{text}{''.join(moved)}\n\nkvbench: configuration error (python -m harness "
          "--help lists the options)", file=sys.stderr)
    sys.exit(EXIT_USER)


def _instead_of_append_hint(text: str, argv: list[str]) -> str:
    """Hydra's answer to a key its schema lacks (``Could not override 'backend.blocksize'.
    To append to your config use +backend.blocksize=32``) with its hint replaced: kvbench
    refuses such a key (harness.config.refuse_unknown_keys), so say what the option's keys
    are, and the closest, instead (issue #54)."""
    import dataclasses
    import re

    from harness.backends import BACKENDS
    from harness.config import RunConfig, unknown_key_message
    from harness.workloads import WORKLOADS

    found = re.search(r"Could not override '([\w.]+)'\.\n(To append to your config use \+\S+)",
                      text)
    if found is None:
        return text
    *path, key = found.group(1).split(".")
    choice = {"backend": "paged", "workload": "multiturn"}  # conf/config.yaml's defaults
    for a in argv:
        k, sep, v = a.lstrip("~+").partition("=")
        if sep and k in choice and "," not in v:
            choice[k] = v
    cls: Any = RunConfig
    for i, part in enumerate(path):
        if i == 0 and part == "backend" and choice["backend"] in BACKENDS:
            cls = BACKENDS[choice["backend"]].Options
            continue
        if i == 0 and part == "workload" and choice["workload"] in WORKLOADS:
            cls = WORKLOADS[choice["workload"]][0]
            continue
        types = {f.name: f.type for f in dataclasses.fields(cls)} \
            if dataclasses.is_dataclass(cls) else {}
        cls = _field_class(cls, types.get(part))
        if cls is None:
            return text
    if not dataclasses.is_dataclass(cls):
        return text
    group = ".".join(path)
    owner = f"{group}={choice[group]}" if group in choice else group or "the run config"
    known = [f.name for f in dataclasses.fields(cls) if f.name != "name"]
    return text.replace(found.group(2), unknown_key_message(group, owner, key, known))


def _field_class(owner: Any, annotation: Any) -> Any:
    """The dataclass a field's annotation (a string, under ``from __future__ import
    annotations``) names, in the module of ``owner``; None if it names none."""
    if not isinstance(annotation, str):
        return annotation if isinstance(annotation, type) else None
    module = sys.modules.get(getattr(owner, "__module__", ""))
    return getattr(module, annotation, None)

