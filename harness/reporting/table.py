"""The comparison table: key metrics per backend x workload (x variant), each with its ratio
to the baseline backend's run on the same workload.

The baseline of a run is a finished run of the baseline backend on the same workload with
the same values of every variant key outside ``backend.*`` (the same budget, the same n...).
When several qualify (a sweep over the baseline's own block sizes), the one that agrees
with the run on the most config values wins, ties to the first in path order; ``--where``
pins it (``backend.block_size=16``). The table names the baseline it used.

A parameter sweep of one backend (every run on a workload is the baseline backend's, and
they differ in some config key) would compare each run with itself, all 1.00x: there, every
run is compared with the *reference run*, whose swept keys hold their default values (what
the run would get without the override) where a run has them, else their first values in
path order (a sweep's first job). ``--where`` still pins the baseline instead.

Speeds are measured on the wall clock (executor=model): a single run of each configuration
can be off by tens of percent, so the report says so and how to get intervals
(``repeats=3``) whenever it shows speeds of runs without repeats.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from harness.metrics.repeats import CI_HIGH, CI_LOW, is_speed, paired_ratio
from harness.reporting.runs import (
    Run,
    comparable,
    flatten,
    fmt_value,
    label,
    one_line,
    per_repeat,
    run_key,
    variant,
    variant_keys,
)

# (metrics.json key, table header, format). "bytes" prints MiB. Order = column order.
KEY_METRICS: list[tuple[str, str, str]] = [
    ("throughput.output_tokens_per_s", "output tok/s", "{:.1f}"),
    ("latency.ttft_ms.p50", "TTFT p50 ms", "{:.1f}"),
    ("latency.ttft_ms.p99", "TTFT p99 ms", "{:.1f}"),
    ("latency.itl_ms.p50", "ITL p50 ms", "{:.2f}"),
    ("latency.e2e_ms.p50", "e2e p50 ms", "{:.1f}"),
    ("memory.waste_pct", "waste %", "{:.1f}"),
    ("memory.max_running_seqs", "max seqs", "{:.0f}"),
    ("memory.peak_reserved_bytes", "peak reserved MiB", "bytes"),
    ("cache.prefix_hit_rate", "prefix hit", "{:.3f}"),
    ("sched.preemptions_recompute", "preempt recompute", "{:.0f}"),
    ("sched.preemptions_swap", "preempt swap", "{:.0f}"),
    ("requests.finished", "finished", "{:.0f}"),
    ("requests.rejected", "rejected", "{:.0f}"),
    ("quality.ppl_delta_pct", "ppl delta %", "{:.2f}"),
    ("quality.kl_mean", "KL mean", "{:.2e}"),
    ("quality.top1_agreement", "top-1 agree", "{:.3f}"),
    ("quality.gen_exact_match_rate", "gen exact", "{:.3f}"),
    # The outputs against the reference's (harness/quality_outputs.py).
    ("quality.output_length_ratio", "output len / ref", "{:.2f}"),
    ("quality.right_to_wrong_share", "right -> wrong", "{:.2f}"),
    # A roofline run's validated error (harness.roofline.bands): its times are +- this.
    ("roofline.expected_error_pct", "what-if error %", "{:.1f}"),
]
# Already a comparison with the exact reference, ~0 for exact backends: a ratio to the
# baseline's ~0 would read 10^6x. Shown as values only.
NO_RATIO = {"quality.ppl_delta_pct", "quality.kl_mean", "roofline.expected_error_pct",
            "quality.output_length_ratio", "quality.right_to_wrong_share"}
RATIO = ".vs_baseline"  # suffix of a ratio column in the CSV
# The notice on speeds of single runs (issue #54: block size 48 read 2.13x once, 1.08x
# [0.96, 1.22] with repeats=3).
NOISE_HINT = ("rerun with `repeats=3` for medians with 95% intervals and paired ratios "
              "(docs/sweeps.md)")


@dataclass(slots=True)
class Comparison:
    frame: pd.DataFrame  # one row per finished run; see compare()
    variant_keys: list[str]
    metrics: list[str]  # the KEY_METRICS some run has
    baseline_backend: str
    failed: list[Run]  # every run that did not finish (status: failed, interrupted, ...)
    # Finished runs with no baseline run of the same config outside backend.*, and how
    # they differ from the baseline backend's runs there ("workload.n=4 (paged: 2)").
    unmatched: list[tuple[Run, list[str]]] = field(default_factory=list)
    # A parameter sweep of one backend: workload -> the key of the run every run on it is
    # compared with (module docstring).
    references: dict[str, str] = field(default_factory=dict)
    # Finished runs whose speeds are one wall-clock measurement each (executor=model, no
    # repeats): their labels.
    single_runs: list[str] = field(default_factory=list)


def resolve_baseline(runs: list[Run], requested: str | None) -> str:
    """The baseline backend: ``requested``, else paged, else the first present."""
    present = sorted({r.backend for r in runs if r.metrics is not None})
    if not present:
        raise ValueError("every run failed: nothing to compare")
    if requested is None:
        return "paged" if "paged" in present else present[0]
    if requested not in present:
        raise ValueError(f"baseline backend {requested!r} has no finished run here; "
                         f"backends present: {', '.join(present)}")
    return requested


def _pick(run: Run, candidates: list[Run], keys: list[str]) -> Run | None:
    shared = [k for k in keys if not k.startswith("backend.")]
    mine = variant(run, keys)
    same = [c for c in candidates
            if all(variant(c, shared).get(k) == mine.get(k) for k in shared)]
    if not same:
        return None
    return max(same, key=lambda c: sum(variant(c, keys).get(k) == v for k, v in mine.items()))


def _differences(run: Run, candidates: list[Run], keys: list[str]) -> list[str]:
    """The variant keys outside backend.* in which ``run`` matches none of ``candidates``:
    ``key=value (baseline runs: a, b)``."""
    out = []
    for k in (k for k in keys if not k.startswith("backend.")):
        mine = variant(run, [k]).get(k)
        theirs = sorted({variant(c, [k]).get(k) or "(unset)" for c in candidates})
        if mine not in theirs:
            out.append(f"{k}={mine or '(unset)'} (baseline runs: {', '.join(theirs)})")
    return out


@functools.lru_cache(maxsize=64)
def default_config(backend: str, workload: str) -> dict[str, str]:
    """The config ``backend=<backend> workload=<workload>`` composes to with no other
    override, flattened and spelled as runs are compared; empty when it cannot be composed
    (a backend or workload this checkout does not have)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from harness.config import compose_config

    try:
        c = OmegaConf.to_container(compose_config([f"backend={backend}",
                                                   f"workload={workload}"]), resolve=True)
    except (OmegaConfBaseException, ValueError, LookupError, ImportError):
        return {}  # hydra's MissingConfigException is a LookupError (IOError's kin: ValueError)
    return comparable(flatten({str(k): v for k, v in c.items()})) if isinstance(c, dict) else {}


def sweep_reference(members: list[Run], keys: list[str]) -> Run | None:
    """The run a parameter sweep of one backend (``members``: its finished runs on one
    workload, in path order) is compared with: the one holding the most swept keys at
    their reference values (the default when a run has it, else the first value), the
    first such in path order. None when they differ in no key."""
    values = {k: list(dict.fromkeys(variant(r, [k]).get(k) for r in members)) for k in keys}
    swept = {k: v for k, v in values.items() if len(v) > 1}
    if len(members) < 2 or not swept:
        return None
    defaults = default_config(members[0].backend, members[0].workload)
    want = {k: defaults[k] if defaults.get(k) in v else v[0] for k, v in swept.items()}
    return max(members, key=lambda r: sum(variant(r, [k]).get(k) == x
                                          for k, x in want.items()))


def _ratio(value: Any, base: Any) -> float:
    if value is None or base is None or _nan(value) or _nan(base):
        return math.nan
    if base == 0:
        return 1.0 if value == 0 else math.nan
    return float(value) / float(base)


def _nan(x: Any) -> bool:
    return isinstance(x, float) and math.isnan(x)


def compare(runs: list[Run], baseline: str | None = None,
            where: dict[str, str] | None = None) -> Comparison:
    """Rows: path, key, label, backend, workload, the variant keys, baseline (the baseline
    run's key), then each key metric followed by ``<metric>.vs_baseline`` (not for
    NO_RATIO). With no finished run the frame is empty: the report still lists the rest."""
    done = [r for r in runs if r.metrics is not None]
    # Runs that did not finish, and the unfinished repeats of groups that did.
    failed = [r for r in runs if r.metrics is None] + [
        x for r in done for x in r.repeats if x.metrics is None]
    if not done:
        return Comparison(pd.DataFrame(), [], [], baseline or "paged", failed)
    backend = resolve_baseline(runs, baseline)
    keys = variant_keys(runs)
    where = where or {}
    known = set().union(*(r.config for r in runs))
    for k in where:
        if k not in known:
            raise ValueError(f"--where {k}: no run has this config key; variant keys here: "
                             f"{', '.join(keys) or '(none)'}")
    base_runs = [r for r in done if r.backend == backend
                 and all(fmt_value(r.config.get(k)) == v for k, v in where.items())]
    metrics = [m for m, _, _ in KEY_METRICS if any(m in (r.metrics or {}) for r in done)]
    references: dict[str, Run] = {}
    for wl in dict.fromkeys(r.workload for r in done):
        members = [r for r in done if r.workload == wl]
        if not where and all(r.backend == backend for r in members):
            ref = sweep_reference(members, keys)
            if ref is not None:
                references[wl] = ref
    rows, unmatched = [], []
    for r in done:
        m = r.metrics or {}
        candidates = [c for c in base_runs if c.workload == r.workload]
        b = references.get(r.workload) or _pick(r, candidates, keys)
        if b is None and candidates:  # compared with nothing rather than with unlike runs
            unmatched.append((r, _differences(r, candidates, keys)))
        bm = (b.metrics or {}) if b else {}
        row: dict[str, Any] = {"path": str(r.path), "key": run_key(r, keys),
                               "label": label(r, keys), "backend": r.backend,
                               "workload": r.workload, **variant(r, keys),
                               "baseline": run_key(b, keys) if b else None}
        for k in metrics:
            row[k] = m.get(k)
            if m.get(k + CI_LOW) is not None:  # a group of repeats: the median's interval
                row[k + CI_LOW], row[k + CI_HIGH] = m.get(k + CI_LOW), m.get(k + CI_HIGH)
            if k not in NO_RATIO:
                row[k + RATIO] = _ratio(m.get(k), bm.get(k)) if b else math.nan
                paired = paired_ratio(per_repeat(r, k), per_repeat(b, k)) \
                    if b is not None and is_speed(k) else None
                if paired is not None:  # repeats on both sides: the paired ratios' median
                    row[k + RATIO], row[k + RATIO + CI_LOW], row[k + RATIO + CI_HIGH] = paired
        rows.append(row)
    frame = pd.DataFrame(rows)
    for k in keys:  # a key only some backends have (backend.reserve) is blank elsewhere
        if k not in frame:
            frame[k] = None
    single = [label(r, keys) for r in done if not r.repeats
              and (r.metrics or {}).get("run.executor", "model") != "roofline"
              and any(is_speed(k) and k in (r.metrics or {}) for k in metrics)]
    return Comparison(frame, keys, metrics, backend, failed, unmatched,
                      {wl: run_key(ref, keys) for wl, ref in references.items()}, single)


def noise_notice(cmp: Comparison) -> str | None:
    """The report's line on speeds of single runs (None when it shows none)."""
    n = len(cmp.single_runs)
    if not n:
        return None
    return (f"Speeds (tok/s, TTFT, ITL, e2e) of {n} run(s) here are single wall-clock "
            "measurements: on a shared CPU one run can be off by tens of percent (a ratio "
            "of 2.13x once read 1.08x [0.96, 1.22] with repeats), so small differences are "
            f"noise; {NOISE_HINT}.")


def status_counts(cmp: Comparison, never_started: int = 0, stale: int = 0) -> str:
    """``4 finished run(s), 1 failed, 2 interrupted, 1 never started`` (failed always;
    the other kinds when there are some)."""
    counts: dict[str, int] = {}
    for r in cmp.failed:
        counts[r.status] = counts.get(r.status, 0) + 1
    parts = [f"{len(cmp.frame)} finished run(s)", f"{counts.pop('failed', 0)} failed"]
    parts += [f"{n} {status}" for status, n in sorted(counts.items())]
    parts += [f"{n} {what}" for what, n in (("never started", never_started),
                                             ("stale (left out)", stale)) if n]
    return ", ".join(parts)


def _cell(value: Any, fmt: str) -> str:
    if value is None or _nan(value):
        return "-"
    if fmt == "bytes":
        return f"{float(value) / 2**20:.2f}"
    return fmt.format(value)


def _interval(row: Any, key: str, fmt: str = "{:.2f}") -> str:
    """`` [low, high]`` when the row has the key's interval (a group of repeats)."""
    low, high = row.get(key + CI_LOW), row.get(key + CI_HIGH)
    if low is None or high is None or _nan(low) or _nan(high):
        return ""
    return f" [{_cell(low, fmt)}, {_cell(high, fmt)}]"


def to_markdown(cmp: Comparison, sources: list[str], images: list[str],
                never_started: list[str] | None = None, stale: list[Run] | None = None,
                unlisted: list[str] | None = None) -> str:
    """The report page: one table per workload, the runs that did not finish, the jobs
    never started, stale runs, the plots. ``unlisted``: a line per sweep whose jobs never
    started cannot be listed (its multirun.yaml unreadable), said under the counts."""
    f = cmp.frame
    n_ok = len(f)
    never_started, stale = never_started or [], stale or []
    counts = status_counts(cmp, len(never_started), len(stale))
    out = ["# kvbench report", "", f"{counts}, from {', '.join(sources)}.", ""]
    for line in unlisted or []:
        out += [f"**Warning:** {line}.", ""]
    if n_ok:
        out += [f"Each cell is the value and, in parentheses, its ratio to the "
                f"`{cmp.baseline_backend}` run on the same workload (same config outside "
                "`backend.*`). Lower is better for latency, waste, preemptions and quality "
                "deltas (ppl delta and KL are already relative to the exact reference: no "
                "ratio).", ""]
        if (notice := noise_notice(cmp)) is not None:
            out += [f"**Noise:** {notice}", ""]
        if any(c.endswith(CI_LOW) for c in f.columns):
            out += ["A run repeated (`repeats=N`) shows the median over its repeats; its "
                    "speed values carry a 95% bootstrap interval in brackets, and a ratio "
                    "between two repeated runs is the median of their paired repeats' ratios "
                    "(repeat k with repeat k: a sweep runs them close in time), with its "
                    "interval.", ""]
    headers = {m: h for m, h, _ in KEY_METRICS}
    fmts = {m: fm for m, _, fm in KEY_METRICS}
    for wl, part in (f.groupby("workload", sort=False) if n_ok else []):
        vkeys = [k for k in cmp.variant_keys if part[k].notna().any()]
        show_base = part["baseline"].nunique() > 1
        mets = [m for m in cmp.metrics if part[m].notna().any()]
        head = ["run", *vkeys, *(["baseline"] if show_base else []), *(headers[m] for m in mets)]
        out += [f"## workload: {wl}", ""]
        if wl in cmp.references:
            out += [f"A parameter sweep of `{cmp.baseline_backend}`: every ratio here is to "
                    f"`{cmp.references[wl]}` (each swept key at its default value where a "
                    "run has it, else at its first value; `--where KEY=VALUE` picks "
                    "another).", ""]
        if part["baseline"].isna().all():
            out += [f"No `{cmp.baseline_backend}` run on this workload: no ratios.", ""]
        for r, diffs in cmp.unmatched:
            if r.workload == wl:
                out += [f"**Not compared:** `{label(r, cmp.variant_keys)}` has no "
                        f"`{cmp.baseline_backend}` run with the same config outside "
                        f"`backend.*`; it differs in {'; '.join(diffs) or 'its config'}: "
                        "no ratios for it.", ""]
        out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for _, row in part.iterrows():
            cells = [row["backend"], *(row[k] if isinstance(row[k], str) else "-"
                                       for k in vkeys)]
            if show_base:
                cells.append(row["baseline"] if isinstance(row["baseline"], str) else "-")
            for m in mets:
                ratio = row.get(m + RATIO, math.nan)
                tail = "" if _nan(ratio) else f" ({ratio:.2f}x{_interval(row, m + RATIO)})"
                cells.append(_cell(row[m], fmts[m]) + _interval(row, m, fmts[m]) + tail)
            out.append("| " + " | ".join(str(c) for c in cells) + " |")
        out.append("")
    if cmp.failed:
        out += ["## Runs that did not finish", ""]
        out += [f"- {r.status}: `{r.path}` ({r.backend} / {r.workload}): "
                + one_line(r.failure) for r in cmp.failed]
        out.append("")
    if never_started:
        out += ["## Jobs never started", "", "The sweep stopped before these jobs:", ""]
        out += [f"- `{j}`" for j in never_started]
        out.append("")
    if stale:
        out += ["## Stale runs (left out)", "",
                "In a sweep folder but not among the jobs of its multirun.yaml: runs of an "
                "earlier sweep into the same folder. Not compared "
                "(`--include-stale` compares them too).", ""]
        out += [f"- `{r.path}`" for r in stale]
        out.append("")
    if images:
        out += ["## Plots", ""] + [f"![{i}]({i})" for i in images] + [""]
    return "\n".join(out)
