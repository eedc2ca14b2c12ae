"""flash-attn 4 (the CuTe DSL package ``flash-attn-4``) behind the flash_attn backend's seam.

The backend (backends/flash_attn.py) calls two flash-attn 2 style functions from a
:class:`~harness.backends.flash_attn_seam.FlashAttnFns`. flash-attn 4 has one paged entry
point instead, ``flash_attn.cute.flash_attn_varlen_func(q, k, v, ..., seqused_k=,
page_table=, causal=)``: paged K/V (num_pages, page_size, KV, D) with an int32
``page_table`` (batch, max_pages) and the context lengths as ``seqused_k`` (it refuses
``cu_seqlens_k`` with a page table); it returns (out, lse). This module maps the two calls
onto it:

- decodes: q (B, 1, H, D) in its batched form, ``seqused_k = cache_seqlens``;
- prefill / extend chunks: q (total_q, H, D) with ``cu_seqlens_q``, and
  ``seqused_k = diff(cu_seqlens_k)``; causal is bottom-right aligned, as in flash-attn 2.

Only the GPU check uses it (``FlashAttnBackend.load_kernels = load_flash_attn4``); it is
not a backend option. Any page size works (a page of 128 tokens, its key tile, loads by
TMA; others take its non-TMA path), so ``block_multiple`` is 16.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from collections.abc import Callable

import torch

from harness.backends.flash_attn_seam import FlashAttnFns

FA4_PAGE_MULTIPLE = 16
NOT_INSTALLED = ("flash-attn 4 is not installed: on the GPU machine run the check's second "
                 "call (scripts/gpu_fa4.sh, see results/gpu/README.md)")


def _first(out: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def fa4_fns(varlen: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]], version: str,
            device_types: tuple[str, ...] = ("cuda",)) -> FlashAttnFns:
    """The seam's two functions on top of flash-attn 4's ``flash_attn_varlen_func``."""

    def with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
                     cache_seqlens: torch.Tensor, block_table: torch.Tensor,
                     causal: bool) -> torch.Tensor:
        return _first(varlen(q, k_cache, v_cache, seqused_k=cache_seqlens,
                             page_table=block_table, causal=causal))

    def paged_varlen(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                     max_seqlen_q: int, max_seqlen_k: int, *, causal: bool,
                     block_table: torch.Tensor) -> torch.Tensor:
        seqused_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).contiguous()
        return _first(varlen(q, k_cache, v_cache, cu_seqlens_q=cu_seqlens_q,
                             max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                             seqused_k=seqused_k, page_table=block_table, causal=causal))

    return FlashAttnFns(with_kvcache=with_kvcache, varlen=paged_varlen, version=version,
                        block_multiple=FA4_PAGE_MULTIPLE, device_types=device_types)


def load_flash_attn4() -> FlashAttnFns:
    """Import flash-attn 4's CuTe interface; ValueError saying what to do when absent."""
    try:
        found = importlib.util.find_spec("flash_attn.cute") is not None
    except (ImportError, ValueError):  # no flash_attn, or one (flash-attn 2) that fails
        found = False
    if not found:
        raise ValueError(NOT_INSTALLED)
    if not torch.cuda.is_available():
        raise ValueError("flash-attn 4 runs on NVIDIA GPUs (sm90+) only")
    cute = importlib.import_module("flash_attn.cute")
    try:
        version = importlib.metadata.version("flash-attn-4")
    except importlib.metadata.PackageNotFoundError:
        version = str(getattr(cute, "__version__", "4"))
    return fa4_fns(cute.flash_attn_varlen_func, version)
