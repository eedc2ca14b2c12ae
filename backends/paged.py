"""`paged`: fixed-size blocks and a block table per sequence (PagedAttention).

Attention reads K/V through the block table. ``backend.kernel``: ``torch`` is the plain
reference (gather each decode's blocks into a padded batch, one SDPA call; one call per
prefill chunk); ``triton`` the kernels of harness.kernels (one store, one decode and one
prefill launch per layer, reading the cache in place; on CPU under Triton's interpreter);
``auto`` picks triton on CUDA when it is importable and torch otherwise, and records the
choice in :attr:`PagedBackend.kernel`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch

from harness.backends.base import AttentionBatch, BackendOptions, KVLayout
from harness.backends.costs import KVCosts, WindowCosts
from harness.backends.kernel_option import KERNELS, check_kernel, resolve_kernel
from harness.backends.paged_storage import PagedStorageBackend

__all__ = ["KERNELS", "PagedBackend", "PagedOptions", "PrefillTables", "prefill_tables"]


@dataclass
class PagedOptions(BackendOptions):
    kernel: str = "auto"  # auto | torch | triton

    def __post_init__(self) -> None:
        super().__post_init__()
        check_kernel(self, triton_built=True)


@dataclass(slots=True)
class PrefillTables:
    """The step's prefill chunks as the Triton prefill kernel takes them, built once per
    step (not per layer). cu_rows: int64 (C+1,) batch rows; starts: int64 (C,) cached
    prefix lengths; tables: int64 (C, max_blocks) block tables padded with 0."""

    cu_rows: torch.Tensor
    starts: torch.Tensor
    tables: torch.Tensor
    max_tokens: int


def prefill_tables(batch: AttentionBatch, device: torch.device) -> PrefillTables | None:
    """The Triton prefill kernel's view of ``batch``'s chunks (None without chunks), from
    host values (no read of a device tensor)."""
    if not batch.prefills:
        return None
    chunks = batch.prefills
    assert all(a.row + a.num_tokens == b.row for a, b in itertools.pairwise(chunks))
    rows = [c.row for c in chunks] + [chunks[-1].row + chunks[-1].num_tokens]
    tables = torch.nn.utils.rnn.pad_sequence([c.table for c in chunks], batch_first=True)
    return PrefillTables(
        cu_rows=torch.tensor(rows, dtype=torch.int64, device=device),
        starts=torch.tensor([c.start for c in chunks], dtype=torch.int64, device=device),
        tables=tables.clamp_(min=0),
        max_tokens=max(c.num_tokens for c in chunks))


class PagedBackend(PagedStorageBackend):
    name = "paged"
    Options = PagedOptions
    supports_groups = True  # and fp8 / int8 (without sinks); subclasses that add more say no

    def __init__(self, layout: KVLayout, device: torch.device, **options: Any) -> None:
        super().__init__(layout, device, **options)
        # auto with blocks too small for the kernels: the torch path, as without Triton.
        self._kernel = resolve_kernel(self.requested_kernel(), self.block_size, device)
        self._prefill: PrefillTables | None = None
        # KV cache groups: each group's prefill tables this step, built on first use.
        self._group_prefill: dict[int, PrefillTables | None] = {}

    @property
    def kernel(self) -> str:
        return self._kernel

    def declare_costs(self) -> KVCosts:
        # Every context token at full precision, or what the window knobs let a query see.
        if self.window:
            return WindowCosts(self.full_slot_bytes(), self.block_size, self.window,
                               self.window_sinks)
        return KVCosts(self.full_slot_bytes(), self.block_size)

    def graph_unsafe_reason(self) -> str | None:
        # A decode step reads its batch only (tables, lengths, slots); the split count is
        # the table width's, fixed per bucket. Subclasses that add per-step state say so.
        if type(self).begin_step is not PagedBackend.begin_step:
            return super().graph_unsafe_reason()
        return None

    def requested_kernel(self) -> str:
        """``backend.kernel`` as this backend can honour it (subclasses narrow it)."""
        assert isinstance(self.opts, PagedOptions)
        return self.opts.kernel

    def begin_step(self, batch: AttentionBatch) -> None:
        super().begin_step(batch)
        self._prefill = self._prefill_tables(batch)
        self._group_prefill = {0: self._prefill}

    def _prefill_tables(self, batch: AttentionBatch) -> PrefillTables | None:
        """The Triton prefill kernel's view of ``batch``'s chunks (None on the torch path
        or without chunks)."""
        if self._kernel != "triton":
            return None
        return prefill_tables(batch, self.device)

    # Attention shape knobs the subclasses set: a window (0 = none) with its sink tokens.
    window: int = 0
    window_sinks: int = 0

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        # The layer's group, storage and window (one group, its own tensor, the backend's
        # window for a uniform model; a hybrid model's: backends.base.LayerSlot).
        s = self.layer_slots[layer]
        if len(self.group_batches) > 1:
            self.batch = self.group_batches[s.group]
            if s.group not in self._group_prefill:
                self._group_prefill[s.group] = self._prefill_tables(self.batch)
            self._prefill = self._group_prefill[s.group]
        window, sinks = (s.window, 0) if s.window else (self.window, self.window_sinks)
        if self._kernel == "triton":
            return self._attend_triton(s.storage, q, k, v, window, sinks)
        self.store(s.storage, k, v)
        return self.torch_attend(s.storage, q, window or None, sinks)

    def scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Per-(token, KV head) scales of a 1-byte cache (None for full precision)."""
        return None, None

    def store_triton(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        b = self.batch
        assert b is not None
        kc = self.k_cache[layer]
        # Cast here, not in the op: the interpreter's float downcasts do not round to
        # nearest even (kernels/store.py).
        torch.ops.kvbench.store_kv(k.to(kc.dtype), v.to(kc.dtype), kc, self.v_cache[layer],
                                   b.slot_mapping)

    def _attend_triton(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, window: int, sinks: int) -> torch.Tensor:
        # Each launch is a torch custom op (harness.kernels.ops): one opaque node to
        # dynamo and to graph capture. Imported here: importing triton fixes the
        # interpreter switch for the process, which triton_for() had to decide first.
        import harness.kernels.ops  # noqa: F401  (registers torch.ops.kvbench.*)
        from harness.kernels.decode import default_splits

        b = self.batch
        assert b is not None
        self.store_triton(layer, k, v)
        self.touch_by_bounds(layer, window or None, sinks)
        kc, vc = self.k_cache[layer], self.v_cache[layer]
        ks, vs = self.scales(layer)
        out = torch.empty_like(q)
        nd = b.num_decode
        if nd:
            # The split count from host values only (the table's width), as the kernel's
            # own default: no read of the lengths.
            splits = default_splits(nd, kc.shape[2], b.decode_tables.shape[1] * kc.shape[1],
                                    q.device)
            torch.ops.kvbench.paged_decode(q[:nd], kc, vc, b.decode_tables, b.decode_lens,
                                           out[:nd], splits, window, sinks, ks, vs)
        if self._prefill is not None:
            p = self._prefill
            torch.ops.kvbench.paged_prefill(q, kc, vc, p.cu_rows, p.starts, p.tables,
                                            p.max_tokens, out, window, sinks, ks, vs)
        return out
