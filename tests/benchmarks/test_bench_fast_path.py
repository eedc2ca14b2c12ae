"""pytest-benchmark: the roofline's fast path (decode lanes, harness/roofline/fastpath) against
stepping one by one, measured in the same run.

Run: ``.venv/bin/python -m pytest tests/benchmarks/test_bench_fast_path.py
--benchmark-enable``. A 400-request ShareGPT-like run on Llama-3.1-70B / 8 x H100 at
100 req/s (``max_num_seqs=256``), each path twice, alternating; the ratio of their
simulation seconds (``engine.sim_wall_s``) is ``extra_info["speedup"]``. Without
``--benchmark-enable`` it runs once, as a test. The full-size figures (100,000 requests)
come from scripts/bench_fast_path.py (docs/whatif_scale.md).
"""

from __future__ import annotations

from typing import Any

from harness.runner import run
from tests.compose import compose_cfg

CFG = ["+experiment=roofline_70b", "backend=paged", "workload.num_requests=400",
       "workload.rate=100", "logger=none"]


def test_lanes_against_one_by_one(benchmark: Any) -> None:
    times: dict[bool, list[float]] = {False: [], True: []}
    metrics: dict[bool, dict[str, Any]] = {}

    def both() -> None:
        for fast in (False, True):
            m = run(compose_cfg([*CFG, f"roofline.fast_path={str(fast).lower()}"])).metrics
            times[fast].append(m["engine.sim_wall_s"])
            metrics[fast] = m

    benchmark.pedantic(both, rounds=2, iterations=1)
    speedup = min(times[False]) / min(times[True])
    benchmark.extra_info["speedup"] = speedup
    assert metrics[True]["run.fast_path"] == "lanes"
    assert metrics[True]["latency.ttft_ms.p99"] == metrics[False]["latency.ttft_ms.p99"]
    assert metrics[True]["latency.itl_ms.p99"] == metrics[False]["latency.itl_ms.p99"]
    # ~3.5x here on a quiet machine (docs/whatif_scale.md); a floor a loaded one keeps
    assert speedup > 1.5
