"""The one place that imports flash-attn: its two paged entry points, behind a seam.

flash-attn builds only against CUDA, so CPU machines never have it; and its Triton fallback
ignores block tables, so it cannot stand in either. The backend (backends.flash_attn) takes
a :class:`FlashAttnFns` from :func:`load_flash_attn`; the CPU tests hand it a strict
pure-torch stand-in (tests/flash_attn_standin.py) that holds the same argument contract.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch

NOT_INSTALLED = ("flash-attn is not installed (it needs CUDA to build): pip install flash-attn "
                 "--no-build-isolation on a CUDA machine, or use backend=paged")
# block_table in flash_attn_varlen_func (paged prefill) is public API from 2.6 on; 2.6.3
# through 2.8.3 all check "Paged KV cache block size must be divisible by 256".
MIN_VERSION = (2, 6)
FA2_BLOCK_MULTIPLE = 256


@dataclass(frozen=True, slots=True)
class FlashAttnFns:
    """flash-attn's paged entry points and the rules the caller must follow.

    with_kvcache: ``flash_attn_with_kvcache(q, k_cache, v_cache, *, cache_seqlens,
        block_table, causal)``, q (B, 1, H, D) for decodes.
    varlen: ``flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
        max_seqlen_k, *, causal, block_table)``, q (total_q, H, D) for prefill chunks.
    block_multiple: the paged cache's block size must be a multiple of it.
    device_types: where the functions run ("cuda" for the real kernels).
    """

    with_kvcache: Callable[..., torch.Tensor]
    varlen: Callable[..., torch.Tensor]
    version: str
    block_multiple: int
    device_types: tuple[str, ...]


def _version(text: str) -> tuple[int, int]:
    """(major, minor) of "2.7.4.post1" and the like; unreadable parts count as 0."""
    major, minor = [*text.split("+")[0].split("."), "0", "0"][:2]
    return (int(major) if major.isdigit() else 0, int(minor) if minor.isdigit() else 0)


def load_flash_attn() -> FlashAttnFns:
    """Import flash-attn 2 (2.6 or newer) and return its paged functions.

    Raises ValueError, with what to do, when flash-attn is missing, does not import, is a
    version without paged prefill, or CUDA is not available.
    """
    if importlib.util.find_spec("flash_attn") is None:
        raise ValueError(NOT_INSTALLED)
    try:
        fa = importlib.import_module("flash_attn")
    except ImportError as e:  # typically built against another torch (undefined symbol)
        raise ValueError(f"flash-attn is installed but does not import ({e}): rebuild it "
                         "against this torch (pip install --force-reinstall --no-cache-dir "
                         "flash-attn --no-build-isolation), or use backend=paged") from e
    version = str(getattr(fa, "__version__", "0"))
    major_minor = _version(version)
    if major_minor < MIN_VERSION or major_minor[0] != 2:
        raise ValueError(f"backend=flash_attn needs flash-attn 2.x, 2.6 or newer (paged prefill "
                         f"through flash_attn_varlen_func(block_table=...)); found {version}: "
                         "pip install 'flash-attn>=2.6,<3' --no-build-isolation, or use "
                         "backend=paged")
    if not torch.cuda.is_available():
        raise ValueError("flash-attn is installed but CUDA is not available: its kernels run "
                         "on NVIDIA GPUs only; use backend=paged (or backend=flex) here")
    return FlashAttnFns(with_kvcache=fa.flash_attn_with_kvcache,
                        varlen=fa.flash_attn_varlen_func, version=version,
                        block_multiple=FA2_BLOCK_MULTIPLE, device_types=("cuda",))
