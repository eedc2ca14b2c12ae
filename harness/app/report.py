"""``python -m harness.report``: compare runs side by side, as tables and plots.

    python -m harness.report results/sweeps/memory_waste-20261129-125918
    python -m harness.report RUN_A RUN_B --baseline-backend contiguous --out /tmp/report

Finds every run at or below the folders given and writes into ``--out`` (default
``<first folder>/report/``):

- ``report.md``: one table per workload of the key metrics per backend (and variant:
  the config keys that differ between runs, such as backend.reserve, workload.n or
  cache.kv_budget), each value with its ratio to the baseline backend's run on the same
  workload with the same config outside ``backend.*``; a run with no such baseline run is
  shown without ratios and named, with what differs, never compared with an unlike run.
  A parameter sweep of one backend is compared with its reference run (the swept keys at
  their defaults, else their first values: harness/reporting/table.py), not each run with
  itself; speeds of single runs (no ``repeats``) carry a notice on their noise;
- ``comparison.csv``: the same rows, every ratio in a ``<metric>.vs_baseline`` column;
- ``runs.csv``: every metric and variant of every run, with its status (for pandas);
- PNG figures: throughput vs memory waste, quality vs memory held per sequence (when
  quality metrics exist), KV reserved/used over time per run, TTFT and e2e latency CDFs,
  and latency vs offered request rate when runs differ in ``workload.rate`` (or a trace's
  ``workload.speedup``): harness/reporting/rate.py.

Runs that did not finish are listed apart with their status (failed, interrupted, no
outcome: killed or still running, unreadable) and why; so are a sweep's jobs that never
started, and stale runs of an earlier sweep into the same folder, which are left out of
the comparison unless ``--include-stale``.

With ``--wandb offline|online`` the report is also logged to W&B: its figures as images,
the comparison as a table and report.md as a file, in a run of job type ``report`` in the
sweep's group (the one its runs were logged in: harness/sinks/names.py).

Exit status: 0; 1 when the report cannot be written (the message names the file); 2 when
no run is found or an option is wrong (the message says why); 3 when the report is
written but logging it to W&B failed.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from harness.errors import interruptible
from harness.reporting.plots import write_plots
from harness.reporting.rate import write_rate_plots
from harness.reporting.runs import SweepCheck, check_sweeps, find_runs, one_line, variant
from harness.reporting.table import (
    Comparison,
    compare,
    noise_notice,
    status_counts,
    to_markdown,
)


@dataclass(slots=True)
class ReportFiles:
    out: Path
    markdown: Path
    comparison_csv: Path
    runs_csv: Path
    plots: list[Path] = field(default_factory=list)
    comparison: Comparison | None = None
    check: SweepCheck | None = None
    stale_left_out: bool = True

    def all(self) -> list[Path]:
        return [self.markdown, self.comparison_csv, self.runs_csv, *self.plots]


def _parse_where(items: list[str]) -> dict[str, str]:
    out = {}
    for it in items:
        k, sep, v = it.partition("=")
        if not sep or not k:
            raise ValueError(f"--where {it!r}: expected KEY=VALUE, e.g. backend.block_size=16")
        out[k] = v
    return out


def build_report(folders: list[Path], baseline: str | None = None,
                 where: dict[str, str] | None = None, out: Path | None = None,
                 include_stale: bool = False) -> ReportFiles:
    """Load the runs under ``folders`` and write the report; raises ValueError for the
    user's mistakes (no runs, unknown baseline backend, unknown --where key) and OSError
    when a file cannot be written."""
    if not folders:
        raise ValueError("give at least one run or sweep folder")
    runs = find_runs(folders)
    check = check_sweeps(folders, runs)
    compared = runs if include_stale else [r for r in runs if not r.stale]
    if not compared:
        raise ValueError("every run here is stale (from an earlier sweep into the same "
                         "folder): --include-stale compares them")
    cmp = compare(compared, baseline, where)
    out = out if out is not None else folders[0] / "report"
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder")
    out.mkdir(parents=True, exist_ok=True)
    files = ReportFiles(out, out / "report.md", out / "comparison.csv", out / "runs.csv",
                        comparison=cmp, check=check, stale_left_out=not include_stale)
    cmp.frame.to_csv(files.comparison_csv, index=False)
    pd.DataFrame([{"path": str(r.path), "status": "finished", **variant(r, cmp.variant_keys),
                   **(r.metrics or {})} for r in compared if r.metrics is not None]
                 + [{"path": str(r.path), "status": r.status, "run.backend": r.backend,
                     "run.workload": r.workload, "failure": r.failure}
                    for r in cmp.failed]).to_csv(files.runs_csv, index=False)
    files.plots = write_plots(cmp, compared, out) if len(cmp.frame) else []
    files.plots += write_rate_plots(compared, out)  # when runs differ in offered rate
    files.markdown.write_text(to_markdown(
        cmp, [str(f) for f in folders], [p.name for p in files.plots],
        never_started=[f"{sweep}: {' '.join(job)}" for sweep, job in check.never_started],
        stale=check.stale if not include_stale else [],
        unlisted=[unlisted_line(sweep, why) for sweep, why in check.unlisted]))
    return files


def unlisted_line(sweep: Path, why: str) -> str:
    """A sweep whose multirun.yaml could not be read: its jobs never started are unknown."""
    return (f"sweep {sweep}: could not read its multirun.yaml ({why}), so jobs it never "
            "started cannot be listed: the counts above are of its run folders only")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.report", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folders", nargs="+", type=Path, help="run folders or sweep folders")
    ap.add_argument("--baseline-backend", default=None,
                    help="ratios are to this backend's run on the same workload "
                         "(default: paged if present, else the first backend by name)")
    ap.add_argument("--where", action="append", default=[], metavar="KEY=VALUE",
                    help="pin the baseline run among several (e.g. backend.block_size=16)")
    ap.add_argument("--out", type=Path, default=None,
                    help="output folder (default: <first folder>/report)")
    ap.add_argument("--include-stale", action="store_true",
                    help="also compare stale runs (a sweep folder's runs that are not jobs "
                         "of its multirun.yaml: an earlier sweep into the same folder)")
    ap.add_argument("--wandb", choices=("offline", "online"), default=None,
                    help="also log the report (figures, comparison table, report.md) to a "
                         "W&B run of job type report, in the sweep's group; offline: files "
                         "under --out/wandb, `wandb sync` uploads them")
    ap.add_argument("--wandb-project", default="kvbench", help="W&B project (kvbench)")
    ap.add_argument("--wandb-entity", default=None, help="W&B entity (the account's default)")
    ap.add_argument("--wandb-group", default=None,
                    help="W&B group (default: the sweep's, as its runs were grouped)")
    args = ap.parse_args(argv)
    try:
        files = build_report(args.folders, args.baseline_backend, _parse_where(args.where),
                             args.out, args.include_stale)
    except ValueError as e:
        print(f"kvbench report: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"kvbench report: cannot write {e.filename or 'the report'}: "
              f"{e.strerror or e}", file=sys.stderr)
        return 1
    cmp, check = files.comparison, files.check
    assert cmp is not None and check is not None
    stale = len(check.stale) if files.stale_left_out else 0
    print(f"kvbench report: {status_counts(cmp, len(check.never_started), stale)}"
          + (f"; ratios to {cmp.baseline_backend}" if len(cmp.frame) else "; nothing finished"))
    for wl, key in cmp.references.items():
        print(f"  {wl}: a parameter sweep of one backend: ratios to {key}")
    if (notice := noise_notice(cmp)) is not None:
        print(f"  note: {notice.replace('`', '')}")
    for r in cmp.failed:
        print(f"  {r.status}: {r.path}: {one_line(r.failure)}")
    for sweep, job in check.never_started:
        print(f"  never started: {sweep}: {' '.join(job)}")
    for sweep, why in check.unlisted:
        print(f"  warning: {unlisted_line(sweep, why)}")
    if files.stale_left_out:
        for r in check.stale:
            print(f"  stale (left out; --include-stale compares it): {r.path}")
    for r, diffs in cmp.unmatched:
        print(f"  warning: not compared (no {cmp.baseline_backend} run with the same config "
              f"outside backend.*): {r.path}: differs in {'; '.join(diffs) or 'its config'}")
    print(f"written to {files.out}/:")
    for p in files.all():
        print(f"  {p.name}")
    if args.wandb:
        return _log_to_wandb(files, args)
    return 0


def report_group(folders: list[Path]) -> str | None:
    """The W&B group of a report on a sweep: the one its runs were logged in
    (harness.sinks.names.sweep_group, from the sweep's multirun.yaml and its first job's
    config and Hydra choices); None for anything else."""
    import yaml

    from harness.reporting.runs import sweep_jobs
    from harness.sinks.names import sweep_group, swept_keys

    sweep = folders[0]
    if not (sweep / "multirun.yaml").is_file():
        return None
    jobs = sweep_jobs(sweep / "multirun.yaml") or []
    first = next((f.parent for f in sorted(sweep.rglob("config.yaml"))
                  if f.parent.name != ".hydra"), None)
    try:
        cfg = yaml.safe_load((first / "config.yaml").read_text()) if first else {}
        hydra = first / ".hydra" / "hydra.yaml" if first else None
        choices = (yaml.safe_load(hydra.read_text()) or {}).get("hydra", {}).get(
            "runtime", {}).get("choices", {}) if hydra and hydra.is_file() else {}
    except (OSError, yaml.YAMLError):
        cfg, choices = {}, {}
    return sweep_group(sweep, cfg or {}, choices or {}, swept_keys(jobs))


def _log_to_wandb(files: ReportFiles, args: argparse.Namespace) -> int:
    """Log the written report to W&B: 0, or 3 (the report is on disk) with why."""
    from harness.sinks import WandbLogError, log_report_to_wandb

    group = args.wandb_group or report_group(args.folders)
    try:
        log_report_to_wandb(files.out, files.plots,
                            files.comparison.frame if files.comparison else None,
                            files.markdown, args.wandb, args.wandb_project,
                            args.wandb_entity, group)
    except WandbLogError as e:
        where = f"; W&B's files: `wandb sync {e.run_dir}`" if e.run_dir else ""
        print(f"kvbench report: the report is written, but logging it to W&B failed: "
              f"{e}{where}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(interruptible(main, "kvbench report"))
