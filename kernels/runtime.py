"""Where the kernels run: compiled on CUDA, or under Triton's interpreter on CPU tensors.

Importing this module does not import triton (an optional dependency). The interpreter is a
process-wide switch read once, when triton is first imported: ``TRITON_INTERPRET=1`` must be
in the environment before then (FACTS.md). :func:`triton_for` sets it when it can and says
how to fix it when it cannot.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import torch


def interpreting() -> bool:
    """True when triton runs (or will run, once imported) kernels in its interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def triton_for(device: torch.device, *, required: bool) -> bool:
    """Make triton usable for tensors on ``device``; return whether it is.

    On CUDA the kernels compile; on any other device they need the interpreter, which this
    switches on when triton is not imported yet. ``required=False`` (``backend.kernel=auto``)
    answers False instead of raising, and never picks the interpreter: it is a correctness
    tool (~200x slower than torch), not a production path.
    """
    if importlib.util.find_spec("triton") is None:
        if required:
            raise ValueError("backend.kernel=triton needs the triton package: "
                             "pip install 'kvbench[triton]' (or use backend.kernel=torch)")
        return False
    if device.type == "cuda":
        if interpreting():
            return required  # correct, only slow: only when asked for
        return True
    if not required:
        return False
    _warn_interpreter(device)
    if not interpreting():
        if "triton" in sys.modules:
            raise ValueError(
                f"backend.kernel=triton on {device.type} runs the kernels in Triton's "
                "interpreter, but triton was already imported without it: set "
                "TRITON_INTERPRET=1 in the environment before starting Python")
        os.environ["TRITON_INTERPRET"] = "1"
    import triton  # noqa: F401  (the switch is read at this first import)
    return True


_warned: set[str] = set()


def _warn_interpreter(device: torch.device) -> None:
    """Say it loudly, once per process: the interpreter is ~1000x slower than the torch
    path, and a run on it on the default model looks hung without a word."""
    if device.type in _warned:
        return
    _warned.add(device.type)
    print(f"kvbench: backend.kernel=triton on {device.type} runs the kernels in Triton's "
          "interpreter: correctness only, about 1000x slower than backend.kernel=torch "
          "(minutes per step on the default model)", file=sys.stderr)


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Assert the flash-attn cache layout; return (num_blocks, block_size, num_kv_heads, D)."""
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, (k_cache.shape, v_cache.shape)
    assert k_cache.dtype == v_cache.dtype, (k_cache.dtype, v_cache.dtype)
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "head_dim must be contiguous"
    nb, bs, kv, d = k_cache.shape
    assert bs >= 8, f"block size {bs} < 8"
    return nb, bs, kv, d


def check_scales(k_cache: torch.Tensor, k_scale: torch.Tensor | None,
                 v_scale: torch.Tensor | None) -> bool:
    """Whether the cache is 1-byte with per-(slot, KV head) float32 scales (asserted)."""
    quant = k_cache.element_size() == 1
    assert quant == (k_scale is not None) == (v_scale is not None), (
        "1-byte caches need k_scale and v_scale; full-precision caches take none")
    if k_scale is not None and v_scale is not None:
        assert k_cache.dtype in (torch.float8_e4m3fn, torch.int8), k_cache.dtype
        assert k_scale.shape == v_scale.shape == k_cache.shape[:3], (k_scale.shape,
                                                                     k_cache.shape)
        assert k_scale.dtype == v_scale.dtype == torch.float32
        assert k_scale.is_contiguous() and v_scale.is_contiguous()
    return quant
