"""KIVI's asymmetric low-bit quantization (Liu et al., 2024), as plain torch functions.

``x ~= code * scale + zero`` with ``code`` in ``[0, 2^bits - 1]``, ``zero`` the group's
minimum and ``scale = (max - min) / (2^bits - 1)``, both stored in float16 (as KIVI does).
Codes are rounded against the stored float16 scale and zero, so dequantizing gives back
exactly what the codes say. Codes are packed along the last dimension, 8 / bits per byte.
"""

from __future__ import annotations

import torch

SCALE_DTYPE = torch.float16


def quantize(x: torch.Tensor, dim: int, bits: int) -> tuple[torch.Tensor, torch.Tensor,
                                                              torch.Tensor]:
    """Quantize ``x`` in groups along ``dim``. Returns (codes uint8, same shape as x;
    scale and zero, float16, ``x``'s shape with ``dim`` of size 1)."""
    qmax = (1 << bits) - 1
    xf = x.float()
    lo = xf.amin(dim, keepdim=True)
    hi = xf.amax(dim, keepdim=True)
    scale = ((hi - lo) / qmax).to(SCALE_DTYPE)
    zero = lo.to(SCALE_DTYPE)
    s = scale.float()
    # A constant group has scale 0: every code 0, and zero gives the value back.
    codes = ((xf - zero.float()) / torch.where(s > 0, s, 1.0)).round_().clamp_(0, qmax)
    return codes.to(torch.uint8), scale, zero


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """``codes * scale + zero`` in float32 (scale and zero broadcast over their group)."""
    return codes.float() * scale.float() + zero.float()


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """(..., D) codes of ``bits`` bits -> (..., D * bits / 8) bytes, low bits first."""
    per = 8 // bits
    c = codes.view(*codes.shape[:-1], -1, per).to(torch.int32)
    shifts = torch.arange(0, 8, bits, dtype=torch.int32, device=codes.device)
    return (c << shifts).sum(-1).to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack`: (..., D * bits / 8) bytes -> (..., D) uint8 codes."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    codes = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return codes.flatten(-2)
