"""Store the step's new K/V into the paged cache through the slot mapping.

Two kernels: a copy into a full-precision cache, and a quantizing store into a 1-byte cache
(fp8 e4m3 or int8) that computes one symmetric scale per (token, KV head) in the kernel.
References: :func:`harness.kernels.reference.store_kv_ref` / ``store_kv_quant_ref``.

One program writes ``BLOCK_T`` tokens, all their KV heads at once: a (BLOCK_T * BLOCK_KV,
BLOCK_D) tile, one row per (token, head). Padded tokens (slot < 0) are skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from harness.kernels.reference import QMAX
from harness.kernels.runtime import interpreting, next_pow2

# Enough rows per program to amortize the launch; the interpreter wants big tiles.
_ROWS = 16


@triton.jit
def _round_e4m3(y):
    """Round float32 ``y`` (|y| <= 448) to the nearest e4m3 value, ties to even, in float32.

    The cast to fp8 then is exact everywhere; Triton 3.9's interpreter rounds half-up and
    loses the carry into the exponent (e.g. 127.8 -> 64), so it must never round itself.
    """
    bits = y.to(tl.int32, bitcast=True)
    lsb = (bits >> 20) & 1
    # Normal e4m3 (|y| >= 2^-6): keep 3 mantissa bits of the float32, rounding half to even.
    normal = ((bits + 0x7FFFF + lsb) & -1048576).to(tl.float32, bitcast=True)
    # Subnormal e4m3: multiples of 2^-9, rounded by the 1.5 * 2^23 float32 trick.
    t = y * 512.0
    sub = tl.abs((t + 12582912.0) - 12582912.0) * 0.001953125
    # The sign bit, not y < 0: -2^-10 rounds to -0 and -0 stays -0, as torch's cast.
    sub = tl.where(bits < 0, -sub, sub)
    return tl.where(tl.abs(y) < 0.015625, sub, normal)


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cs, stride_ch,
    num_tokens,
    KV: tl.constexpr, D: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_KV: tl.constexpr, BLOCK_D: tl.constexpr,
):
    r = tl.arange(0, BLOCK_T * BLOCK_KV)
    t = tl.program_id(0) * BLOCK_T + r // BLOCK_KV
    h = r % BLOCK_KV
    d = tl.arange(0, BLOCK_D)
    slot = tl.load(slot_ptr + t, mask=t < num_tokens, other=-1).to(tl.int64)
    mask = ((slot >= 0) & (h < KV))[:, None] & (d < D)[None, :]
    t64 = t.to(tl.int64)
    dst = slot[:, None] * stride_cs + h[:, None] * stride_ch + d[None, :]
    k = tl.load(k_ptr + t64[:, None] * stride_kt + h[:, None] * stride_kh + d[None, :],
                mask=mask)
    tl.store(kc_ptr + dst, k, mask=mask)
    v = tl.load(v_ptr + t64[:, None] * stride_vt + h[:, None] * stride_vh + d[None, :],
                mask=mask)
    tl.store(vc_ptr + dst, v, mask=mask)


@triton.jit
def _quantize_store(x, out_ptr, scale_ptr, dst, scale_dst, mask, row_mask,
                    QMAX: tl.constexpr, IS_INT8: tl.constexpr):
    """Quantize rows of float32 ``x`` symmetrically and store values and per-row scales."""
    scale = tl.math.div_rn(tl.max(tl.abs(x), axis=1), tl.full([1], QMAX, tl.float32))
    safe = tl.where(scale > 0, scale, 1.0)
    y = tl.math.div_rn(x, safe[:, None])
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    if IS_INT8:  # noqa: SIM108 (a constexpr branch: each kernel compiles one side)
        y = (y + 12582912.0) - 12582912.0  # round half to even, as torch.round
    else:
        y = _round_e4m3(y)
    tl.store(out_ptr + dst, y.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + scale_dst, scale, mask=row_mask)


@triton.jit
def _store_kv_quant_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cs, stride_ch,
    num_tokens,
    KV: tl.constexpr, D: tl.constexpr, QMAX: tl.constexpr, IS_INT8: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_KV: tl.constexpr, BLOCK_D: tl.constexpr,
):
    r = tl.arange(0, BLOCK_T * BLOCK_KV)
    t = tl.program_id(0) * BLOCK_T + r // BLOCK_KV
    h = r % BLOCK_KV
    d = tl.arange(0, BLOCK_D)
    slot = tl.load(slot_ptr + t, mask=t < num_tokens, other=-1).to(tl.int64)
    row_mask = (slot >= 0) & (h < KV)
    mask = row_mask[:, None] & (d < D)[None, :]
    t64 = t.to(tl.int64)
    dst = slot[:, None] * stride_cs + h[:, None] * stride_ch + d[None, :]
    scale_dst = slot * KV + h
    k = tl.load(k_ptr + t64[:, None] * stride_kt + h[:, None] * stride_kh + d[None, :],
                mask=mask, other=0.0).to(tl.float32)
    _quantize_store(k, kc_ptr, ks_ptr, dst, scale_dst, mask, row_mask, QMAX, IS_INT8)
    v = tl.load(v_ptr + t64[:, None] * stride_vt + h[:, None] * stride_vh + d[None, :],
                mask=mask, other=0.0).to(tl.float32)
    _quantize_store(v, vc_ptr, vs_ptr, dst, scale_dst, mask, row_mask, QMAX, IS_INT8)


def _check(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           slots: torch.Tensor) -> tuple[int, int, int]:
    t, kv, d = k.shape
    assert v.shape == k.shape and k.stride(-1) == 1 and v.stride(-1) == 1, (k.shape, v.shape)
    assert k_cache.shape[2:] == (kv, d) and v_cache.shape == k_cache.shape, k_cache.shape
    # Flat slots: (block, offset) must collapse into one stride, the same for K and V.
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    assert k_cache.stride(0) == k_cache.shape[1] * k_cache.stride(1), k_cache.stride()
    assert slots.shape == (t,) and not slots.is_floating_point(), slots.shape
    return t, kv, d


def _launch(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            slots: torch.Tensor, k_scale: torch.Tensor | None,
            v_scale: torch.Tensor | None) -> None:
    t, kv, d = _check(k, v, k_cache, v_cache, slots)
    if t == 0:
        return
    block_kv = next_pow2(kv)
    block_t = max(1, (_ROWS * (8 if interpreting() else 1)) // block_kv)
    grid = (triton.cdiv(t, block_t),)
    common = (k.stride(0), k.stride(1), v.stride(0), v.stride(1),
              k_cache.stride(1), k_cache.stride(2), t)
    sizes = {"KV": kv, "D": d, "BLOCK_T": block_t, "BLOCK_KV": block_kv,
             "BLOCK_D": next_pow2(d)}
    if k_scale is None:
        _store_kv_kernel[grid](k, v, k_cache, v_cache, slots, *common, **sizes)
    else:
        assert k_scale.shape == k_cache.shape[:3] and k_scale.is_contiguous()
        assert v_scale is not None and v_scale.shape == k_scale.shape and v_scale.is_contiguous()
        assert k_scale.dtype == v_scale.dtype == torch.float32
        _store_kv_quant_kernel[grid](
            k, v, k_cache, v_cache, k_scale, v_scale, slots, *common,
            QMAX=QMAX[k_cache.dtype], IS_INT8=k_cache.dtype == torch.int8, **sizes)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """Write k, v (T, KV, D) into caches (num_blocks, block_size, KV, D) at flat slots
    ``slots`` (T,) = block * block_size + offset, in place; slot < 0 is skipped."""
    assert k_cache.element_size() > 1, "1-byte caches: use store_kv_quant"
    # Cast in torch: the interpreter's own float downcasts do not round to nearest even.
    k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
    _launch(k, v, k_cache, v_cache, slots, None, None)


def store_kv_quant(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
                   slots: torch.Tensor) -> None:
    """:func:`store_kv` into an fp8 e4m3 or int8 cache: each (token, KV head) vector is
    stored as round(x / scale) with scale = amax / 448 (fp8) or amax / 127 (int8), written
    to the float32 ``k_scale`` / ``v_scale`` shaped (num_blocks, block_size, KV)."""
    assert k_cache.dtype in QMAX, f"quantized caches are {list(QMAX)}, not {k_cache.dtype}"
    _launch(k, v, k_cache, v_cache, slots, k_scale, v_scale)
