"""The cluster_routing experiment's table and plot, from its sweep folder:

    .venv/bin/python scripts/cluster_table.py results/sweeps/cluster_routing-... [more] \
        [--plot docs/img/cluster_routing/routers.png]

Prints one markdown row per run (backend, router: prefix hit rate, TTFT p50 / p90 / p99, TPOT
p50, output tokens/s, goodput and SLO attainment, load imbalance, recompute preemptions);
with --plot, hit rate and TTFT p99 per router, one bar per backend (prefix_aware: its
default scorer, dynamo).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from harness.reporting.runs import find_runs

ROUTERS = ("round_robin", "random", "least_loaded", "prefix_aware")
BACKENDS = ("paged", "fp8", "int8", "kivi")  # the table's and the plot's order


def _backend_key(name: object) -> tuple[int, str]:
    return (BACKENDS.index(str(name)) if name in BACKENDS else len(BACKENDS), str(name))
COLS = ("backend | router | prefix hit rate | TTFT p50 / p90 / p99 (s) | TPOT p50 (ms) | "
        "output tok/s | goodput (req/s) | SLO met | load imbalance | preemptions")


def runs(sweeps: list[Path]) -> list[dict[str, object]]:
    """The finished runs' metrics at or below ``sweeps`` (as the report finds them)."""
    out: list[dict[str, object]] = [r.metrics for r in find_runs(sweeps)
                                    if r.metrics is not None]
    order = {r: i for i, r in enumerate(ROUTERS)}
    return sorted(out, key=lambda m: (_backend_key(m["run.backend"]),
                                      order.get(str(m.get("run.router")), 9),
                                      str(m.get("run.prefix_scorer", ""))))


def fmt(m: dict[str, object]) -> str:
    def f(key: str, spec: str = "{:.2f}", scale: float = 1.0) -> str:
        v = m.get(key)
        return spec.format(float(v) * scale) if isinstance(v, int | float) else "-"

    router = str(m.get("run.router", "-"))
    if "run.prefix_scorer" in m:
        router += f" ({m['run.prefix_scorer']})"
    return (f"| {m['run.backend']} | {router} | "
            f"{f('cache.prefix_hit_rate')} | {f('latency.ttft_ms.p50', '{:.2f}', 1e-3)} / "
            f"{f('latency.ttft_ms.p90', '{:.2f}', 1e-3)} / "
            f"{f('latency.ttft_ms.p99', '{:.2f}', 1e-3)} | {f('latency.tpot_ms.p50', '{:.1f}')} | "
            f"{f('throughput.output_tokens_per_s', '{:.0f}')} | {f('latency.goodput_rps')} | "
            f"{f('latency.slo_attainment')} | {f('cluster.load_imbalance')} | "
            f"{m.get('sched.preemptions_recompute', '-')} |")


def plot(ms: list[dict[str, object]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    backends = sorted({str(m["run.backend"]) for m in ms}, key=_backend_key)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(1, len(backends))
    for k, b in enumerate(backends):
        by = {str(m.get("run.router")): m for m in ms if m["run.backend"] == b
              and m.get("run.prefix_scorer", "dynamo") == "dynamo"}
        xs = [i + k * width for i in range(len(ROUTERS))]
        for ax, key, scale in ((axes[0], "cache.prefix_hit_rate", 1.0),
                               (axes[1], "latency.ttft_ms.p99", 1e-3)):
            ax.bar(xs, [float(by[r][key]) * scale if r in by else 0.0  # type: ignore[arg-type]
                        for r in ROUTERS], width, label=b)
    for ax, title in ((axes[0], "prefix hit rate"), (axes[1], "TTFT p99 (s, log)")):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(ROUTERS))], ROUTERS)
        ax.set_title(title)
    axes[1].set_yscale("log")
    axes[0].legend()
    fig.suptitle("8 x Llama-3.1-8B on L40S behind a router, multi-turn trace (modelled)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sweeps", type=Path, nargs="+")
    ap.add_argument("--plot", type=Path, default=None)
    a = ap.parse_args()
    missing = [str(p) for p in a.sweeps if not p.exists()]
    if missing:
        ap.error(f"no such folder: {', '.join(missing)} (give sweep or run folders)")
    ms = runs(a.sweeps)
    print(f"| {COLS} |")
    print("|" + "---|" * (COLS.count("|") + 1))
    for m in ms:
        print(fmt(m))
    if a.plot is not None:
        plot(ms, a.plot)


if __name__ == "__main__":
    main()
