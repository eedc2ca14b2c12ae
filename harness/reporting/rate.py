"""Latency against offered request rate: the figure of a rate sweep or an SLA search.

Runs of one workload that differ in their offered rate (``workload.rate``, or a trace's
``workload.speedup``) form one series per backend (and per other variant: block size,
reservation...). Panels: TTFT and TPOT p50 / p99, end-to-end p99, and the achieved
throughput next to the goodput (requests/s meeting the SLOs) when targets were set; the
targets themselves are drawn as dotted lines. Up to the knee latency stays flat; past the
rate the backend can serve, queues grow and TTFT climbs first.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from matplotlib.ticker import ScalarFormatter

from harness.reporting.plots import _colors, _grid, _save
from harness.reporting.runs import Run, label, variant_keys

RATE_KEYS = ("workload.rate", "workload.speedup")
# (title, p50 key, p99 key, SLO config key)
PANELS: list[tuple[str, str | None, str, str | None]] = [
    ("TTFT (ms)", "latency.ttft_ms.p50", "latency.ttft_ms.p99", "slo.ttft_ms"),
    ("TPOT (ms)", "latency.tpot_ms.p50", "latency.tpot_ms.p99", "slo.tpot_ms"),
    ("end-to-end latency (ms)", "latency.e2e_ms.p50", "latency.e2e_ms.p99", "slo.e2e_ms"),
]


def rate_key(runs: list[Run]) -> str | None:
    """The config key the runs' offered rate varies in, if any."""
    for key in RATE_KEYS:
        if len({r.config.get(key) for r in runs if key in r.config}) > 1:
            return key
    return None


def rate_series(runs: list[Run]) -> dict[tuple[str, str], list[tuple[float, Run]]]:
    """(workload, series label) -> [(rate, run)] sorted by rate, for every workload whose
    finished runs differ in rate; the label names the backend and its other variants."""
    done = [r for r in runs if r.metrics is not None]
    by_workload: dict[str, list[Run]] = defaultdict(list)
    for r in done:
        by_workload[r.workload].append(r)
    out: dict[tuple[str, str], list[tuple[float, Run]]] = {}
    for wl, members in by_workload.items():
        key = rate_key(members)
        if key is None:
            continue
        others = [k for k in variant_keys(members) if k != key]
        for r in members:
            if r.config.get(key) is not None:
                out.setdefault((wl, label(r, others)), []).append((float(r.config[key]), r))
    for pts in out.values():
        pts.sort(key=lambda p: p[0])
    return out


def _value(run: Run, key: str | None) -> float:
    v = (run.metrics or {}).get(key) if key else None
    return float("nan") if v is None else float(v)


def latency_vs_rate(runs: list[Run], path: Path) -> Path | None:
    """The figure (one row of panels per workload), or None when no workload's runs differ
    in rate."""
    series = rate_series(runs)
    if not series:
        return None
    workloads = list(dict.fromkeys(wl for wl, _ in series))
    colors = _colors([pts[0][1].backend for pts in series.values()])
    styles = ["-", "--", "-.", ":"]
    ncols = len(PANELS) + 1
    fig, axes = _grid(len(workloads) * ncols, ncols, 3.8, 3.0)
    for w, wl in enumerate(workloads):
        row = axes[w * ncols:(w + 1) * ncols]
        mine = [(lab, pts) for (k, lab), pts in series.items() if k == wl]
        key = rate_key([r for _, pts in mine for _, r in pts]) or RATE_KEYS[0]
        seen: dict[str, int] = defaultdict(int)
        targets: dict[str, Any] = {}
        for lab, pts in mine:
            backend = pts[0][1].backend
            ls, seen[backend] = styles[seen[backend] % len(styles)], seen[backend] + 1
            xs = [x for x, _ in pts]
            for ax, (_, p50, p99, slo) in zip(row, PANELS):
                ax.plot(xs, [_value(r, p99) for _, r in pts], color=colors[backend], ls=ls,
                        marker="o", ms=3, label=f"{lab} p99")
                ax.plot(xs, [_value(r, p50) for _, r in pts], color=colors[backend], ls=ls,
                        marker=".", ms=3, alpha=0.45)
                if slo and pts[0][1].config.get(slo) is not None:
                    targets[slo] = pts[0][1].config[slo]
            ax = row[-1]
            ax.plot(xs, [_value(r, "throughput.requests_per_s") for _, r in pts],
                    color=colors[backend], ls=ls, marker="o", ms=3, label=f"{lab} achieved")
            if any("latency.goodput_rps" in (r.metrics or {}) for _, r in pts):
                ax.plot(xs, [_value(r, "latency.goodput_rps") for _, r in pts],
                        color=colors[backend], ls=ls, marker="s", ms=3, alpha=0.5,
                        label=f"{lab} goodput")
        for ax, (title, _, _, slo) in zip(row, PANELS):
            if slo in targets:
                ax.axhline(float(targets[slo]), color="k", ls=":", lw=0.9, label="SLO")
            ax.set(title=f"{title} / {wl}", xlabel=f"offered rate ({key})", ylabel=title)
        row[-1].set(title=f"requests/s / {wl}", xlabel=f"offered rate ({key})",
                    ylabel="requests/s")
        row[-1].set_ylim(bottom=0)
        rates = [x for _, pts in mine for x, _ in pts]
        for ax in row:
            ax.grid(alpha=0.3, which="both")
            if min(rates) > 0 and max(rates) / min(rates) >= 4:  # rates swept by factors
                ax.set_xscale("log", base=2)
                ax.xaxis.set_major_formatter(ScalarFormatter())  # 0.5, 1, 2: not 2^-1
        for ax in row[:-1]:  # past the knee latency grows by orders of magnitude
            ax.set_yscale("log")
        row[0].legend(fontsize=6, loc="upper left")
        row[-1].legend(fontsize=6, loc="upper left")
    fig.suptitle("Latency vs offered request rate (p99 solid, p50 faint; log scales)")
    return _save(fig, path)


def write_rate_plots(runs: list[Run], out: Path) -> list[Path]:
    """The rate figure when the runs make one (for ``python -m harness.report``)."""
    made = latency_vs_rate(runs, out / "latency_vs_rate.png")
    return [made] if made is not None else []
