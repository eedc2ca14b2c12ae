"""The report's task-accuracy part (runs of ``workload=ruler``): a depth x length accuracy
heatmap per run, a frontier of accuracy against KV bytes held per sequence and against
throughput (one point per backend/variant, with its bootstrap interval), and a markdown
table of the same figures (``task_accuracy.md``).

KV bytes held per sequence are counted *logically*: the blocks each sequence's table
holds (steps.csv ``logical_blocks``), not the distinct blocks in the pool. The suite's
questions share their haystacks, so the pool holds fewer bytes than the sequences
address; what a backend saves per sequence is what the frontier is about.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from harness.reporting.runs import Run, label

ACC = "quality.task_accuracy"


def _task_runs(runs: list[Run]) -> list[Run]:
    return [r for r in runs if r.metrics is not None and ACC in r.metrics]


def held_logical_bytes(run: Run) -> float | None:
    """Mean KV bytes one running sequence's block table holds, over the run's steps."""
    s = run.steps()
    need = {"reserved_bytes", "held_blocks", "logical_blocks", "running"}
    if s.empty or not need <= set(s.columns):
        return None
    busy = s[(s["running"] > 0) & (s["held_blocks"] > 0)]
    if busy.empty:
        return None
    per_block = float(busy["reserved_bytes"].sum() / busy["held_blocks"].sum())
    return float(busy["logical_blocks"].sum() / busy["running"].sum() * per_block)


def depth_length_grid(run: Run) -> pd.DataFrame:
    """Mean score by needle depth (rows, %) x prompt length (columns), needle tasks only."""
    q = run.requests()
    if q.empty or not {"depth", "length", "score"} <= set(q.columns):
        return pd.DataFrame()
    q = q[q["depth"] >= 0].copy()
    # Realised depths sit near the configured ones: bin them to the nearest 5%.
    q["depth_bin"] = (q["depth"] / 5).round() * 5
    return q.pivot_table(index="depth_bin", columns="length", values="score", aggfunc="mean")


def heatmaps(runs: list[Run], keys: list[str], path: Path) -> Path | None:
    grids = [(r, depth_length_grid(r)) for r in _task_runs(runs)]
    grids = [(r, g) for r, g in grids if not g.empty]
    if not grids:
        return None
    ncols = min(4, len(grids))
    nrows = math.ceil(len(grids) / ncols)
    fig = Figure(figsize=(3.4 * ncols, 3.0 * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    im = None
    for ax, (r, g) in zip(axes, grids):
        im = ax.imshow(g.to_numpy(float), vmin=0, vmax=1, cmap="RdYlGn", aspect="auto",
                       origin="upper")
        ax.set_xticks(range(len(g.columns)), [str(c) for c in g.columns], fontsize=7)
        ax.set_yticks(range(len(g.index)), [f"{d:g}" for d in g.index], fontsize=7)
        for (i, j), v in np.ndenumerate(g.to_numpy(float)):
            if not np.isnan(v):
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7)
        ax.set_title(label(r, keys), fontsize=8)
        ax.set_xlabel("prompt tokens", fontsize=8)
        ax.set_ylabel("needle depth %", fontsize=8)
    for ax in axes[len(grids):]:
        ax.set_visible(False)
    if im is not None:
        fig.colorbar(im, ax=axes[:len(grids)].tolist(), shrink=0.8, label="accuracy")
    fig.suptitle("Task accuracy by needle depth and context length")
    fig.savefig(path, dpi=110)
    return path


def frontier(runs: list[Run], keys: list[str], path: Path) -> Path | None:
    done = _task_runs(runs)
    if not done:
        return None
    fig = Figure(figsize=(10, 4), layout="constrained")
    FigureCanvasAgg(fig)
    ax_mem, ax_tp = fig.subplots(1, 2)
    for i, r in enumerate(done):
        m = r.metrics or {}
        y = float(m[ACC])
        err = [[y - float(m.get(f"{ACC}_ci95_low", y))], [float(m.get(f"{ACC}_ci95_high", y)) - y]]
        color = f"C{i % 10}"
        for ax, x in ((ax_mem, held_logical_bytes(r)),
                      (ax_tp, m.get("throughput.total_tokens_per_s"))):
            if x is None:
                continue
            x = float(x) / (2**20 if ax is ax_mem else 1)
            ax.errorbar([x], [y], yerr=err, fmt="o", color=color, capsize=3)
            ax.annotate(label(r, keys), (x, y), fontsize=7, xytext=(4, 3),
                        textcoords="offset points")
    ax_mem.set(xlabel="KV MiB held per sequence (mean over steps)",
               ylabel="task accuracy (95% CI)", title="accuracy vs memory")
    ax_tp.set(xlabel="total tokens/s", ylabel="task accuracy (95% CI)",
              title="accuracy vs throughput")
    for ax in (ax_mem, ax_tp):
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    fig.suptitle("Long-context accuracy frontier (one point per backend / variant)")
    fig.savefig(path, dpi=110)
    return path


def _ci(m: dict[str, object], key: str) -> str:
    v, lo, hi = m.get(key), m.get(f"{key}_ci95_low"), m.get(f"{key}_ci95_high")
    if v is None:
        return "-"
    return f"{float(v):.2f}" + (f" [{float(lo):.2f}, {float(hi):.2f}]"  # type: ignore[arg-type]
                                if lo is not None and hi is not None else "")


def table(runs: list[Run], keys: list[str]) -> str:
    """Markdown: per run, accuracy with its interval, per task, per length, memory, speed
    (total tok/s: prompt and output tokens per second, as RULER's runs are mostly prompt;
    the report's table and the run summary show output tok/s)."""
    done = _task_runs(runs)
    if not done:
        return ""
    ms = [r.metrics or {} for r in done]
    tasks = sorted({k.split(".")[2] for m in ms for k in m
                    if k.startswith(ACC + ".") and k.count(".") == 2 and "_ci95" not in k
                    and k.split(".")[2] != "all"})
    lengths = sorted({int(k.split(".")[3]) for m in ms for k in m
                      if k.startswith(ACC + ".all.") and "_ci95" not in k})
    # Against the reference's answers: right ones the run got wrong, output lengths.
    vs_ref = [("right -> wrong", "quality.right_to_wrong_share"),
              ("output len / ref", "quality.output_length_ratio")]
    head = (["run", "accuracy [95% CI]", *tasks, *[f"all @{n}" for n in lengths],
             *[h for h, _ in vs_ref], "KV MiB / seq", "total tok/s", "wall s"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r, m in zip(done, ms):
        held = held_logical_bytes(r)
        cells = [label(r, keys), _ci(m, ACC),
                 *[f"{float(m[f'{ACC}.{t}']):.2f}" if f"{ACC}.{t}" in m else "-" for t in tasks],
                 *[f"{float(m[f'{ACC}.all.{n}']):.2f}" if f"{ACC}.all.{n}" in m else "-"
                   for n in lengths],
                 *[f"{float(m[k]):.2f}" if k in m else "-" for _, k in vs_ref],
                 "-" if held is None else f"{held / 2**20:.1f}",
                 f"{float(m.get('throughput.total_tokens_per_s', 0)):.0f}",
                 f"{float(m.get('engine.wall_s', 0)):.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_task_report(runs: list[Run], keys: list[str], out: Path) -> list[Path]:
    """Heatmaps, frontier and task_accuracy.md for the runs that have task accuracy."""
    md = table(runs, keys)
    if not md:
        return []
    made = [heatmaps(runs, keys, out / "task_depth_length.png"),
            frontier(runs, keys, out / "task_frontier.png")]
    (out / "task_accuracy.md").write_text(md)
    return [p for p in made if p is not None] + [out / "task_accuracy.md"]
