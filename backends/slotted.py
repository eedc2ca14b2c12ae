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

``backend.kernel=triton`` (``auto`` on CUDA): the step's store is the store kernel and
the attention the paged decode and prefill kernels in their slot-list form
(harness.kernels.decode / prefill with ``slot_pos``): each scans its table's slots, skips
the holes and, for a prefill row, the positions after it, reading K/V in place; a scored
method adds its scores from the same launches (backends.scored). The torch path gathers
each decode's held slots into a padded batch for one masked SDPA call.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from harness.backends.base import AttentionBatch, CacheSizing, KVLayout, PrefillChunk
from harness.backends.costs import KVCosts
from harness.backends.kernel_option import resolve_kernel
from harness.backends.paged import PrefillTables, prefill_tables
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

    def __init__(self, layout: KVLayout, device: torch.device, **options: Any) -> None:
        super().__init__(layout, device, **options)
        # backend.kernel as the options give it (a method's options carry it), resolved
        # as paged's: triton on CUDA under auto, the interpreter only when asked for.
        self._kernel = resolve_kernel(getattr(self.opts, "kernel", "torch"), self.block_size,
                                      device)

    @property
    def kernel(self) -> str:
        return self._kernel

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
        if self._kernel == "triton":
            self.begin_triton(batch)

    def begin_triton(self, batch: AttentionBatch) -> None:
        """What every layer's kernels read this step, made once from host values: the
        decodes' slots to scan (their blocks x block size), the chunks' tables, starts and
        slots to scan; each layer's sliding-window prefill tables (a hybrid model) on
        first use."""
        # Imported here: importing triton fixes the interpreter switch for the process,
        # which resolve_kernel had to decide first (backends.paged).
        import harness.kernels.ops  # noqa: F401  (registers torch.ops.kvbench.*)

        bs = self.block_size
        self._slot_lens = batch.decode_num_blocks * bs if batch.num_decode else None
        self._prefill: PrefillTables | None = prefill_tables(batch, self.device)
        slots = [c.table.numel() * bs for c in batch.prefills]
        self._kv_lens = torch.tensor(slots, dtype=torch.int64, device=self.device)
        self._max_slots = max(slots, default=0)
        self._group_prefill: dict[int, PrefillTables | None] = {}

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        slot = self.layer_slots[layer]
        if slot.window:  # a hybrid model's sliding layer: its own window, nothing chosen
            return self.attend_window(slot.storage, slot.group, slot.window, q, k, v)
        b = self.batch
        assert b is not None
        self.store(layer, k, v)
        if self._kernel == "triton":
            return self.attend_triton(layer, q)
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
            self.after_chunk(layer, q[rows], c, slots)
        return out

    def attend_triton(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """The Triton path, after the store: one decode launch (with its split-K combine)
        and one prefill launch over slot lists, then the method's scores
        (:meth:`triton_scores`) and each chunk's hook. q: (T, H, D) -> (T, H, D)."""
        from harness.kernels.decode import default_splits

        b = self.batch
        assert b is not None
        i = self.layer_slots[layer].storage
        kc, vc = self.k_cache[i], self.v_cache[i]
        out = torch.empty_like(q)
        logits, lse = self.decode_scratch(q)
        nd = b.num_decode
        f = self.touch_factor(layer)
        if nd:
            if f:
                self.touch_slots(self._decode_valid, f, decode=True)
            splits = default_splits(nd, kc.shape[2], b.decode_tables.shape[1] * kc.shape[1],
                                    q.device)
            torch.ops.kvbench.slotted_decode(q[:nd], kc, vc, b.decode_tables, self._slot_lens,
                                             self.slot_pos, out[:nd], splits, logits, lse)
        p = self._prefill
        if p is not None:
            torch.ops.kvbench.slotted_prefill(q, kc, vc, p.cu_rows, p.starts, p.tables,
                                              self._kv_lens, self.slot_pos, p.max_tokens,
                                              out, self.prefill_lse(q))
        self.triton_scores(layer, q, logits, lse)
        for c, slots in zip(b.prefills, self._chunk_slots):
            rows = slice(c.row, c.row + c.num_tokens)
            if f:
                self.touch_slots(self.chunk_valid(c, slots), f, decode=False)
            self.after_chunk(layer, q[rows], c, slots)
        return out

    def decode_scratch(self, q: torch.Tensor) -> tuple[torch.Tensor | None,
                                                        torch.Tensor | None]:
        """The Triton decode's scores scratch (logits, lse), or (None, None): a method
        that scores keys by the decode's weights makes them (backends.scored)."""
        return None, None

    def prefill_lse(self, q: torch.Tensor) -> torch.Tensor | None:
        """Where the Triton prefill writes each row's log-sum-exp (T, H), or None."""
        return None

    def triton_scores(self, layer: int, q: torch.Tensor, logits: torch.Tensor | None,
                      lse: torch.Tensor | None) -> None:
        """On the Triton path, after the layer's attention: the method's scores from the
        kernels' outputs (backends.scored). Default: none."""

    def after_chunk(self, layer: int, q: torch.Tensor, c: PrefillChunk,
                    slots: torch.Tensor) -> None:
        """After prefill chunk ``c``'s attention, on either path (q: (n, H, D) its queries;
        slots: (L,) its table's): a method that scores a prompt's window or its held keys
        does it here (backends.scored). Default: nothing."""

    def chunk_valid(self, c: PrefillChunk, slots: torch.Tensor) -> torch.Tensor:
        """bool (n, L): which of ``slots`` (chunk ``c``'s table's) each of its queries sees,
        held tokens at or before it."""
        b = self.batch
        assert b is not None
        kpos = self.slot_pos[slots]
        qpos = b.positions[c.row:c.row + c.num_tokens]
        return (kpos[None, :] >= 0) & (kpos[None, :] <= qpos[:, None])

    def attend_window(self, storage: int, group: int, window: int, q: torch.Tensor,
                      k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """A sliding layer of a hybrid model: its group's positional tables (given-back
        blocks masked by the window), the paged reference attention or, on the Triton
        path, the paged kernels with the window; the full group's state (slot positions,
        scores) is not touched."""
        self.batch = self.group_batches[group]
        try:
            if self._kernel == "triton":
                return self.window_triton(storage, group, window, q, k, v)
            PagedStorageBackend.store(self, storage, k, v)
            return self.torch_attend(storage, q, window)
        finally:
            self.batch = self.group_batches[0]

    def window_triton(self, storage: int, group: int, window: int, q: torch.Tensor,
                      k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """:meth:`attend_window` on the Triton path (``self.batch`` is the group's)."""
        from harness.kernels.decode import default_splits

        b = self.batch
        assert b is not None
        kc, vc = self.k_cache[storage], self.v_cache[storage]
        torch.ops.kvbench.store_kv(k.to(kc.dtype), v.to(kc.dtype), kc, vc, b.slot_mapping)
        self.touch_by_bounds(storage, window)
        out = torch.empty_like(q)
        nd = b.num_decode
        if nd:
            splits = default_splits(nd, kc.shape[2], b.decode_tables.shape[1] * kc.shape[1],
                                    q.device)
            torch.ops.kvbench.paged_decode(q[:nd], kc, vc, b.decode_tables, b.decode_lens,
                                           out[:nd], splits, window, 0, None, None)
        if group not in self._group_prefill:
            self._group_prefill[group] = prefill_tables(b, self.device)
        p = self._group_prefill[group]
        if p is not None:
            torch.ops.kvbench.paged_prefill(q, kc, vc, p.cu_rows, p.starts, p.tables,
                                            p.max_tokens, out, window, 0, None, None)
        return out

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """``layer`` is the model's: its storage tensor is its LayerSlot's (KV cache
        groups share tensors across groups; the layer itself otherwise)."""
        i = self.layer_slots[layer].storage
        if self._kernel != "triton":
            super().store(i, k, v)
            return
        b = self.batch
        assert b is not None
        kc = self.k_cache[i]
        torch.ops.kvbench.store_kv(k.to(kc.dtype), v.to(kc.dtype), kc, self.v_cache[i],
                                   b.slot_mapping)

    def attend_chunk(self, layer: int, q: torch.Tensor, c: PrefillChunk,
                     slots: torch.Tensor) -> torch.Tensor:
        """One prefill chunk. q: (n, H, D); slots: (L,) its table's slots. -> (n, H, D)."""
        valid = self.chunk_valid(c, slots)
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
