"""Greedy and seeded temperature / top-p sampling: on the host (here; bit-identical
run to run on the CPU and under executor=roofline) or on the device
(harness.engine.device_sampler, what a CUDA run uses: :func:`make_sampler`)."""

from __future__ import annotations

from typing import Protocol

import torch

from harness.engine.streams import stream_of, stream_seed
from harness.sched.sequence import Sequence, SequenceGroup


class TokenSampler(Protocol):
    """What the engine asks of a sampler."""

    def sample(self, logits: torch.Tensor, seqs: list[Sequence],
               samples: list[int | None] | None = None) -> list[int]: ...

    def forget(self, group: SequenceGroup) -> None: ...


def make_sampler(seed: int, device: torch.device) -> TokenSampler:
    """The device sampler on CUDA (no per-row host work, one read a step), the host one
    elsewhere (the streams every CPU record was made with)."""
    if device.type == "cuda":
        from harness.engine.device_sampler import DeviceSampler

        return DeviceSampler(seed, device)
    return Sampler(seed)


class Sampler:
    """Chooses next tokens from float32 logits; each sequence draws from its own generator
    (seeded by the run seed, the request and the sample index), so a run is reproducible
    whatever else shares its batch."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._gens: dict[tuple[int, int], torch.Generator] = {}  # (request, sample index)

    def _gen(self, seq: Sequence, sample: int | None) -> torch.Generator:
        stream = stream_of(seq, sample)
        g = self._gens.get(stream)
        if g is None:
            g = torch.Generator().manual_seed(stream_seed(seq, sample, self.seed))
            self._gens[stream] = g
        return g

    def sample(self, logits: torch.Tensor, seqs: list[Sequence],
               samples: list[int | None] | None = None) -> list[int]:
        """logits: (S, vocab) float32, one row per sequence in ``seqs``. ``samples[i]``:
        the index within its group of the sample row ``i`` draws for, where that is not
        ``seqs[i]`` itself (a fork not made yet draws its first token from its parent's
        row); None: ``seqs[i]``'s own."""
        out: list[int] = []
        greedy = logits.argmax(dim=-1).tolist()
        for i, seq in enumerate(seqs):
            p = seq.group.params
            if p.temperature <= 0:
                out.append(greedy[i])
                continue
            # On the CPU: the per-sequence generators are CPU generators (and one row is
            # cheap to move), so a run samples the same tokens on any device.
            probs = torch.softmax(logits[i].float().cpu() / p.temperature, dim=-1)
            if p.top_p < 1.0:
                sp, si = probs.sort(descending=True)
                keep = sp.cumsum(0) - sp < p.top_p  # always keeps the top token
                probs = torch.zeros_like(probs).scatter_(0, si[keep], sp[keep])
            gen = self._gen(seq, samples[i] if samples is not None else None)
            out.append(int(torch.multinomial(probs, 1, generator=gen)))
        return out

    def forget(self, group: SequenceGroup) -> None:
        """A finished request's generators."""
        for idx in range(len(group.seqs)):
            self._gens.pop((group.request_id, idx), None)
