"""Lazy names (harness/roofline/fastpath/lazy_names.py): a decode lane's filled blocks,
named when first read, leave the pool's index as stepping one by one leaves it. The lane's
property tests (tests/roofline/test_lane.py) cover random workloads; these cases are built
to need each rule."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from harness.backends.costs import KVCosts
from harness.kv.paged import PagedKVManager
from harness.metrics.collector import MetricsCollector
from harness.roofline.executor import SYNTHETIC_IDS, synthetic_token, synthetic_tokens
from harness.roofline.fastpath.scheduler import LaneScheduler
from harness.roofline.shape import step_shape
from harness.sched.scheduler import Scheduler, SchedulerConfig
from harness.sched.sequence import SamplingParams, SequenceGroup
from harness.sched.step import NewToken, StepOutcome

BS = 4


def _drive(make: Callable[[], list[tuple[int, SequenceGroup]]], lane_on: bool,
           read_at: frozenset[int] = frozenset()) -> list[Any]:
    """Serve ``make()``'s arrivals (step, group) as the engine does a roofline run; the pool's
    names (with their copies, oldest first) read at the steps ``read_at`` and at the end,
    with every step's free and LRU orders and every request's prefix hits."""
    kv = PagedKVManager(64, BS, enable_prefix_caching=True)
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256)
    costs = KVCosts(3, BS)
    sch = LaneScheduler(cfg, kv, (), None, costs, synthetic_tokens, SYNTHETIC_IDS) \
        if lane_on else Scheduler(cfg, kv)
    col = MetricsCollector(kv, sch, 1)
    pending = sorted(make(), key=lambda a: (a[0], a[1].request_id))
    log: list[Any] = []
    step = 0
    while pending or sch.has_unfinished:
        while pending and pending[0][0] <= step:
            g = pending.pop(0)[1]
            col.on_arrival(g, float(step))
            assert sch.add(g)
        step += 1
        assert step < 500
        if not sch.has_unfinished:
            continue
        rec = sch.schedule()
        for rid in rec.lane_left:  # as the engine does
            col.lane_leave(rid)
        sh = step_shape(rec, costs, kv)
        sch.end_forward()
        out = StepOutcome([NewToken(s.seq, synthetic_token(s.seq.group.request_id, 0,
                                                           s.seq.num_tokens))
                           for s in sh.samplers])
        upd = sch.update(rec, out)
        col.on_tokens(rec, upd, [s.seq.group for s in sh.samplers], float(step))
        col.on_step(rec, upd, 0.0, float(step), 0.5, 0.0, sh.reads)
        log.append((step, kv.pool.free_order(), kv.pool.lru_order(),
                    sorted(kv.pool.hash_index().items()) if step in read_at else None))
    if isinstance(sch, LaneScheduler):
        for rid in sch.leave_lane():
            col.lane_leave(rid)
    log.append(sorted(kv.pool.hash_index().items()))
    log.append([(r["request_id"], r["prefix_hit_tokens"], r["prefix_source"])
                for r in col.rows])
    return log


def _outputs(rid: int, start: int, n: int) -> list[int]:
    return [synthetic_token(rid, 0, p) for p in range(start, start + n)]


def test_a_holder_of_the_root_keeps_the_chain_from_opening() -> None:
    """S re-sends A's prompt and A's first outputs while A decodes, and decodes what A
    decodes (request ids 26 apart make the same ids), one by one (a stop token keeps it
    out of the lane). Its lookup names A's pending blocks and shares A's last one, so A
    may not start a chain there: S names the next blocks' content itself, after A filled
    them, and the copies must come out A's first (what a chain opened anyway gets wrong)."""
    prompt = [100 + i for i in range(2 * BS)]

    def arrivals() -> list[tuple[int, SequenceGroup]]:
        a = SequenceGroup(0, prompt, SamplingParams(max_tokens=24, ignore_eos=True))
        s = SequenceGroup(26, prompt + _outputs(0, len(prompt), 6), SamplingParams(
            max_tokens=16, ignore_eos=True, stop_token_ids=[999]))
        return [(0, a), (6, s)]

    one, lane = _drive(arrivals, False), _drive(arrivals, True)
    assert one == lane
    assert one[-1][1][1] == 3 * BS  # S hit A's prompt and its first decode block
    names = dict(one[-2])
    assert any(len(copies) == 2 for copies in names.values())  # content named twice


def test_lookups_evictions_and_reads_between() -> None:
    """Conversations whose next turn re-sends the answer (hits on blocks a chain held),
    in a pool small enough that pending blocks are evicted, with the index read now and
    then (which names everything pending) and at the end."""
    def arrivals() -> list[tuple[int, SequenceGroup]]:
        out: list[tuple[int, SequenceGroup]] = []
        for k in range(6):
            prompt = [100 + k] * (BS + 1 + k)
            n = 10 + 3 * k
            out.append((k, SequenceGroup(k, prompt, SamplingParams(max_tokens=n,
                                                                    ignore_eos=True))))
            follow = prompt + _outputs(k, len(prompt), n) + [120]
            out.append((30 + 2 * k, SequenceGroup(100 + k, follow, SamplingParams(
                max_tokens=5, ignore_eos=True))))
        return out

    for read_at in (frozenset(), frozenset({9, 20, 33})):
        one, lane = _drive(arrivals, False, read_at), _drive(arrivals, True, read_at)
        assert one == lane
        hits = [h for _, h, _ in one[-1]]
        assert sum(hits[6:]) > 0  # the follow-ups hit their answers


def test_a_copy_of_the_root_names_the_chain_first() -> None:
    """S sends A's prompt again, whole blocks: a prompt's last block is always computed,
    so S names its own copy of the block before A's chain without looking it up. The
    chain must be named then (BlockPool.name), before S names the same content after it
    (request ids 26 apart decode the same ids; a stop token keeps S out of the lane)."""
    prompt = [100 + i for i in range(2 * BS)]

    def arrivals() -> list[tuple[int, SequenceGroup]]:
        a = SequenceGroup(0, prompt, SamplingParams(max_tokens=24, ignore_eos=True))
        s = SequenceGroup(26, list(prompt), SamplingParams(
            max_tokens=16, ignore_eos=True, stop_token_ids=[999]))
        return [(0, a), (7, s)]

    one, lane = _drive(arrivals, False), _drive(arrivals, True)
    assert one == lane
    assert one[-1][1][1] == BS  # S hit A's first block only: it computed its last
    assert any(len(copies) == 2 for _, copies in one[-2])  # content named twice
