"""The tiered_cache experiments' table and plot, from their sweep folders:

    .venv/bin/python scripts/tiered_cache_table.py results/sweeps/tiered_cache-... [more]
        [--plot docs/img/tiered_cache/ttft_vs_cpu_tier.png]

Prints one markdown row per run (hit shares per tier, TTFT, TPOT, throughput, goodput,
bytes loaded, transfer seconds); with --plot, TTFT p50/p99 and goodput against the CPU
tier's size, paged and fp8.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from harness.units import parse_bytes

COLS = ("backend | tiers | hit gpu / cpu / disk / miss | TTFT p50 / p99 (s) | TPOT p50 (ms) "
        "| output tok/s | goodput (req/s) | SLO met | TB loaded | transfer s")


def rows(sweeps: list[Path]) -> list[dict[str, object]]:
    out = []
    for sweep in sweeps:
        for d in sorted(p for p in sweep.iterdir() if (p / "metrics.json").exists()):
            m = json.loads((d / "metrics.json").read_text())
            out.append({"dir": d.name, **m})
    return out


def fmt(m: dict[str, object]) -> str:
    def f(key: str, spec: str = "{:.2f}", scale: float = 1.0) -> str:
        v = m.get(key)
        return spec.format(float(v) * scale) if isinstance(v, int | float) else "-"

    up = sum(float(m.get(f"cache.tier.{t}.bytes_up", 0) or 0) for t in ("cpu", "disk"))
    hits = " / ".join(f(f"cache.hit_rate.{k}") for k in ("gpu", "cpu", "disk", "miss"))
    return (f"| {m['run.backend']} | {m['run.tiers']} | {hits} | "
            f"{f('latency.ttft_ms.p50', '{:.1f}', 1e-3)} / "
            f"{f('latency.ttft_ms.p99', '{:.1f}', 1e-3)} | {f('latency.tpot_ms.p50', '{:.1f}')} | "
            f"{f('throughput.output_tokens_per_s', '{:.0f}')} | {f('latency.goodput_rps')} | "
            f"{f('latency.slo_attainment')} | {up / 1e12:.2f} | "
            f"{f('cache.tier.transfer_s', '{:.1f}')} |")


def cpu_tier_bytes(m: dict[str, object]) -> float:
    tiers = str(m.get("run.tiers", "off"))
    if tiers == "off":
        return 0.0
    parts = dict(p.split("=", 1) for p in tiers.split(","))
    return parse_bytes(parts["cpu"]) if "disk" not in parts else -1.0  # disk runs: apart


def plot(runs: list[dict[str, object]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for backend, marker in (("paged", "o"), ("fp8", "s")):
        pts = sorted((cpu_tier_bytes(m) / 1e12, m) for m in runs
                     if m["run.backend"] == backend and cpu_tier_bytes(m) >= 0
                     and "through" not in str(m["run.tiers"]))
        xs = [x for x, _ in pts]
        for key, style in (("latency.ttft_ms.p50", "-"), ("latency.ttft_ms.p99", "--")):
            a.plot(xs, [float(m[key]) / 1e3 for _, m in pts], style, marker=marker,
                   label=f"{backend} {key.split('.')[-1]}")
        b.plot(xs, [float(m["latency.goodput_rps"]) for _, m in pts], marker=marker,
               label=backend)
    a.set_yscale("log")
    a.set_xlabel("CPU tier (TB)")
    a.set_ylabel("TTFT (s)")
    a.legend()
    b.set_xlabel("CPU tier (TB)")
    b.set_ylabel("goodput (req/s: TTFT <= 2 s, TPOT <= 100 ms)")
    b.legend()
    fig.suptitle("Llama-3.1-70B, 8xH100 (modelled): multi-turn, users back after ~2 min")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("sweeps", nargs="+", type=Path)
    ap.add_argument("--plot", type=Path)
    args = ap.parse_args()
    runs = rows(args.sweeps)
    print("| " + COLS + " |")
    print("|" + "---|" * len(COLS.split(" | ")))
    for m in runs:
        print(fmt(m))
    if args.plot:
        plot(runs, args.plot)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
