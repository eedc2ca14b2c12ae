"""`h2o`: Heavy-Hitter Oracle eviction (Zhang et al., 2023) under a per-sequence budget.

Each sequence keeps at most ``backend.budget`` tokens (or ``backend.budget_ratio`` of its
prompt + max_tokens): the most recent ``(1 - heavy_ratio)`` share of the budget, and as
heavy hitters the tokens that received the most attention so far. The decision is the KV
manager's :class:`~harness.kv.policies.h2o.H2OPolicy`; this backend stores, attends with
explicit softmax weights, and after each forward hands the manager the attention every
touched slot received (summed over layers, KV heads, query heads and queries) in one
device-to-host transfer. A slot holds a token's K/V for every layer and head, so memory
is given back a whole token at a time, and new tokens reuse the freed slots: the
sequence never holds more than its budget (the allocator's count, not a mask).

Slots are not in position order, so the backend keeps each slot's position
(``slot_pos``, -1 = empty): new tokens set it, the step record's ``invalidated`` slots
clear it, copies copy it; attention reads a sequence's held blocks and masks by it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from harness.backends.base import AttentionBatch, BackendOptions, CacheSizing, KVLayout
from harness.backends.paged_storage import PagedStorageBackend
from harness.kv.base import KVManager, StepScores
from harness.kv.evicting import EvictingKVManager
from harness.kv.policies.h2o import H2OPolicy
from harness.sched.step import StepRecord


@dataclass
class H2OOptions(BackendOptions):
    budget: int = 0  # tokens per sequence; or
    budget_ratio: float = 0.2  # share of prompt + max_tokens (set exactly one)
    heavy_ratio: float = 0.5  # heavy hitters' share of the budget; the rest is recent


class H2OBackend(PagedStorageBackend):
    name = "h2o"
    exact = False
    supports_prefix_caching = False
    Options = H2OOptions

    def __init__(self, layout: KVLayout, device: torch.device, **options: Any) -> None:
        super().__init__(layout, device, **options)
        o = self.opts
        assert isinstance(o, H2OOptions)
        self.policy = H2OPolicy(o.budget, o.budget_ratio, o.heavy_ratio)

    def make_manager(self, sizing: CacheSizing, **options: Any) -> KVManager:
        options.pop("num_cpu_blocks", None)
        return EvictingKVManager(sizing.num_blocks, sizing.block_size, self.policy, **options)

    def allocate(self, sizing: CacheSizing) -> None:
        if sizing.num_cpu_blocks:
            raise ValueError("backend h2o does not swap (its scores live on the device): "
                             "use scheduler.preemption_mode=recompute and cache.swap_space=0")
        super().allocate(sizing)
        n = sizing.num_blocks * sizing.block_size
        self.slot_pos = torch.full((n,), -1, dtype=torch.int64, device=self.device)
        # Attention received this step per slot (all layers, heads, queries).
        self._received = torch.zeros(n, dtype=torch.float32, device=self.device)

    # -- per step ------------------------------------------------------------------------
    def apply_cache_ops(self, rec: StepRecord) -> None:
        super().apply_cache_ops(rec)
        if rec.invalidated:
            self.slot_pos[torch.tensor(rec.invalidated, device=self.device)] = -1
        for op in rec.copies:
            src, dst = slice(op.src, op.src + op.num_slots), slice(op.dst, op.dst + op.num_slots)
            self.slot_pos[dst] = self.slot_pos[src]

    def begin_step(self, batch: AttentionBatch) -> None:
        super().begin_step(batch)
        bs = self.block_size
        offs = torch.arange(bs, device=self.device)
        self.slot_pos[batch.slot_mapping] = batch.positions
        nd = batch.num_decode
        touched = []
        if nd:
            width = batch.decode_tables.shape[1]
            # (B, L) slots of each decode's held blocks; padding columns are not held.
            self._decode_slots = (batch.decode_tables.unsqueeze(-1) * bs + offs).flatten(1)
            held = torch.arange(width, device=self.device) < batch.decode_num_blocks[:, None]
            self._decode_valid = (held.repeat_interleave(bs, dim=1)
                                  & (self.slot_pos[self._decode_slots] >= 0))
            touched.append(self._decode_slots[self._decode_valid])
        self._chunk_slots = []
        for c in batch.prefills:
            slots = (c.table[:, None] * bs + offs).flatten()
            self._chunk_slots.append(slots)
            touched.append(slots)
        self._touched = torch.unique(torch.cat(touched)) if touched else None

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        b = self.batch
        assert b is not None
        self.store(layer, k, v)
        out = torch.empty_like(q)
        nd = b.num_decode
        if nd:
            out[:nd] = self._attend(layer, q[:nd].unsqueeze(1), self._decode_slots,
                                    self._decode_valid[:, None, :])[:, 0]
        for c, slots in zip(b.prefills, self._chunk_slots):
            kpos = self.slot_pos[slots]
            qpos = b.positions[c.row:c.row + c.num_tokens]
            valid = (kpos[None, :] >= 0) & (kpos[None, :] <= qpos[:, None])
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
        received = w.sum(dim=(1, 2, 3))  # (B, L): summed over KV heads, group, queries
        self._received.index_add_(0, slots.flatten(), received.flatten())
        return outp.to(q.dtype)

    def take_scores(self) -> StepScores | None:
        if self._touched is None:
            return None
        t = self._touched
        both = torch.stack([t.to(torch.float64), self._received[t].to(torch.float64)])
        self._received[t] = 0.0
        host = both.cpu().numpy()  # the step's one device-to-host transfer
        return StepScores(slots=host[0].astype(np.int64), values=host[1])
