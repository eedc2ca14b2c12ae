"""A sampling stream's identity: which (request, sample) a row draws for, and its seed.
Shared by the host sampler (its generator's seed) and the device sampler (its noise's
key), so the same identity drives both."""

from __future__ import annotations

from harness.sched.sequence import Sequence


def stream_of(seq: Sequence, sample: int | None) -> tuple[int, int]:
    """(request id, sample index) of the stream a row draws for: ``sample`` where given (a
    fork not made yet draws from its parent's row), else ``seq``'s place in its group."""
    group = seq.group
    return group.request_id, group.seqs.index(seq) if sample is None else sample


def stream_seed(seq: Sequence, sample: int | None, default_seed: int) -> int:
    """The 31-bit seed of that stream: the request's own seed, or the run's, with the
    stream's identity. The host sampler seeds its generator with it, the device sampler
    keys its noise by it."""
    p = seq.group.params
    base = p.seed if p.seed is not None else default_seed
    return hash((base, *stream_of(seq, sample))) & 0x7FFF_FFFF
