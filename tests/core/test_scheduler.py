"""Scheduler scenarios, driven by a fake model whose next token is a pure function of the
sequence so far: any lost or duplicated K/V bookkeeping shows up as different tokens."""

from __future__ import annotations

import pytest

from harness.kv.base import Demand
from harness.kv.contiguous import ContiguousKVManager
from harness.kv.paged import PagedKVManager
from harness.sched.scheduler import Scheduler, SchedulerConfig
from harness.sched.sequence import SeqStatus, SequenceGroup
from harness.sched.step import NewToken, StepOutcome, StepRecord
from tests.helpers import make_group

EOS = 0


def fake_next(tokens: list[int]) -> int:
    return (sum((i + 1) * t for i, t in enumerate(tokens[-8:])) % 97) + 1  # never EOS


def run(sched: Scheduler, groups: list[SequenceGroup], max_steps: int = 2000,
        check: bool = True) -> list[StepRecord]:
    for g in groups:
        sched.add(g)
    recs = []
    while sched.has_unfinished:
        rec = sched.schedule()
        assert rec.num_tokens <= sched.cfg.max_num_batched_tokens
        assert len({s.seq.seq_id for s in rec.seqs}) == len(rec.seqs)
        if check:
            # A group is never split: all or none of its live sequences run.
            for g in {s.seq.group for s in rec.seqs}:
                ran = {s.seq.seq_id for s in rec.seqs if s.seq.group is g}
                assert ran == {s.seq_id for s in g.live_seqs}
        sched.update(rec, next_tokens(rec))
        recs.append(rec)
        assert len(recs) < max_steps, "scheduler made no progress"
    return recs


def next_tokens(rec: StepRecord) -> StepOutcome:
    """Every sampling sequence of ``rec`` appends its fake next token."""
    return StepOutcome.appending([(x.seq, fake_next(x.seq.token_ids))
                                  for x in rec.seqs if x.sample])


def step(sched: Scheduler) -> StepRecord:
    rec = sched.schedule()
    sched.update(rec, next_tokens(rec))
    return rec


def paged(num_blocks: int, bs: int = 4, **kw: object) -> PagedKVManager:
    return PagedKVManager(num_blocks, bs, watermark=0.0, **kw)  # type: ignore[arg-type]


def expected_output(prompt: list[int], n: int) -> list[int]:
    toks = list(prompt)
    for _ in range(n):
        toks.append(fake_next(toks))
    return toks[len(prompt):]


def prompts(k: int, length: int) -> list[list[int]]:
    return [[(7 * r + i) % 50 + 1 for i in range(length + r)] for r in range(k)]


def test_token_budget_and_decodes_first_with_chunked_prefill() -> None:
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16, chunked_prefill=True)
    s = Scheduler(cfg, paged(200))
    short = [make_group(i, p, max_tokens=20) for i, p in enumerate(prompts(3, 4))]
    for g in short:
        s.add(g)
    step(s)  # admits the three short prompts
    long = make_group(9, list(range(60, 119)), max_tokens=4)
    s.add(long)
    for _ in range(4):
        rec = s.schedule()
        # Every running decode is scheduled, and the long prompt gets only what is left.
        decodes = [x for x in rec.seqs if x.seq.group is not long]
        assert len(decodes) == 3 and all(x.num_tokens == 1 for x in decodes)
        chunk = [x for x in rec.seqs if x.seq.group is long]
        assert chunk and chunk[0].num_tokens == 13 and not chunk[0].sample
        s.update(rec, next_tokens(rec))
    rec = s.schedule()
    chunk = next(x for x in rec.seqs if x.seq.group is long)
    assert chunk.num_tokens == 59 - 4 * 13 and chunk.sample  # the last chunk samples


def test_without_chunking_long_prompt_waits_for_whole_budget() -> None:
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32, chunked_prefill=False)
    s = Scheduler(cfg, paged(200))
    for i, p in enumerate(prompts(3, 4)):
        s.add(make_group(i, p, max_tokens=5))
    step(s)
    s.add(make_group(9, list(range(60, 90)), max_tokens=2))  # 30 > 32 - 3 decodes
    rec = s.schedule()
    assert all(x.num_tokens == 1 for x in rec.seqs)  # it waits: no partial prompt
    assert s.waiting and s.waiting[0].request_id == 9


def test_too_long_prompt_rejected_with_reason_and_run_goes_on() -> None:
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=32)
    s = Scheduler(cfg, paged(4))  # 16 slots in all
    ok = make_group(1, [1, 2, 3], max_tokens=4)
    too_long = make_group(2, list(range(1, 40)), max_tokens=4)
    too_big = make_group(3, list(range(1, 15)), max_tokens=10)
    run(s, [ok, too_long, too_big])
    assert too_long.rejected_reason and "max_model_len" in too_long.rejected_reason
    assert too_big.rejected_reason and "cache.kv_budget" in too_big.rejected_reason
    assert ok.seqs[0].output_ids == expected_output([1, 2, 3], 4)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_restores_exact_tokens(mode: str) -> None:
    ps = prompts(6, 6)
    ref = [expected_output(p, 12) for p in ps]
    cfg = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=64, preemption_mode=mode)
    kv = paged(14, num_cpu_blocks=40, enable_prefix_caching=False)
    s = Scheduler(cfg, kv, swap=kv if mode == "swap" else None)
    groups = [make_group(i, p, max_tokens=12) for i, p in enumerate(ps)]
    run(s, groups)
    assert [g.seqs[0].output_ids for g in groups] == ref
    if mode == "recompute":
        assert s.preemptions_recompute > 0 and s.recomputed_tokens > 0
        assert s.preemptions_swap == 0
    else:
        assert s.preemptions_swap > 0 and kv.stats.swapped_out_blocks > 0
    assert kv.pool.num_used == 0


def test_preemption_victim_is_most_recent() -> None:
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64)
    s = Scheduler(cfg, paged(6, enable_prefix_caching=False))
    g0 = make_group(0, [1, 2, 3, 4, 5, 6, 7], max_tokens=9)
    g1 = make_group(1, [9, 8, 7, 6, 5, 4, 3], max_tokens=9)
    s.add(g0)
    s.add(g1)
    preempted: list[int] = []
    while s.has_unfinished:
        rec = s.schedule()
        preempted += [g.request_id for g in rec.preempted]
        s.update(rec, next_tokens(rec))
    assert preempted and set(preempted) == {1}  # LIFO: the later admission pays


def test_priority_policy_orders_admission() -> None:
    cfg = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, policy="priority")
    s = Scheduler(cfg, paged(50))
    lo = make_group(0, [1, 2, 3], max_tokens=2, priority=5)
    hi = make_group(1, [4, 5, 6], max_tokens=2, priority=0, arrival=1.0)
    s.add(lo)
    s.add(hi)
    rec = s.schedule()
    assert [x.seq.group.request_id for x in rec.seqs] == [1]


def test_groups_are_admitted_and_preempted_whole() -> None:
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64)
    s = Scheduler(cfg, paged(16, enable_prefix_caching=False))
    groups = [make_group(i, p, max_tokens=10, n=3) for i, p in enumerate(prompts(3, 5))]
    for g in groups:
        s.add(g)
    steps = 0
    while s.has_unfinished:
        rec = s.schedule()
        for g in {x.seq.group for x in rec.seqs}:
            ran = {x.seq.seq_id for x in rec.seqs if x.seq.group is g}
            assert ran == {q.seq_id for q in g.live_seqs}
        toks = []
        for x in rec.seqs:
            if not x.sample:
                continue
            g = x.seq.group
            if g.params.n > 1 and len(g.seqs) == 1:
                for k in range(g.params.n - 1):  # forks share the parent's tokens so far
                    toks.append(NewToken(x.seq, fake_next(x.seq.token_ids) + k + 1, fork=True))
            toks.append(NewToken(x.seq, fake_next(x.seq.token_ids)))
        s.update(rec, StepOutcome(toks))
        steps += 1
        assert steps < 1000
    assert all(len(g.seqs) == 3 and g.is_finished for g in groups)
    assert all(q.num_output_tokens == 10 for g in groups for q in g.seqs)


def test_contiguous_runs_same_tokens_as_paged() -> None:
    ps = prompts(5, 7)
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    outs = []
    contiguous = ContiguousKVManager(120, policy="exact", max_model_len=64, watermark=0.0)
    for kv in (paged(40), contiguous):
        s = Scheduler(cfg, kv)  # type: ignore[arg-type]
        groups = [make_group(i, p, max_tokens=9) for i, p in enumerate(ps)]
        run(s, groups)
        outs.append([g.seqs[0].output_ids for g in groups])
    assert outs[0] == outs[1]


def test_contiguous_max_policy_admits_fewer_at_once() -> None:
    ps = prompts(6, 5)
    peak = {}
    for policy in ("max", "exact"):
        cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
        s = Scheduler(cfg, ContiguousKVManager(128, policy=policy, max_model_len=64,
                                                    watermark=0.0))
        for i, p in enumerate(ps):
            s.add(make_group(i, p, max_tokens=8))
        best = 0
        while s.has_unfinished:
            rec = s.schedule()
            best = max(best, len(s.running))
            s.update(rec, next_tokens(rec))
        peak[policy] = best
    assert peak == {"max": 2, "exact": 6}


def test_eos_stops_and_frees() -> None:
    cfg = SchedulerConfig()
    s = Scheduler(cfg, paged(20), eos_token_ids=(EOS,))
    g = make_group(0, [5, 6, 7], max_tokens=10)
    s.add(g)
    rec = s.schedule()
    upd = s.update(rec, StepOutcome.appending([(rec.seqs[0].seq, EOS)]))
    assert upd.finished == [g] and g.seqs[0].finish_reason == "stop"
    assert g.seqs[0].status is SeqStatus.FINISHED and not s.has_unfinished


def _running(s: Scheduler, rid: int, prompt: int, computed: int, sampled: bool) -> SequenceGroup:
    """A group already running with ``computed`` tokens cached (and, if ``sampled``, its
    first output token waiting to be computed): a step's starting state, built directly."""
    g = make_group(rid, list(range(1, prompt + 1)), max_tokens=2)
    s.add(g)
    seq = g.seqs[0]
    if sampled:
        seq.token_ids.append(7)
    s.kv.allocate_group([Demand(seq, computed)])
    seq.num_computed = computed
    seq.status = SeqStatus.RUNNING
    s.waiting.remove(g)
    s.running.append(g)
    s.num_running_seqs += 1
    return g


def test_a_preempted_decode_gives_its_budget_back_to_prefills() -> None:
    # Block size 4, six blocks, all held: d0 (decoding, its next token needs a block), p1
    # (prefilling, 16 tokens left), d2 (decoding). d0 preempts d2 (LIFO) for its block;
    # d2's decode token no longer needs budget, so p1 gets 10 - 1 = 9, not 8.
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=10)
    s = Scheduler(cfg, paged(6, enable_prefix_caching=False))
    d0 = _running(s, 0, 4, 4, sampled=True)
    p1 = _running(s, 1, 20, 4, sampled=False)
    d2 = _running(s, 2, 15, 15, sampled=True)
    assert s.kv.pool.num_free == 0  # type: ignore[attr-defined]
    rec = s.schedule()
    assert rec.preempted == [d2]
    chunks = {x.seq.group.request_id: x.num_tokens for x in rec.seqs}
    assert chunks == {0: 1, 1: 9}
    assert rec.num_decode_tokens == 1 and rec.num_prefill_tokens == 9
    del d0, p1


def test_the_last_prompt_token_is_a_prefill_token() -> None:
    # A 1025-token prompt under a 1024-token budget: the second step computes its last
    # prompt token, a prefill token (it once took the decode fast path).
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=1024, max_model_len=4096)
    s = Scheduler(cfg, paged(400))
    s.add(make_group(0, [(i % 50) + 1 for i in range(1025)], max_tokens=3))
    recs = run(s, [])
    assert sum(r.num_prefill_tokens for r in recs) == 1025
    assert sum(r.num_decode_tokens for r in recs) == 2  # 3 outputs, the last never fed back
