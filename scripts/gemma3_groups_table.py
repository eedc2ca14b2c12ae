"""The gemma3_groups experiment's table and plot, from its sweep folder:

    .venv/bin/python scripts/gemma3_groups_table.py results/sweeps/gemma3_groups-...
        [--plot docs/img/gemma3_groups/held_per_step.png]

One markdown row per run (the layout, sequences running at once, the pool's free share per
step, peak held bytes, preemptions, throughput, TTFT), then whether the two runs produced
the same tokens request by request; with --plot, the K/V bytes each held per step.
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

COLS = ("cache | KV budget | max running seqs | free share of the pool per step (mean / min) "
        "| peak held (MiB) | preemptions | output tok/s | TTFT p50 (s) | e2e p50 (s)")


def load(sweep: Path) -> list[dict[str, object]]:
    out = []
    for d in sorted(p for p in sweep.iterdir() if (p / "metrics.json").exists()):
        m = json.loads((d / "metrics.json").read_text())
        with (d / "steps.csv").open() as f:
            steps = list(csv.DictReader(f))
        with (d / "requests.csv").open() as f:
            reqs = {r["request_id"]: r["output_ids"] for r in csv.DictReader(f)}
        out.append({"dir": d.name, "m": m, "steps": steps, "outputs": reqs})
    return out


def row(r: dict[str, object]) -> str:
    m, steps = r["m"], r["steps"]
    assert isinstance(m, dict) and isinstance(steps, list)
    budget = float(m["memory.kv_budget_bytes"])
    free = [1.0 - float(s["reserved_bytes"]) / budget for s in steps]
    return (f"| {m['run.kv_groups']} | {budget / 2**20:.0f} MiB | "
            f"{m['memory.max_running_seqs']} | {100 * sum(free) / len(free):.0f}% / "
            f"{100 * min(free):.0f}% | {float(m['memory.peak_reserved_bytes']) / 2**20:.0f} | "
            f"{m['sched.preemptions_recompute']} | "
            f"{float(m['throughput.output_tokens_per_s']):.1f} | "
            f"{float(m['latency.ttft_ms.p50']) / 1e3:.1f} | "
            f"{float(m['latency.e2e_ms.p50']) / 1e3:.1f} |")


def plot(runs: list[dict[str, object]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    for r in runs:
        m, steps = r["m"], r["steps"]
        assert isinstance(m, dict) and isinstance(steps, list)
        t = [float(s["time_s"]) for s in steps]
        held = [float(s["reserved_bytes"]) / 2**20 for s in steps]
        label = "uniform (every layer every token)" if str(m["run.kv_groups"]).startswith(
            "uniform") else "KV cache groups"
        ax.plot(t, held, label=f"{label}: max {m['memory.max_running_seqs']} running")
    budget = float(runs[0]["m"]["memory.kv_budget_bytes"]) / 2**20  # type: ignore[index]
    ax.axhline(budget, color="grey", linestyle=":", label="KV budget")
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("K/V held (MiB)")
    ax.set_title("Gemma 3 270M, 12 requests of ~1.5k tokens, one budget")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweep", type=Path)
    ap.add_argument("--plot", type=Path)
    args = ap.parse_args()
    runs = load(args.sweep)
    print("| " + COLS + " |")
    print("|" + "---|" * len(COLS.split("|")))
    for r in runs:
        print(row(r))
    if len(runs) == 2:
        a, b = (r["outputs"] for r in runs)
        assert isinstance(a, dict) and isinstance(b, dict)
        same = sum(1 for k in a if a[k] == b.get(k))
        print(f"\nidentical outputs: {same} of {len(a)} requests, token for token")
    if args.plot:
        plot(runs, args.plot)


if __name__ == "__main__":
    main()
