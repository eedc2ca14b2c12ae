"""The scheduler's modes that mirror published engines: prefill-first steps (vLLM V0
without chunked prefill; SGLang's prefill batches with it), no-evict admission
(TensorRT-LLM's GUARANTEED_NO_EVICT), reserved-output admission (SGLang's
new_token_ratio) and multi-step scheduling (vLLM 0.6's num_scheduler_steps). Each is
compared with the default on the same requests, and every run must still produce each
request's exact tokens."""

from __future__ import annotations

import pytest

from harness.sched.scheduler import Scheduler, SchedulerConfig
from harness.sched.step import StepRecord
from tests.core.test_scheduler import expected_output, paged, prompts, run, step
from tests.helpers import make_group


def run_exact(s: Scheduler, ps: list[list[int]], max_tokens: int) -> list[StepRecord]:
    """Run one request per prompt to completion; each must produce its exact tokens."""
    groups = [make_group(i, p, max_tokens=max_tokens) for i, p in enumerate(ps)]
    recs = run(s, groups)
    for g, p in zip(groups, ps):
        assert g.seqs[0].token_ids[len(p):] == expected_output(p, max_tokens)
    return recs


def test_chunked_prefill_first_runs_prefill_batches_alone() -> None:
    # SGLang's default: a prompt longer than the budget is prefilled in chunks, each in a
    # step of prefills only, and the running decode waits until the chunked prompt is done.
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16, chunked_prefill=True,
                          mixing="prefill_first")
    s = Scheduler(cfg, paged(200))
    s.add(make_group(0, prompts(1, 6)[0], max_tokens=10))
    step(s)  # the first prompt
    step(s)  # one decode
    s.add(make_group(1, list(range(100, 140)), max_tokens=5))  # 40 tokens: 16 + 16 + 8
    recs = [step(s) for _ in range(4)]
    assert [r.num_prefill_tokens for r in recs[:3]] == [16, 16, 8]
    assert all(r.num_decode_tokens == 0 for r in recs[:3])  # the decode waited
    assert {x.seq.group.request_id for x in recs[3].seqs} == {0, 1}  # both decode


def test_chunked_prefill_first_keeps_every_request_exact() -> None:
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, chunked_prefill=True,
                          mixing="prefill_first")
    recs = run_exact(Scheduler(cfg, paged(60)), prompts(6, 19), 12)
    assert all(r.num_prefill_tokens == 0 or r.num_decode_tokens == 0 for r in recs)
    assert max(r.num_prefill_tokens for r in recs) == 8


def test_reserve_admits_by_prompt_and_output_budget() -> None:
    # 30 blocks of 4 = 120 slots; requests of 8 prompt + 24 output. Each new request needs
    # its prompt and whole output budget (32) in the room the running ones leave: three
    # start together (96 < 120), a fourth (128) waits. Watermark admission starts all
    # four and preempts as their outputs grow.
    ps = [[(5 * r + i) % 40 + 1 for i in range(8)] for r in range(4)]
    firsts, preempted = {}, {}
    for admission in ("watermark", "reserve"):
        cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, admission=admission)
        s = Scheduler(cfg, paged(30))
        recs = run_exact(s, ps, 24)
        firsts[admission] = {x.seq.group.request_id for x in recs[0].seqs}
        preempted[admission] = s.preemptions_recompute
    assert firsts == {"watermark": {0, 1, 2, 3}, "reserve": {0, 1, 2}}
    assert preempted["reserve"] <= preempted["watermark"]


def test_reserve_ratio_decays_and_a_retract_raises_it() -> None:
    from harness.sched.admission import INIT_RATIO, TokenReserve

    r = TokenReserve(max_model_len=4096)
    for _ in range(600):
        r.stepped(decoded=True, running=True)
    assert r.ratio == pytest.approx(INIT_RATIO * 0.14)
    r.stepped(decoded=False, running=False)
    assert r.ratio == INIT_RATIO  # idle: reset
    from harness.sched.sequence import SeqStatus, Sequence

    g = make_group(0, [1, 2, 3, 4], max_tokens=100)
    seq = Sequence(0, g, [1, 2, 3, 4] + [5] * 30)  # 30 of its 100 outputs done
    seq.num_prompt_tokens = 4
    seq.status = SeqStatus.RUNNING
    g.seqs.append(seq)
    r.retracted([g])
    assert r.ratio == pytest.approx((30 + 20) / 100)


@pytest.mark.parametrize("mixing", ["mixed", "prefill_first"])
def test_prefill_first_runs_prompts_alone(mixing: str) -> None:
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, chunked_prefill=False,
                          mixing=mixing)
    s = Scheduler(cfg, paged(200))
    first = make_group(0, prompts(1, 6)[0], max_tokens=10)
    s.add(first)
    step(s)  # the first prompt
    step(s)  # one decode
    late = make_group(1, list(range(30, 40)), max_tokens=5)
    s.add(late)
    rec = step(s)
    kinds = {x.seq.group.request_id: x.is_decode for x in rec.seqs}
    if mixing == "mixed":  # the decode and the new prompt share the step
        assert kinds == {0: True, 1: False}
    else:  # the prompt runs alone; the decode waits one step
        assert kinds == {1: False}
        assert rec.num_decode_tokens == 0
    rec = step(s)
    assert {x.seq.group.request_id for x in rec.seqs} == {0, 1}
    assert all(x.is_decode for x in rec.seqs)


def test_prefill_first_keeps_every_request_exact() -> None:
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=40, chunked_prefill=False,
                          mixing="prefill_first")
    recs = run_exact(Scheduler(cfg, paged(60)), prompts(6, 9), 12)
    # No step mixes a prompt with a decode.
    assert all(r.num_prefill_tokens == 0 or r.num_decode_tokens == 0 for r in recs)


@pytest.mark.parametrize("admission", ["watermark", "no_evict"])
def test_no_evict_never_preempts_where_watermark_does(admission: str) -> None:
    # 30 blocks of 4 = 120 slots; four requests of 8 prompt + 24 output = 32 slots each:
    # all four prompts fit at once (watermark admits them), their outputs do not.
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, admission=admission)
    s = Scheduler(cfg, paged(30))
    recs = run_exact(s, [[(5 * r + i) % 40 + 1 for i in range(8)] for r in range(4)], 24)
    first = {x.seq.group.request_id for x in recs[0].seqs}
    if admission == "watermark":
        assert first == {0, 1, 2, 3}
        assert s.preemptions_recompute > 0
    else:  # 3 x 32 = 96 <= 120 slots; a fourth would need 128
        assert first == {0, 1, 2}
        assert s.preemptions_recompute == 0
        assert s._worst_total == 0  # every finished group gave its worst case back


def test_multi_step_schedules_once_per_window() -> None:
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, num_scheduler_steps=4)
    s = Scheduler(cfg, paged(200))
    a = make_group(0, prompts(1, 6)[0], max_tokens=20)
    s.add(a)
    recs = [step(s)]  # the prompt: a fresh step, no window
    recs += [step(s)]  # the first decode-only step opens a window of 4
    late = make_group(1, list(range(30, 40)), max_tokens=5)
    s.add(late)
    recs += [step(s) for _ in range(4)]
    assert [r.fresh for r in recs] == [True, True, False, False, False, True]
    # The late prompt waits for the window's end: admitted only at the next fresh step.
    assert all({x.seq.group.request_id for x in r.seqs} == {0} for r in recs[2:5])
    assert {x.seq.group.request_id for x in recs[5].seqs} == {0, 1}


def test_multi_step_keeps_every_request_exact() -> None:
    cfg = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=32, num_scheduler_steps=8)
    recs = run_exact(Scheduler(cfg, paged(40)), prompts(5, 7), 15)
    stale = [r for r in recs if not r.fresh]
    assert stale and all(r.num_prefill_tokens == 0 for r in stale)


@pytest.mark.parametrize("admission", ["watermark", "no_evict"])
def test_long_outputs_under_a_tight_cache_preempt_only_without_no_evict(admission: str) -> None:
    # The what-if's FP8 long-output case in miniature: 48 requests of 64 + 512 tokens all
    # at once into ~8,000 slots. Watermark admission starts every prompt that fits and
    # preempts as outputs grow; no_evict starts only what its worst case allows, never
    # preempts, and every request still finishes.
    from harness.runner import run as run_harness
    from tests.compose import compose_cfg

    m = run_harness(compose_cfg([
        "executor=roofline", "roofline.model=Llama-3.1-8B", "roofline.hardware=h100-sxm",
        "backend=fp8", "cache.kv_budget=540MiB", "workload=random",
        "workload.num_requests=48", "workload.rate=0", "workload.distribution=uniform",
        "workload.input_min=64", "workload.input_max=64", "workload.output_min=512",
        "workload.output_max=512", "scheduler.max_num_seqs=64",
        f"scheduler.admission={admission}", "progress=false"], None)).metrics
    assert m["requests.finished"] == 48
    if admission == "watermark":
        assert m["sched.preemptions_recompute"] > 0
    else:
        assert m["sched.preemptions_recompute"] == 0
        assert m["memory.max_running_seqs"] <= m["memory.token_capacity"] // 576
