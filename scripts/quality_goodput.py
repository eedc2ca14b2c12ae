"""The quality x goodput frontier (issue #59, part 3): task accuracy against the highest
request rate a method sustains within SLOs, at one fixed KV budget, per method and ratio.

    .venv/bin/python scripts/quality_goodput.py [--out results/quality_goodput] \\
        [--only paged,snapkv@25] [--phases accuracy,cpu,whatif] [--steps 2]
    .venv/bin/python scripts/quality_goodput.py --table-only --out results/quality_goodput

Per point (a method at a ratio; ``paged`` is the exact cache), three phases, each a set of
ordinary run folders under ``--out`` (a rerun reuses what is there):

- ``accuracy``: the RULER-style suite (``workload=ruler``, the default needle tasks, 1k
  prompts, 5 depths: 10 greedy requests) on SmolLM2-135M, this CPU: ``quality.task_accuracy``
  and its bootstrap interval (``accuracy/<point>/``);
- ``cpu``: ``python -m harness.sla``'s search (its :class:`Searcher`, not a second one) on
  the real engine, same model, ``+experiment=quality_goodput``: 16 Poisson arrivals of 256-token
  prompts (1k ones would make each probe minutes long on this CPU) under 18 MiB of KV,
  which holds ~1.5 of them in paged's fp32 (``cpu/<point>/``);
- ``whatif``: the same search with ``executor=roofline``, Llama-3.1-8B on one H100 SXM,
  4k-token prompts under 800 MiB (~1.5 of them in bf16 again: the same relative budget)
  (``whatif/<point>/``). The what-if has no words, so it has no accuracy: its goodput is
  paired with the CPU-measured accuracy of the same method and ratio.

A ratio is the share of each prompt a method keeps (snapkv, pyramidkv, h2o: ``budget_ratio``;
quest: tokens read per decode, ``token_budget``, of the prompt; it keeps every token). kivi's
points are its bit widths (the bytes kept are ~bits/16 of bf16's, ~bits/32 of fp32's, plus
scales and a full-precision residual block).

Writes ``<out>/frontier.json``, ``<out>/frontier.md`` (the table) and, with matplotlib,
``<out>/frontier.png`` (accuracy against goodput, CPU and what-if panels).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CPU_PROMPT = 1024  # the accuracy runs' prompt length
TRAFFIC_PROMPT = 256  # the CPU traffic's (conf/experiment/quality_goodput.yaml)
WHATIF_PROMPT = 4096
ATTAINMENT = 0.9
# kivi's full-precision residual pool, one block a running sequence: its default (32,
# scheduler.max_num_seqs' default) is 32 fp32 blocks of SmolLM2, 22.5 MiB, more than the
# CPU budget (18 MiB) itself. 10 covers what either bit width runs at once there (4-bit
# ~6, 2-bit ~9) and in the what-if's 800 MiB (20 MiB of it).
KIVI_RESIDUAL = 10

ACCURACY = ["workload=ruler", f"workload.lengths=[{CPU_PROMPT}]", "scheduler.max_model_len=2048",
            "cache.kv_budget=72MiB", "quality.generation_agreement=false", "logger=none"]
CPU = ["+experiment=quality_goodput", "logger=none"]
# The what-if: the same traffic's shape at 4k prompts; 800 MiB holds 1.5 of them in bf16
# (128 KiB a token), as 18 MiB holds 1.5 of the CPU's 256-token ones in fp32 (45 KiB a token).
WHATIF = ["+experiment=quality_goodput", "executor=roofline", "model=random_llama8b",
          "roofline.model=Llama-3.1-8B", "roofline.hardware=h100-sxm",
          "cache.kv_budget=800MiB", "scheduler.max_model_len=8192",
          f"workload.input_min={WHATIF_PROMPT}", "workload.num_requests=64",
          "slo.ttft_ms=2000", "slo.tpot_ms=50", "logger=none"]
# Rates searched: (lo, hi) per phase, geometric bisection between them; the what-if's
# probes take seconds, so it bisects further (5 steps leave the bracket within 19%).
RANGES = {"cpu": (0.25, 3.2), "whatif": (0.25, 64.0)}
WHATIF_STEPS = 5
REFUSED = "refused.txt"  # a search whose probe run failed: its message


@dataclass(frozen=True, slots=True)
class Point:
    """One method at one ratio: ``kept`` is the share of the prompt kept (or read: quest;
    or the bit width over 16: kivi), 1.0 for the exact cache."""

    method: str
    kept: float
    label: str

    def overrides(self, prompt: int) -> list[str]:
        """The backend's overrides for prompts of ``prompt`` tokens (quest's reads scale)."""
        if self.method == "paged":
            return []
        if self.method == "kivi":
            return [f"backend.bits={round(self.kept * 16)}",
                    f"backend.residual_blocks={KIVI_RESIDUAL}"]
        if self.method == "quest":
            return [f"backend.token_budget={round(self.kept * prompt)}"]
        return ["backend.budget=0", f"backend.budget_ratio={self.kept}"]


def point(method: str, kept: float) -> Point:
    tag = "exact" if method == "paged" else (f"{round(kept * 16)}bit" if method == "kivi"
                                            else f"{round(kept * 100)}")
    return Point(method, kept, f"{method}@{tag}")


POINTS = [point("paged", 1.0),
          *(point(m, k) for m in ("snapkv", "pyramidkv", "h2o", "quest") for k in (0.25, 0.5)),
          point("kivi", 0.25), point("kivi", 0.125)]


@dataclass(slots=True)
class Row:
    """One point's results: None where a phase was not run (or failed)."""

    label: str
    method: str
    kept: float
    accuracy: float | None = None
    ci: tuple[float, float] | None = None
    # The highest passing rate, the lowest failing one (None: even hi passed), and
    # whether even lo failed; per phase.
    goodput: dict[str, dict[str, Any]] = field(default_factory=dict)


def read_accuracy(folder: Path) -> tuple[float, tuple[float, float] | None] | None:
    """(accuracy, 95% interval) from a run folder's metrics.json, or None."""
    f = folder / "metrics.json"
    if not f.is_file():
        return None
    m = json.loads(f.read_text())
    acc = m.get("quality.task_accuracy")
    if acc is None:
        return None
    lo, hi = m.get("quality.task_accuracy_ci95_low"), m.get("quality.task_accuracy_ci95_high")
    return float(acc), (None if lo is None or hi is None else (float(lo), float(hi)))


def read_search(folder: Path, method: str) -> dict[str, Any] | None:
    """A finished search's answer (the sla.json this script writes per point), or None."""
    f = folder / "sla.json"
    if not f.is_file():
        refused = folder / REFUSED
        return {"refused": refused.read_text().strip()} if refused.is_file() else None
    b = json.loads(f.read_text())["backends"].get(method)
    return None if b is None else {"best": b["best"], "first_fail": b["first_fail"]}


def fmt_goodput(g: dict[str, Any] | None, hi: float) -> str:
    """'1.2 (fails 1.6)', '>= hi' when even ``hi`` passed, '< lo' when even lo failed."""
    if g is None:
        return "not run"
    if "refused" in g:
        return f"run failed ({REFUSED})"
    if g["best"] is None:
        return f"< {g['first_fail']:.3g}"
    if g["first_fail"] is None:
        return f">= {hi:.3g}"
    return f"{g['best']:.3g} (fails {g['first_fail']:.3g})"


def fmt_accuracy(r: Row) -> str:
    if r.accuracy is None:
        return "not run"
    ci = "" if r.ci is None else f" [{r.ci[0]:.2f}, {r.ci[1]:.2f}]"
    return f"{r.accuracy:.2f}{ci}"


def kept_text(r: Row) -> str:
    if r.method == "paged":
        return "100% (exact)"
    if r.method == "kivi":
        return f"{round(r.kept * 16)}-bit"
    return f"{r.kept:.0%}" + (" read" if r.method == "quest" else "")


def table(rows: list[Row]) -> str:
    """The page's markdown table, rows in the order given."""
    lines = ["| method | kept | accuracy [95% CI] (CPU) | CPU goodput req/s | "
             "what-if goodput req/s (H100, CPU accuracy) |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.method} | {kept_text(r)} | {fmt_accuracy(r)} | "
                     f"{fmt_goodput(r.goodput.get('cpu'), RANGES['cpu'][1])} | "
                     f"{fmt_goodput(r.goodput.get('whatif'), RANGES['whatif'][1])} |")
    return "\n".join(lines) + "\n"


def frontier(rows: list[Row], phase: str) -> list[str]:
    """Labels of the points on the phase's Pareto frontier (no other point has both higher
    or equal accuracy and goodput, one of them strictly): the points to choose among."""
    pts = [(r.label, r.accuracy, r.goodput[phase]["best"]) for r in rows
           if r.accuracy is not None and r.goodput.get(phase, {}).get("best") is not None]
    return [a for a, acc, g in pts
            if not any(acc2 >= acc and g2 >= g and (acc2 > acc or g2 > g)
                       for _, acc2, g2 in pts)]


def collect(out: Path, points: list[Point]) -> list[Row]:
    rows = []
    for p in points:
        r = Row(p.label, p.method, p.kept)
        got = read_accuracy(out / "accuracy" / p.label)
        if got is not None:
            r.accuracy, r.ci = got
        for phase in RANGES:
            g = read_search(out / phase / p.label, p.method)
            if g is not None:
                r.goodput[phase] = g
        rows.append(r)
    return rows


def plot(rows: list[Row], path: Path) -> Path | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6), dpi=90)
    titles = {"cpu": "real engine, SmolLM2-135M, 2-core CPU",
              "whatif": "what-if, Llama-3.1-8B on H100 (CPU accuracy)"}
    for ax, phase in zip(axes, RANGES, strict=True):
        tied: dict[tuple[float, float], list[str]] = {}  # one label per spot
        for r in rows:
            g = r.goodput.get(phase)
            if r.accuracy is None or g is None or g.get("best") is None:
                continue
            yerr = None if r.ci is None else [[r.accuracy - r.ci[0]], [r.ci[1] - r.accuracy]]
            # ">": never failed, the rate is a lower bound
            ax.errorbar(g["best"], r.accuracy, yerr=yerr, ms=5, capsize=2,
                        fmt="o" if g["first_fail"] is not None else ">",
                        color="black" if r.method == "paged" else None)
            tied.setdefault((g["best"], r.accuracy), []).append(r.label)
        for (x, y), labels in tied.items():
            ax.annotate(", ".join(labels), (x, y), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
        ax.set_xscale("log")
        ax.set_xlabel("max rate within SLOs (req/s)")
        ax.set_ylabel("RULER accuracy (1k prompts)")
        ax.set_ylim(-0.05, 1.1)
        ax.set_title(titles[phase], fontsize=9)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def run_accuracy(out: Path, p: Point) -> None:
    folder = out / "accuracy" / p.label
    if read_accuracy(folder) is not None:
        return
    if folder.exists():  # an earlier attempt without results
        from harness.results import set_aside
        set_aside(folder, out)
    cmd = [sys.executable, "-m", "harness", *ACCURACY, f"backend={p.method}",
           *p.overrides(CPU_PROMPT), f"hydra.run.dir={folder}", "progress=false"]
    print(f"accuracy {p.label}: {' '.join(cmd[3:])}", flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def run_search(out: Path, phase: str, p: Point, steps: int) -> None:
    from harness.app.sla import ProbeFailed, Searcher, check_overrides, write_outputs

    base = CPU if phase == "cpu" else WHATIF
    overrides = [*base, *p.overrides(TRAFFIC_PROMPT if phase == "cpu" else WHATIF_PROMPT)]
    lo, hi = RANGES[phase]
    check_overrides(overrides, [p.method], "workload.rate")
    folder = out / phase / p.label
    folder.mkdir(parents=True, exist_ok=True)
    try:
        res = Searcher(folder, overrides, "workload.rate", ATTAINMENT).search(
            p.method, lo, hi, steps if phase == "cpu" else WHATIF_STEPS)
    except ProbeFailed as e:  # a refused point (a budget too small for it) is a result
        (folder / REFUSED).write_text(str(e) + "\n")
        print(f"{phase} {p.label}: {e}", flush=True)
        return
    write_outputs(folder, [res], "workload.rate", ATTAINMENT, overrides)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("results/quality_goodput"))
    ap.add_argument("--only", default="", help="comma-separated labels or methods")
    ap.add_argument("--phases", default="accuracy,cpu,whatif")
    ap.add_argument("--steps", type=int, default=2, help="bisection steps of the CPU searches (2)")
    ap.add_argument("--table-only", action="store_true", help="read the folders, run nothing")
    args = ap.parse_args(argv)
    want = {s for s in args.only.split(",") if s}
    points = [p for p in POINTS if not want or p.label in want or p.method in want]
    if not points:
        print(f"--only {args.only}: no point; known: {', '.join(p.label for p in POINTS)}",
              file=sys.stderr)
        return 2
    phases = [s for s in args.phases.split(",") if s]
    if not args.table_only:
        for phase in phases:
            for p in points:
                if phase == "accuracy":
                    run_accuracy(args.out, p)
                else:
                    run_search(args.out, phase, p, args.steps)
    rows = collect(args.out, points)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "frontier.json").write_text(json.dumps([asdict(r) for r in rows], indent=2))
    md = table(rows) + "".join(f"\nPareto frontier ({ph}): {', '.join(frontier(rows, ph))}\n"
                               for ph in RANGES)
    (args.out / "frontier.md").write_text(md)
    png = plot(rows, args.out / "frontier.png")
    print(md + (f"\nplot: {png}" if png else "\nno plot: matplotlib is not installed"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
