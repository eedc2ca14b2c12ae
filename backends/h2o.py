"""`h2o`: Heavy-Hitter Oracle eviction (Zhang et al., 2023) under a per-sequence budget.

Each sequence keeps at most ``backend.budget`` tokens (or ``backend.budget_ratio`` of its
prompt + max_tokens): the most recent ``(1 - heavy_ratio)`` share of the budget, and as
heavy hitters the tokens that received the most attention so far. Attention weights are
computed explicitly (torch) so that every decode and prefill adds, per layer and KV head,
the attention each cached token receives (summed over the query heads of the group).
A slot holds a token's K/V for every layer and head, so memory can only be given back a
whole token at a time: the victim is the token with the lowest score summed over layers
and heads, outside the recent window, and the new token is written into its slot
(harness.kv.h2o). The sequence never holds more than its budget: the allocator's
accounting shows it, not just a mask.
"""

from __future__ import annotations

from typing import Any

import torch

from harness.backends.base import CacheSizing, KVLayout
from harness.backends.paged_storage import PagedStorageBackend
from harness.kv.base import KVManager
from harness.kv.h2o import H2OKVManager
from harness.sched.sequence import Sequence
from harness.sched.step import StepRecord


class H2OBackend(PagedStorageBackend):
    name = "h2o"
    exact = False
    supports_prefix_caching = False

    def __init__(self, layout: KVLayout, device: torch.device, *, budget: int = 0,
                 budget_ratio: float = 0.0, heavy_ratio: float = 0.5,
                 **options: Any) -> None:
        super().__init__(layout, device, **options)
        self.budget, self.budget_ratio, self.heavy_ratio = budget, budget_ratio, heavy_ratio

    def make_manager(self, sizing: CacheSizing, **options: Any) -> KVManager:
        options.pop("enable_prefix_caching", None)
        return H2OKVManager(sizing.num_blocks, sizing.block_size, budget=self.budget,
                            budget_ratio=self.budget_ratio, heavy_ratio=self.heavy_ratio,
                            policy=self, num_cpu_blocks=0, **options)

    def allocate(self, sizing: CacheSizing) -> None:
        if sizing.num_cpu_blocks:
            raise ValueError("backend h2o does not swap (its scores live on the device): "
                             "use scheduler.preemption_mode=recompute and cache.swap_space=0")
        super().allocate(sizing)
        n = sizing.num_blocks * sizing.block_size
        # Accumulated attention received, per layer, slot and KV head; and each slot's
        # position (slots are reused, so position order is not slot order).
        self.scores = torch.zeros(self.layout.num_layers, n, self.layout.num_kv_heads,
                                  dtype=torch.float32, device=self.device)
        self.slot_pos = torch.zeros(n, dtype=torch.int64, device=self.device)

    # -- the eviction policy (called by H2OKVManager while scheduling) -----------------
    def victims(self, seq: Sequence, slots: list[int], n: int, next_pos: int) -> list[int]:
        kv = self.kv
        assert isinstance(kv, H2OKVManager)
        idx = torch.tensor(slots, dtype=torch.int64, device=self.device)
        total = self.scores[:, idx, :].sum(dim=(0, 2))
        recent = self.slot_pos[idx] >= next_pos - kv.recent_of(seq)
        total = total.masked_fill(recent, float("inf"))
        order = torch.argsort(total, stable=True)[:n]
        assert not bool(recent[order].any()), "a chunk larger than the evictable budget"
        return idx[order].tolist()

    # -- per step ------------------------------------------------------------------------
    def apply_cache_ops(self, rec: StepRecord) -> None:
        super().apply_cache_ops(rec)
        for op in rec.copies:
            src, dst = slice(op.src, op.src + op.num_slots), slice(op.dst, op.dst + op.num_slots)
            self.scores[:, dst] = self.scores[:, src]
            self.slot_pos[dst] = self.slot_pos[src]

    def begin_step(self, batch: Any) -> None:
        super().begin_step(batch)
        kv = self.kv
        assert isinstance(kv, H2OKVManager)
        self._decode_held = torch.tensor(
            [kv.held_tokens(s.seq, s.start + 1) for s in batch.decode_seqs],
            dtype=torch.int64, device=self.device)
        self._chunk_held = [kv.held_tokens(c.sched.seq, c.start + c.num_tokens)
                            for c in batch.prefills]
        # New tokens take fresh or reused slots: their past scores belong to nobody.
        self.scores[:, batch.slot_mapping] = 0.0
        self.slot_pos[batch.slot_mapping] = batch.positions

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        b = self.batch
        assert b is not None
        self.store(layer, k, v)
        out = torch.empty_like(q)
        bs = self.block_size
        nd = b.num_decode
        if nd:
            slots = (b.decode_tables.unsqueeze(-1) * bs
                     + torch.arange(bs, device=q.device)).flatten(1)  # (B, L)
            valid = torch.arange(slots.shape[1], device=q.device) < self._decode_held[:, None]
            out[:nd] = self._attend(layer, q[:nd].unsqueeze(1), slots, valid[:, None, :])[:, 0]
        for c, held in zip(b.prefills, self._chunk_held):
            nb = -(-held // bs)
            slots = (c.table[:nb, None] * bs + torch.arange(bs, device=q.device)).flatten()
            kpos = self.slot_pos[slots]
            qpos = b.positions[c.row:c.row + c.num_tokens]
            valid = (torch.arange(len(slots), device=q.device) < held)[None, :] \
                & (kpos[None, :] <= qpos[:, None])
            rows = slice(c.row, c.row + c.num_tokens)
            out[rows] = self._attend(layer, q[rows].unsqueeze(0), slots[None],
                                     valid[None])[0]
        return out

    def _attend(self, layer: int, q: torch.Tensor, slots: torch.Tensor,
                valid: torch.Tensor) -> torch.Tensor:
        """Explicit attention that also scores the keys. q: (B, n, H, D); slots: (B, L);
        valid: (B, n, L). Returns (B, n, H, D); adds the weights each key received."""
        kv_heads, d = self.layout.num_kv_heads, self.layout.head_dim
        bsz, n, h, _ = q.shape
        g = h // kv_heads
        kc = self.k_cache[layer].view(-1, kv_heads, d)[slots].to(torch.float32)  # B L KV D
        vc = self.v_cache[layer].view(-1, kv_heads, d)[slots].to(torch.float32)
        qg = q.to(torch.float32).view(bsz, n, kv_heads, g, d)
        logits = torch.einsum("bnkgd,blkd->bkgnl", qg, kc) * d ** -0.5
        logits = logits.masked_fill(~valid[:, None, None, :, :], float("-inf"))
        w = torch.softmax(logits, dim=-1)
        outp = torch.einsum("bkgnl,blkd->bnkgd", w, vc).reshape(bsz, n, h, d)
        received = w.sum(dim=(2, 3)).transpose(1, 2)  # (B, L, KV): summed over queries
        self.scores[layer].index_put_((slots.flatten(),), received.flatten(0, 1),
                                      accumulate=True)
        return outp.to(q.dtype)
