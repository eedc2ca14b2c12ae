"""``python -m harness.gate``: a CI verdict on runs, against a committed baseline.

    python -m harness.gate SWEEP_OR_RUN... --baseline results/baselines/cpu-tiny.json
    python -m harness.gate --write-baseline results/baselines/cpu-tiny.json SWEEP [--metrics ...]

A baseline file (harness/reporting/baseline.py) holds the gate spec (metric -> direction,
rel_tol, abs_floor), the config keys that tell its runs apart, and per run key
(``<backend>/<workload>[/k=v,...]``) the metric values and the config that ran. The gate
derives the same keys from the runs given and compares metric by metric: a value worse
than the baseline by more than ``max(rel_tol * |baseline|, abs_floor)`` is a regression
(for direction ``match``, a change either way); better by more than that is an
improvement, which passes. Runs whose config differs from the baseline's (in a key the
baseline recorded) are not gated: the gate says "baseline from another config", lists the
differing keys first and exits 2; a NaN anywhere (a baseline value, a tolerance, a run's
value) fails closed.

Exit status: 0 pass; 1 a regression, a gated metric missing from a run (it is part of the
results contract), a run whose metrics.json cannot be read (named, with what is wrong), a
baseline run that did not finish (failed, interrupted, killed) or is missing (unless
``--partial``), or a baseline file that cannot be written; 2 a usage error (no runs, an
unreadable baseline, runs that match none of its keys, runs of another config, bad
options). Stale runs (not jobs
of their sweep folder's multirun.yaml) are left out, with a note.
A run of repeats (``repeats=N``) is gated by its median, and a speed metric by its 95%
interval over the repeats: it fails only when the baseline's value lies outside that
interval by more than the tolerance (the verdict says so); other metrics, quality among
them, are judged by value and tolerance, even where a run carries a bootstrap interval;
a baseline written from repeats records each repeat's value. ``--write-baseline`` writes
or refreshes a file from finished runs; it keeps the spec already in the file unless
``--metrics`` is given, and starts from :data:`DEFAULT_SPEC` otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from harness.errors import UserError, interruptible
from harness.metrics.repeats import CI_HIGH, CI_LOW
from harness.reporting.baseline import (
    Baseline,
    MetricSpec,
    config_diffs,
    keyed,
    make_spec,
    number,
    take_baseline,
)
from harness.reporting.runs import UNREADABLE, Run, check_sweeps, find_runs, one_line
from harness.roofline.bands import timed

# The default gated metrics. Only what a run's schedule decides, never the clock: with all
# arrivals at t=0 (or right after the answer they follow), greedy sampling and seeded
# weights, these repeat exactly from run to run on a loaded CPU (two ci_smoke sweeps gave
# identical values), while throughput and latency moved by 2x there. The tolerances are
# therefore not for noise: they are how much worse counts as a regression rather than a
# harmless change (a different kernel's rounding flipping one greedy token, say). Zero
# tolerance where any worsening is a bug: requests lost, capacity, concurrency.
DEFAULT_SPEC: dict[str, MetricSpec] = {
    # Work done: every request of the sweep finishes, none newly rejected.
    "requests.finished": MetricSpec("higher", 0.0, 0.0),
    "requests.rejected": MetricSpec("lower", 0.0, 0.0),
    # Memory accounting. Capacity is budget / bytes per token (block-rounded): exact.
    "memory.token_capacity": MetricSpec("higher", 0.0, 0.0),
    "memory.max_running_seqs": MetricSpec("higher", 0.0, 0.0),
    # More peak bytes used is more sharing lost or more sequences admitted: neither way is
    # better by itself, so any drift beyond 2% fails.
    "memory.peak_used_bytes": MetricSpec("match", 0.02, 0.0),
    "memory.waste_pct": MetricSpec("lower", 0.02, 0.1),  # floor in percentage points
    # Prefix caching and block sharing.
    "cache.prefix_hit_rate": MetricSpec("higher", 0.02, 0.005),
    "cache.prefill_tokens_computed": MetricSpec("lower", 0.02, 16.0),  # floor: one block
    "cache.prefill_tokens_saved": MetricSpec("higher", 0.02, 16.0),
    "cache.cow_copies": MetricSpec("lower", 0.05, 1.0),
    "cache.blocks_saved_by_sharing": MetricSpec("higher", 0.02, 0.5),  # mean over steps
    # Scheduling: one preemption more under a tight budget is churn, a few are a bug.
    "sched.preemptions_recompute": MetricSpec("lower", 0.10, 1.0),
    "sched.preemptions_swap": MetricSpec("lower", 0.10, 1.0),
    "sched.recomputed_tokens": MetricSpec("lower", 0.10, 64.0),
    # Quality, when a run has it (lossy backends). quality.ppl and ppl_ref are left out:
    # ppl_delta_pct is their comparison. Exact backends sit near 0: the floors decide.
    "quality.ppl_delta_pct": MetricSpec("lower", 0.05, 0.1),
    "quality.kl_mean": MetricSpec("lower", 0.05, 1e-4),
    "quality.top1_agreement": MetricSpec("higher", 0.0, 0.005),
    # Greedy generation against the reference's (quality.generation_agreement).
    "quality.gen_exact_match_rate": MetricSpec("higher", 0.0, 0.05),
    "quality.gen_agree_tokens_mean": MetricSpec("higher", 0.05, 1.0),
    # What the scored quality cost in memory (bytes one evaluated sequence held).
    "quality.kv_bytes_per_seq_mean": MetricSpec("lower", 0.02, 0.0),
}


def parse_metrics(items: list[str]) -> dict[str, MetricSpec]:
    """``name`` (from DEFAULT_SPEC) or ``name:higher|lower|match[:rel_tol[:abs_floor]]``
    (rel_tol 0.02 and abs_floor 0 when left out)."""
    out = {}
    for it in items:
        name, *rest = it.split(":")
        if not rest:
            if name not in DEFAULT_SPEC:
                raise ValueError(f"--metrics {name}: not in the default spec; give its "
                                 f"direction ({name}:higher|lower|match[:rel_tol[:abs_floor]])"
                                 f" or one of: {', '.join(DEFAULT_SPEC)}")
            out[name] = DEFAULT_SPEC[name]
            continue
        try:
            nums = [float(x) for x in rest[1:3]]
        except ValueError as e:
            raise ValueError(f"--metrics {it}: rel_tol and abs_floor are numbers") from e
        out[name] = make_spec(rest[0], *(nums + [0.02, 0.0][len(nums):]))
    return out


@dataclass(slots=True)
class Row:
    run: str
    metric: str  # "(run)" for a verdict on the run as a whole
    baseline: float | None
    current: float | None
    allowed: float | None
    verdict: str  # ok | improved | REGRESSED | MISSING | FAILED | INTERRUPTED | NOT RUN | new
    failing: bool
    note: str = ""  # how a run of repeats was judged (its interval)


def judge(spec: MetricSpec, base: float, cur: float) -> str:
    """ok, improved or REGRESSED: ``cur`` against ``base`` under ``spec``. Fails closed:
    a value that is not finite is REGRESSED (NaN compares false with every tolerance)."""
    if not (math.isfinite(base) and math.isfinite(cur)):
        return "REGRESSED"
    worse = {"higher": base - cur, "lower": cur - base, "match": abs(cur - base)}[
        spec.direction]
    tol = spec.allowed(base) * (1 + 1e-9) + 1e-12  # float rounding is not a regression
    return "REGRESSED" if worse > tol else "improved" if -worse > tol else "ok"


def judge_interval(spec: MetricSpec, base: float, cur: float, low: float,
                   high: float) -> tuple[str, str]:
    """(verdict, note) for a run of repeats whose median is ``cur`` with the 95% interval
    [``low``, ``high``]: a baseline inside the interval is noise (ok); outside it, the
    interval's nearer end is judged as :func:`judge` judges a value, so the run fails only
    when the baseline lies outside its interval by more than the tolerance."""
    if not all(math.isfinite(x) for x in (base, cur, low, high)):
        return "REGRESSED", "not a finite value"
    if low <= base <= high:
        return "ok", f"baseline inside the run's 95% interval [{low:.6g}, {high:.6g}]"
    nearer = high if base > high else low
    v = judge(spec, base, nearer)
    where = f"the run's 95% interval [{low:.6g}, {high:.6g}]"
    note = {"REGRESSED": f"baseline outside {where} by more than the tolerance",
            "improved": f"better than the baseline over all of {where}",
            "ok": f"baseline outside {where}, within the tolerance"}[v]
    return v, note


def check(base: Baseline, runs: list[Run], partial: bool = False) -> list[Row]:
    """One row per (baseline run, gated metric), plus rows for runs missing or new;
    ``partial``: a baseline run absent here is skipped, not failed."""
    # A run whose files cannot even tell what it was gets a row of its own, by path.
    lost = [r for r in runs if r.status == UNREADABLE and not r.config]
    current = keyed([r for r in runs if r not in lost], base.key_fields)
    if not set(current) & set(base.runs) and not lost:
        raise ValueError(f"no run here matches the baseline: runs {sorted(current)}, "
                         f"baseline {sorted(base.runs)}")
    rows: list[Row] = []
    for key, values in base.runs.items():
        r = current.get(key)
        if r is None and partial:
            continue
        if r is None or r.metrics is None:
            why = "NOT RUN" if r is None else f"{r.status.upper()}: {one_line(r.failure)}"
            rows.append(Row(key, "(run)", None, None, None, why, True))
            continue
        if r.repeats and r.failure:  # medians of fewer repeats than it was run for
            rows.append(Row(key, "(run)", None, None, None,
                            f"PARTIAL: {one_line(r.failure)}", True))
        band = number(r.metrics.get("roofline.expected_error_pct"))  # roofline runs only
        for m, b in values.items():
            c = number(r.metrics.get(m))
            spec = base.spec[m]
            if band is not None and timed(m):  # never tighter than the what-if's error
                spec = dataclasses.replace(spec, rel_tol=max(spec.rel_tol, band / 100))
            if c is None:
                rows.append(Row(key, m, b, None, spec.allowed(b), "MISSING", True))
                continue
            low, high = number(r.metrics.get(m + CI_LOW)), number(r.metrics.get(m + CI_HIGH))
            note = ""
            # A speed metric of a run of repeats: its interval over the repeats. Any other
            # metric by its value: a quality metric's interval is a bootstrap over one run's
            # tokens, and a baseline inside it passed a +107% perplexity regression
            # (issue #55); its tolerance says how far it may move.
            if low is not None and high is not None and timed(m):
                v, note = judge_interval(spec, b, c, low, high)
            else:
                v = judge(spec, b, c)
            rows.append(Row(key, m, b, c, spec.allowed(b), v, v == "REGRESSED", note))
    rows += [Row(k, "(run)", None, None, None, "new (not in baseline)", False)
             for k in current if k not in base.runs]
    rows += [Row(str(r.path), "(run)", None, None, None,
                 f"UNREADABLE: {one_line(r.failure)}", True) for r in lost]
    return rows


def format_rows(rows: list[Row], spec: dict[str, MetricSpec]) -> str:
    def num(x: float | None) -> str:
        return "-" if x is None else f"{x:.6g}"

    table = [("run", "metric", "better", "baseline", "current", "change", "tolerance",
              "verdict")]
    for r in rows:
        change = "-"
        if r.baseline is not None and r.current is not None:
            d = r.current - r.baseline
            change = f"{d:+.4g}" + (f" ({100 * d / abs(r.baseline):+.1f}%)" if r.baseline else "")
        better = spec[r.metric].direction if r.metric in spec else ""
        table.append((r.run, r.metric, better, num(r.baseline), num(r.current), change,
                      "-" if r.allowed is None else f"{r.allowed:.4g}",
                      r.verdict + (f" ({r.note})" if r.note else "")))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
                     for row in table)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.gate", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folders", nargs="+", type=Path, help="run folders or sweep folders")
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--baseline", type=Path, help="gate the runs against this file")
    mode.add_argument("--write-baseline", type=Path, help="write (refresh) this file")
    ap.add_argument("--metrics", nargs="+", default=None, metavar="NAME[:DIR[:REL[:ABS]]]",
                    help="with --write-baseline: the metrics to gate (default: the spec "
                         "already in the file, else DEFAULT_SPEC)")
    ap.add_argument("--partial", action="store_true",
                    help="gate only the runs given (e.g. one run of a sweep): baseline runs "
                         "absent here are skipped instead of failing as NOT RUN")
    args = ap.parse_args(argv)
    try:
        runs = find_runs(args.folders)
        sweeps = check_sweeps(args.folders, runs)
        if stale := sweeps.stale:
            print(f"note: leaving out {len(stale)} stale run(s), not jobs of their sweep "
                  "folder's multirun.yaml (an earlier sweep into the same folder): "
                  + ", ".join(str(r.path) for r in stale), file=sys.stderr)
            runs = [r for r in runs if not r.stale]
        # Jobs a sweep planned that never started: no run to gate, so no row would say it
        # (issue #55: such a sweep passed). Named in the verdict, refused as a baseline.
        missing = [f"{sweep}: {' '.join(job)}" for sweep, job in sweeps.never_started]
        if missing and args.write_baseline is not None:
            raise ValueError("cannot take a baseline from a sweep with jobs that never "
                             f"started: {'; '.join(missing)}; finish the sweep first")
        # A sweep whose multirun.yaml cannot be read may have jobs that never started
        # which nobody can list: said in the verdict as such, refused as a baseline.
        unlisted = [f"{sweep} ({why})" for sweep, why in sweeps.unlisted]
        if unlisted and args.write_baseline is not None:
            raise ValueError("cannot take a baseline from a sweep whose multirun.yaml could "
                             f"not be read: {'; '.join(unlisted)}: jobs it never started "
                             "cannot be listed; restore the file or gate its runs apart")
        if args.write_baseline is not None:
            return _write(args.write_baseline, runs, args.metrics)
        if args.metrics is not None:
            raise ValueError("--metrics goes with --write-baseline (a gate uses the spec in "
                             "the baseline file)")
        base = Baseline.load(args.baseline)
        if diffs := config_diffs(base, keyed(runs, base.key_fields)):
            print(f"kvbench gate: baseline from another config: {args.baseline} was taken "
                  "from runs whose configs differ from these in:", file=sys.stderr)
            print("\n".join(f"  {d}" for d in diffs), file=sys.stderr)
            print("Gate runs of the baseline's config, or, if the change is intended, "
                  f"refresh it: python -m harness.gate --write-baseline {args.baseline} "
                  "<runs>", file=sys.stderr)
            return 2
        rows = check(base, runs, args.partial)
        if not args.partial:
            rows += [Row(m, "(run)", None, None, None, "NOT STARTED (a job of its sweep)",
                         True) for m in missing]
            rows += [Row(u, "(run)", None, None, None, "UNLISTED (multirun.yaml unreadable: "
                         "jobs never started cannot be listed)", True) for u in unlisted]
    except ValueError as e:
        print(f"kvbench gate: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"kvbench gate: cannot write {e.filename or args.write_baseline}: "
              f"{e.strerror or e}", file=sys.stderr)
        return 1
    print(f"kvbench gate: {', '.join(map(str, args.folders))} against {args.baseline}")
    print("\n" + format_rows(rows, base.spec) + "\n")
    gated = sum(1 for r in rows if r.metric != "(run)")
    if bad := [r for r in rows if r.failing]:
        counts: dict[str, int] = {}
        for r in bad:
            v = r.verdict.split(":")[0]
            counts[v] = counts.get(v, 0) + 1
        print("kvbench gate: FAIL (" + ", ".join(f"{n} {v}" for v, n in counts.items())
              + f"; {gated} checks). If the change is intended, refresh the baseline: "
              f"python -m harness.gate --write-baseline {args.baseline} <runs>")
        return 1
    improved = sum(1 for r in rows if r.verdict == "improved")
    n_runs = len({r.run for r in rows if r.metric != "(run)"})
    print(f"kvbench gate: PASS ({gated} checks over {n_runs} runs"
          + (f"; {improved} improved: refresh the baseline to keep them" if improved else "")
          + ")")
    return 0


def _write(path: Path, runs: list[Run], metrics: list[str] | None) -> int:
    if path.is_dir():
        raise UserError(f"--write-baseline {path} is a folder; give the baseline's file name, "
                        f"e.g. {path / 'baseline.json'}")
    if metrics is not None:
        spec, explicit = parse_metrics(metrics), True
    elif path.is_file():
        spec, explicit = Baseline.load(path).spec, False
    else:
        spec, explicit = dict(DEFAULT_SPEC), False
    base = take_baseline(runs, spec, require_all=explicit)
    base.dump(path)
    n = sum(len(v) for v in base.runs.values())
    print(f"kvbench gate: wrote {path}: {len(base.runs)} runs, {n} values "
          f"(key fields: {', '.join(base.key_fields) or 'backend/workload only'})")
    for k in base.runs:
        print(f"  {k}")
    return 0


if __name__ == "__main__":
    sys.exit(interruptible(main, "kvbench gate"))
