"""`flash_attn`: flash-attn 2's paged kernels over the paged cache (CUDA only).

Decodes: one ``flash_attn_with_kvcache`` call (q as (B, 1, H, D), the step's K/V already
stored, so no ``k=``/``v=``); prefill and extend chunks: one ``flash_attn_varlen_func``
call with ``block_table``. Both read the cache in place in flash-attn's own layout
(num_blocks, block_size, KV, D), which is paged storage's. The step's int32 tables and
lengths are built once in begin_step, not per layer.

flash-attn's rules, checked at start with what to change: fp16/bf16 (model.dtype),
block size a multiple of 256 (flash-attn 2.6-2.8), head_dim a multiple of 8 and <= 256,
a CUDA device. The kernels come from :attr:`FlashAttnBackend.load_kernels`
(backends.flash_attn_seam); the CPU tests put a strict stand-in there.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from harness.backends.base import AttentionBatch, BackendOptions, KVLayout
from harness.backends.costs import KVCosts
from harness.backends.flash_attn_seam import FlashAttnFns, load_flash_attn
from harness.backends.paged_storage import PagedStorageBackend

DTYPES = (torch.float16, torch.bfloat16)


@dataclass(slots=True)
class FlashStep:
    """One step's flash-attn arguments, built once per step.

    decode_table: int32 (num_decode, max_blocks); cache_seqlens: int32 (num_decode,)
    context lengths including the new token. For the C prefill chunks (None without):
    prefill_table int32 (C, max_blocks); cu_seqlens_q int32 (C+1,) query rows from the
    first chunk's; cu_seqlens_k int32 (C+1,) cumulative context lengths; max_seqlen_q /
    max_seqlen_k the largest chunk and context.
    """

    decode_table: torch.Tensor | None
    cache_seqlens: torch.Tensor | None
    prefill_table: torch.Tensor | None
    cu_seqlens_q: torch.Tensor | None
    cu_seqlens_k: torch.Tensor | None
    max_seqlen_q: int
    max_seqlen_k: int


@dataclass
class FlashAttnOptions(BackendOptions):
    block_size: int = 256  # flash-attn 2's paged kernels need a multiple of 256


class FlashAttnBackend(PagedStorageBackend):
    name = "flash_attn"
    default_block_size = 256
    # Where the kernels come from. A class attribute, so that tests can put the stand-in
    # here for runs composed from config too.
    load_kernels: ClassVar[Callable[[], FlashAttnFns]] = staticmethod(load_flash_attn)

    Options = FlashAttnOptions

    def __init__(self, layout: KVLayout, device: torch.device, **options: Any) -> None:
        super().__init__(layout, device, **options)
        block_size = self.block_size
        self.fns = type(self).load_kernels()
        fns = self.fns
        if device.type not in fns.device_types:
            raise ValueError(f"backend=flash_attn runs on {' or '.join(fns.device_types)}, not "
                             f"{device}: set device=cuda, or use backend=paged")
        if block_size % fns.block_multiple:
            raise ValueError(f"flash-attn {fns.version}'s paged kernels need backend.block_size "
                             f"to be a multiple of {fns.block_multiple}, got {block_size}: set "
                             f"backend.block_size={fns.block_multiple}")
        if layout.dtype not in DTYPES:
            raise ValueError(f"flash-attn computes in float16 or bfloat16, and the model runs "
                             f"in {str(layout.dtype).removeprefix('torch.')}: set "
                             "model.dtype=bfloat16 (or float16)")
        if layout.head_dim % 8 or layout.head_dim > 256:
            # Not a multiple of 8: flash-attn pads, copying the whole cache every call.
            raise ValueError(f"flash-attn needs head_dim a multiple of 8 and <= 256; this "
                             f"model's is {layout.head_dim}: use backend=paged")
        self._step: FlashStep | None = None

    @property
    def kernel(self) -> str:
        return f"flash_attn-{self.fns.version}"

    def declare_costs(self) -> KVCosts:
        return KVCosts(self.full_slot_bytes(), self.block_size)  # paged, dense

    def begin_step(self, batch: AttentionBatch) -> None:
        super().begin_step(batch)
        i32, dev, bs = torch.int32, self.device, self.block_size
        nd, chunks = batch.num_decode, batch.prefills
        decode_table = cache_seqlens = None
        if nd:
            decode_table = batch.decode_tables.to(i32).contiguous()
            cache_seqlens = batch.decode_lens.to(i32)
        prefill_table = cu_q = cu_k = None
        max_q = max_k = 0
        if chunks:
            assert chunks[0].row == nd
            assert all(a.row + a.num_tokens == b.row for a, b in itertools.pairwise(chunks))
            ctx = [c.start + c.num_tokens for c in chunks]
            prefill_table = torch.nn.utils.rnn.pad_sequence(
                [c.table[:-(-n // bs)] for c, n in zip(chunks, ctx)], batch_first=True
            ).to(i32)
            cu_q = torch.tensor(list(itertools.accumulate([c.num_tokens for c in chunks],
                                                          initial=0)), dtype=i32, device=dev)
            cu_k = torch.tensor(list(itertools.accumulate(ctx, initial=0)), dtype=i32,
                                device=dev)
            max_q, max_k = max(c.num_tokens for c in chunks), max(ctx)
        self._step = FlashStep(decode_table, cache_seqlens, prefill_table, cu_q, cu_k,
                               max_q, max_k)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        st, b = self._step, self.batch
        assert st is not None and b is not None
        self.store(layer, k, v)
        self.touch_by_bounds(layer)
        kc, vc = self.k_cache[layer], self.v_cache[layer]
        if q.stride(-1) != 1:  # flash-attn's one layout rule for q
            q = q.contiguous()
        out = torch.empty_like(q)
        nd = b.num_decode
        if nd:
            out[:nd] = self.fns.with_kvcache(
                q[:nd].unsqueeze(1), kc, vc, cache_seqlens=st.cache_seqlens,
                block_table=st.decode_table, causal=True).squeeze(1)
        if st.prefill_table is not None:
            out[nd:] = self.fns.varlen(
                q[nd:], kc, vc, st.cu_seqlens_q, st.cu_seqlens_k, st.max_seqlen_q,
                st.max_seqlen_k, causal=True, block_table=st.prefill_table)
        return out
