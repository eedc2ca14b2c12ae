"""A served what-if's API server (harness.metrics.api_server) against a brute-force
first-come-first-served single server, and on the engine: a burst queues there."""

from __future__ import annotations

import dataclasses
import random

import pytest

from harness.metrics.api_server import ApiServer
from harness.sched.sequence import SamplingParams
from harness.workloads.base import Request


def _fifo(jobs: list[tuple[float, int, float]]) -> list[float]:
    """Brute force: jobs (arrival, order, seconds) served one at a time, first come
    first served (ties by order); each job's completion, in the given order."""
    done = [0.0] * len(jobs)
    free = 0.0
    for i in sorted(range(len(jobs)), key=lambda i: (jobs[i][0], jobs[i][1])):
        free = max(free, jobs[i][0]) + jobs[i][2]
        done[i] = free
    return done


def _req(rid: int, at: float) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(max_tokens=4), arrival_s=at)


@pytest.mark.parametrize("seed", range(15))
def test_a_burst_then_its_outputs_match_a_fifo_server(seed: int) -> None:
    # Every input sent before the first output (a burst, and the idle server after):
    # the account is exact.
    rng = random.Random(seed)
    n, req_s, tok_s = rng.randint(1, 12), rng.uniform(0.001, 0.03), rng.uniform(0, 0.002)
    sent = sorted(rng.uniform(0.0, 0.01) for _ in range(n))
    api = ApiServer(req_s, tok_s)
    got = [r.arrival_s for r in api.retime(_req(i, t) for i, t in enumerate(sent))]
    steps = sorted(rng.uniform(0.011, 1.0) for _ in range(rng.randint(1, 20)))
    tokens = [rng.randint(1, 8) for _ in steps]
    for t, k in zip(steps, tokens):
        api.on_step(t, k)
    jobs = [(t, i, req_s) for i, t in enumerate(sent)] + \
        [(t, n + j, tok_s * k) for j, (t, k) in enumerate(zip(steps, tokens))]
    done = _fifo(jobs)
    assert got == pytest.approx(done[:n])
    assert [t + api.lag(t) for t in steps] == pytest.approx(done[n:])
    assert [api.wait_s(i) for i in range(n)] == pytest.approx(
        [d - s for d, s in zip(done[:n], sent)])
    assert api.final_lag() == pytest.approx(done[-1] - steps[-1])


def test_an_idle_server_only_adds_its_service() -> None:
    api = ApiServer(0.01, 0.001)
    assert [r.arrival_s for r in api.retime([_req(0, 0.0), _req(1, 5.0)])] == \
        pytest.approx([0.01, 5.01])
    api.on_step(1.0, 3)
    assert api.lag(1.0) == pytest.approx(0.003)
    assert api.lag(0.5) == 0.0  # before any step


def test_a_burst_queues_on_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    # 20 requests of 128 / 4 at once through 20 ms a request: they reach the engine
    # 20 ms apart, so the run lasts at least 0.4 s and the last first token comes after
    # every input; without the server (roofline.api_server=false) the engine alone.
    from harness.config import compose_config
    from harness.errors import UserError
    from harness.roofline import engines
    from harness.runner import run

    prof = dataclasses.replace(engines.PROFILES["vllm-v1"], request_s=0.0, prompt_token_s=0.0)
    monkeypatch.setitem(engines.PROFILES, "vllm-v1", prof)
    ov = ["executor=roofline", "roofline.model=Llama-3.1-8B", "roofline.engine=vllm-v1",
          "roofline.api_request_s=0.02", "roofline.api_token_s=0.001",
          "workload=random", "workload.num_requests=20", "workload.rate=0",
          "workload.distribution=uniform", "workload.input_min=128",
          "workload.input_max=128", "workload.output_min=4", "workload.output_max=4",
          "progress=false"]
    served = run(compose_config(ov))
    alone = run(compose_config([*ov, "roofline.api_server=false"]))
    s_rows = sorted(served.requests, key=lambda r: r["request_id"])
    assert served.metrics["engine.wall_s"] >= 0.4 > alone.metrics["engine.wall_s"]
    # Every first token, the first request's too (its engine made it after 20 ms and a
    # prefill), reaches its client after all 20 inputs: they were sent before it.
    assert min(s["ttft_ms"] for s in s_rows) >= 400.0
    assert max(a["ttft_ms"] for a in alone.requests) < 400.0
    assert served.metrics["throughput.requests_per_s"] < 20 / 0.4
    with pytest.raises(UserError, match=r"roofline.api_token_s=-0.001 is out of range"):
        run(compose_config([*ov, "roofline.api_token_s=-0.001"]))
    # A cluster's replicas run without it (the router feeds them), the same as off.
    two = [*ov, "cluster.replicas=2"]
    on, off = (run(compose_config(o)) for o in (two, [*two, "roofline.api_server=false"]))
    assert [r["ttft_ms"] for r in on.requests] == [r["ttft_ms"] for r in off.requests]


def test_the_grid_fit_recovers_an_api_server_it_made(monkeypatch: pytest.MonkeyPatch) -> None:
    # Two bursts "published" by a run at 15 ms + 100 us: the grid's best is that pair,
    # and the loss there is 0 (the figures are the what-if's own).
    from harness.roofline import engines
    from harness.roofline_tools import api_fit, validate

    monkeypatch.setattr(api_fit, "GRID", ((0.0, 0.015), (100e-6, 400e-6)))
    src = {"s": {"served": True, "fit_api": ["vllm-v1"]}}
    pts = [{"id": f"b{i}", "set": "fit", "source": "s", "engine": "vllm-v1",
            "model": "Llama-3.1-8B", "hardware": "h100-sxm", "tp": 1,
            "weight_dtype": "bfloat16", "backend": "paged", "workload": wl,
            "num_prompts": n, "rate": 0, "max_model_len": 2048, "figures": {}}
           for i, (wl, n) in enumerate((({"input": 128, "output": 4}, 30),
                                        ({"input": 512, "output": 32}, 12)))]
    assert api_fit.bursts("vllm-v1", pts, src, validate.served) == pts
    assert api_fit.bursts("sglang", pts, src, validate.served) == []
    truth = dataclasses.replace(engines.PROFILES["vllm-v1"], api_request_s=0.015,
                                api_token_s=100e-6)
    with monkeypatch.context() as m:
        m.setitem(engines.PROFILES, "vllm-v1", truth)
        for p, r in zip(pts, validate.run_all(pts, src, 1)):
            p["figures"] = {k: r["pred"][k] for k in ("requests_per_s", "ttft_ms_mean",
                                                      "tpot_ms_mean", "e2e_ms_median")}
    before = engines.PROFILES["vllm-v1"]
    fit = api_fit.fit_api("vllm-v1", pts,
                          lambda ps: validate.compare(ps, validate.run_all(ps, src, 1)))
    assert engines.PROFILES["vllm-v1"] is before  # the profile is left as it was
    assert fit is not None
    assert (fit["api_request_s"], fit["api_token_s"]) == (0.015, 100e-6)
    assert fit["api_loss"] == pytest.approx(0.0, abs=1e-9)
    assert len(fit["api_grid"]) == 4 and min(v for v, _, _ in fit["api_grid"]) == 0.0
