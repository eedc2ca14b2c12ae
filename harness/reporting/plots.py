"""The report's figures, as PNG files.

Figures are drawn on matplotlib's Agg canvas directly (no pyplot): no display is needed
and no global figure state is left behind in the caller's process. One colour per backend
in every figure, so the figures read together.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from harness.reporting.runs import Run, label
from harness.reporting.table import Comparison
from harness.reporting.task_plots import write_task_report

MIB = 2**20
QUALITY = [("quality.ppl_delta_pct", "perplexity delta %"), ("quality.kl_mean", "mean KL")]
MARKERS = "osD^vP*Xhp<>d"  # one per run in quality_vs_memory's legend


def _colors(backends: list[str]) -> dict[str, Any]:
    palette = [f"C{i}" for i in range(10)]
    return {b: palette[i % 10] for i, b in enumerate(sorted(set(backends)))}


def _grid(n: int, ncols: int, w: float, h: float,
          sharey: bool = False) -> tuple[Figure, list[Axes]]:
    """``n`` panels, ``ncols`` a row; ``sharey``: one y axis for all (panels that read
    against each other)."""
    ncols = max(1, min(ncols, n))
    nrows = math.ceil(n / ncols)
    fig = Figure(figsize=(w * ncols, h * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False, sharey=sharey).ravel().tolist()
    for ax in axes[n:]:
        ax.set_visible(False)
    return fig, axes[:n]


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=110)
    return path


def _backend_legend(ax: Axes, colors: dict[str, Any]) -> None:
    for b, c in colors.items():
        ax.scatter([], [], color=c, label=b)
    ax.legend(fontsize=8, loc="best")


def throughput_vs_waste(cmp: Comparison, path: Path) -> Path | None:
    """Output tokens/s against memory waste %, one panel per workload (up and left is good)."""
    f = cmp.frame
    need = {"throughput.output_tokens_per_s", "memory.waste_pct"}
    if f.empty or not need <= set(f.columns):
        return None
    colors = _colors(f["backend"].tolist())
    workloads = list(dict.fromkeys(f["workload"]))
    fig, axes = _grid(len(workloads), 3, 4.6, 3.6)
    for ax, wl in zip(axes, workloads):
        part = f[f["workload"] == wl]
        for _, row in part.iterrows():
            x, y = row["memory.waste_pct"], row["throughput.output_tokens_per_s"]
            ax.scatter([x], [y], color=colors[row["backend"]], s=40, zorder=3)
            low = row.get("throughput.output_tokens_per_s_ci95_low")
            high = row.get("throughput.output_tokens_per_s_ci95_high")
            if isinstance(low, float) and isinstance(high, float) and low == low:
                # a repeated run: the median's 95% interval over its repeats
                ax.errorbar([x], [y], yerr=[[y - low], [high - y]], fmt="none",
                            ecolor=colors[row["backend"]], capsize=3, zorder=2)
            tail = row["label"].removeprefix(row["backend"]).strip()
            if tail:
                ax.annotate(tail, (x, y), fontsize=7, xytext=(4, 3), textcoords="offset points")
        ax.set(title=f"workload: {wl}", xlabel="memory waste % (lower is better)",
               ylabel="output tokens/s (higher is better)")
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        _backend_legend(ax, {b: colors[b] for b in dict.fromkeys(part["backend"])})
    fig.suptitle("Throughput vs KV memory waste")
    return _save(fig, path)


def held_per_seq_bytes(run: Run) -> float | None:
    """KV bytes a sequence holds: the quality evaluation's own measure when the run has it
    (quality.kv_bytes_per_seq_mean: the texts the quality is scored on), else the workload's
    steps.csv (sum of reserved bytes / sum of running sequences over steps)."""
    q = (run.metrics or {}).get("quality.kv_bytes_per_seq_mean")
    if q is not None:
        return float(q)
    s = run.steps()
    if s.empty or not {"reserved_bytes", "running"} <= set(s.columns):
        return None
    busy = s[s["running"] > 0]
    return float(busy["reserved_bytes"].sum() / busy["running"].sum()) if len(busy) else None


def quality_vs_memory(cmp: Comparison, runs: list[Run], path: Path) -> Path | None:
    """Quality loss against KV bytes held per sequence: the lossy backends' trade-off.
    Points are named in a legend beside the panels (one entry per run: its backend's
    colour, a marker of its own), never by labels on the plot, which overlapped where
    runs held about the same memory."""
    present = [(k, t) for k, t in QUALITY if k in cmp.frame and cmp.frame[k].notna().any()]
    if not present:
        return None
    by_path = {str(r.path): r for r in runs}
    colors = _colors(cmp.frame["backend"].tolist())
    several = cmp.frame["workload"].nunique() > 1
    held = {row["path"]: held_per_seq_bytes(by_path[row["path"]])
            for _, row in cmp.frame.iterrows()}
    fig, axes = _grid(len(present), 2, 4.8, 3.8)
    entries: dict[str, Any] = {}  # legend text -> a handle
    for ax, (key, title) in zip(axes, present):
        for i, (_, row) in enumerate(cmp.frame.iterrows()):
            h = held[row["path"]]
            if h is None or row[key] is None or np.isnan(row[key]):
                continue
            name = row["label"] + (f" ({row['workload']})" if several else "")
            entries[name] = ax.scatter([h / 1024], [row[key]], color=colors[row["backend"]],
                                       marker=MARKERS[i % len(MARKERS)], s=40, zorder=3)
        ax.set(title=title, xlabel="KV KiB held per sequence (mean over steps)",
               ylabel=f"{title} (lower is better)")
        ax.grid(alpha=0.3)
    if entries:
        fig.legend(list(entries.values()), list(entries), loc="outside right upper",
                   fontsize=7, title="run", title_fontsize=8)
    fig.suptitle("Quality vs memory held per sequence")
    return _save(fig, path)


def kv_over_time(runs: list[Run], keys: list[str], path: Path) -> Path | None:
    """Reserved and used KV bytes over each run's time, one small panel per run, on one
    y axis (the panels read against each other: the same budget looks the same)."""
    every = [(r, r.steps()) for r in runs if r.metrics is not None]
    series = [(r, s) for r, s in every if not s.empty and "reserved_bytes" in s]
    _say_left_out(path, "steps", [r for r, s in every if not any(r is x for x, _ in series)])
    order = list(dict.fromkeys(r.workload for r, _ in series))
    series.sort(key=lambda rs: order.index(rs[0].workload))  # stable: path order within
    if not series:
        return None
    colors = _colors([r.backend for r, _ in series])
    fig, axes = _grid(len(series), 4, 3.6, 2.7, sharey=True)
    for ax, (r, s) in zip(axes, series):
        t, res, used = s["time_s"], s["reserved_bytes"] / MIB, s["used_bytes"] / MIB
        c = colors[r.backend]
        ax.fill_between(t, 0, used, step="post", color=c, alpha=0.45, label="used")
        ax.step(t, res, where="post", color=c, lw=1.2, label="reserved")
        ext = s.get("external_frag_bytes")
        if ext is not None and ext.any():
            ax.step(t, res + ext / MIB, where="post", color="k", lw=0.8, ls=":",
                    label="reserved + external")
        ax.set_title(f"{label(r, keys)}\n{r.workload}", fontsize=8)
        ax.set_xlabel("time (s)", fontsize=8)
        ax.set_ylabel("KV MiB", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="upper left")
    fig.suptitle("KV cache reserved vs used over time (the gap is waste)")
    return _save(fig, path)


def latency_cdfs(runs: list[Run], keys: list[str], path: Path) -> Path | None:
    """CDFs of TTFT and end-to-end latency of finished requests; one row per workload."""
    finished = [r for r in runs if r.metrics is not None]
    frames = {str(r.path): r.requests() for r in finished}
    done = [r for r in finished
            if {"ttft_ms", "e2e_ms"} <= set(frames[str(r.path)].columns)]
    _say_left_out(path, "requests", [r for r in finished if r not in done])
    if not done:
        return None
    workloads = list(dict.fromkeys(r.workload for r in done))
    colors = _colors([r.backend for r in done])
    fig = Figure(figsize=(10, 3.4 * len(workloads)), layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.subplots(len(workloads), 2, squeeze=False)
    styles = ["-", "--", ":", "-."]
    for row, wl in zip(grid, workloads):
        mine = [r for r in done if r.workload == wl]
        for col, (ax, key, name) in enumerate(zip(row, ["ttft_ms", "e2e_ms"],
                                                  ["TTFT", "end-to-end latency"])):
            seen: dict[str, int] = {}
            for r in mine:
                q = frames[str(r.path)]
                x = np.sort(q.loc[q["status"] == "finished", key].dropna().to_numpy(float))
                if not len(x):
                    continue
                y = np.arange(1, len(x) + 1) / len(x)
                ls = styles[seen.get(r.backend, 0) % len(styles)]
                seen[r.backend] = seen.get(r.backend, 0) + 1
                ax.step(x, y, where="post", color=colors[r.backend], ls=ls, label=label(r, keys))
            ax.set(title=f"{name} / {wl}", xlabel=f"{name} (ms)", ylabel="share of requests",
                   ylim=(0, 1.02))
            ax.grid(alpha=0.3)
            if col == 0 and ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7, loc="lower right")
    fig.suptitle("Latency CDFs (finished requests)")
    return _save(fig, path)


def _say_left_out(path: Path, records: str, runs: list[Run]) -> None:
    """One line on stderr naming the finished runs a figure leaves out for want of their
    records (issue #55: a missing requests.csv left a plot out without a word)."""
    if runs:
        print(f"kvbench report: {path.name} leaves out {len(runs)} run(s) without readable "
              f"{records} records: {', '.join(str(r.path) for r in runs)}", file=sys.stderr)


def write_plots(cmp: Comparison, runs: list[Run], out: Path) -> list[Path]:
    """Every figure that the runs have data for; returns the files written."""
    made = [
        throughput_vs_waste(cmp, out / "throughput_vs_waste.png"),
        quality_vs_memory(cmp, runs, out / "quality_vs_memory.png"),
        kv_over_time(runs, cmp.variant_keys, out / "kv_memory_over_time.png"),
        latency_cdfs(runs, cmp.variant_keys, out / "latency_cdf.png"),
    ]
    # ruler runs: depth x length heatmaps, the accuracy frontier, task_accuracy.md
    return [p for p in made if p is not None] + write_task_report(runs, cmp.variant_keys, out)
