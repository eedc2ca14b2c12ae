"""snapkv: the tokens kept after a prompt's prefill are the window plus a brute-force
top-k of SnapKV's score (the window queries' softmax weights, pooled per head over
neighbouring positions, summed over heads and layers), also when the window spans
prefill chunks; the kept tokens are compacted so whole blocks go back, and attention
then reads exactly them; freed memory lets more sequences run."""

from __future__ import annotations

import pytest
import torch

from harness.backends.attention_ref import attend_decode
from harness.kv.evicting import EvictingKVManager
from harness.runner import run
from tests.backend_steps import NUM_HEADS, Driver
from tests.compose import compose_cfg

BS = 8


def _brute_force_snapkv(d: Driver, seq_id: int, q: dict[int, list[torch.Tensor]], p: int,
                        window: int, kernel: int, pooling: str, budget: int) -> set[int]:
    """SnapKV's rule spelled out, position by position. ``q[t][layer]``: (H, D) query of
    position t. Returns the kept positions."""
    lay = d.layout
    g = NUM_HEADS // lay.num_kv_heads
    lo = p - window
    score = torch.zeros(lo, dtype=torch.float64)
    for layer in range(lay.num_layers):
        keys = d.k[seq_id][layer]
        for h in range(NUM_HEADS):
            s = torch.zeros(lo, dtype=torch.float64)
            for t in range(lo, p):  # causal softmax of each window query, summed
                logits = keys[:t + 1, h // g] @ q[t][layer][h] / lay.head_dim ** 0.5
                s += torch.softmax(logits.double(), 0)[:lo]
            half = kernel // 2
            for j in range(lo):
                near = s[max(0, j - half):j + half + 1]
                score[j] += near.max() if pooling == "max" else near.sum() / kernel
    top = sorted(range(lo), key=lambda j: (-float(score[j]), j))[:budget]
    return set(top) | set(range(lo, p))


@pytest.mark.parametrize("pooling,chunks", [("max", [50, 40, 10]), ("avg", [100]),
                                            ("max", [85, 15])])
def test_kept_tokens_equal_a_brute_force_snapkv(pooling: str, chunks: list[int]) -> None:
    p, window, kernel, budget = 100, 16, 5, 20
    opts = {"budget": budget, "budget_ratio": 0.0, "window": window, "pool_width": kernel,
            "pooling": pooling}
    d = Driver("snapkv", block_size=BS, options=opts, seed=len(chunks))
    s = d.add(p, max_tokens=8)
    q: dict[int, list[torch.Tensor]] = {}
    for n in chunks:  # [50, 40, 10]: the window [84, 100) spans the last two chunks
        start = s.num_computed
        out = d.step([(s, n)])
        rows = out.rows[s.seq_id]
        for i in range(n):
            q[start + i] = [ql[rows.start + i] for ql in out.q]
    _, kept = d.held(s)
    assert set(kept) == _brute_force_snapkv(d, s.seq_id, q, p, window, kernel, pooling,
                                            budget)
    # Compacted: 36 tokens in ceil(36 / 8) = 5 blocks; the other 8 went back.
    kv = d.kv
    assert isinstance(kv, EvictingKVManager)
    assert len(kv.table_of(s)) == 5 and kv.pool.num_used == 5
    assert kv.stats.evicted_tokens == p - budget - window
    # A decode now attends to exactly the kept tokens (moved K/V intact) and itself.
    out = d.step([(s, 1)])
    pos = [*sorted(kept), p]
    for layer in range(d.layout.num_layers):
        k, v = d.k[s.seq_id][layer, pos], d.v[s.seq_id][layer, pos]
        ref = attend_decode(out.q[layer][:1], k[None], v[None], torch.tensor([len(pos)]))
        torch.testing.assert_close(out.out[layer][:1], ref, atol=1e-5, rtol=1e-5)
    assert d.read_bytes_per_token() == len(pos) * d.be.bytes_per_slot()


@pytest.mark.parametrize("pooling", ["max", "avg"])
def test_streaming_selects_after_each_chunk_by_its_own_window(pooling: str) -> None:
    # prefill=streaming: memory bounded while prefilling. Chunks of the kept prompt (here
    # 8 + 12 = 20): the second chunk's last 8 queries score the 32 tokens before them, all
    # still held (the first chunk brought no more than the kept count), so what stays is a
    # brute-force SnapKV over the first 40 positions; never more than kept + a chunk.
    p, window, kernel, budget = 60, 8, 5, 12
    opts = {"budget": budget, "budget_ratio": 0.0, "window": window, "pool_width": kernel,
            "pooling": pooling, "prefill": "streaming"}
    d = Driver("snapkv", block_size=BS, options=opts, seed=7)
    s = d.add(p, max_tokens=4)
    keep = window + budget
    assert d.kv.max_chunk(s) == keep
    q: dict[int, list[torch.Tensor]] = {}
    while s.num_computed < p:
        start, n = s.num_computed, min(keep, p - s.num_computed)
        out = d.step([(s, n)])
        rows = out.rows[s.seq_id]
        for i in range(n):
            q[start + i] = [ql[rows.start + i] for ql in out.q]
        _, kept = d.held(s)
        assert len(kept) == min(s.num_computed, keep)
        if s.num_computed == 2 * keep:
            assert set(kept) == _brute_force_snapkv(d, s.seq_id, q, 2 * keep, window,
                                                    kernel, pooling, budget)
    assert d.be.trigger == "streaming"


def test_max_tokens_caps_what_a_decoding_sequence_holds() -> None:
    opts = {"budget": 10, "budget_ratio": 0.0, "window": 8, "max_tokens": 24}
    d = Driver("snapkv", block_size=BS, options=opts)
    s = d.add(40, max_tokens=30)
    d.step([(s, 40)])
    assert len(d.held(s)[1]) == 18  # window 8 + 10
    for _ in range(20):
        d.step([(s, 1)])
        _, pos = d.held(s)
        assert len(pos) <= 24 - 1  # room for the next token within the cap
    # The compressed prompt stays; the oldest generated tokens went.
    _, pos = d.held(s)
    assert sum(1 for x in pos if x < 40) == 18


def test_freed_prompt_blocks_let_more_sequences_run() -> None:
    load = ("model=tiny", "workload=random", "workload.num_requests=12",
            "workload.distribution=uniform", "workload.input_min=240",
            "workload.input_max=300", "workload.output_min=16", "workload.output_max=16",
            "cache.kv_budget=640KiB", "backend.block_size=8")
    paged = run(compose_cfg(["backend=paged", "cache.enable_prefix_caching=false",
                             *load])).metrics
    snap = run(compose_cfg(["backend=snapkv", *load])).metrics
    assert snap["requests.finished"] == paged["requests.finished"] == 12
    assert snap["memory.max_running_seqs"] > paged["memory.max_running_seqs"]
    assert snap["cache.evicted_tokens"] > 0


def test_streaming_bounds_memory_in_the_engine() -> None:
    # One long prompt, prefilled in chunks of the kept count (window 8 + 24): the allocator
    # never holds more than kept + one chunk, and the run's record names the trigger.
    common = ["model=tiny", "backend=snapkv", "backend.window=8", "backend.budget=24",
              "backend.budget_ratio=0", "backend.block_size=8", "workload=shared_prefix",
              "workload.num_requests=1", "workload.prefix_tokens=200",
              "workload.suffix_tokens=0", "workload.output_tokens=8", "cache.kv_budget=1MiB"]
    full = run(compose_cfg([*common, "backend.prefill=full"]))
    stream = run(compose_cfg([*common, "backend.prefill=streaming"]))
    per_slot = stream.metrics["memory.kv_budget_bytes"] // stream.metrics["memory.token_capacity"]
    assert stream.metrics["run.prefill"] == "streaming" and full.metrics["run.prefill"] == "full"
    assert max(s.used_bytes for s in stream.steps) <= (32 + 32) * per_slot
    assert max(s.used_bytes for s in full.steps) == 200 * per_slot  # the whole prompt
    # Both end the prompt holding the same count: the window + 24.
    assert [s.used_bytes for s in stream.steps][-1] == [s.used_bytes for s in full.steps][-1]
