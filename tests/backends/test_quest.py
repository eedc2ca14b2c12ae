"""quest: the blocks a decode reads are a brute-force top-k of the paper's upper bound
(sum over channels of max(q*min, q*max), the last block always); its output is attention
over exactly those tokens; a context within the budget is exact; prefix caching stays on
and the bytes read drop against paged."""

from __future__ import annotations

import pytest
import torch

from harness.runner import run
from tests.backend_steps import NUM_HEADS, Driver
from tests.compose import compose_cfg, tiny

BS = 8


def _brute_force_blocks(keys: torch.Tensor, q: torch.Tensor, n_tokens: int,
                        k_blocks: int) -> list[set[int]]:
    """Per KV head: the last block plus the k - 1 others with the largest upper bound
    (the largest over the head's query heads). keys: (ctx, KV, D); q: (H, D)."""
    kv_heads = keys.shape[1]
    g = NUM_HEADS // kv_heads
    nblk = -(-n_tokens // BS)
    out = []
    for kvh in range(kv_heads):
        bounds = []
        for blk in range(nblk):
            kb = keys[blk * BS:min((blk + 1) * BS, n_tokens), kvh]
            lo, hi = kb.min(0).values, kb.max(0).values
            bounds.append(max(float(torch.maximum(q[h] * lo, q[h] * hi).sum())
                              for h in range(kvh * g, (kvh + 1) * g)))
        others = sorted(range(nblk - 1), key=lambda i: -bounds[i])[:k_blocks - 1]
        out.append({nblk - 1, *others})
    return out


@pytest.mark.parametrize("seed", range(4))
def test_chosen_blocks_equal_a_brute_force_topk(seed: int) -> None:
    budget = 32
    d = Driver("quest", block_size=BS, options={"token_budget": budget}, seed=seed)
    lens = [5, 30, 77, 120]  # within the budget (all blocks), and well past it
    seqs = [d.add(n) for n in lens]
    d.step([(s, s.num_prompt_tokens) for s in seqs])
    out = d.step([(s, 1) for s in seqs])
    be = d.be
    per_head = 2 * d.layout.head_dim * 4
    want_reads = 0
    for layer in range(d.layout.num_layers):
        q = out.q[layer][:len(seqs)]
        top, chosen = be.select_blocks(layer, q)  # type: ignore[attr-defined]
        for i, s in enumerate(seqs):
            n = s.num_computed
            keys = d.k[s.seq_id][layer, :n]
            want = _brute_force_blocks(keys, q[i], n, budget // BS)
            for kvh, blocks in enumerate(want):
                got = {int(t) for t, c in zip(top[i, :, kvh], chosen[i, :, kvh]) if c}
                assert got == blocks
                # The output reads only those blocks' tokens: attention over them, dense.
                toks = sorted(p for b in blocks for p in range(b * BS, min(b * BS + BS, n)))
                want_reads += len(toks) * per_head
                g = NUM_HEADS // d.layout.num_kv_heads
                for h in range(kvh * g, (kvh + 1) * g):
                    kk = keys[toks, kvh]
                    vv = d.v[s.seq_id][layer, toks, kvh]
                    w = torch.softmax(kk @ q[i, h] / d.layout.head_dim ** 0.5, 0)
                    torch.testing.assert_close(out.out[layer][i, h], w @ vv,
                                               atol=1e-5, rtol=1e-5)
            want_reads += -(-n // BS) * be.meta_bytes_per_block() // d.layout.num_layers  # type: ignore[attr-defined]
    assert d.read_bytes_per_token() == pytest.approx(want_reads / len(seqs))


def test_context_within_the_budget_is_paged_exactly() -> None:
    outs = {}
    for name, opts in (("paged", {"kernel": "torch"}), ("quest", {"token_budget": 128})):
        d = Driver(name, block_size=BS, options=opts, seed=3)
        seqs = [d.add(n) for n in (9, 40, 100)]
        d.step([(s, s.num_prompt_tokens) for s in seqs])
        outs[name] = [d.step([(s, 1) for s in seqs]).out for _ in range(3)]
    for a, b in zip(outs["paged"], outs["quest"]):
        for la, lb in zip(a, b):
            torch.testing.assert_close(la, lb, atol=1e-5, rtol=1e-5)


def test_keeps_prefix_caching_and_reads_less_than_paged() -> None:
    common = ("workload.answer_tokens=48", "workload.ignore_eos=true", "backend.block_size=8")
    paged = run(tiny("backend=paged", *common)).metrics
    quest = run(tiny("backend=quest", "backend.token_budget=32", *common)).metrics
    assert quest["run.prefix_caching"] is True
    assert quest["cache.prefix_hit_rate"] > 0 and paged["cache.prefix_hit_rate"] > 0
    assert quest["cache.evicted_tokens"] == 0
    assert quest["attention.kv_read_bytes_per_token"] < \
        0.6 * paged["attention.kv_read_bytes_per_token"]


def test_swapped_and_copied_blocks_keep_their_bounds() -> None:
    # Beam search: forks copy partly filled blocks (copy-on-write) and, under a tight
    # budget, groups are swapped out and back. The bounds travel with their blocks, so
    # the chosen blocks, and the best beams, are those of a roomy run.
    beam = ["model=tiny", "backend=quest", "backend.token_budget=16", "workload=beam_search",
            "workload.n=3", "workload.prompt_tokens=40", "workload.output_tokens=24",
            "workload.num_requests=4", "backend.block_size=8"]
    roomy = run(compose_cfg([*beam, "cache.kv_budget=2MiB"]))
    swap = run(compose_cfg([*beam, "cache.kv_budget=72KiB", "scheduler.preemption_mode=swap",
                            "cache.swap_space=1MiB"]))
    assert swap.metrics["sched.preemptions_swap"] > 0 and roomy.metrics["cache.cow_copies"] > 0
    assert swap.outputs == roomy.outputs
