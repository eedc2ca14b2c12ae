"""The engine loop runs with rare cyclic collections (harness.engine.gc_quiet), which is
sound only if the loop makes no reference cycles: checked here by collecting, with the
collector off during the loop, what the loop left unreachable while its stack is alive."""

from __future__ import annotations

import gc
from typing import Any

import pytest

from harness.engine.engine import Engine
from harness.engine.gc_quiet import LOOP_GEN0, rare_collections
from harness.runner import run
from tests.compose import compose_cfg, tiny

ROOFLINE = ["executor=roofline", "roofline.model=Llama-3.1-8B", "roofline.hardware=a100-80gb",
            "logger=none", "cache.kv_budget=2GiB"]


def test_thresholds_are_raised_inside_and_restored_after_a_failure() -> None:
    before = gc.get_threshold()
    with pytest.raises(RuntimeError), rare_collections():
        assert gc.get_threshold() == (max(LOOP_GEN0, before[0]), *before[1:])
        raise RuntimeError("a failed run")
    assert gc.get_threshold() == before


def _loop_garbage(cfg: Any, monkeypatch: pytest.MonkeyPatch) -> tuple[int, int]:
    """(requests run, objects the engine loop left in cycles)."""
    found: list[int] = []
    real = Engine.run

    def counting(self: Engine, *a: Any, **k: Any) -> float:
        gc.collect()
        gc.disable()
        try:
            out = real(self, *a, **k)
            found.append(gc.collect())  # the engine, its stack and records still held
        finally:
            gc.enable()
        return out

    monkeypatch.setattr(Engine, "run", counting)
    r = run(cfg)
    monkeypatch.undo()
    return len(r.requests), found[0]


@pytest.mark.parametrize("workload", [
    ["workload=random", "workload.num_requests=300", "workload.rate=50"],
    ["workload=multiturn", "workload.conversations=60"],
    ["workload=parallel_sampling", "workload.num_requests=100"],
    ["workload=beam_search", "workload.num_requests=20"],
    ["workload=random", "workload.num_requests=300", "cache.kv_budget=256MiB",
     "scheduler.preemption_mode=swap", "cache.swap_space=1GiB"],
    ["workload=random", "workload.num_requests=200", "backend=h2o"],
])
def test_the_roofline_loop_makes_no_cycles(workload: list[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    n, garbage = _loop_garbage(compose_cfg([*workload, *ROOFLINE]), monkeypatch)
    assert n >= 20 and garbage == 0


def test_the_model_loop_makes_no_cycles(monkeypatch: pytest.MonkeyPatch) -> None:
    n, garbage = _loop_garbage(tiny("logger=none"), monkeypatch)
    assert n == 6 and garbage == 0
