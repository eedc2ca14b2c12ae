"""Sampling: greedy is argmax; seeded sampling reproduces; top-p never drops the top token."""

from __future__ import annotations

import torch

from harness.engine.sampler import Sampler
from harness.sched.sequence import SamplingParams, Sequence, SequenceGroup


def seqs(n: int, **params: float) -> list[Sequence]:
    out = []
    for i in range(n):
        g = SequenceGroup(i, [1], SamplingParams(**params))  # type: ignore[arg-type]
        s = Sequence(i, g, [1])
        g.seqs.append(s)
        out.append(s)
    return out


def test_greedy_is_argmax() -> None:
    logits = torch.randn(5, 50)
    assert Sampler(0).sample(logits, seqs(5)) == logits.argmax(-1).tolist()


def test_seeded_sampling_reproduces_and_varies() -> None:
    logits = torch.zeros(4, 1000)
    a = Sampler(7).sample(logits, seqs(4, temperature=1.0))
    b = Sampler(7).sample(logits, seqs(4, temperature=1.0))
    c = Sampler(8).sample(logits, seqs(4, temperature=1.0))
    assert a == b and a != c
    assert len(set(a)) > 1  # different requests draw differently from uniform logits


def test_top_p_keeps_only_the_nucleus() -> None:
    logits = torch.tensor([[5.0, 4.0, -10.0, -10.0, -10.0]])
    s = Sampler(0)
    draws = {s.sample(logits, seqs(1, temperature=1.0, top_p=0.5))[0] for _ in range(20)}
    assert draws == {0}  # token 0 alone holds more than half of the mass
    draws = set()
    for k in range(40):
        draws |= set(Sampler(k).sample(logits, seqs(1, temperature=1.0, top_p=0.99)))
    assert draws == {0, 1}
