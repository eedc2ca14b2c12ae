"""The disaggregation experiment's grid, table and plot (conf/experiment/disaggregation.yaml):

    .venv/bin/python scripts/disaggregation_table.py [--json results/disaggregation.json] \
        [--plot docs/img/disaggregation/goodput.png] [--set roofline.served=false ...]

For each configuration of one 8-GPU node (co-located replicas, or a prefill pool and a
decode pool over a link) and each KV dtype, the highest Poisson rate at which 90% of the
requests meet the experiment's SLOs, found by bisection (each probe one what-if run, in
this process); goodput per GPU is that rate over the configuration's GPUs (DistServe's
per-GPU goodput). Prints one markdown row per configuration, with its TTFT split and TPOT
at that rate, and the best disaggregated over the best co-located goodput per GPU. With
--json, the probes are kept there and read back instead of run again; --set adds
overrides to every probe (a variant of the grid: give it its own --json).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from omegaconf import open_dict

from harness.cluster.disagg_records import SPLIT
from harness.config import compose_config
from harness.runner import run

ATTAINMENT = 0.9  # DistServe's goodput: the highest rate with 90% of requests in SLO
LO, HI, STEP = 0.0, 16.0, 0.125  # req/s: the bisection's bounds and resolution
DIS = ["cluster.mode=disaggregated"]
# (label, GPUs, overrides): every configuration uses the node's 8 GPUs.
CONFIGS: list[tuple[str, int, list[str]]] = [
    ("co-located 4 x TP2", 8, ["cluster.replicas=4", "roofline.tp=2"]),
    ("co-located 2 x TP4", 8, ["cluster.replicas=2", "roofline.tp=4"]),
    *[(f"P:D {p}:{d} x TP2, {link}", 8,
       [*DIS, "roofline.tp=2", f"cluster.prefill_replicas={p}", f"cluster.decode_replicas={d}",
        f"cluster.link={link}"])
      for link in ("nvlink", "ib") for p, d in ((1, 3), (2, 2), (3, 1))],
    *[(f"P:D 1:1 x TP4, {link}", 8, [*DIS, "roofline.tp=4", f"cluster.link={link}"])
      for link in ("nvlink", "ib")],
]
BACKENDS = {"paged": "bf16", "fp8": "fp8"}
KEYS = ("latency.slo_attainment", "latency.goodput_rps", "latency.ttft_ms.p50",
        "latency.tpot_ms.p50", *(f"latency.ttft_ms.{k}.p50" for k in SPLIT),
        "cluster.prefill.utilization", "cluster.decode.utilization",
        "cluster.transfer_time_ms.p50", "run.engine", "run.engine_source",
        "run.expected_error")


def probe(overrides: list[str], rate: float, cache: dict[str, Any]) -> dict[str, Any]:
    """One run at ``rate`` (its metrics of :data:`KEYS`), from ``cache`` when there."""
    key = " ".join([*overrides, f"workload.rate={rate}"])
    if key not in cache:
        cfg = compose_config(["+experiment=disaggregation", *overrides,
                              f"workload.rate={rate}", "logger=none"])
        with open_dict(cfg):
            cfg.progress = False
        m = run(cfg).metrics
        cache[key] = {k: m.get(k) for k in KEYS}
    return dict(cache[key])


def highest_rate(overrides: list[str], cache: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """The highest rate (to :data:`STEP`) with SLO attainment >= 90%, and its metrics."""
    lo, hi = LO, HI
    best: dict[str, Any] = {}
    while hi - lo > STEP:
        mid = round((lo + hi) / 2 / STEP) * STEP
        m = probe(overrides, mid, cache)
        if (m["latency.slo_attainment"] or 0.0) >= ATTAINMENT:
            lo, best = mid, m
        else:
            hi = mid
    return lo, best


def ms(m: dict[str, Any], key: str) -> str:
    v = m.get(key)
    return f"{v:.0f}" if isinstance(v, int | float) else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="keep (and reuse) every probe's metrics here")
    ap.add_argument("--plot", type=Path, help="goodput per GPU per configuration (png)")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="overrides added to every probe (e.g. roofline.served=false)")
    args = ap.parse_args()
    cache: dict[str, Any] = {}
    if args.json is not None and args.json.exists():
        cache = json.loads(args.json.read_text())
    rows: list[tuple[str, str, float, dict[str, Any]]] = []
    try:
        for backend, kv in BACKENDS.items():
            for label, gpus, ov in CONFIGS:
                rate, m = highest_rate([f"backend={backend}", *ov, *args.set], cache)
                rows.append((kv, label, rate / gpus, m))
    finally:
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(cache, indent=1, sort_keys=True))
    print("| KV | configuration | goodput / GPU (req/s) | TTFT p50 (ms): front end / prefill "
          "queue / prefill / transfer / decode queue | TPOT p50 (ms) | busy: prefill / "
          "decode |")
    print("|---|---|---|---|---|---|")
    for kv, label, g, m in rows:
        split = " / ".join(ms(m, f"latency.ttft_ms.{k}.p50") for k in SPLIT)
        busy = (f"{m['cluster.prefill.utilization']:.2f} / {m['cluster.decode.utilization']:.2f}"
                if m.get("cluster.prefill.utilization") is not None else "-")
        print(f"| {kv} | {label} | {g:.3f} | {ms(m, 'latency.ttft_ms.p50')}"
              f"{' (' + split + ')' if 'P:D' in label else ''} | "
              f"{ms(m, 'latency.tpot_ms.p50')} | {busy} |")
    for kv in BACKENDS.values():
        co = max(g for k, label, g, _ in rows if k == kv and label.startswith("co-"))
        pd = max(g for k, label, g, _ in rows if k == kv and label.startswith("P:D"))
        print(f"\n{kv}: best P/D {pd:.3f} vs best co-located {co:.3f} req/s per GPU "
              f"({pd / co:.2f}x)" if co else f"\n{kv}: no co-located rate met the SLOs")
    if args.plot is not None:
        plot(rows, args.plot, " ".join(args.set))


def plot(rows: list[tuple[str, str, float, dict[str, Any]]], path: Path, variant: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [label for label, _, _ in CONFIGS]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.4
    for j, kv in enumerate(BACKENDS.values()):
        vals = [next(g for k, lab, g, _ in rows if k == kv and lab == label)
                for label in labels]
        ax.bar([i + (j - 0.5) * width for i in range(len(labels))], vals, width,
               label=f"{kv} KV")
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("goodput per GPU (req/s)")
    ax.set_title("Llama-3.1-70B FP8, 8 x H100, 3000 in / 150 out, TTFT <= 2 s, "
                 f"TPOT <= 50 ms (modelled{', ' + variant if variant else ''})", fontsize=9)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
