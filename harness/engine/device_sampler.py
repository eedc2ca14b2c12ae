"""Sampling on the device: greedy, temperature and top-p for the whole batch in a few
kernels, and the chosen ids read back once (the step's one host sync).

The host sampler (harness.engine.sampler) draws each non-greedy row on the CPU from its own
``torch.Generator``: a row moved to the host and a ``multinomial`` per sequence, each a
sync on CUDA. Here every row draws with the Gumbel-max trick, argmax(logits / T + G) over
the tokens top-p keeps, where G is standard Gumbel noise made by a counter-based hash of
(the request's key, the sequence's length, the token id): no generator state, so a
request's draws depend only on its seed, its identity and its sample index, never on what
else shares the batch or on the order of rows (the property the host sampler's
per-sequence generators give). Streams differ from the host sampler's: a run on CUDA does
not sample the CPU run's tokens (docs/results/2026-12-04-engine-host-work.md says so).

The hash: ``lowbias32`` (Chris Wellons' 32-bit integer finalizer, bias ~0.17) applied in
int64 arithmetic masked to 32 bits, so it runs as plain elementwise ops on any device;
:func:`gumbel_reference` is the same in numpy's uint64, for the tests.
"""

from __future__ import annotations

import numpy as np
import torch

from harness.backends.staging import Staging
from harness.engine.streams import stream_seed
from harness.sched.sequence import Sequence, SequenceGroup

_M32 = 0xFFFF_FFFF
_GOLDEN = 0x9E37_79B9


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on the low 32 bits of int64 ``x`` (products wrap; only their low 32 bits
    are kept, which wrapping does not change)."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def uniform_bits(keys: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """int64 (S, vocab) hash values in [0, 2^32) of (keys[s], counters[s], token id)."""
    row = _mix32(keys + _mix32(counters * _GOLDEN))  # (S,)
    tok = torch.arange(vocab, device=keys.device, dtype=torch.int64)
    return _mix32(_mix32(row[:, None] ^ tok[None, :]) + row[:, None])


def gumbel(keys: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """float32 (S, vocab) standard Gumbel noise, a pure function of (key, counter, id):
    -log(-log(u)) with u the hash's top 24 bits + 1/2, over 2^24 (in (0, 1))."""
    bits = uniform_bits(keys, counters, vocab)
    u = ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    return -torch.log(-torch.log(u))


def gumbel_reference(key: int, counter: int, vocab: int) -> np.ndarray:
    """:func:`gumbel` for one row, in numpy's unsigned arithmetic (float64 logs)."""
    m = np.uint64(_M32)

    def mix(x: np.ndarray) -> np.ndarray:
        x = x & m
        x ^= x >> np.uint64(16)
        x = (x * np.uint64(0x7FEB352D)) & m
        x ^= x >> np.uint64(15)
        x = (x * np.uint64(0x846CA68B)) & m
        return x ^ (x >> np.uint64(16))

    with np.errstate(over="ignore"):
        c = mix(np.array([counter], dtype=np.uint64) * np.uint64(_GOLDEN))
        row = mix(np.array([key], dtype=np.uint64) + c)
        tok = np.arange(vocab, dtype=np.uint64)
        bits = mix(mix(row ^ tok) + row)
    u = ((bits >> np.uint64(8)).astype(np.float32) + np.float32(0.5)) * np.float32(2.0**-24)
    return -np.log(-np.log(u.astype(np.float64)))


def top_p_mask(scaled: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """bool (S, vocab): the tokens each row's nucleus keeps, from its probabilities
    softmax(``scaled``): the most likely first while the mass before them is < top_p
    (so the top token always stays), as the host sampler keeps them."""
    probs = torch.softmax(scaled, dim=-1)
    sp, si = probs.sort(dim=-1, descending=True)
    keep_sorted = sp.cumsum(-1) - sp < top_p[:, None]
    return torch.zeros_like(keep_sorted).scatter_(-1, si, keep_sorted)


class DeviceSampler:
    """The host :class:`~harness.engine.sampler.Sampler`'s interface, sampling on the
    logits' device; one read of the chosen ids per call."""

    def __init__(self, seed: int, device: torch.device) -> None:
        self.seed = seed
        self.device = device
        self.staging = Staging(device, capacity=256)
        self._ids_host: torch.Tensor | None = None  # pinned, on CUDA

    def key(self, seq: Sequence, sample: int | None) -> int:
        """The 31-bit key of a (request, sample index): the host sampler's seed for it
        (harness.engine.streams.stream_seed), so the same identity drives both."""
        return stream_seed(seq, sample, self.seed)

    def sample(self, logits: torch.Tensor, seqs: list[Sequence],
               samples: list[int | None] | None = None) -> list[int]:
        """logits: (S, vocab) float32, one row per sequence in ``seqs``; ``samples`` as
        for the host sampler. The draw of row s is a function of its key and its
        sequence's length (its position in its own stream)."""
        params = [s.group.params for s in seqs]
        ids = logits.argmax(dim=-1)
        if any(p.temperature > 0 for p in params):
            st = self.staging
            st.begin()
            n, vocab = len(seqs), logits.shape[1]
            temps = st.put("temperature", [p.temperature if p.temperature > 0 else 1.0
                                           for p in params], n, torch.float32)
            greedy = st.put("greedy", [int(p.temperature <= 0) for p in params], n)
            keys = st.put("keys", [self.key(s, samples[i] if samples is not None else None)
                                   for i, s in enumerate(seqs)], n)
            counters = st.put("counters", [len(s.token_ids) for s in seqs], n)
            scaled = logits.float() / temps[:, None]
            if any(p.top_p < 1.0 for p in params):
                top_p = st.put("top_p", [p.top_p for p in params], n, torch.float32)
                scaled = scaled.masked_fill(~top_p_mask(scaled, top_p), float("-inf"))
            st.end()
            drawn = (scaled + gumbel(keys, counters, vocab)).argmax(dim=-1)
            ids = torch.where(greedy.bool(), ids, drawn)
        return self._read(ids)

    def _read(self, ids: torch.Tensor) -> list[int]:
        """The step's one host sync: the ids, copied into pinned memory, then read."""
        if ids.device.type != "cuda":
            return ids.tolist()
        n = ids.shape[0]
        if self._ids_host is None or self._ids_host.shape[0] < n:
            self._ids_host = torch.empty(max(256, n), dtype=torch.int64, pin_memory=True)
        host = self._ids_host[:n]
        host.copy_(ids, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        done.synchronize()
        return host.tolist()

    def forget(self, group: SequenceGroup) -> None:
        """Nothing is kept per request (the keys are made from the request each time)."""
