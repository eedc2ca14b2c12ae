"""Small builders shared by the allocator and scheduler tests."""

from __future__ import annotations

from typing import TYPE_CHECKING

from harness.kv.base import Demand, KVManager
from harness.sched.sequence import SamplingParams, Sequence, SequenceGroup
from harness.sched.step import StepOutcome

if TYPE_CHECKING:
    from harness.sched.scheduler import Scheduler

_next = [0]


def make_seq(tokens: list[int], *, max_tokens: int = 16, n: int = 1,
             extra_key: int | str | None = None) -> Sequence:
    """A fresh one-sequence group over ``tokens`` (ids unique per call)."""
    _next[0] += 1
    g = SequenceGroup(_next[0], list(tokens), SamplingParams(max_tokens=max_tokens, n=n),
                      extra_key=extra_key)
    s = Sequence(1000 + _next[0], g, list(tokens))
    g.seqs.append(s)
    return s


def make_group(rid: int, prompt: list[int], *, max_tokens: int = 8, n: int = 1,
               arrival: float = 0.0, priority: int = 0, **kw: object) -> SequenceGroup:
    return SequenceGroup(rid, list(prompt), SamplingParams(max_tokens=max_tokens, n=n, **kw),  # type: ignore[arg-type]
                         arrival_time=arrival, priority=priority)


def decode(m: KVManager, seq: Sequence, token: int) -> None:
    """Append one token and give it a slot, as a decode step does (the engine writes its
    K/V this step)."""
    seq.token_ids.append(token)
    d = Demand(seq, 1)
    assert m.can_allocate([d], watermark=False)
    m.allocate(d)
    seq.num_computed += 1


def decode_ready(kv: KVManager, num_seqs: int, prompt: int = 40) -> Scheduler:
    """A scheduler over ``kv`` with ``num_seqs`` sequences prefilled and decoding (prompts
    of ``prompt`` + 3 tokens, unbounded max_tokens): the benchmarks' starting state."""
    from harness.sched.scheduler import Scheduler, SchedulerConfig

    cfg = SchedulerConfig(max_num_seqs=num_seqs, max_num_batched_tokens=1 << 20,
                          max_model_len=1 << 20)
    s = Scheduler(cfg, kv)
    for i in range(num_seqs):
        s.add(make_group(i, [i + 1] * 3 + list(range(100 + 40 * i, 100 + 40 * i + prompt)),
                         max_tokens=1 << 19))
    rec = s.schedule()
    s.update(rec, StepOutcome.appending([(x.seq, 7) for x in rec.seqs if x.sample]))
    assert len(s.running) == num_seqs
    return s
