"""The roofline's fast path (decode lanes) against stepping one by one, in one benchmark
run: each round runs every variant once, in turn, as its own ``python -m harness``
process, and reads its simulation seconds (metrics.json ``engine.sim_wall_s``: the
engine loop, this CPU's time; ``engine.sim_cpu_s``: the CPU seconds the process ran in
it) and its peak RSS; the medians and their ratios are printed, by wall and by CPU time.
On a shared machine the wall ratio moves with the load (a variant that waits for a core
is charged for it); the CPU ratio is what each path cost.
The lane run's steps.csv, requests.csv and metrics are checked equal to the one-by-one
run's (but for this CPU's time and the name of the path).

    python scripts/bench_fast_path.py --requests 100000 --rate 100 --rounds 1
    python scripts/bench_fast_path.py --requests 100000 --rate 10 --rounds 1 \
        --baseline /tmp/snap-b471e65   # also: one by one as of an older commit

``--baseline DIR``: a snapshot made by scripts/snapshot_run.sh, run in the same rounds
with its own defaults (a snapshot from before the lanes steps one by one; a later one
takes the lanes unless ``--baseline-overrides roofline.fast_path=false``). Writes
``--out`` (JSON) when given.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOT_COMPARED = {"engine.sim_wall_s", "engine.sim_cpu_s", "run.fast_path", "run.started_at",
                "run.git_sha", "engine.peak_rss_bytes"}


def run_once(tree: Path, overrides: list[str],
             out: Path) -> tuple[float, float | None, int, Path]:
    """(simulation seconds, their CPU seconds (None: a snapshot from before they were
    recorded), peak RSS bytes, run folder) of one ``python -m harness``."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [sys.executable, "-m", "harness", *overrides, "logger=none", f"results_dir={out}"]
    p = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE)
    _, status, usage = os.wait4(p.pid, 0)
    err = p.stderr.read().decode() if p.stderr else ""
    if status != 0:
        raise SystemExit(f"bench_fast_path: {' '.join(cmd)} failed:\n{err[-2000:]}")
    (folder,) = [d for d in out.iterdir() if d.is_dir()]
    metrics = json.loads((folder / "metrics.json").read_text())
    cpu = metrics.get("engine.sim_cpu_s")
    return (float(metrics["engine.sim_wall_s"]), None if cpu is None else float(cpu),
            usage.ru_maxrss * 1024, folder)


def same_run(a: Path, b: Path) -> list[str]:
    """What differs between two run folders' records and metrics (empty: nothing)."""
    bad = []
    for name in ("steps.csv", "requests.csv"):
        with open(a / name) as fa, open(b / name) as fb:
            if list(csv.reader(fa)) != list(csv.reader(fb)):
                bad.append(name)
    ma = json.loads((a / "metrics.json").read_text())
    mb = json.loads((b / "metrics.json").read_text())
    bad += sorted(k for k in ma.keys() | mb.keys()
                  if k not in NOT_COMPARED and ma.get(k) != mb.get(k))
    return bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--rate", type=float, default=100.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--experiment", default="roofline_70b")
    ap.add_argument("--baseline", type=Path, default=None)
    ap.add_argument("--baseline-overrides", nargs="*", default=[],
                    help="harness overrides for the baseline snapshot's run only")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("overrides", nargs="*", help="more harness overrides")
    a = ap.parse_args(argv)
    base = [f"+experiment={a.experiment}", "backend=paged",
            f"workload.num_requests={a.requests}", f"workload.rate={a.rate}", *a.overrides]
    variants: dict[str, tuple[Path, list[str]]] = {
        "one by one": (ROOT, [*base, "roofline.fast_path=false"]),
        "lanes": (ROOT, [*base, "roofline.fast_path=true"])}
    if a.baseline is not None:
        rev = (a.baseline / "SNAPSHOT_REV").read_text().strip()[:7]
        extra = f" ({' '.join(a.baseline_overrides)})" if a.baseline_overrides else ""
        variants[f"snapshot @ {rev}{extra}"] = (a.baseline, [*base, *a.baseline_overrides])
    times: dict[str, list[float]] = {k: [] for k in variants}
    cpus: dict[str, list[float]] = {k: [] for k in variants}
    rss: dict[str, list[int]] = {k: [] for k in variants}
    diffs: list[str] = []
    with tempfile.TemporaryDirectory(prefix="bench-fast-path-") as tmp:
        for r in range(a.rounds):
            folders = {}
            for name, (tree, ov) in variants.items():
                out = Path(tmp) / f"{r}-{name.replace(' ', '_').replace('@', '')}"
                out.mkdir()
                s, c, m, folders[name] = run_once(tree, ov, out)
                times[name].append(s)
                if c is not None:
                    cpus[name].append(c)
                rss[name].append(m)
                cpu = f" ({c:.2f} s CPU)" if c is not None else ""
                print(f"round {r + 1}: {name}: {s:.2f} s{cpu}, {m / 2**20:.0f} MiB",
                      flush=True)
            diffs += same_run(folders["one by one"], folders["lanes"])
    med = {k: statistics.median(v) for k, v in times.items()}
    cmed = {k: statistics.median(v) for k, v in cpus.items() if v}
    result = {"requests": a.requests, "rate": a.rate, "experiment": a.experiment,
              "overrides": a.overrides, "rounds": a.rounds, "sim_wall_s": times,
              "sim_cpu_s": cpus, "peak_rss_bytes": rss, "median_s": med,
              "median_cpu_s": cmed,
              "speedup": {k: med[k] / med["lanes"] for k in med if k != "lanes"},
              "speedup_cpu": {k: cmed[k] / cmed["lanes"] for k in cmed if k != "lanes"},
              "lanes_equal_one_by_one": not diffs, "differs": sorted(set(diffs))}
    for k, v in result["speedup"].items():
        print(f"lanes vs {k}: {v:.2f}x wall ({med[k]:.1f} s -> {med['lanes']:.1f} s)")
    for k, v in result["speedup_cpu"].items():
        print(f"lanes vs {k}: {v:.2f}x CPU ({cmed[k]:.1f} s -> {cmed['lanes']:.1f} s)")
    print("lanes equal one by one:", "yes" if not diffs else f"NO: {sorted(set(diffs))}")
    if a.out is not None:
        a.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if not diffs else 1


if __name__ == "__main__":
    raise SystemExit(main())
