"""One matrix for all backends: every backend (easy to hard) through the same engine on
every workload, tiny model. Exact backends must give paged's tokens; every backend must
finish every request with coherent memory accounting."""

from __future__ import annotations

import pytest

from harness.backends import BACKENDS as REGISTRY
from harness.runner import RunResult, run
from tests.compose import block_size, compose_cfg

# Every registered backend, in the registry's order (easy to hard); a few get options
# that make their method act on these tiny workloads. Adding a backend to the registry
# adds it here; its `exact` flag says whether it must give paged's tokens.
EXTRA = {
    "contiguous": ["backend.reserve=exact"],
    "sliding_window": ["backend.window=64"],
    "streaming_llm": ["backend.window=64"],
    "h2o": ["backend.budget=48", "backend.budget_ratio=0"],
    "tova": ["backend.budget=48", "backend.budget_ratio=0"],
    "quest": ["backend.token_budget=16"],  # two blocks of 8: contexts here are longer
    "snapkv": ["backend.window=8"],  # prompts here are short: a window of 32 keeps them
    "pyramidkv": ["backend.window=4", "backend.beta=2"],  # (a window of 64 keeps them all)
    "adakv": ["backend.window=4"],
    "duo_attention": ["backend.sink_tokens=2", "backend.recent=4",
                      "backend.calibration_tokens=64"],
}
NEEDS_CUDA = {"flash_attn"}  # its adapter is tested on CPU in test_flash_attn.py
BACKENDS = [(name, EXTRA.get(name, []), cls.exact) for name, cls in REGISTRY.items()]
WORKLOADS = {
    "multiturn": ["workload.conversations=2", "workload.turns=2", "workload.system_words=8",
                  "workload.user_words=4", "workload.answer_tokens=6"],
    "shared_prefix": ["workload.num_requests=3", "workload.prefix_tokens=40",
                      "workload.output_tokens=6"],
    "beam_search": ["workload.num_requests=2", "workload.prompt_tokens=21",
                    "workload.output_tokens=6", "workload.n=3"],
    "parallel_sampling": ["workload.num_requests=2", "workload.prompt_tokens=21",
                          "workload.output_tokens=6", "workload.n=3"],
    "long_prompt": ["workload.num_short=2", "workload.short_output_tokens=6",
                    "workload.long_prompt_tokens=120", "workload.num_long=1",
                    "workload.long_start_s=0", "workload.long_output_tokens=4"],
    "random": ["workload.num_requests=4", "workload.input_max=40", "workload.output_max=8"],
}
_paged: dict[str, RunResult] = {}


def _run(backend: str, extra: list[str], workload: str) -> RunResult:
    return run(compose_cfg(["model=tiny", f"backend={backend}", *extra,
                            f"workload={workload}", *WORKLOADS[workload],
                            "cache.kv_budget=512KiB", *block_size(backend, 8)]))


@pytest.mark.parametrize("workload", list(WORKLOADS))
@pytest.mark.parametrize("backend,extra,exact", BACKENDS, ids=[b[0] for b in BACKENDS])
def test_backend_on_workload(backend: str, extra: list[str], exact: bool,
                             workload: str) -> None:
    if backend in NEEDS_CUDA:
        pytest.skip(f"backend {backend} runs on CUDA only")
    r = _run(backend, extra, workload)
    m = r.metrics
    assert m["requests.rejected"] == 0 and m["requests.finished"] == len(r.requests)
    assert 0 < m["memory.peak_used_bytes"] <= m["memory.peak_reserved_bytes"] \
        <= m["memory.kv_budget_bytes"]
    # The ledger's waste against an independent count: the per-step rows are snapshots of
    # the pool's own counters while each forward ran, summed here slot-step by slot-step.
    used = sum(s.used_bytes for s in r.steps)
    held = sum(s.reserved_bytes + s.external_frag_bytes for s in r.steps)
    assert m["memory.waste_pct"] == pytest.approx(100.0 * (1 - used / held), abs=1e-9)
    assert all(len(v) > 0 for v in r.outputs.values())
    assert m["attention.kv_read_bytes_per_token"] > 0  # every backend counts its reads
    if exact:
        if workload not in _paged:
            _paged[workload] = _run("paged", [], workload)
        assert r.outputs == _paged[workload].outputs
        if r.metrics["memory.token_capacity"] == _paged[workload].metrics[
                "memory.token_capacity"]:  # the same bytes per token: the same reads
            assert m["attention.kv_read_bytes_per_token"] == pytest.approx(
                _paged[workload].metrics["attention.kv_read_bytes_per_token"])
