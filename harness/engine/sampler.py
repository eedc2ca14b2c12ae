"""Greedy and seeded temperature / top-p sampling."""

from __future__ import annotations

import torch

from harness.sched.sequence import Sequence


class Sampler:
    """Chooses next tokens from float32 logits; each sequence draws from its own generator
    (seeded by the run seed, the request and the sample index), so a run is reproducible
    whatever else shares its batch."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._gens: dict[int, torch.Generator] = {}

    def _gen(self, seq: Sequence) -> torch.Generator:
        g = self._gens.get(seq.seq_id)
        if g is None:
            p = seq.group.params
            base = p.seed if p.seed is not None else self.seed
            idx = seq.group.seqs.index(seq)
            g = torch.Generator().manual_seed(hash((base, seq.group.request_id, idx)) & 0x7FFF_FFFF)
            self._gens[seq.seq_id] = g
        return g

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """logits: (S, vocab) float32, one row per sequence in ``seqs``."""
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
            out.append(int(torch.multinomial(probs, 1, generator=self._gen(seq))))
        return out

    def forget(self, seq: Sequence) -> None:
        self._gens.pop(seq.seq_id, None)
