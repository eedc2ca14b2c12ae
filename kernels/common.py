"""Small @triton.jit helpers shared by the attention kernels."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dot_f32(a, b, FP32: tl.constexpr):
    """a @ b with a float32 result; float32 operands exactly (ieee, not tf32)."""
    if FP32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)
