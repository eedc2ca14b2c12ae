"""Small builders shared by the allocator and scheduler tests."""

from __future__ import annotations

from harness.kv.base import Demand, KVManager
from harness.sched.sequence import SamplingParams, Sequence, SequenceGroup

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
