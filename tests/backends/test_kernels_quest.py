"""Quest's Triton path (harness.kernels.quest, under the interpreter): the blocks each KV
head chooses are a brute-force top-k of the bound (ties to the lower column, as the torch
path), the decode over them equals attention over exactly those tokens, and the backend's
triton path gives the torch path's outputs and declared reads."""

from __future__ import annotations

import pytest
import torch

from harness.backends.quest import QuestBackend
from harness.kernels.cases import paged_case
from harness.kernels.reference import quest_blocks_ref, quest_decode_ref
from tests.backend_steps import Driver

pytest.importorskip("triton")

from harness.kernels.quest import quest_decode, quest_select


def _bounds(k_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each block's elementwise key min and max: (num_blocks, KV, D) twice."""
    return k_cache.amin(1), k_cache.amax(1)


# (lens, group, KV heads, head dim, block size, dtype, blocks read): contexts within the
# budget and well past it, one block, GQA 1 / 3 / 4, an odd head dim, 16-bit caches.
CASES = [
    ([5, 30, 77, 120], 2, 2, 32, 8, torch.float32, 4),
    ([1, 8, 9, 200], 3, 2, 64, 8, torch.float32, 1),
    ([16, 100, 33], 1, 3, 16, 16, torch.float16, 2),
    ([250, 64], 4, 1, 80, 16, torch.bfloat16, 5),
    ([40, 41, 300, 7, 129], 2, 2, 32, 8, torch.float32, 40),  # more than any table holds
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_selection_and_decode_equal_the_brute_force_reference(case: int) -> None:
    lens, g, kv, d, bs, dtype, k_sel = CASES[case]
    gen = torch.Generator().manual_seed(case)
    c = paged_case(lens, block_size=bs, num_kv_heads=kv, head_dim=d, dtype=dtype,
                   generator=gen)
    kmin, kmax = _bounds(c.k_cache)
    nblk = (c.lens + bs - 1) // bs
    q = torch.randn(len(lens), g * kv, d, generator=gen).to(dtype)
    bsz, width = c.tables.shape
    bounds = torch.empty(bsz, kv, width)
    sel = torch.full((bsz, kv, k_sel), -1, dtype=torch.int64)
    sel_lens = torch.empty(bsz, kv, dtype=torch.int64)
    quest_select(q, kmin, kmax, c.tables, nblk, c.lens, k_sel, bs, bounds, sel, sel_lens)
    for b, n in enumerate(nblk.tolist()):
        want = quest_blocks_ref(q[b], kmin, kmax, c.tables[b], n, k_sel)
        cnt = min(n, k_sel)
        for h in range(kv):
            phys = sel[b, h, :cnt].tolist()
            assert phys[-1] == int(c.tables[b, n - 1])  # the last block, last
            assert phys == [int(c.tables[b, col]) for col in want[h]]  # in rank order
            assert int(sel_lens[b, h]) == (cnt - 1) * bs + int(c.lens[b]) - (n - 1) * bs
            assert (sel[b, h, cnt:] == -1).all()  # nothing written past them
    ref = quest_decode_ref(q, c.k_cache, c.v_cache, c.tables, nblk, c.lens, kmin, kmax, k_sel)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    for splits in (1, 3):
        out = quest_decode(q, c.k_cache, c.v_cache, c.tables, nblk, c.lens, kmin, kmax,
                           k_sel, num_splits=splits)
        torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


def test_ties_rank_the_lower_column_first() -> None:
    # Integer keys: every bound is exact, and blocks 1..6 are copies of one block.
    bs, kv, d = 8, 1, 16
    gen = torch.Generator().manual_seed(7)
    c = paged_case([80], block_size=bs, num_kv_heads=kv, head_dim=d, dtype=torch.float32,
                   generator=gen)
    c.k_cache.copy_(torch.randint(-3, 4, c.k_cache.shape, generator=gen).float())
    t = c.tables[0]
    c.k_cache[t[2:7]] = c.k_cache[t[1]].clone()
    c.k_cache[t[8]] = c.k_cache[t[1]] - 50  # far below: never chosen
    kmin, kmax = _bounds(c.k_cache)
    q = torch.ones(1, 2, d)
    bounds = torch.empty(1, kv, t.numel())
    sel = torch.empty(1, kv, 4, dtype=torch.int64)
    sel_lens = torch.empty(1, kv, dtype=torch.int64)
    nblk = torch.tensor([10])
    quest_select(q, kmin, kmax, c.tables, nblk, c.lens, 4, bs, bounds, sel, sel_lens)
    cols = [int((t == p).nonzero()) for p in sel[0, 0].tolist()]
    want = quest_blocks_ref(q[0], kmin, kmax, t, 10, 4)[0]
    assert cols == want
    top = sorted(range(9), key=lambda i: -float(bounds[0, 0, i]))[:3]  # stable: ties low
    assert cols[:3] == top and cols[3] == 9


def _tied_driver(kernel: str) -> tuple[Driver, list]:
    """quest on the step driver, keys with exact ties: every block of a sequence holds the
    same integer keys (its values differ), so the choice among them is the tie rule's."""
    d = Driver("quest", block_size=8, options={"token_budget": 24, "kernel": kernel},
               seed=5)
    seqs = [d.add(n, max_tokens=6) for n in (50, 71, 9)]
    for s in seqs:
        k = d.k[s.seq_id]
        block = torch.randint(-2, 3, (k.shape[0], 8, *k.shape[2:]), generator=d.gen).float()
        reps = -(-k.shape[1] // 8)
        d.k[s.seq_id] = block.repeat(1, reps, 1, 1)[:, :k.shape[1]].contiguous()
    return d, seqs


def test_the_triton_path_gives_the_torch_paths_outputs_and_reads_ties_included() -> None:
    runs = {}
    for kernel in ("torch", "triton"):
        d, seqs = _tied_driver(kernel)
        assert d.be.kernel == kernel
        outs = [d.step([(seqs[0], 20), (seqs[1], 71), (seqs[2], 9)]).out]  # chunks
        outs.append(d.step([(seqs[0], 30), (seqs[1], 1), (seqs[2], 1)]).out)  # mixed
        for _ in range(3):
            outs.append(d.step([(s, 1) for s in seqs]).out)
        runs[kernel] = (outs, d.reads)  # (the driver held touches to the declaration)
    for a, b in zip(runs["torch"][0], runs["triton"][0], strict=True):
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(y, x, atol=1e-5, rtol=1e-5)
    assert runs["torch"][1] == runs["triton"][1]


def test_the_torch_paths_ties_rank_the_lower_column_first() -> None:
    d, seqs = _tied_driver("torch")
    d.step([(s, s.num_prompt_tokens) for s in seqs])
    out = d.step([(s, 1) for s in seqs])
    be = d.be
    assert isinstance(be, QuestBackend) and be.batch is not None
    for layer in range(d.layout.num_layers):
        q = out.q[layer][:len(seqs)]
        top, chosen = be.select_blocks(layer, q)
        for i, s in enumerate(seqs):
            n = -(-s.num_computed // 8)
            tab = torch.tensor(d.kv.tables([s])[0])
            k_sel = be.blocks_read(be.batch.decode_tables.shape[1])
            want = quest_blocks_ref(q[i], be.k_min[layer], be.k_max[layer], tab, n, k_sel)
            for h in range(d.layout.num_kv_heads):
                got = [int(t) for t, c in zip(top[i, :, h], chosen[i, :, h]) if c]
                assert sorted(got) == sorted(want[h])
