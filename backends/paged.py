"""`paged`: fixed-size blocks and a block table per sequence (PagedAttention).

Attention reads K/V through the block table. ``backend.kernel``: ``torch`` is the plain
reference (gather each decode's blocks into a padded batch, one SDPA call; one call per
prefill chunk); ``triton`` the kernels of harness.kernels (see README); ``auto`` picks
triton on CUDA when it is importable and torch otherwise, and records the choice.
"""

from __future__ import annotations

from typing import Any

import torch
from harness.backends.attention_ref import attend_chunk, attend_decode
from harness.backends.base import KVLayout
from harness.backends.paged_storage import PagedStorageBackend

KERNELS = ("auto", "torch", "triton")


class PagedBackend(PagedStorageBackend):
    name = "paged"

    def __init__(self, layout: KVLayout, device: torch.device, *, kernel: str = "auto",
                 **options: Any) -> None:
        super().__init__(layout, device, **options)
        if kernel not in KERNELS:
            raise ValueError(f"unknown backend.kernel {kernel!r}; known: {', '.join(KERNELS)}")
        if kernel == "triton":
            raise ValueError("backend.kernel=triton: the Triton kernels are not built yet "
                             "(use backend.kernel=torch or auto)")
        self._kernel = "torch"

    @property
    def kernel(self) -> str:
        return self._kernel

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        b = self.batch
        assert b is not None
        self.store(layer, k, v)
        out = torch.empty_like(q)
        nd = b.num_decode
        if nd:
            kc, vc = self.k_cache[layer], self.v_cache[layer]
            # (B, max_blocks, bs, KV, D) -> (B, max_blocks * bs, KV, D): the reference's
            # one gather; masked by each sequence's length.
            kd = kc[b.decode_tables].flatten(1, 2)
            vd = vc[b.decode_tables].flatten(1, 2)
            out[:nd] = attend_decode(q[:nd], kd, vd, b.decode_lens)
        for c in b.prefills:
            kk, vv = self.gather(layer, c.table, c.start + c.num_tokens)
            out[c.row:c.row + c.num_tokens] = attend_chunk(
                q[c.row:c.row + c.num_tokens], kk, vv, c.start)
        return out
