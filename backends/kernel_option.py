"""``backend.kernel`` as every method backend takes it: ``auto`` | ``torch`` | ``triton``.

``torch`` is each method's reference path; ``triton`` its Triton kernels (compiled on CUDA,
Triton's interpreter on the CPU); ``auto`` picks triton on CUDA where the method has a
Triton path and torch otherwise (backends.paged decides, through
:func:`harness.kernels.runtime.triton_for`). The run records what ran in ``run.kernel``.

A method whose Triton path is not built refuses ``triton`` here, when its options are
typed (never a silent fall back to torch); ``auto`` is torch for it. Since issue #56's
second stage every method has one but the per-head presses (pyramidkv, adakv,
duo_attention: issue #59, which landed while #56 was under way).
"""

from __future__ import annotations

from typing import Any

import torch

from harness.errors import UserError
from harness.kernels.runtime import triton_for
from harness.validate import one_of

KERNELS = ("auto", "torch", "triton")
MIN_TRITON_BLOCK = 8  # the kernels' smallest block (kernels/runtime.py check_cache)

# Why a method has no Triton path: the per-head presses keep pages per (layer, KV head),
# a layout no kernel here reads (each head its own table).
PENDING = ("the per-head methods of issue #59 keep a table per (layer, KV head), which no "
           "kernel here reads yet; issue #56 built the other methods' kernels")


def check_kernel(opts: Any, *, triton_built: bool) -> None:
    """``opts.kernel`` is one of :data:`KERNELS`; ``triton`` only where ``triton_built``
    and with blocks the kernels take. ``opts``: a backend's options dataclass (its
    ``name``, ``kernel`` and ``block_size``)."""
    one_of(opts, "backend", "kernel", KERNELS)
    if opts.kernel == "triton" and not triton_built:
        name = opts.name or "this method"
        raise UserError(f"backend.kernel=triton: backend={name} has no Triton path yet "
                        f"({PENDING}); use backend.kernel=torch, or auto (torch for {name})")
    if opts.kernel == "triton" and opts.block_size < MIN_TRITON_BLOCK:
        raise UserError(f"backend.kernel=triton needs backend.block_size >= "
                        f"{MIN_TRITON_BLOCK}, got {opts.block_size}: raise the block size "
                        "or use backend.kernel=torch")


def resolve_kernel(kernel: str, block_size: int, device: torch.device) -> str:
    """The kernel that runs for ``backend.kernel=kernel``: ``triton`` when asked for (the
    interpreter off CUDA), or under ``auto`` on CUDA with triton importable and blocks the
    kernels take; ``torch`` otherwise."""
    use = kernel != "torch" and block_size >= MIN_TRITON_BLOCK \
        and triton_for(device, required=kernel == "triton")
    return "triton" if use else "torch"
