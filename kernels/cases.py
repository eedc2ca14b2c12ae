"""Random paged caches for the kernel tests and the GPU benchmark.

Blocks are handed out in a random order (as a long-running allocator would) and a few
spare blocks hold data no sequence owns, so a kernel that reads a wrong block, or past a
sequence's end, gives a wrong answer instead of a lucky right one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.kernels.reference import store_kv_quant_ref


@dataclass(slots=True)
class PagedCase:
    """k_cache, v_cache: (num_blocks, block_size, KV, D); tables: int64 (B, max_blocks)
    padded with 0; lens: int64 (B,); k_scale, v_scale: float32 (num_blocks, block_size, KV)
    for 1-byte caches, else None."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    tables: torch.Tensor
    lens: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @property
    def scales(self) -> dict[str, torch.Tensor | None]:
        return {"k_scale": self.k_scale, "v_scale": self.v_scale}


def paged_case(lens: list[int], *, block_size: int, num_kv_heads: int, head_dim: int,
               dtype: torch.dtype, cache_dtype: torch.dtype | None = None,
               device: str | torch.device = "cpu", spare_blocks: int = 3,
               generator: torch.Generator | None = None) -> PagedCase:
    """A cache holding ``len(lens)`` sequences of the given lengths, N(0, 1) K/V in ``dtype``
    (stored quantized when ``cache_dtype`` is fp8 / int8)."""
    per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(per_seq) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    gen_device = generator.device if generator is not None else device
    k = torch.randn(shape, generator=generator, device=gen_device, dtype=dtype).to(device)
    v = torch.randn(shape, generator=generator, device=gen_device, dtype=dtype).to(device)
    order = torch.randperm(num_blocks, generator=generator, device=gen_device).to(device)
    tables = torch.zeros((len(lens), max(per_seq, default=1)), dtype=torch.int64,
                         device=device)
    used = 0
    for b, n in enumerate(per_seq):
        tables[b, :n] = order[used:used + n]
        used += n
    case = PagedCase(k, v, tables, torch.tensor(lens, dtype=torch.int64, device=device))
    if cache_dtype is not None and cache_dtype != dtype:
        kq = torch.empty(shape, dtype=cache_dtype, device=device)
        vq = torch.empty_like(kq)
        ks = torch.empty(shape[:3], dtype=torch.float32, device=device)
        vs = torch.empty_like(ks)
        slots = torch.arange(num_blocks * block_size, device=device)
        store_kv_quant_ref(k.flatten(0, 1), v.flatten(0, 1), kq, vq, ks, vs, slots)
        case = PagedCase(kq, vq, case.tables, case.lens, ks, vs)
    return case


@dataclass(frozen=True, slots=True)
class Geometry:
    """One test shape: H = group * num_kv_heads query heads."""

    group: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def num_heads(self) -> int:
        return self.group * self.num_kv_heads

    def __str__(self) -> str:
        dt = str(self.dtype).removeprefix("torch.")
        return (f"g{self.group}-kv{self.num_kv_heads}-d{self.head_dim}-bs{self.block_size}"
                f"-{dt}")


# Every pair of values of (GQA ratio, block size, dtype, head dim) in some row: the L9
# orthogonal array (3 levels x 4 factors, head dim folded to 2 levels), 9 rows instead of
# the 54 of the full product. The last row is the odd shape: non-power-of-2 head dim and
# block size, 3 KV heads.
PAIRWISE: list[Geometry] = [
    Geometry(1, 3, 64, 8, torch.float32),
    Geometry(1, 2, 128, 16, torch.float16),
    Geometry(1, 2, 64, 32, torch.bfloat16),
    Geometry(3, 2, 64, 8, torch.float16),
    Geometry(3, 2, 64, 16, torch.bfloat16),
    Geometry(3, 1, 128, 32, torch.float32),
    Geometry(8, 1, 128, 8, torch.bfloat16),
    Geometry(8, 1, 64, 16, torch.float32),
    Geometry(8, 1, 64, 32, torch.float16),
    Geometry(3, 3, 80, 24, torch.float16),
]


def tolerance(dtype: torch.dtype, device: torch.device | str = "cpu") -> dict[str, float]:
    """atol / rtol of a kernel's output against the float32 reference rounded to ``dtype``.

    On CPU the interpreter computes in float32 too: the output's last-bit rounding is the
    whole difference. Compiled, 16-bit operands go into the tensor cores and probabilities
    are rounded to the input dtype before the P @ V product.
    """
    gpu = torch.device(device).type == "cuda"
    tol = {torch.float32: 1e-5, torch.float16: 2e-3 if not gpu else 4e-3,
           torch.bfloat16: 1.6e-2 if not gpu else 3e-2}[dtype]
    return {"atol": tol, "rtol": tol}
