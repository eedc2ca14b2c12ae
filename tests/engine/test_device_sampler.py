"""The device sampler (harness.engine.device_sampler), run here on CPU tensors: its noise
equals a numpy reference bit for bit, it samples softmax(logits / T) restricted to the
top-p nucleus (chi-square against the exact probabilities), a request's draws do not
depend on its batch, and a call reads the device once."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from harness.engine.device_sampler import (
    DeviceSampler,
    gumbel,
    gumbel_reference,
    top_p_mask,
    uniform_bits,
)
from harness.engine.host_syncs import HostSyncCounter
from harness.sched.sequence import SamplingParams, Sequence, SequenceGroup

CPU = torch.device("cpu")


def chisquare_p(counts: np.ndarray, expected: np.ndarray | None = None) -> float:
    """Pearson's chi-square test's p-value (expected: uniform when None)."""
    counts = counts.astype(np.float64)
    if expected is None:
        expected = np.full_like(counts, counts.sum() / len(counts))
    x = float(((counts - expected) ** 2 / expected).sum())
    dof = len(counts) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(x / 2, dtype=torch.float64)))


def seq(rid: int, length: int = 5, temperature: float = 1.0, top_p: float = 1.0,
        seed: int | None = None) -> Sequence:
    g = SequenceGroup(rid, [1] * length, SamplingParams(temperature=temperature,
                                                        top_p=top_p, seed=seed))
    s = Sequence(rid, g, [1] * length)
    g.seqs.append(s)
    return s


def test_noise_equals_the_numpy_reference() -> None:
    keys = torch.tensor([0, 1, 123456789, 0x7FFF_FFFF])
    counters = torch.tensor([0, 7, 2048, 131071])
    g = gumbel(keys, counters, 300)
    for i in range(4):
        ref = gumbel_reference(int(keys[i]), int(counters[i]), 300)
        np.testing.assert_allclose(g[i].double().numpy(), ref, rtol=1e-5, atol=1e-6)


def test_hash_bits_are_uniform_and_distinct_across_rows() -> None:
    bits = uniform_bits(torch.arange(64), torch.arange(64) * 3, 4096)
    top = (bits >> 28).flatten().numpy()  # 16 bins
    counts = np.bincount(top, minlength=16)
    assert chisquare_p(counts) > 1e-4, counts
    # Rows of neighbouring keys share no pattern (a poor mix repeats columns).
    assert len({tuple(r[:16].tolist()) for r in bits}) == 64
    assert float((bits[0] == bits[1]).float().mean()) < 0.01


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.3, 0.8)])
def test_draws_follow_the_tempered_nucleus(temperature: float, top_p: float) -> None:
    """Many requests draw once from the same logits: the counts match the exact
    probabilities of softmax(logits / T) renormalized over the nucleus."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0, 1.5])
    n = 6000
    sampler = DeviceSampler(seed=11, device=CPU)
    seqs = [seq(r, temperature=temperature, top_p=top_p) for r in range(n)]
    ids = sampler.sample(logits.expand(n, -1).contiguous(), seqs)
    probs = torch.softmax(logits / temperature, dim=-1)
    keep = top_p_mask((logits / temperature)[None], torch.tensor([top_p]))[0]
    want = torch.where(keep, probs, 0.0)
    want = (want / want.sum()).numpy()
    counts = np.bincount(ids, minlength=8)
    assert counts[~keep.numpy()].sum() == 0  # outside the nucleus: never
    kept = keep.numpy()
    assert chisquare_p(counts[kept], want[kept] * n) > 1e-4, (counts, want * n)


def test_top_p_keeps_the_host_samplers_nucleus() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 40, generator=gen) * 2
    tp = torch.tensor([0.1, 0.5, 0.9, 0.999, 1e-6])
    got = top_p_mask(logits, tp)
    for i in range(5):  # the host sampler's rule, one row at a time
        probs = torch.softmax(logits[i], -1)
        sp, si = probs.sort(descending=True)
        keep = sp.cumsum(0) - sp < tp[i]
        want = torch.zeros(40, dtype=torch.bool)
        want[si[keep]] = True
        assert torch.equal(got[i], want)
        assert got[i].any()


def test_a_request_draws_the_same_whatever_shares_its_batch() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 50, generator=gen)
    a, b, c = seq(1, temperature=0.9), seq(2, temperature=1.0, top_p=0.7), seq(3, 0)
    sampler = DeviceSampler(seed=5, device=CPU)
    first = sampler.sample(logits, [a, b, c])
    again = sampler.sample(logits[[2, 0]], [c, a])
    assert again == [first[2], first[0]]
    assert first[2] == int(logits[2].argmax())  # temperature 0: greedy
    # A new position draws anew; another seed, another stream.
    a.token_ids.append(7)
    draws = {sampler.sample(logits[:1], [a])[0] for _ in range(1)}
    other = DeviceSampler(seed=6, device=CPU)
    keys = {sampler.key(a, None), other.key(a, None), sampler.key(b, None)}
    assert len(keys) == 3 and draws


def test_a_call_reads_the_device_once() -> None:
    logits = torch.randn(8, 64)
    seqs = [seq(r, temperature=0.8 if r % 2 else 0.0, top_p=0.9) for r in range(8)]
    sampler = DeviceSampler(seed=0, device=CPU)
    sampler.sample(logits, seqs)  # first call sizes its buffers
    with HostSyncCounter() as c:
        ids = sampler.sample(logits, seqs)
    assert c.num_syncs == 1, c.syncs
    assert len(ids) == 8 and all(0 <= i < 64 for i in ids)
    assert math.isfinite(float(gumbel(torch.tensor([3]), torch.tensor([0]), 4).sum()))


def test_the_engine_runs_forks_on_the_device_sampler(monkeypatch: pytest.MonkeyPatch) -> None:
    """A parallel-sampling run (forks draw their first token from the parent's row) with
    the device sampler in the engine, as a CUDA run has it: every sample finishes, the
    samples of a prompt differ, and a second run draws the same tokens."""
    import harness.model_target as mt
    from harness.runner import run
    from tests.compose import compose_cfg

    monkeypatch.setattr(mt, "make_sampler", lambda seed, device: DeviceSampler(seed, device))
    cfg = compose_cfg(["model=tiny", "device=cpu", "workload=parallel_sampling",
                       "cache.kv_budget=1MiB"])
    first, second = run(cfg), run(cfg)
    assert first.outputs == second.outputs
    assert first.metrics["requests.finished"] == len(first.outputs) > 0
    rows = first.requests
    assert all(r["status"] == "finished" for r in rows)
    outs = [tuple(o) for o in first.outputs.values()]
    assert len(set(outs)) > 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_noise_and_the_draws_are_the_cpus() -> None:
    """The hash is integer arithmetic: the same bits on CUDA; and the sampler reads once."""
    dev = torch.device("cuda")
    keys, counters = torch.tensor([0, 7, 123456789]), torch.tensor([1, 2, 2048])
    assert torch.equal(uniform_bits(keys.to(dev), counters.to(dev), 999).cpu(),
                       uniform_bits(keys, counters, 999))
    logits = torch.randn(16, 300)
    seqs = [seq(r, temperature=0.9, top_p=0.95) for r in range(16)]
    on_cpu = DeviceSampler(seed=3, device=CPU).sample(logits, seqs)
    on_cuda = DeviceSampler(seed=3, device=dev).sample(logits.to(dev), seqs)
    # The same keys and noise; the logits' float arithmetic may differ by an ulp, which
    # can flip a near tie: nearly all rows agree.
    assert sum(a == b for a, b in zip(on_cpu, on_cuda)) >= 15
