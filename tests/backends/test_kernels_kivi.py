"""KIVI's Triton decode (harness.kernels.kivi, under the interpreter): 2/4-bit codes
dequantized in the kernel (keys per channel, values per token) and the residual slabs read
as they are equal a token-by-token reference; the reference unpacks as the storage packs;
the backend's triton path gives its torch path's outputs and declared reads."""

from __future__ import annotations

import pytest
import torch

from harness.backends.kivi_quant import pack, unpack
from harness.kernels.reference import kivi_decode_ref, kivi_unpack_ref
from tests.backend_steps import Driver

pytest.importorskip("triton")

from harness.kernels.kivi import kivi_decode


def _cache(lens: list[int], bits: int, bs: int, kv: int, d: int, dtype: torch.dtype,
           gen: torch.Generator) -> dict[str, torch.Tensor]:
    """A random KIVI cache: blocks in a random order plus spares, any byte a valid packed
    code, float16 scales and zeros; each sequence's partly filled last block, and one full
    block, in a residual slab (a block that filled this step is read from its slab too)."""
    per_seq = [-(-n // bs) for n in lens]
    nb = sum(per_seq) + 3
    order = torch.randperm(nb, generator=gen)
    tables = torch.zeros(len(lens), max(per_seq), dtype=torch.int64)
    used = 0
    for i, m in enumerate(per_seq):
        tables[i, :m] = order[used:used + m]
        used += m
    packed = (nb, bs, kv, d * bits // 8)
    slabs = 2 + len(lens)
    slab_map = torch.full((nb,), -1, dtype=torch.int64)
    free = list(torch.randperm(slabs, generator=gen).tolist())
    for i, n in enumerate(lens):
        if n % bs:
            slab_map[tables[i, (n - 1) // bs]] = free.pop()
    slab_map[tables[-1, 0]] = free.pop()
    return {
        "k_q": torch.randint(0, 256, packed, generator=gen).to(torch.uint8),
        "v_q": torch.randint(0, 256, packed, generator=gen).to(torch.uint8),
        "k_scale": (torch.rand(nb, kv, d, generator=gen) / 2).half(),
        "k_zero": torch.randn(nb, kv, d, generator=gen).half(),
        "v_scale": (torch.rand(nb, bs, kv, generator=gen) / 2).half(),
        "v_zero": torch.randn(nb, bs, kv, generator=gen).half(),
        "slab_map": slab_map,
        "res_k": torch.randn(slabs, bs, kv, d, generator=gen).to(dtype),
        "res_v": torch.randn(slabs, bs, kv, d, generator=gen).to(dtype),
        "tables": tables,
        "lens": torch.tensor(lens),
    }


# (lens, bits, group, KV heads, head dim, block size, dtype): one token, a block boundary,
# long contexts; GQA 1 / 3 / 4; an odd head dim and block size; 16-bit queries and
# residuals.
CASES = [
    ([1, 8, 9, 77], 2, 2, 2, 32, 8, torch.float32),
    ([30, 160, 16], 4, 3, 1, 64, 16, torch.float32),
    ([50, 24, 100], 2, 1, 3, 80, 24, torch.float16),
    ([129, 7], 4, 4, 2, 64, 8, torch.bfloat16),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_decode_equals_the_token_by_token_reference(case: int) -> None:
    lens, bits, g, kv, d, bs, dtype = CASES[case]
    gen = torch.Generator().manual_seed(case)
    c = _cache(lens, bits, bs, kv, d, dtype, gen)
    q = torch.randn(len(lens), g * kv, d, generator=gen).to(dtype)
    ref = kivi_decode_ref(q, **c, bits=bits)
    # Values reach ~ 15 x 0.5 + 3 at 4 bits: 16-bit outputs round at that scale.
    tol = {torch.float32: 1e-5, torch.float16: 8e-3, torch.bfloat16: 6e-2}[dtype]
    for splits in (1, 3):
        out = kivi_decode(q, **c, bits=bits, num_splits=splits)
        torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("bits", [2, 4])
def test_the_reference_unpacks_what_the_storage_packs(bits: int) -> None:
    gen = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 1 << bits, (5, 3, 32), generator=gen).to(torch.uint8)
    packed = pack(codes, bits)
    assert torch.equal(kivi_unpack_ref(packed, bits), codes.long())
    assert torch.equal(unpack(packed, bits).long(), codes.long())


@pytest.mark.parametrize("bits", [2, 4])
def test_the_triton_path_gives_the_torch_paths_outputs_and_reads(bits: int) -> None:
    runs = {}
    for kernel in ("torch", "triton"):
        d = Driver("kivi", block_size=8, seed=bits,
                   options={"bits": bits, "residual_blocks": 4, "kernel": kernel})
        assert d.be.kernel == kernel
        a, b, c = d.add(30, max_tokens=12), d.add(16, max_tokens=12), d.add(5, max_tokens=12)
        outs = [d.step([(a, 13), (b, 16), (c, 5)]).out]  # chunks: partial and whole blocks
        outs.append(d.step([(a, 17), (b, 1), (c, 1)]).out)  # a chunk beside decodes
        for _ in range(9):  # decodes filling and sealing blocks (every 8 tokens)
            outs.append(d.step([(a, 1), (b, 1), (c, 1)]).out)
        runs[kernel] = (outs, d.reads)  # (the driver held touches to the declaration)
    for x, y in zip(runs["torch"][0], runs["triton"][0], strict=True):
        for t, u in zip(x, y, strict=True):
            torch.testing.assert_close(u, t, atol=1e-5, rtol=1e-5)
    assert runs["torch"][1] == runs["triton"][1]
