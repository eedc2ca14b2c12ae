"""Slotted storage whose attention also scores every key it reads: the base of h2o and
tova, whose policies evict by attention weight.

Attention is an explicit softmax in float32 (the weights are needed, SDPA does not return
them). After each forward the backend hands the KV manager one score per touched slot,
summed over layers, in one device-to-host transfer (:meth:`take_scores`). What a score is
differs, and is all a subclass writes (:meth:`score_weights`).
"""

from __future__ import annotations

from abc import abstractmethod

import numpy as np
import torch

from harness.backends.base import AttentionBatch, CacheSizing
from harness.backends.slotted import SlottedBackend
from harness.kv.base import StepScores
from harness.kv.policies.budget import BudgetPolicy


class ScoredBackend(SlottedBackend):
    policy: BudgetPolicy

    @property
    def trigger(self) -> str | None:
        return self.policy.prefill

    def allocate(self, sizing: CacheSizing) -> None:
        super().allocate(sizing)
        n = sizing.num_blocks * sizing.block_size
        # The step's score per slot, summed over layers (reset by take_scores).
        self._received = torch.zeros(n, dtype=torch.float32, device=self.device)

    def begin_step(self, batch: AttentionBatch) -> None:
        super().begin_step(batch)
        touched = list(self._chunk_slots)
        if batch.num_decode:
            touched.append(self._decode_slots[self._decode_valid])
        self._touched = torch.unique(torch.cat(touched)) if touched else None

    @abstractmethod
    def score_weights(self, w: torch.Tensor) -> torch.Tensor:
        """One layer's contribution to each key's score. w: (B, KV, G, n, L) softmax
        weights (G query heads per KV head, n queries) -> (B, L)."""

    def attend_rows(self, layer: int, q: torch.Tensor, slots: torch.Tensor,
                    valid: torch.Tensor) -> torch.Tensor:
        kv_heads, d = self.layout.num_kv_heads, self.layout.head_dim
        bsz, n, h, _ = q.shape
        k, v = self.gather(layer, slots, torch.float32)  # (B, L, KV, D)
        qg = q.to(torch.float32).view(bsz, n, kv_heads, h // kv_heads, d)
        logits = torch.einsum("bnkgd,blkd->bkgnl", qg, k) * d ** -0.5
        logits = logits.masked_fill(~valid[:, None, None, :, :], float("-inf"))
        w = torch.softmax(logits, dim=-1)
        out = torch.einsum("bkgnl,blkd->bnkgd", w, v).reshape(bsz, n, h, d)
        self._received.index_add_(0, slots.flatten(), self.score_weights(w).flatten())
        return out.to(q.dtype)

    def take_scores(self) -> StepScores | None:
        if self._touched is None:
            return None
        t = self._touched
        both = torch.stack([t.to(torch.float64), self._received[t].to(torch.float64)])
        self._received[t] = 0.0
        host = both.cpu().numpy()  # the step's one device-to-host transfer
        return StepScores(slots=host[0].astype(np.int64), values=host[1])
