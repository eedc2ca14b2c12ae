"""Storing new K/V through the slot mapping: full-precision copies and fp8/int8
quantization with per-(token, KV head) scales, bit for bit against the torch reference."""

from __future__ import annotations

import pytest
import torch

from harness.kernels.reference import QMAX, dequantize_ref, store_kv_quant_ref, store_kv_ref
from harness.kernels.runtime import interpreting
from harness.kernels.store import store_kv, store_kv_quant

FP8 = torch.float8_e4m3fn
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8) if x.element_size() == 1 else x


def _assert_same_bits(ours: torch.Tensor, ref: torch.Tensor) -> None:
    """Bit-equal, or a message naming the first differing entries (what a GPU log needs)."""
    a, b = _bits(ours), _bits(ref)
    diff = (a != b).nonzero()
    if len(diff):
        shown = [(tuple(i.tolist()), float(ours[tuple(i)].float()), float(ref[tuple(i)].float()),
                  int(a[tuple(i)]), int(b[tuple(i)])) for i in diff[:8]]
        raise AssertionError(f"{len(diff)} of {a.numel()} entries differ; (index, ours, ref, "
                             f"our bits, ref bits): {shown}")


def _inputs(t: int, kv: int, d: int, dtype: torch.dtype, num_slots: int, device: str = "cpu",
            seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device).manual_seed(seed)
    k = torch.randn(t, kv, d, generator=gen, device=device, dtype=dtype) * 3
    v = torch.randn(t, kv, d, generator=gen, device=device, dtype=dtype)
    k[1] = 0  # an all-zero vector: scale 0, stored zeros
    slots = torch.randperm(num_slots, generator=gen, device=device)[:t]
    slots[::3] = -1  # padded tokens
    return k, v, slots


def _run(dtype: torch.dtype, cache_dtype: torch.dtype, t: int, kv: int, d: int, bs: int,
         device: str = "cpu") -> None:
    nb = -(-t // bs) + 2
    k, v, slots = _inputs(t, kv, d, dtype, nb * bs, device)
    # Non-contiguous k/v, as the model's split of a fused projection hands them over.
    k = torch.cat([k, k], dim=-1)[..., :d]
    gen = torch.Generator(device).manual_seed(1)
    caches = [torch.randn(nb, bs, kv, d, generator=gen, device=device).to(cache_dtype)
              for _ in range(2)]
    ours = [c.clone() for c in caches]
    if cache_dtype in QMAX:
        scales = [torch.rand(nb, bs, kv, generator=gen, device=device) for _ in range(2)]
        our_scales = [s.clone() for s in scales]
        store_kv_quant_ref(k, v, *caches, *scales, slots)
        store_kv_quant(k, v, *ours, *our_scales, slots)
        for a, b in zip(our_scales, scales):
            assert torch.equal(a, b)
    else:
        store_kv_ref(k, v, *caches, slots)
        store_kv(k, v, *ours, slots)
    for a, b in zip(ours, caches):
        _assert_same_bits(a, b)  # untouched slots included


@pytest.mark.parametrize("cache_dtype", [None, FP8, torch.int8], ids=["same", "fp8", "int8"])
@pytest.mark.parametrize(("dtype", "kv", "d", "bs"), [
    (torch.float32, 3, 64, 8),
    (torch.float16, 2, 128, 16),
    (torch.bfloat16, 1, 80, 24),  # odd head dim and block size
], ids=str)
def test_store_matches_reference(dtype: torch.dtype, kv: int, d: int, bs: int,
                                 cache_dtype: torch.dtype | None) -> None:
    _run(dtype, cache_dtype or dtype, 23, kv, d, bs)


def test_quantized_store_round_trips_within_half_a_step() -> None:
    k, v, slots = _inputs(9, 2, 64, torch.float32, 64)
    for cache_dtype in (FP8, torch.int8):
        kc = torch.zeros(8, 8, 2, 64, dtype=cache_dtype)
        vc, ks, vs = torch.zeros_like(kc), torch.zeros(8, 8, 2), torch.zeros(8, 8, 2)
        store_kv_quant(k, v, kc, vc, ks, vs, slots)
        keep = slots >= 0
        back = dequantize_ref(kc.view(-1, 2, 64)[slots[keep]], ks.view(-1, 2)[slots[keep]])
        amax = k[keep].abs().amax(-1, keepdim=True)
        # int8: half a step of amax/127; e4m3: 3 mantissa bits, relative error <= 2^-4.
        bound = (amax / 254 if cache_dtype == torch.int8
                 else k[keep].abs() / 16 + amax / 448 * 2.0**-10)
        assert bool(((back - k[keep]).abs() <= bound + 1e-7).all())


def _fp8_every_value_and_tie(device: str) -> None:
    # Rows whose amax is 448 (scale 1) carrying every e4m3 value of either sign (-0
    # included), every midpoint between neighbours and values just below them: ties must
    # go to even, 2^k - tiny must carry into the exponent (the interpreter's own cast gets
    # both wrong), and -0 must stay -0 (it did not until 2026-12-04). The reference is
    # torch's cast on the same device (on CUDA, the hardware conversion).
    grid = torch.arange(0, 127, dtype=torch.uint8).view(FP8).float()
    mids = (grid[1:] + grid[:-1]) / 2
    below = grid[1:] * (1 - 2.0**-12)
    vals = torch.cat([grid, -grid, mids, -mids, below, -below, mids / 2**10])
    d = 128
    rows = torch.cat([vals, torch.zeros((-vals.numel()) % (d - 1))]).view(-1, d - 1)
    x = torch.cat([torch.full((rows.shape[0], 1), 448.0), rows], dim=1).to(device)
    t = x.shape[0]
    k = x.view(t, 1, d)
    slots = torch.arange(t, device=device)
    kc = torch.zeros(t, 1, 1, d, dtype=FP8, device=device)
    vc = torch.zeros_like(kc)
    ks, vs = torch.zeros(t, 1, 1, device=device), torch.zeros(t, 1, 1, device=device)
    store_kv_quant(k, k, kc, vc, ks, vs, slots)
    assert bool((ks == 1).all())
    _assert_same_bits(kc.view(t, d), x.to(FP8))


def test_fp8_rounding_hits_every_e4m3_value_and_tie() -> None:
    _fp8_every_value_and_tie("cpu")


def test_int8_rounds_half_to_even() -> None:
    x = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, 126.5, 3.49]).view(1, 1, 8)
    kc = torch.zeros(1, 8, 1, 8, dtype=torch.int8)
    vc, ks, vs = torch.zeros_like(kc), torch.zeros(1, 8, 1), torch.zeros(1, 8, 1)
    store_kv_quant(x, x, kc, vc, ks, vs, torch.tensor([5]))
    assert kc[0, 5, 0].tolist() == [127, 0, 2, 2, 0, -2, 126, 3]


gpu = pytest.mark.skipif(not torch.cuda.is_available() or interpreting(),
                         reason="needs CUDA and compiled Triton (TRITON_INTERPRET unset)")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8, torch.int8])
def test_store_gpu_llama3_sizes(cache_dtype: torch.dtype) -> None:
    _run(torch.bfloat16, cache_dtype, 4099, 8, 128, 16, device="cuda")


@pytest.mark.gpu
@gpu
def test_fp8_rounding_hits_every_e4m3_value_and_tie_on_gpu() -> None:
    _fp8_every_value_and_tie("cuda")
