"""The roofline experiments at paper scale, as markdown tables (times are modelled):

    python -m harness.roofline_tools.experiments [--only waste,70b,prefix,mla] [--scale 1.0]

``waste``: ``+experiment=memory_waste_at_scale`` (Llama-2-13B, one A100 40GB, ShareGPT-like
lengths): paged vs contiguous max / pow2 / exact. ``70b``: Llama-3.1-70B on 8 x H100,
bf16 vs fp8 vs int8 caches. ``prefix``: prefix caching on / off on multiturn, same stack.
``mla``: DeepSeek-V3 (MLA) vs Llama-3.1-70B (GQA): bytes per token and the sequences of
32k tokens the auto budget holds. ``--scale`` multiplies request counts (CI: small).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

from harness.roofline_tools.calibrate import compose

WASTE = ["+experiment=memory_waste_at_scale"]
R70 = ["+experiment=roofline_70b"]
VARIANTS = {"contiguous max": ["+variant=contiguous_max"],
            "contiguous pow2": ["+variant=contiguous_pow2"],
            "contiguous exact": ["+variant=contiguous_exact"],
            "paged (block 16)": ["+variant=paged_16"]}


def _run(overrides: list[str]) -> dict[str, Any]:
    from harness.runner import run

    return run(compose([*overrides, "progress=false"])).metrics


def _f(v: Any, fmt: str = "{:.1f}") -> str:
    return "-" if v is None else fmt.format(v)


def table(head: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(out + ["| " + " | ".join(r) + " |" for r in rows])


def waste(scale: float) -> str:
    n = max(20, int(1000 * scale))
    rows = []
    for name, ov in VARIANTS.items():
        m = _run([*WASTE, *ov, f"workload.num_requests={n}"])
        rows.append([name, _f(100 - m["memory.waste_pct"]), str(m["memory.max_running_seqs"]),
                     _f(m["throughput.requests_per_s"], "{:.2f}"),
                     _f(m["throughput.output_tokens_per_s"], "{:.0f}"),
                     _f(m["latency.ttft_ms.p50"], "{:.0f}"), _f(m["latency.itl_ms.p50"]),
                     _f(m["latency.e2e_ms.p50"] / 1e3), _f(m["engine.sim_wall_s"])])
    return table(["storage", "token-state share %", "max batch", "req/s", "output tok/s",
                  "TTFT p50 ms", "ITL p50 ms", "e2e p50 s", "sim s"], rows)


# Long prompts at a load where the cache binds: ~12k-token contexts at 12 req/s.
LONG = ["workload.input_mean=12000", "workload.input_std=6000", "workload.input_max=30000",
        "workload.output_mean=400", "workload.output_std=300", "workload.output_max=1024",
        "workload.rate=12", "scheduler.max_num_seqs=512",
        "scheduler.max_num_batched_tokens=8192", "scheduler.max_model_len=32768"]


def caches_70b(scale: float) -> str:
    rows = []
    for label, extra, n in (("ShareGPT 10 req/s", [], max(20, int(2000 * scale))),
                            ("12k prompts 12 req/s", LONG, max(20, int(1000 * scale)))):
        for b in ("paged", "fp8", "int8"):
            m = _run([*R70, f"backend={b}", f"workload.num_requests={n}", *extra])
            rows.append(_row_70b(label, b, m))
    return table(["workload", "cache", "KiB/token", "token capacity", "max batch",
                  "output tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms",
                  "preemptions"], rows)


def _row_70b(label: str, b: str, m: dict[str, Any]) -> list[str]:
    return [label, b if b != "paged" else "paged (bf16)",
            _f(m["roofline.kv_bytes_per_token"] / 1024, "{:.0f}"),
            str(m["memory.token_capacity"]), str(m["memory.max_running_seqs"]),
            _f(m["throughput.output_tokens_per_s"], "{:.0f}"),
            _f(m["latency.ttft_ms.p50"], "{:.0f}"), _f(m["latency.ttft_ms.p99"], "{:.0f}"),
            _f(m["latency.itl_ms.p50"]), _f(m["latency.itl_ms.p99"]),
            str(m["sched.preemptions_recompute"])]


def prefix(scale: float) -> str:
    conv = max(8, int(200 * scale))
    rows = []
    for on in ("true", "false"):
        m = _run(["executor=roofline", "roofline.model=Llama-3.1-70B", "roofline.tp=8",
                  "roofline.hardware=h100-sxm", "cache.kv_budget=auto", "workload=multiturn",
                  f"workload.conversations={conv}", "workload.turns=4", "workload.rate=2",
                  "workload.think_time_s=5", "workload.answer_tokens=200",
                  "scheduler.max_num_seqs=256", "scheduler.max_num_batched_tokens=2048",
                  "scheduler.max_model_len=8192", f"cache.enable_prefix_caching={on}"])
        rows.append([on, _f(m["cache.prefix_hit_rate"], "{:.3f}"),
                     str(m["cache.prefill_tokens_computed"]),
                     _f(m["throughput.total_tokens_per_s"], "{:.0f}"),
                     _f(m["latency.ttft_ms.p50"]), _f(m["latency.ttft_ms.p99"]),
                     _f(m["latency.itl_ms.p50"])])
    return table(["prefix caching", "hit rate", "prefill tokens computed", "total tok/s",
                  "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms"], rows)


def mla(scale: float) -> str:
    from harness.config import run_config
    from harness.model import ByteTokenizer
    from harness.roofline.run import build_roofline
    from harness.workloads import make_workload

    rows = []
    for model, hw, wdt in (("Llama-3.1-70B", "h100-sxm", "bfloat16"),
                           ("Llama-3.1-70B", "h200", "bfloat16"),
                           ("DeepSeek-V3", "h200", "fp8")):
        for backend in ("paged", "fp8"):
            rc = run_config(compose([
                "executor=roofline", f"roofline.model={model}", f"roofline.hardware={hw}",
                "roofline.tp=8", f"roofline.weight_dtype={wdt}", "cache.kv_budget=auto",
                f"backend={backend}", "workload=random", "workload.num_requests=1"]))
            st, _ = build_roofline(rc, make_workload(rc.workload, ByteTokenizer()), quiet=True)
            s = st.sizing
            rows.append([model, f"8x {hw}", wdt, "bf16" if backend == "paged" else "fp8",
                         _f(s.bytes_per_slot / 1024, "{:.1f}"),
                         _f(s.kv_budget_bytes / 2**30, "{:.0f}"), str(s.num_slots),
                         str(s.num_slots // 32768)])
    return table(["model", "hardware", "weights", "cache", "KiB/token", "KV budget GiB",
                  "token capacity", "seqs at 32k"], rows)


TABLES: dict[str, Callable[[float], str]] = {"waste": waste, "70b": caches_70b,
                                             "prefix": prefix, "mla": mla}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=",".join(TABLES))
    ap.add_argument("--scale", type=float, default=1.0)
    args = ap.parse_args(argv)
    for name in args.only.split(","):
        t0 = time.perf_counter()
        print(f"\n### {name}\n\n{TABLES[name](args.scale)}\n\n({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
