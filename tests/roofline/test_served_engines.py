"""Issue #53's findings 5-8, each at its mechanism: the what-if's served engines as they
schedule (vLLM V1 and SGLang apart), their prefix caching against recompute thrash, their
own all-reduce kernels and CPU overlap, and a served front end's latency. Each test fails
on e82b94d's code (where vllm-v1 and sglang were one profile, validate ran every point with
prefix caching off, every all-reduce paid NCCL's latency and nothing was served)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from harness.config import compose_config
from harness.roofline import engines
from harness.roofline_tools import validate
from harness.runner import RunResult, run


def _point(engine: str, inp: int, out: int, n: int, **kw: Any) -> dict[str, Any]:
    p = {"id": f"t-{engine}", "source": "test", "engine": engine, "model": "Llama-3.1-8B",
         "hardware": "h100-sxm", "tp": 1, "weight_dtype": "bfloat16", "backend": "paged",
         "workload": {"input": inp, "output": out}, "num_prompts": n, "rate": 0,
         "max_model_len": inp + out + 16, "figures": {}}
    p.update(kw)
    return p


def _run(point: dict[str, Any], source: dict[str, Any] | None = None,
         extra: tuple[str, ...] = ()) -> RunResult:
    """The what-if of a published-style point; ``extra`` overrides replace its own."""
    keys = {e.split("=")[0] for e in extra}
    ov = [o for o in validate.overrides(point, source or {}) if o.split("=")[0] not in keys]
    return run(compose_config([*ov, *extra]))


# -- finding 5: prefill-heavy work on chunked-prefill served engines ----------------------
def test_sglang_runs_prefill_batches_alone_where_vllm_v1_mixes_them() -> None:
    # 2000 in / 100 out, all at once: SGLang's steps are prefill batches or decode batches,
    # never both (its decodes wait); vLLM V1 puts prefill chunks beside every decode.
    v1 = _run(_point("vllm-v1", 2000, 100, 24))
    sg = _run(_point("sglang", 2000, 100, 24))
    mixed = [r for r in v1.steps if r.prefill_tokens and r.decode_tokens]
    assert mixed, "vLLM V1 mixes prefill chunks into decode steps"
    assert not [r for r in sg.steps if r.prefill_tokens and r.decode_tokens]
    # SGLang's chunk on an 80 GB card is 8192 tokens; vLLM V1's API-server budget 8192 too.
    assert max(r.prefill_tokens for r in sg.steps) <= 8192
    assert max(r.batch_tokens for r in v1.steps) <= 8192
    assert sg.metrics["latency.tpot_ms.p50"] != pytest.approx(
        v1.metrics["latency.tpot_ms.p50"], rel=0.02)


def test_each_engines_default_sizes_reach_the_run() -> None:
    # vLLM V1's defaults by usage context and card: 8 prompts of 1,500 tokens at once take
    # 2048-token steps on an A100's API server, 8192 on an H100's, all 12,000 in one step
    # offline (LLM: 16384).
    def first_step(hardware: str, served: bool) -> int:
        p = _point("vllm-v1", 1500, 4, 8, hardware=hardware)
        return _run(p, {"served": served}).steps[0].batch_tokens

    assert first_step("a100-80gb", True) == 2048
    assert first_step("h100-sxm", True) == 8192
    assert first_step("h100-sxm", False) == 12000


# -- finding 6: long context at full memory ---------------------------------------------
def test_prefix_caching_keeps_recompute_preemption_from_thrashing() -> None:
    # 20,000-token prompts filling an H100's cache (the finding's case, 40 of them):
    # vLLM V1 (prefix caching on by default) finds a preempted request's computed blocks
    # again on readmission; with it off (what validate ran every point with on e82b94d)
    # the run prefills its prompts ~3x over (160 prompts of 20,000 + 2,000: 30.6M prefill
    # tokens for 3.2M prompt tokens, 1.07x with it on).
    p = _point("vllm-v1", 20000, 1000, 40)
    on = _run(p).metrics
    off = _run({**p, "prefix_caching": False}).metrics
    prompts = 40 * 20000
    assert on["cache.prefill_tokens_computed"] <= 1.15 * prompts
    assert off["cache.prefill_tokens_computed"] > 2 * on["cache.prefill_tokens_computed"]


@pytest.mark.slow  # (~12 s: the per-step path; finding 6's default-run test is the one above)
def test_sglang_reserves_output_room_and_preempts_less_than_admitting_by_prompt() -> None:
    p = _point("sglang", 2000, 1000, 32)
    small = ("cache.kv_budget=4GiB",)
    reserve = _run(p, extra=small).metrics
    by_prompt = _run(p, extra=(*small, "scheduler.admission=watermark")).metrics
    assert reserve["sched.preemptions_recompute"] < by_prompt["sched.preemptions_recompute"]


# -- finding 7: engine profiles ---------------------------------------------------------
def test_vllm_v1_and_sglang_are_distinct_profiles() -> None:
    v1, sg = engines.PRIORS["vllm-v1"], engines.PRIORS["sglang"]
    assert v1.scheduler != sg.scheduler
    assert (v1.overlap_cpu, v1.prefix_caching) == (False, True)
    assert (sg.overlap_cpu, sg.allreduce) == (True, "trtllm-custom")


def test_tp4_batch1_all_reduces_take_the_engines_own_kernels() -> None:
    # Llama-3.1-70B TP4 batch 1 on H100: 160 all-reduces of 16 KiB. vLLM's kernels take
    # ~8.5-9.2 us each (sglang#2904), NCCL 42 us (Vidur): 1.5 ms a step, not 6.7 ms.
    from harness.roofline.allreduce import custom_allreduce_s
    from harness.roofline.hardware import get_hardware
    from harness.roofline.models import get_model_spec
    from harness.roofline.steptime import StepModel

    arch, hw = get_model_spec("Llama-3.1-70B"), get_hardware("h100-sxm")
    kv = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * 2
    for name, want in (("vllm-0.6", custom_allreduce_s("vllm-custom", 4, 16384)),
                       ("trtllm", custom_allreduce_s("trtllm-custom", 4, 16384))):
        m = StepModel(arch, hw, kv, tp=4, engine=engines.PROFILES[name])
        t = m.time(m.work(1, 1, 1, 0.0, 0.0, 1000.0))
        assert t.allreduce == pytest.approx(160 * want)
        assert t.allreduce < 0.3 * 160 * hw.allreduce_latency(4)
    # Without an engine (kvbench's own spec overheads) NCCL's latency stays.
    m = StepModel(arch, hw, kv, tp=4)
    assert m.time(m.work(1, 1, 1, 0.0, 0.0, 1000.0)).allreduce > 160 * 40e-6


def test_an_overlapping_engine_hides_its_cpu_time_behind_the_forward() -> None:
    from harness.roofline.hardware import get_hardware
    from harness.roofline.models import get_model_spec
    from harness.roofline.steptime import StepModel

    arch, hw = get_model_spec("Llama-3.1-8B"), get_hardware("h100-sxm")
    kv = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * 2
    prof = dataclasses.replace(engines.PRIORS["vllm-v1"], step_s=2e-3)
    serial = StepModel(arch, hw, kv, engine=prof)
    overlap = StepModel(arch, hw, kv, engine=prof, overlap_cpu=True)
    w = serial.work(8, 8, 8, 0.0, 0.0, 8000.0)
    ts, to = serial.time(w), overlap.time(w)
    assert ts.total == pytest.approx(ts.forward + ts.overhead) and ts.overhead >= 2e-3
    assert to.total == pytest.approx(max(to.forward, ts.overhead))
    # The decode lane's steps agree with the per-step path.
    lane = overlap.lane_time(8, 8000.0, 0.0, w.dec_bytes)
    assert lane.total == pytest.approx(to.total)


# -- finding 8: served latency at low load ----------------------------------------------
def test_a_served_request_pays_its_front_end_and_an_offline_one_does_not(
        monkeypatch: pytest.MonkeyPatch) -> None:
    prof = dataclasses.replace(engines.PROFILES["vllm-v1"], request_s=0.02,
                               prompt_token_s=1e-5)
    monkeypatch.setitem(engines.PROFILES, "vllm-v1", prof)
    p = _point("vllm-v1", 1000, 50, 6, rate=0.5)
    served = _run(p, {"served": True}).requests
    offline = _run(p, {"served": True}, ("roofline.served=false",)).requests
    for s, o in zip(served, offline):
        assert s["ttft_ms"] - o["ttft_ms"] == pytest.approx(20.0 + 10.0, abs=1e-6)
        assert s["e2e_ms"] - o["e2e_ms"] == pytest.approx(30.0, abs=1e-6)
        assert s["tpot_ms"] == pytest.approx(o["tpot_ms"])


def test_a_closed_loop_client_pays_its_own_front_end(monkeypatch: pytest.MonkeyPatch) -> None:
    # Two clients, six equal requests: each request's TTFT and end-to-end time carry its
    # own front end (30 ms: they cancelled against the finish that freed its slot, which
    # carried one too), and each client's chain of three pays three (the run 90 ms longer).
    prof = dataclasses.replace(engines.PROFILES["vllm-v1"], request_s=0.02,
                               prompt_token_s=1e-5)
    monkeypatch.setitem(engines.PROFILES, "vllm-v1", prof)
    p = _point("vllm-v1", 1000, 50, 6, concurrency=2)
    served = validate.run_point((p, {"served": True}, False))["pred"]
    offline = validate.run_point((p, {"served": False}, False))["pred"]
    for m in ("ttft_ms_mean", "ttft_ms_median", "e2e_ms_mean", "e2e_ms_median"):
        assert served[m] - offline[m] == pytest.approx(30.0, abs=1e-6), m
    assert served["tpot_ms_mean"] == pytest.approx(offline["tpot_ms_mean"])
    longer = 6 / served["requests_per_s"] - 6 / offline["requests_per_s"]
    assert longer == pytest.approx(0.09, rel=1e-6)


# -- finding 9: what is not built is refused, naming the feature -------------------------
@pytest.mark.parametrize(("override", "message"), [
    ("roofline.hardware=gb200", r"gb200 is not modelled.*NVL72"),
    ("roofline.speculative=eagle3", r"speculative=eagle3 is not modelled"),
    ("roofline.expert_parallel=8", r"expert_parallel=8 is not modelled"),
    ("roofline.dp_attention=true", r"dp_attention=true is not modelled"),
])
def test_unmodelled_features_are_refused_by_name(override: str, message: str) -> None:
    from harness.errors import UserError

    with pytest.raises(UserError, match=message):
        run(compose_config(["executor=roofline", "workload=random",
                            "workload.num_requests=2", "progress=false", override]))
