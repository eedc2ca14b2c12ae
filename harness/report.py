"""``python -m harness.report``: compare runs side by side, as tables and plots.

    python -m harness.report results/sweeps/memory_waste-20261129-125918
    python -m harness.report RUN_A RUN_B --baseline-backend contiguous --out /tmp/report

Finds every run at or below the folders given (metrics.json; failed runs, with FAILED, are
listed apart) and writes into ``--out`` (default ``<first folder>/report/``):

- ``report.md``: one table per workload of the key metrics per backend (and variant:
  the config keys that differ between runs, such as backend.reserve or workload.n), each
  value with its ratio to the baseline backend's run on the same workload;
- ``comparison.csv``: the same rows, every ratio in a ``<metric>.vs_baseline`` column;
- ``runs.csv``: every metric and variant of every finished run (for pandas);
- PNG figures: throughput vs memory waste, quality vs memory held per sequence (when
  quality metrics exist), KV reserved/used over time per run, TTFT and e2e latency CDFs.

Exit status: 0, or 2 when no run is found or an option is wrong (the message says why).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from harness.reporting.plots import write_plots
from harness.reporting.runs import find_runs, variant
from harness.reporting.table import Comparison, compare, to_markdown


@dataclass(slots=True)
class ReportFiles:
    out: Path
    markdown: Path
    comparison_csv: Path
    runs_csv: Path
    plots: list[Path] = field(default_factory=list)
    comparison: Comparison | None = None

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
                 where: dict[str, str] | None = None, out: Path | None = None) -> ReportFiles:
    """Load the runs under ``folders`` and write the report; raises ValueError for the
    user's mistakes (no runs, unknown baseline backend, unknown --where key)."""
    if not folders:
        raise ValueError("give at least one run or sweep folder")
    runs = find_runs(folders)
    cmp = compare(runs, baseline, where)
    out = out if out is not None else folders[0] / "report"
    out.mkdir(parents=True, exist_ok=True)
    files = ReportFiles(out, out / "report.md", out / "comparison.csv", out / "runs.csv",
                        comparison=cmp)
    cmp.frame.to_csv(files.comparison_csv, index=False)
    pd.DataFrame([{"path": str(r.path), "status": "finished", **variant(r, cmp.variant_keys),
                   **(r.metrics or {})} for r in runs if r.metrics is not None]
                 + [{"path": str(r.path), "status": "failed", "run.backend": r.backend,
                     "run.workload": r.workload, "failure": r.failure}
                    for r in cmp.failed]).to_csv(files.runs_csv, index=False)
    files.plots = write_plots(cmp, runs, out)
    files.markdown.write_text(to_markdown(cmp, [str(f) for f in folders],
                                          [p.name for p in files.plots]))
    return files


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
    args = ap.parse_args(argv)
    try:
        files = build_report(args.folders, args.baseline_backend, _parse_where(args.where),
                             args.out)
    except ValueError as e:
        print(f"kvbench report: {e}", file=sys.stderr)
        return 2
    cmp = files.comparison
    assert cmp is not None
    print(f"kvbench report: {len(cmp.frame)} finished run(s), {len(cmp.failed)} failed; "
          f"ratios to {cmp.baseline_backend}")
    for r in cmp.failed:
        print(f"  failed: {r.path}: {r.failure}")
    print(f"written to {files.out}/:")
    for p in files.all():
        print(f"  {p.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
