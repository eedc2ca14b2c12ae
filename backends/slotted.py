"""Token-granular paged storage: the base of the backends whose KV manager gives back
single tokens (h2o, tova, snapkv: :class:`~harness.kv.evicting.EvictingKVManager` with a
token-granular policy).

A sequence's slots are not in position order: an evicted token's slot is reused by a later
token, and a compaction moves kept tokens into fewer blocks. So the backend keeps each
slot's position (``slot_pos``, -1 = empty): new tokens set it, the step record's
``invalidated`` slots clear it, copies copy it (a move also clears its source). Attention
reads a sequence's held blocks and masks by it: a decode sees every live slot of its
blocks; a prefill query at position p sees the live slots at positions <= p. Keys are
stored already rotated (RoPE), so their order in the cache does not matter, only which
ones a query sees.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from harness.backends.base import AttentionBatch, CacheSizing, PrefillChunk
from harness.backends.costs import KVCosts
from harness.backends.paged_storage import PagedStorageBackend
from harness.kv.base import KVManager
from harness.kv.evicting import EvictingKVManager
from harness.kv.policies.base import EvictionPolicy
from harness.sched.step import StepRecord


class SlottedBackend(PagedStorageBackend):
    """Paged K/V + per-slot positions + attention over held slots (masked SDPA).
    Subclasses set ``self.policy`` and may override :meth:`attend_rows` (explicit softmax
    that scores keys) or :meth:`attend_chunk` (observe a prompt's last queries)."""

    exact = False
    # A block whose slots were rewritten or compacted is not the block its hash names.
    supports_prefix_caching = False
    policy: EvictionPolicy

    def make_manager(self, sizing: CacheSizing, **options: Any) -> KVManager:
        options.pop("num_cpu_blocks", None)
        return EvictingKVManager(sizing.num_blocks, sizing.block_size, self.policy, **options)

    def allocate(self, sizing: CacheSizing) -> None:
        if sizing.num_cpu_blocks:
            raise ValueError(f"backend {self.name} does not swap (its per-slot state lives on "
                             "the device): use scheduler.preemption_mode=recompute and "
                             "cache.swap_space=0")
        super().allocate(sizing)
        n = sizing.num_blocks * sizing.block_size
        self.slot_pos = torch.full((n,), -1, dtype=torch.int64, device=self.device)

    # -- per step ------------------------------------------------------------------------
    def apply_cache_ops(self, rec: StepRecord) -> None:
        super().apply_cache_ops(rec)
        if rec.invalidated:
            n = len(rec.invalidated)
            self.slot_pos[self.staging.put("invalidated", rec.invalidated, n)] = -1
        for src, dst, move in self.step_copies(rec):
            self.slot_pos[dst] = self.slot_pos[src]
            if move:
                self.slot_pos[src] = -1

    def begin_step(self, batch: AttentionBatch) -> None:
        # (KV cache groups: the first group's, the full one whose tokens the policy
        # chooses; the sliding groups attend through the paged reference, attend_window.)
        super().begin_step(batch)
        bs = self.block_size
        offs = torch.arange(bs, device=self.device)
        self.slot_pos[batch.slot_mapping] = batch.positions
        if batch.num_decode:
            width = batch.decode_tables.shape[1]
            # (B, W * bs) slots of each decode's held blocks; padding columns are not held.
            self._decode_slots = (batch.decode_tables.unsqueeze(-1) * bs + offs).flatten(1)
            held = torch.arange(width, device=self.device) < batch.decode_num_blocks[:, None]
            self._decode_valid = (held.repeat_interleave(bs, dim=1)
                                  & (self.slot_pos[self._decode_slots] >= 0))
        self._chunk_slots = [(c.table[:, None] * bs + offs).flatten() for c in batch.prefills]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        slot = self.layer_slots[layer]
        if slot.window:  # a hybrid model's sliding layer: its own window, nothing chosen
            return self.attend_window(slot.storage, slot.group, slot.window, q, k, v)
        b = self.batch
        assert b is not None
        self.store(layer, k, v)
        out = torch.empty_like(q)
        nd = b.num_decode
        if nd:
            if f := self.touch_factor(layer):
                self.touch_slots(self._decode_valid, f, decode=True)
            out[:nd] = self.attend_rows(layer, q[:nd].unsqueeze(1), self._decode_slots,
                                        self._decode_valid[:, None, :])[:, 0]
        for c, slots in zip(b.prefills, self._chunk_slots):
            rows = slice(c.row, c.row + c.num_tokens)
            out[rows] = self.attend_chunk(layer, q[rows], c, slots)
        return out

    def attend_window(self, storage: int, group: int, window: int, q: torch.Tensor,
                      k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """A sliding layer of a hybrid model: its group's positional tables (given-back
        blocks masked by the window), the paged reference attention; the full group's
        state (slot positions, scores) is not touched."""
        self.batch = self.group_batches[group]
        try:
            PagedStorageBackend.store(self, storage, k, v)
            return self.torch_attend(storage, q, window)
        finally:
            self.batch = self.group_batches[0]

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """``layer`` is the model's: its storage tensor is its LayerSlot's (KV cache
        groups share tensors across groups; the layer itself otherwise)."""
        super().store(self.layer_slots[layer].storage, k, v)

    def attend_chunk(self, layer: int, q: torch.Tensor, c: PrefillChunk,
                     slots: torch.Tensor) -> torch.Tensor:
        """One prefill chunk. q: (n, H, D); slots: (L,) its table's slots. -> (n, H, D)."""
        b = self.batch
        assert b is not None
        kpos = self.slot_pos[slots]
        qpos = b.positions[c.row:c.row + c.num_tokens]
        valid = (kpos[None, :] >= 0) & (kpos[None, :] <= qpos[:, None])
        if f := self.touch_factor(layer):
            self.touch_slots(valid, f, decode=False)
        return self.attend_rows(layer, q.unsqueeze(0), slots[None], valid[None])[0]

    def attend_rows(self, layer: int, q: torch.Tensor, slots: torch.Tensor,
                    valid: torch.Tensor) -> torch.Tensor:
        """q: (B, n, H, D) over the keys in ``slots`` (B, L) where ``valid`` (B, n, L).
        Returns (B, n, H, D). Every query sees at least its own key."""
        k, v = self.gather(layer, slots, q.dtype)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=valid[:, None], enable_gqa=True)
        return out.transpose(1, 2)

    def gather(self, layer: int, slots: torch.Tensor,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at ``slots`` (any shape S) as (*S, KV, D) tensors in ``dtype``."""
        kv_heads, d = self.layout.num_kv_heads, self.layout.head_dim
        i = self.layer_slots[layer].storage
        k = self.k_cache[i].view(-1, kv_heads, d)[slots]
        v = self.v_cache[i].view(-1, kv_heads, d)[slots]
        return k.to(dtype), v.to(dtype)

    def declare_costs(self) -> KVCosts:
        # A query reads the live slots of its held blocks: the tokens its sequence keeps
        # (a prefill query those at or before it), every one at full precision.
        return KVCosts(self.full_slot_bytes(), self.block_size)

    def held_slots(self) -> int | None:
        # Under KV cache groups only the full group's slots keep positions here (the
        # executor then compares with that group's used slots).
        return int((self.slot_pos >= 0).sum())

    def touch_slots(self, valid: torch.Tensor, layers: int, decode: bool) -> None:
        """Count ``layers`` layers' reads from a mask over held slots (B, [n,] L): the
        slots' positions are the step's, the same for every layer."""
        n = valid.sum() * layers
        if decode:
            self.touch_full_keys(n)
        else:
            self.touch_prefill(n)
