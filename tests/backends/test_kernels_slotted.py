"""The token-evicting methods' kernels (issue #56, second stage), under the interpreter:
the paged decode and prefill over slot lists (tokens out of position order, holes where
tokens were evicted) and the attention weights per slot they score by, each against a
brute-force torch reference on random caches with shuffled blocks."""

from __future__ import annotations

import pytest
import torch

from harness.kernels.cases import paged_case, tolerance
from harness.kernels.reference import (
    decode_weights_ref,
    prefill_weights_ref,
    slotted_decode_ref,
    slotted_prefill_ref,
)
from harness.kernels.runtime import interpreting

pytest.importorskip("triton")

from harness.kernels.decode import paged_decode
from harness.kernels.prefill import paged_prefill
from harness.kernels.scores import decode_weights, prefill_weights


def _slot_lists(blocks: list[int], held: list[int], chunk: list[int], bs: int, kv: int,
                d: int, dtype: torch.dtype, gen: torch.Generator):
    """A cache whose sequence i holds ``held[i]`` tokens in ``blocks[i]`` shuffled blocks,
    at random slots of them, the last ``chunk[i]`` positions its newest (the chunk's own
    keys, or a decode's token); the rest a random earlier subset. The spare blocks' slots
    hold positions too: a kernel reading outside a table counts them."""
    c = paged_case([n * bs for n in blocks], block_size=bs, num_kv_heads=kv, head_dim=d,
                   dtype=dtype, generator=gen)
    nslots = c.k_cache.shape[0] * bs
    slot_pos = torch.randint(0, 5, (nslots,), generator=gen)  # spare blocks: live-looking
    starts = []
    for i, (n, h, m) in enumerate(zip(blocks, held, chunk)):
        assert m <= h <= n * bs
        table = c.tables[i, :n]
        slots = (table[:, None] * bs + torch.arange(bs)).flatten()
        slot_pos[slots] = -1
        ctx = h + int(torch.randint(0, 3 * h + 1, (1,), generator=gen))  # evicted: ctx - h
        start = ctx - m
        old = torch.randperm(start, generator=gen)[:h - m].sort().values
        pos = torch.cat([old, torch.arange(start, ctx)])
        where = torch.randperm(n * bs, generator=gen)[:h]
        slot_pos[slots[where]] = pos
        starts.append(start)
    return c, slot_pos, torch.tensor(starts)


# (blocks per sequence, tokens held, group, KV heads, head dim, block size, dtype): holes
# in every block, one token, a table of holes but one slot, GQA 1-4, odd head dim, 16-bit.
DECODE = [
    ([3, 1, 5], [17, 1, 9], 2, 2, 32, 8, torch.float32),
    ([2, 9], [16, 70], 1, 3, 16, 8, torch.float32),
    ([4, 2, 1], [40, 3, 16], 4, 1, 80, 16, torch.float16),
    ([6], [23], 3, 2, 64, 8, torch.bfloat16),
]


@pytest.mark.parametrize("case", range(len(DECODE)))
def test_slotted_decode_and_its_weights_equal_brute_force(case: int) -> None:
    blocks, held, g, kv, d, bs, dtype = DECODE[case]
    gen = torch.Generator().manual_seed(case)
    c, slot_pos, _ = _slot_lists(blocks, held, [1] * len(blocks), bs, kv, d, dtype, gen)
    q = torch.randn(len(blocks), g * kv, d, generator=gen).to(dtype)
    lens = torch.tensor(blocks) * bs
    width = c.tables.shape[1] * bs
    ref = slotted_decode_ref(q, c.k_cache, c.v_cache, c.tables, lens, slot_pos)
    want = decode_weights_ref(q, c.k_cache, c.tables, lens, slot_pos, slot_pos.numel(), 0.5)
    for splits in (1, 3):
        logits = torch.full((len(blocks), g * kv, width), float("nan"))
        lse = torch.empty(len(blocks), g * kv)
        out = paged_decode(q, c.k_cache, c.v_cache, c.tables, lens, num_splits=splits,
                           slot_pos=slot_pos, logits=logits, lse=lse)
        torch.testing.assert_close(out, ref, **tolerance(dtype))
        w = torch.zeros(slot_pos.numel())
        decode_weights(logits, lse, c.tables, lens, slot_pos, bs, w, coef=0.5)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(w, want, atol=tol, rtol=tol)
        # Every head's weights sum to one: coef x heads per decode.
        assert abs(float(w.sum()) - 0.5 * g * kv * len(blocks)) < 1e-3 * g * kv
    # Without scores the output is the same.
    out = paged_decode(q, c.k_cache, c.v_cache, c.tables, lens, slot_pos=slot_pos)
    torch.testing.assert_close(out, ref, **tolerance(dtype))


def test_a_split_of_holes_only_weighs_nothing() -> None:
    # Three blocks, the first two all holes: split 0 (and a whole tile) sees no key.
    bs, kv, d = 8, 1, 16
    gen = torch.Generator().manual_seed(3)
    c, slot_pos, _ = _slot_lists([3], [2], [1], bs, kv, d, torch.float32, gen)
    slots = (c.tables[0, :3, None] * bs + torch.arange(bs)).flatten()
    slot_pos[slots] = -1
    slot_pos[slots[-2:]] = torch.tensor([0, 5])
    q = torch.randn(1, 2, d, generator=gen)
    lens = torch.tensor([3 * bs])
    ref = slotted_decode_ref(q, c.k_cache, c.v_cache, c.tables, lens, slot_pos)
    for splits in (1, 3):
        logits, lse = torch.empty(1, 2, 3 * bs), torch.empty(1, 2)
        out = paged_decode(q, c.k_cache, c.v_cache, c.tables, lens, num_splits=splits,
                           slot_pos=slot_pos, logits=logits, lse=lse)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        assert torch.isinf(logits[0, :, :2 * bs]).all()


# (blocks, held, chunk tokens, group, KV heads, head dim, block size, dtype)
PREFILL = [
    ([3, 5], [20, 33], [6, 17], 2, 2, 32, 8, torch.float32),
    ([2, 1, 4], [16, 5, 30], [16, 5, 1], 1, 3, 16, 8, torch.float32),
    ([3], [40], [20], 4, 1, 80, 16, torch.float16),
]


@pytest.mark.parametrize("case", range(len(PREFILL)))
def test_slotted_prefill_and_its_weights_equal_brute_force(case: int) -> None:
    blocks, held, chunk, g, kv, d, bs, dtype = PREFILL[case]
    gen = torch.Generator().manual_seed(10 + case)
    c, slot_pos, starts = _slot_lists(blocks, held, chunk, bs, kv, d, dtype, gen)
    h = g * kv
    cu = torch.tensor([0, *chunk]).cumsum(0)
    q = torch.randn(int(cu[-1]), h, d, generator=gen).to(dtype)
    kv_lens = torch.tensor(blocks) * bs
    ref = slotted_prefill_ref(q, c.k_cache, c.v_cache, cu, starts, c.tables, kv_lens,
                              slot_pos)
    lse = torch.empty(q.shape[:2])
    out = paged_prefill(q, c.k_cache, c.v_cache, cu, starts, c.tables, max(chunk),
                        slot_pos=slot_pos, kv_lens=kv_lens, lse=lse)
    torch.testing.assert_close(out, ref, **tolerance(dtype))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    args = (q, c.k_cache, slot_pos, cu, starts, c.tables, kv_lens)
    n = torch.tensor(chunk)
    big = torch.full_like(n, 1 << 40)
    # h2o / observed attention: every row, every key; tova: the last row.
    for lo, hi in ((torch.zeros_like(n), n), (n - 1, n)):
        w = torch.zeros(slot_pos.numel())
        prefill_weights(*args, lo, hi, big, lse, w, int(kv_lens.max()), coef=0.25)
        want = prefill_weights_ref(*args, lo, hi, big, (slot_pos.numel(),), 0.25)
        torch.testing.assert_close(w, want, atol=tol, rtol=tol)
        # Each scoring row's weights over the keys it sees sum to one.
        assert abs(float(w.sum()) - 0.25 * h * int((hi - lo).sum())) < 1e-3 * h
    # snapkv: the last 3 rows' weights per head, by position, on the keys before them.
    lo = (n - 3).clamp(min=0)
    limit = starts + lo
    p = int(limit.max()) + 2
    w = torch.zeros(len(blocks), h, p)
    prefill_weights(*args, lo, n, limit, lse, w, int(kv_lens.max()), per_head=True)
    want = prefill_weights_ref(*args, lo, n, limit, (len(blocks), h, p), per_head=True)
    torch.testing.assert_close(w, want, atol=tol, rtol=tol)


gpu = pytest.mark.skipif(not torch.cuda.is_available() or interpreting(),
                         reason="needs CUDA and compiled Triton (TRITON_INTERPRET unset)")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("splits", [1, 5, None])
def test_slot_lists_compiled_at_llama3_8b_geometry(splits: int | None) -> None:
    """The same checks compiled, 32 query / 8 KV heads of 128 in bf16, blocks of 16: long
    tables with holes (decode, split-K), a 300-token chunk over 1000 held keys."""
    bs, kv, d, g, dtype = 16, 8, 128, 4, torch.bfloat16
    gen = torch.Generator().manual_seed(99)
    blocks, held = [80, 3, 256], [1000, 40, 3500]
    c, slot_pos, _ = _slot_lists(blocks, held, [1] * 3, bs, kv, d, dtype, gen)
    q = torch.randn(3, g * kv, d, generator=gen).to(dtype)
    lens = torch.tensor(blocks) * bs
    ref = slotted_decode_ref(q, c.k_cache, c.v_cache, c.tables, lens, slot_pos)
    want = decode_weights_ref(q, c.k_cache, c.tables, lens, slot_pos, slot_pos.numel())
    cu = [t.cuda() for t in (q, c.k_cache, c.v_cache, c.tables, lens, slot_pos)]
    logits = torch.empty(3, g * kv, c.tables.shape[1] * bs, device="cuda")
    lse = torch.empty(3, g * kv, device="cuda")
    out = paged_decode(*cu[:5], num_splits=splits, slot_pos=cu[5], logits=logits, lse=lse)
    torch.testing.assert_close(out.cpu(), ref, **tolerance(dtype, "cuda"))
    w = torch.zeros(slot_pos.numel(), device="cuda")
    decode_weights(logits, lse, cu[3], cu[4], cu[5], bs, w)
    torch.testing.assert_close(w.cpu(), want, atol=2e-2, rtol=3e-2)
    # A prefill chunk of 300 over 1000 held tokens.
    c, slot_pos, starts = _slot_lists([70], [1000], [300], bs, kv, d, dtype, gen)
    q = torch.randn(300, g * kv, d, generator=gen).to(dtype)
    cu_rows, kv_lens = torch.tensor([0, 300]), torch.tensor([70 * bs])
    ref = slotted_prefill_ref(q, c.k_cache, c.v_cache, cu_rows, starts, c.tables, kv_lens,
                              slot_pos)
    args = [t.cuda() for t in (q, c.k_cache, c.v_cache, cu_rows, starts, c.tables)]
    lse = torch.empty(300, g * kv, device="cuda")
    out = paged_prefill(*args, 300, slot_pos=slot_pos.cuda(), kv_lens=kv_lens.cuda(), lse=lse)
    torch.testing.assert_close(out.cpu(), ref, **tolerance(dtype, "cuda"))
    n = torch.tensor([300])
    big = torch.full_like(n, 1 << 40)
    w = torch.zeros(slot_pos.numel(), device="cuda")
    prefill_weights(args[0], args[1], slot_pos.cuda(), args[3], args[4], args[5],
                    kv_lens.cuda(), (n - 1).cuda(), n.cuda(), big.cuda(), lse, w, 70 * bs)
    want = prefill_weights_ref(q, c.k_cache, slot_pos, cu_rows, starts, c.tables, kv_lens,
                               n - 1, n, big, (slot_pos.numel(),))
    torch.testing.assert_close(w.cpu(), want, atol=2e-2, rtol=3e-2)
