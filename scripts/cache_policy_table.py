"""The cache_policy experiment's tables (issue #58): every prefix-cache eviction order and
admission rule on four kinds of traffic, in the what-if (Llama-3.1-8B on one H100, with
and without a CPU tier) and on the real engine (the tiny model, this CPU).

    .venv/bin/python scripts/cache_policy_table.py [--only chat,rag] [--out FILE.json]

Runs each configuration in this process (the same runs `python -m harness -m
+experiment=cache_policy <workload options>` sweeps, one folder each) and prints one
markdown table per traffic: prefix hit rate (other requests' blocks, every tier), regret
(prompt blocks computed again because their content was evicted), TTFT p50 / p99 and
output tokens/s. The traces: traces/conversations.jsonl, traces/rag_example.jsonl
(`trace_synth --kind rag --rows 2000 --rate 20 --block 64 --output-median 64 --seed 1`)
and a Mooncake-like one written here (`trace_synth --rows 2000 --rate 10 --block 64
--input-median 1500 --output-median 100`, seed 0). ``rag-tier``: the RAG trace over the
8 GiB CPU tier, the device at lru / always, the tier's own order
(``cache.tiers.cpu_policy``) each of the six.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness.kv.eviction import ADMISSIONS, EVICTIONS  # noqa: E402

WHATIF = ["executor=roofline", "roofline.model=Llama-3.1-8B", "roofline.hardware=h100-sxm",
          "scheduler.max_num_seqs=64", "logger=none"]
TIER = "cache.tiers.cpu=8GiB"
# The device's orders over a CPU tier kept at lru (unset, the tier would take
# cache.eviction's order too); rag-tier varies the tier's order instead.
TIER_LRU = [TIER, "cache.tiers.cpu_policy=lru"]


def grids(mooncake: Path) -> dict[str, tuple[list[str], list[list[str]]]]:
    """Traffic -> (its options, the variants each policy runs under)."""
    budget = "cache.kv_budget=1536MiB"
    rag = ["workload=trace", "workload.path=traces/rag_example.jsonl",
           "workload.hash_block_tokens=64", "workload.speedup=0.25"]
    return {
        "chat": ([*WHATIF, budget, "workload=multiturn", "workload.conversations=48",
                  "workload.turns=4", "workload.answer_tokens=64", "workload.rate=4",
                  "workload.think_time_s=2"], [[], TIER_LRU]),
        "rag": ([*WHATIF, budget, *rag], [[], TIER_LRU]),
        "rag-tier": ([*WHATIF, budget, *rag],
                     [[TIER, f"cache.tiers.cpu_policy={p}"] for p in EVICTIONS]),
        "mooncake": ([*WHATIF, budget, "workload=trace", f"workload.path={mooncake}",
                      "workload.hash_block_tokens=64", "workload.speedup=0.1"], [[], TIER_LRU]),
        "conversations": ([*WHATIF, "cache.kv_budget=24GiB", "workload=trace",
                           "workload.path=traces/conversations.jsonl",
                           "workload.speedup=0.05"], [[]]),
        "tiny-engine": (["model=tiny", "workload=multiturn", "workload.conversations=6",
                         "workload.turns=3", "workload.answer_tokens=24",
                         "cache.kv_budget=1MiB", "backend.kernel=torch", "logger=none"], [[]]),
    }


def policies(traffic: str) -> list[tuple[str, str]]:
    if traffic in ("conversations", "tiny-engine"):  # (slow, or a CPU: the orders only)
        return [(e, "always") for e in EVICTIONS]
    if traffic == "rag-tier":  # (the tier's order varies: cache.tiers.cpu_policy)
        return [("lru", "always")]
    return [(e, a) for e in EVICTIONS for a in ADMISSIONS]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="comma-separated traffic names")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    from harness.runner import run
    from harness.workloads.trace_synth import write_mooncake_like
    from tests.compose import compose_cfg

    tmp = Path(tempfile.mkdtemp(prefix="kvbench-cache-policy-"))
    mooncake = tmp / "mooncake.jsonl"
    write_mooncake_like(mooncake, 2000, rate=10.0, seed=0, input_median=1500,
                        output_median=100, block=64)
    rows: list[dict[str, object]] = []
    for traffic, (opts, variants) in grids(mooncake).items():
        if a.only and traffic not in a.only.split(","):
            continue
        print(f"\n### {traffic}\n\n| eviction | admission | CPU tier | hit % | regret blocks "
              "| TTFT p50 / p99 (ms) | output tok/s | fast path |\n"
              "|---|---|---|---|---|---|---|---|", flush=True)
        for extra in variants:
            for ev, adm in policies(traffic):
                m = run(compose_cfg([*opts, *extra, f"cache.eviction={ev}",
                                     f"cache.admission={adm}"])).metrics
                rows.append({"traffic": traffic, "eviction": ev, "admission": adm,
                             "tier": bool(extra), **m})
                tier = f"8 GiB, {extra[1].split('=')[1]}" if extra else "-"
                print(f"| {ev} | {adm} | {tier} | "
                      f"{100 * float(m['cache.prefix_hit_rate']):.2f} | "
                      f"{m['cache.regret_blocks']} | {float(m['latency.ttft_ms.p50']):.0f} / "
                      f"{float(m['latency.ttft_ms.p99']):.0f} | "
                      f"{float(m['throughput.output_tokens_per_s']):.0f} | "
                      f"{m.get('run.fast_path', '-')} |", flush=True)
    if a.out:
        a.out.write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
