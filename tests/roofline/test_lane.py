"""The roofline's fast path (decode lanes, harness/roofline/fastpath) equals stepping one by one.

A hypothesis property test over random workloads: arrivals during the run, preemption by
recompute and by swap (small KV budgets), prefix hits (shared prompts, conversations that
re-send their answers: hits on blocks that lane members named), identical prompts (two
requests naming the same content), length limits, block sizes, prefix caching on and off,
and the backends that take the lane (paged, fp8, int8, kivi, quest, a sliding window,
contiguous). Each example runs twice, ``roofline.fast_path``
on and off, and compares every request's token times (so its TTFT, every ITL and its
finish), every requests.csv row, every steps.csv column, the output ids and every metric.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.backends.costs import KIVICosts, KVCosts, QuantCosts, QuestCosts, WindowCosts
from harness.engine.engine import Engine
from harness.kv.contiguous import ContiguousKVManager
from harness.kv.evicting import WindowKVManager
from harness.kv.eviction import EVICTIONS
from harness.kv.paged import PagedKVManager
from harness.kv.policies.window import WindowPolicy
from harness.kv.residual import ResidualKVManager
from harness.metrics import collector
from harness.roofline import executor as roofline_executor
from harness.roofline.executor import (
    SYNTHETIC_IDS,
    synthetic_token,
    synthetic_tokens,
)
from harness.roofline.fastpath.lane import DecodeLane
from harness.roofline.fastpath.scheduler import LaneScheduler
from harness.roofline.shape import step_shape
from harness.runner import RunResult, run
from harness.sched.scheduler import Scheduler, SchedulerConfig
from harness.sched.sequence import SamplingParams, SequenceGroup
from harness.sched.step import NewToken, StepOutcome
from tests.compose import compose_cfg

# Keys a run reports that are this CPU's time or say which path ran, not the run's numbers.
NOT_COMPARED = ("engine.sim_wall_s", "engine.sim_cpu_s", "run.fast_path", "run.started_at")

BASE = ["executor=roofline", "roofline.model=Llama-3.1-8B", "roofline.hardware=a100-80gb",
        "logger=none", "records.output_ids=true"]  # (outputs compared: kept)


def workloads() -> st.SearchStrategy[list[str]]:
    rate = st.sampled_from(["0", "50", "400"])  # 0: all at once
    random_ = st.builds(
        lambda n, r, i, o, seed: ["workload=random", f"workload.num_requests={n}",
                                  f"workload.rate={r}", f"workload.input_max={i}",
                                  f"workload.output_max={o}", f"seed={seed}"],
        st.integers(4, 40), rate, st.sampled_from([64, 300]), st.sampled_from([40, 160]),
        st.integers(0, 3))
    multiturn = st.builds(
        lambda c, t, a, r: ["workload=multiturn", f"workload.conversations={c}",
                            f"workload.turns={t}", f"workload.answer_tokens={a}",
                            "workload.system_words=20", "workload.user_words=12",
                            f"workload.rate={r}"],
        st.integers(2, 8), st.integers(2, 4), st.sampled_from([17, 48]), rate)
    # suffix 0: identical prompts; request ids 26 apart then also decode identical tokens
    shared = st.builds(
        lambda n, p, s, o, r: ["workload=shared_prefix", f"workload.num_requests={n}",
                               f"workload.num_prefixes={p}", "workload.prefix_tokens=96",
                               f"workload.suffix_tokens={s}", f"workload.output_tokens={o}",
                               f"workload.rate={r}"],
        st.sampled_from([8, 30, 60]), st.integers(1, 2), st.sampled_from([0, 9]),
        st.sampled_from([20, 40]), rate)
    return st.one_of(random_, multiturn, shared)


def options() -> st.SearchStrategy[list[str]]:
    return st.builds(
        lambda backend, bs, budget, swap, caching, seqs, tokens, mml, evict: [
            f"backend={backend}",
            # (contiguous storage has no blocks: it refuses the option)
            *([f"backend.block_size={bs}"] if backend != "contiguous" else []),
            f"cache.kv_budget={budget}",
            f"cache.enable_prefix_caching={caching}", f"scheduler.max_num_seqs={seqs}",
            # any eviction order among cached prefixes (harness/kv/eviction.py)
            *([f"cache.eviction={evict}"] if caching and backend != "contiguous" else []),
            f"scheduler.max_num_batched_tokens={tokens}", f"scheduler.max_model_len={mml}",
            *(["scheduler.preemption_mode=swap", "cache.swap_space=256MiB"] if swap else [])],
        st.sampled_from(["paged", "paged", "fp8", "int8", "kivi", "quest", "contiguous",
                         "sliding_window"]),
        st.sampled_from([4, 8, 16]), st.sampled_from(["48MiB", "128MiB", "512MiB"]),
        st.booleans(), st.booleans(), st.sampled_from([4, 16, 64]),
        st.sampled_from([64, 256]), st.sampled_from([256, 2048]),
        st.sampled_from(["lru", "lru", *EVICTIONS]))


def _run(overrides: list[str], fast: bool, monkeypatch: pytest.MonkeyPatch,
         lane_steps: list[int] | None = None) -> tuple[RunResult, dict[int, list[float]], int]:
    """The run, every request's token times as it was let go, and the lane's joins;
    ``lane_steps``: counts the steps taken as lane steps (Engine.lane_step)."""
    times: dict[int, list[float]] = {}
    real_let_go = collector.MetricsCollector._let_go

    def let_go(self: Any, g: Any, finished: float | None = None) -> Any:
        times[g.request_id] = list(self.requests[g.request_id].token_times)
        return real_let_go(self, g, finished)

    joins = [0]
    real_join = DecodeLane.try_join

    def try_join(self: DecodeLane, g: Any) -> bool:
        ok = real_join(self, g)
        joins[0] += ok
        return ok

    monkeypatch.setattr(collector.MetricsCollector, "_let_go", let_go)
    monkeypatch.setattr(DecodeLane, "try_join", try_join)
    if lane_steps is not None:
        real_lane_step = Engine.lane_step

        def lane_step(self: Engine, *args: Any) -> None:
            lane_steps[0] += 1
            real_lane_step(self, *args)

        monkeypatch.setattr(Engine, "lane_step", lane_step)
    # The lane run builds no prompt slot lists, as the roofline does outside the tests
    # (KVBENCH_CHECK keeps them for the slot check): stepping one by one does.
    monkeypatch.setattr(roofline_executor, "CHECKS", not fast)
    r = run(compose_cfg([*BASE, *overrides, f"roofline.fast_path={str(fast).lower()}"]))
    monkeypatch.undo()
    return r, times, joins[0]


def assert_same_run(one: RunResult, lane: RunResult) -> None:
    a = {k: v for k, v in one.metrics.items() if k not in NOT_COMPARED}
    b = {k: v for k, v in lane.metrics.items() if k not in NOT_COMPARED}
    assert a.keys() == b.keys()
    for k in a:
        assert a[k] == b[k] or (a[k] != a[k] and b[k] != b[k]), (k, a[k], b[k])  # NaN
    assert one.requests == lane.requests
    assert one.outputs == lane.outputs
    assert len(one.steps) == len(lane.steps)
    cols_a, cols_b = one.steps.columns(), lane.steps.columns()  # type: ignore[attr-defined]
    assert cols_a.keys() == cols_b.keys()
    for k in cols_a:
        assert np.array_equal(cols_a[k], cols_b[k]), k


@settings(max_examples=16, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(workload=workloads(), opts=options())
def test_the_lane_equals_stepping_one_by_one(workload: list[str], opts: list[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    overrides = [*workload, *opts]
    try:
        one, t_one, _ = _run(overrides, False, monkeypatch)
    except Exception as e:  # a drawn budget too small for the workload: not this test's
        if type(e).__name__ == "UserError":
            return
        raise
    lane, t_lane, joins = _run(overrides, True, monkeypatch)
    assert t_one == t_lane  # every request's TTFT, ITLs and finish, exactly
    assert_same_run(one, lane)
    on = lane.metrics["run.fast_path"] == "lanes"
    assert on, lane.metrics["run.fast_path"]
    if on and one.metrics["requests.finished"]:
        assert joins > 0  # the lane ran, not only the per-sequence path


@pytest.mark.parametrize("opts", [
    # few at a time: the waiting queue is held back by max_num_seqs, members finish
    ["workload.rate=0", "scheduler.max_num_seqs=4"],
    # arrivals between steps; prefix caching off; kivi's manager
    ["workload.rate=50", "cache.enable_prefix_caching=false", "backend=kivi"],
    # a small pool: touches that find no free block, preemption
    ["workload.rate=0", "cache.kv_budget=48MiB", "backend.block_size=4"],
])
def test_lane_steps_equal_stepping_one_by_one(opts: list[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps of lane members only (Engine.lane_step: no StepRecord) are taken, and the
    run equals stepping one by one, row by row."""
    overrides = ["workload=random", "workload.num_requests=24", "workload.input_max=64",
                 "workload.output_max=160", *opts]
    one, t_one, _ = _run(overrides, False, monkeypatch)
    n = [0]
    lane, t_lane, _ = _run(overrides, True, monkeypatch, lane_steps=n)
    assert n[0] > 10, n[0]
    assert t_one == t_lane
    assert_same_run(one, lane)


# -- the scheduler, KV manager and collector alone: many small cases a second -----------------

def _pool_state(kv: PagedKVManager | ContiguousKVManager, names: bool = True
                ) -> tuple[Any, ...]:
    """The free and LRU orders and (``names``) every name with its copies, oldest first.
    Reading the names makes a lane's pending ones (harness/roofline/fastpath/lazy_names.py):
    the drive reads them every few steps, so that chains stay pending, get evicted and are
    looked up in between. (The index's own key order is when a name was entered: not compared.)"""
    if isinstance(kv, ContiguousKVManager):
        return (kv.arena.holes(), kv.usage())
    return (kv.pool.free_order(), kv.pool.lru_order(),
            sorted(kv.pool.hash_index().items()) if names else None)


def _drive(case: dict[str, Any], lane_on: bool) -> tuple[Any, ...]:
    """One case driven as the engine drives a roofline run (samples forked as its sampler
    does, a follow-up re-sending a finished answer), logging after every step what the
    step ran, its shape, the pool's free and LRU orders and its named blocks."""
    r = random.Random(case["seed"])
    bs = case["bs"]
    kv: PagedKVManager | ContiguousKVManager
    if case.get("contiguous"):  # a range per sequence (``reserve``: exact, pow2 or max)
        kv = ContiguousKVManager(case["blocks"] * bs, policy=case["contiguous"],
                                 max_model_len=case["mml"], granule=bs)
        case = {**case, "cpu": 0, "caching": False, "sinks": max(case["sinks"], -1)}
    elif case["sinks"] == -4:  # a sliding window: blocks given back as it moves on
        kv = WindowKVManager(case["blocks"], bs, WindowPolicy(case["window"], case["wsinks"]),
                             num_cpu_blocks=case["cpu"], enable_prefix_caching=case["caching"])
    else:  # kivi's manager: paged, and it lists the partly filled blocks it frees
        kv = (ResidualKVManager if case["sinks"] == -2 else PagedKVManager)(
            case["blocks"], bs, num_cpu_blocks=case["cpu"], enable_prefix_caching=case["caching"])
    if case["caching"] and isinstance(kv, PagedKVManager):
        kv.set_cache_policy(case["evict"], case["admit"])  # (harness/kv/eviction.py)
    cfg = SchedulerConfig(max_num_seqs=case["seqs"], max_num_batched_tokens=case["tokens"],
                          max_model_len=case["mml"], chunked_prefill=case["chunked"],
                          preemption_mode="swap" if case["cpu"] else "recompute",
                          policy=case["policy"], admission=case["adm"])
    costs = (KVCosts(3, bs) if case["sinks"] == -1 else KIVICosts(7, 5, bs, 0)
             if case["sinks"] == -2 else QuestCosts(5, 3, bs, 2 * bs)
             if case["sinks"] == -3 else WindowCosts(3, bs, case["window"], case["wsinks"])
             if case["sinks"] == -4 else QuantCosts(1, 4, bs, case["sinks"]))
    swap = kv if case["cpu"] else None
    sch = LaneScheduler(cfg, kv, (), swap, costs, synthetic_tokens, SYNTHETIC_IDS) \
        if lane_on else Scheduler(cfg, kv, swap=swap)
    col = collector.MetricsCollector(kv, sch, 1)
    prompts = [[r.randrange(97, 123) for _ in range(r.randrange(1, 3 * bs + 2))]
               for _ in range(3)]
    pending: list[tuple[int, SequenceGroup]] = [
        (0, SequenceGroup(rid, [1], SamplingParams(max_tokens=6, n=n, ignore_eos=True)))
        for rid, n in enumerate(case.get("given", ()))]
    for rid in range(len(pending), case["n"]):
        p = list(r.choice(prompts))
        if r.random() < 0.5:  # else an identical prompt
            p = p[:r.randrange(1, 2 * bs)] + [r.randrange(97, 123)
                                              for _ in range(r.randrange(0, 2 * bs))]
        mt = r.randrange(1, 3 * bs + 3)
        n = r.choice([1, 1, 1, 2, 3]) if case["forks"] else 1
        params = SamplingParams(max_tokens=mt, ignore_eos=True, n=n,
                                stop_after=r.choice([None, None, r.randrange(0, mt + 2)]))
        pending.append((r.randrange(0, 12), SequenceGroup(rid, p, params,
                                                          priority=r.randrange(3))))
    pending.sort(key=lambda x: (x[0], x[1].request_id))
    log: list[Any] = []
    step = t = 0
    while pending or sch.has_unfinished:
        while pending and pending[0][0] <= step:
            _, g = pending.pop(0)
            col.on_arrival(g, float(step))
            if not sch.add(g):
                col.on_rejected(g)
        step += 1
        assert step < 5000, "stuck"
        if not sch.has_unfinished:
            continue
        rec = sch.schedule()
        for rid in rec.lane_left:  # as the engine does
            col.lane_leave(rid)
        if rec.is_empty:
            for stuck in rec.rejected:
                col.on_rejected(stuck)
            log.append(("empty", rec.step, [g.request_id for g in rec.preempted]))
            continue
        sh = step_shape(rec, costs, kv)
        sch.end_forward()
        out = StepOutcome()
        for s in sh.samplers:
            g = s.seq.group
            idx = g.seqs.index(s.seq) if len(g.seqs) > 1 else 0
            out.tokens.append(NewToken(s.seq, synthetic_token(g.request_id, idx,
                                                              s.seq.num_tokens)))
            if g.params.n > 1 and len(g.seqs) == 1:
                out.tokens += [NewToken(s.seq, synthetic_token(g.request_id, k,
                                                               s.seq.num_tokens), fork=True)
                               for k in range(1, g.params.n)]
        upd = sch.update(rec, out)
        for g in upd.finished:
            follow = list(g.prompt_ids) + g.seqs[0].output_ids + [r.randrange(97, 123)]
            if r.random() < 0.6 and len(follow) + 2 < cfg.max_model_len:
                ng = SequenceGroup(1000 + step * 10 + len(pending), follow,
                                   SamplingParams(max_tokens=r.randrange(1, 3 * bs + 3),
                                                  ignore_eos=True))
                pending.append((step + 1, ng))
                pending.sort(key=lambda x: (x[0], x[1].request_id))
        t += 1
        col.on_tokens(rec, upd, [s.seq.group for s in sh.samplers], t * 1.37)
        col.on_step(rec, upd, 0.0, float(t), 0.5, 0.0, sh.reads)
        log.append((rec.step, rec.num_tokens, rec.num_decode_tokens, rec.num_seqs, rec.usage,
                    [g.request_id for g in rec.preempted], [g.request_id for g in upd.finished],
                    list(rec.swap_out), list(rec.swap_in), list(rec.copies),
                    list(rec.invalidated),
                    sh.tokens, sh.ctx_decode, sh.gather_decode, sh.dec_bytes, sh.num_decode,
                    sh.rows, *_pool_state(kv, names=step % 7 == 0)))
    if isinstance(sch, LaneScheduler):
        # A window's give-backs are filed only before their member's finish: a finished
        # member is not kept for a step it never reaches.
        assert all(m.gives_back_at < m.finish_at for due in sch.lane._drops.values() for m in due)
        for rid in sch.leave_lane():
            col.lane_leave(rid)
    log.append(_pool_state(kv))
    vals, counts = col.itl_ms()
    return (log, kv.ledger.finish(), list(col.rows), vals.tolist(), counts.tolist(), kv.stats,
            col.outputs())


@settings(max_examples=200, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**31), bs=st.sampled_from([2, 3, 4, 8]),
       blocks=st.sampled_from([5, 7, 9, 12, 40]), cpu=st.sampled_from([0, 0, 64]),
       caching=st.booleans(), seqs=st.sampled_from([3, 4, 8, 16]),
       tokens=st.sampled_from([3, 16, 64]), mml=st.sampled_from([12, 24, 256]),
       chunked=st.booleans(), policy=st.sampled_from(["fcfs", "priority"]),
       adm=st.sampled_from(["watermark", "watermark", "no_evict"]), n=st.integers(3, 30),
       sinks=st.sampled_from([-1, -2, -3, -4, -4, 0, 2, 5]), forks=st.booleans(),
       window=st.sampled_from([1, 3, 8, 17]), wsinks=st.sampled_from([0, 1, 4]),
       contiguous=st.sampled_from([None, None, "exact", "pow2", "max"]),
       evict=st.sampled_from(["lru", "lru", *EVICTIONS]),
       admit=st.sampled_from(["always", "always", "second_hit", "tinylfu"]))
def test_the_lane_equals_one_by_one_step_for_step(**case: Any) -> None:
    """Every step's record, shape, free and LRU orders and named blocks, the ledger, the
    rows, the ITLs, the KV stats and the outputs, with and without the lane (n > 1
    requests among the members included: their forks can outrun the token budget)."""
    if case["seqs"] > case["tokens"]:  # the stack keeps such a run off the lane
        case["tokens"] = case["seqs"]
    if not case["chunked"] and case["tokens"] < 64:
        case["chunked"] = True
    assert _drive(case, True) == _drive(case, False)


@pytest.mark.parametrize("ns", [[1, 3, 1], [3, 1, 1], [1, 1, 3], [2, 1, 3, 1]])
@pytest.mark.parametrize("bs", [4, 16])
def test_members_the_budget_cannot_reach_leave_the_lane(ns: list[int], bs: int) -> None:
    """A group of n > 1 is admitted as one sequence and forks after its prompt, so the
    running sequences can outnumber max_num_seqs = max_num_batched_tokens: the decodes
    past the budget wait a step, which the lane cannot express; they leave it (found by
    review: the lane had counted them as decoded)."""
    case = {"seed": 0, "bs": bs, "blocks": 100, "cpu": 0, "caching": False, "seqs": 3,
            "tokens": 3, "mml": 64, "chunked": True, "policy": "fcfs", "adm": "watermark",
            "n": len(ns), "sinks": -1, "forks": False, "given": ns}
    assert _drive(case, True) == _drive(case, False)
