"""tova: each step's victim is the held token the current query attends to least,
averaged over layers and heads (a brute-force softmax over the held keys says which);
exact when the budget covers the sequence; never holds more than its budget."""

from __future__ import annotations

import pytest
import torch

from harness.runner import run
from tests.backend_steps import NUM_HEADS, Driver
from tests.compose import tiny


def _brute_force_tova(d: Driver, seq_id: int, row: int, q: list[torch.Tensor],
                      positions: list[int], need: int) -> list[int]:
    """The paper's rule spelled out: softmax of the current query over the held keys, per
    layer and head; mean over both; the ``need`` lowest positions go."""
    lay = d.layout
    g = NUM_HEADS // lay.num_kv_heads
    score = torch.zeros(len(positions), dtype=torch.float64)
    for layer in range(lay.num_layers):
        keys = d.k[seq_id][layer, positions]  # (held, KV, D)
        for h in range(NUM_HEADS):
            logits = keys[:, h // g] @ q[layer][row, h] / lay.head_dim ** 0.5
            score += torch.softmax(logits.double(), 0)
    score /= lay.num_layers * NUM_HEADS
    order = sorted(range(len(positions)), key=lambda i: (float(score[i]), i))
    return sorted(positions[i] for i in order[:need])


@pytest.mark.parametrize("seed", range(4))
def test_victims_equal_a_brute_force_tova(seed: int) -> None:
    budget = 13 + seed * 3
    d = Driver("tova", options={"budget": budget, "budget_ratio": 0.0}, seed=seed)
    s = d.add(prompt_len=budget + 5, max_tokens=12)
    while s.num_computed < s.num_prompt_tokens:  # chunks of at most half the budget
        n = min(budget // 2, s.num_uncomputed)
        d.step([(s, n)])
    for _ in range(8):
        out = d.step([(s, 1)], observe=False)
        _, pos = d.held(s)
        need = len(pos) + 1 - budget
        assert need == 1  # full: one token goes per decode
        want = _brute_force_tova(d, s.seq_id, out.rows[s.seq_id].start, out.q, pos, need)
        d.kv.observe([s], d.last_scores)
        _, after = d.held(s)
        assert sorted(set(pos) - set(after)) == want
        assert len(after) == budget - 1  # room for the next token, never more


def test_budget_covering_the_sequence_is_exact() -> None:
    exact = run(tiny("backend=paged", "cache.enable_prefix_caching=false"))
    tova = run(tiny("backend=tova", "backend.budget=100000", "backend.budget_ratio=0"))
    assert tova.outputs == exact.outputs
    assert tova.metrics["cache.evicted_tokens"] == 0
    assert tova.metrics["run.prefix_caching"] is False


def test_never_holds_more_than_its_budget() -> None:
    budget = 40
    r = run(tiny("backend=tova", f"backend.budget={budget}", "backend.budget_ratio=0",
                 "workload.conversations=1", "workload.turns=1", "workload.answer_tokens=64",
                 "workload.ignore_eos=true", "backend.block_size=8"))
    m = r.metrics
    per_slot = m["memory.kv_budget_bytes"] // m["memory.token_capacity"]
    assert max(s.held_blocks for s in r.steps) <= -(-budget // 8)
    assert max(s.used_bytes for s in r.steps) <= budget * per_slot
    prompt = r.requests[0]["prompt_tokens"]
    assert m["cache.evicted_tokens"] == prompt + 63 - budget
    assert max(s.prefill_tokens for s in r.steps) <= budget // 2
    # A decode reads the tokens it keeps: at most the budget.
    assert m["attention.kv_read_bytes_per_token"] <= budget * per_slot
