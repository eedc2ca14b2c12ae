"""Shared base of the 1-byte backends: paged storage whose K and V are fp8 (e4m3) or int8
with a float32 scale per (token, KV head), symmetric (scale = amax / qmax).

The bytes a token takes include its scales, so under the same ``cache.kv_budget`` these
backends hold about 2x the tokens of an fp16/bf16 cache and about 4x an fp32 one.
``backend.sink_tokens=k`` keeps the first k tokens of every sequence in full precision as
well (attention sinks are sensitive to quantization error): each block keeps a
full-precision overlay of its first k slots, used where the block is a sequence's first,
and the overlay's bytes are charged to every slot (k / block_size of a full-precision
token), so the capacity shows what sinks cost.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from harness.backends.base import AttentionBatch, CacheSizing, KVLayout
from harness.backends.costs import KVCosts, QuantCosts
from harness.backends.paged import PagedBackend, PagedOptions
from harness.errors import UserError
from harness.kernels.reference import dequantize_ref, quantize_ref

SCALE_BYTES = 4  # float32 scale per (token, KV head), for K and for V


@dataclass
class QuantizedOptions(PagedOptions):
    sink_tokens: int = 0  # first tokens of each sequence also kept in full precision

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sink_tokens < 0:
            raise UserError(f"backend.sink_tokens must be >= 0, got {self.sink_tokens}")
        if self.sink_tokens and self.kernel == "triton":
            raise UserError("backend.sink_tokens > 0 (full-precision sinks) runs on the torch "
                            "path only: use backend.kernel=torch or sink_tokens=0")


def store_kv_quant_torch(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
                         slots: torch.Tensor) -> None:
    """The torch path's quantizing store: :func:`~harness.kernels.reference.
    store_kv_quant_ref`'s values and scales, for a slot mapping with no padding (every
    slot >= 0, as the engine's eager steps have), without its boolean mask (which reads
    the kept rows' count back: six syncs a layer). k, v: (T, KV, D); slots: int64 (T,)."""
    for x, cache, scales in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        stored, scale = quantize_ref(x, cache.dtype)  # row by row: the same as on x[keep]
        # An integer index (index_copy_ has no fp8 on the CPU).
        cache.view(-1, *cache.shape[2:])[slots] = stored
        scales.view(-1, scales.shape[2])[slots] = scale


class QuantizedBackend(PagedBackend):
    """Paged, 1-byte K/V: quantized when stored, dequantized when read."""

    cache_dtype: torch.dtype = torch.int8
    exact = False
    Options = QuantizedOptions

    def __init__(self, layout: KVLayout, device: torch.device, **options: Any) -> None:
        super().__init__(layout, device, **options)
        assert isinstance(self.opts, QuantizedOptions)
        self.sink_tokens = self.opts.sink_tokens

    def graph_unsafe_reason(self) -> str | None:
        # Its begin_step adds only the sink rows, None without sinks.
        if self.sink_tokens:
            return "backend.sink_tokens > 0 finds its sink rows on the host every step"
        return None

    def requested_kernel(self) -> str:
        # Full-precision sinks are a torch-path feature: auto then means torch (recorded
        # in run.kernel, never a silent switch).
        assert isinstance(self.opts, QuantizedOptions)
        return "torch" if self.opts.sink_tokens else self.opts.kernel

    def declare_costs(self) -> KVCosts:
        lay = self.layout
        quant = 2 * lay.num_layers * lay.num_kv_heads * self._head_bytes()
        return QuantCosts(quant, self.full_slot_bytes(), self.block_size, self.sink_tokens)

    def _head_bytes(self) -> int:
        """One token's K or V of one layer and KV head: 1-byte values and the scale."""
        return self.layout.head_dim * self.cache_dtype.itemsize + SCALE_BYTES

    def touch_decode_mask(self, tables: torch.Tensor, mask: torch.Tensor, layers: int) -> None:
        # Values and scales of every key read; read_blocks then overlays the first block's
        # first sink_tokens slots in full precision (positions < sink_tokens of the mask).
        lay = self.layout
        n = mask.sum() * layers
        nbytes = n * lay.num_kv_heads * 2 * self._head_bytes()
        if self.sink_tokens:
            sinks = mask[:, :self.sink_tokens].sum() * layers
            nbytes = nbytes + sinks * (self.full_slot_bytes() // lay.num_layers)
        self.touch_decode(n * lay.num_kv_heads, nbytes)

    def allocate(self, sizing: CacheSizing) -> None:
        if self.sink_tokens > sizing.block_size:
            raise ValueError(f"backend.sink_tokens={self.sink_tokens} must be <= "
                             f"backend.block_size={sizing.block_size}")
        lay = self.layout
        self.block_size = sizing.block_size
        nb = self.tensor_blocks(sizing)  # (with the pad block of a replayed decode batch)
        shape = (nb, sizing.block_size, lay.num_kv_heads, lay.head_dim)
        dev, n = self.device, self.storage_layers  # per layer, or per group position
        self.k_cache = [torch.zeros(shape, dtype=self.cache_dtype, device=dev)
                        for _ in range(n)]
        self.v_cache = [torch.zeros_like(t) for t in self.k_cache]
        self.k_scale = [torch.zeros(shape[:3], dtype=torch.float32, device=dev)
                        for _ in range(n)]
        self.v_scale = [torch.zeros_like(t) for t in self.k_scale]
        sink_shape = (nb, self.sink_tokens, lay.num_kv_heads, lay.head_dim)
        self.k_sink = [torch.zeros(sink_shape, dtype=lay.dtype, device=dev)
                       for _ in range(n if self.sink_tokens else 0)]
        self.v_sink = [torch.zeros_like(t) for t in self.k_sink]
        if sizing.num_cpu_blocks:
            raise ValueError(f"backend {self.name} does not swap: use "
                             "scheduler.preemption_mode=recompute and cache.swap_space=0")
        self.k_cpu: list[torch.Tensor] = []
        self.v_cpu: list[torch.Tensor] = []

    def slot_tensors(self) -> list[torch.Tensor]:
        # Copy-on-write copies a partly filled block's values and their scales.
        return [*super().slot_tensors(), *self.k_scale, *self.v_scale]

    def block_tensors(self) -> list[torch.Tensor] | None:
        # The 1-byte values, their per-token scales and the block's full-precision sinks.
        return [*self.slot_tensors(), *self.k_sink, *self.v_sink]

    def apply_cache_ops(self, rec: Any) -> None:
        assert not rec.swap_in and not rec.swap_out
        super().apply_cache_ops(rec)
        bs = self.block_size
        for op in rec.copies:  # ... and the block's full-precision sinks, if any
            for t in (*self.k_sink, *self.v_sink):
                t[op.dst // bs] = t[op.src // bs]

    def begin_step(self, batch: AttentionBatch) -> None:
        super().begin_step(batch)
        # The batch rows of tokens at positions < sink_tokens, from the host's own
        # positions (a mask of the device's positions would read its size back, a sync a
        # layer): decodes at such a position, then each chunk's first ones. None: no such
        # row this step (every decode past the sinks: most steps).
        self._sink_rows: torch.Tensor | None = None
        if self.sink_tokens:
            n = self.sink_tokens
            rows = [i for i, d in enumerate(batch.decode_seqs) if d.start < n]
            for c in batch.prefills:
                rows += range(c.row, c.row + max(0, min(c.num_tokens, n - c.start)))
            if rows:
                self._sink_rows = self.staging.put("sink_rows", rows, len(rows))

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        b = self.batch
        assert b is not None
        store_kv_quant_torch(k, v, self.k_cache[layer], self.v_cache[layer],
                             self.k_scale[layer], self.v_scale[layer], b.slot_mapping)
        rows = self._sink_rows
        if rows is not None:
            slots = b.slot_mapping[rows]
            blocks, offs = slots // self.block_size, slots % self.block_size
            self.k_sink[layer][blocks, offs] = k[rows].to(self.layout.dtype)
            self.v_sink[layer][blocks, offs] = v[rows].to(self.layout.dtype)

    def read_blocks(self, layer: int, blocks: torch.Tensor) -> tuple[torch.Tensor,
                                                                       torch.Tensor]:
        dt = self.layout.dtype
        k = dequantize_ref(self.k_cache[layer][blocks], self.k_scale[layer][blocks]).to(dt)
        v = dequantize_ref(self.v_cache[layer][blocks], self.v_scale[layer][blocks]).to(dt)
        if self.sink_tokens:
            # The first block of every sequence (column 0 of a table) gets its sinks back
            # in full precision.
            first = blocks[..., 0]
            s = self.sink_tokens
            k[..., 0, :s, :, :] = self.k_sink[layer][first]
            v[..., 0, :s, :, :] = self.v_sink[layer][first]
        return k, v

    def scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self.k_scale[layer], self.v_scale[layer]

    def store_triton(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        b = self.batch
        assert b is not None
        torch.ops.kvbench.store_kv_quant(k, v, self.k_cache[layer], self.v_cache[layer],
                                         self.k_scale[layer], self.v_scale[layer],
                                         b.slot_mapping)
