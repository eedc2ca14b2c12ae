"""tova: each step's victim is the held token the current query attends to least,
averaged over layers and heads (a brute-force softmax over the held keys says which).
Exact under a covering budget and never over its budget: tests/backends/test_h2o.py."""

from __future__ import annotations

import pytest
import torch

from tests.backend_steps import NUM_HEADS, Driver


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


@pytest.mark.parametrize("chunks", [[40], [25, 15], [39, 1]])
def test_full_prefill_selects_once_by_the_prompts_last_query(chunks: list[int]) -> None:
    # prefill=full (the default, as the paper's long-context runs and kvpress): the whole
    # prompt is held, however it is chunked, and its last query's weights choose, once.
    budget = 17
    d = Driver("tova", options={"budget": budget, "budget_ratio": 0.0, "prefill": "full"})
    s = d.add(prompt_len=sum(chunks), max_tokens=4)
    for i, n in enumerate(chunks):
        last = i == len(chunks) - 1
        out = d.step([(s, n)], observe=False)
        _, pos = d.held(s)
        if not last:
            d.kv.observe([s], d.last_scores)
            assert len(d.held(s)[1]) == s.num_computed  # nothing goes before the end
    need = len(pos) + 1 - budget  # down to the budget, room for the first decode
    row = out.rows[s.seq_id].stop - 1  # the prompt's last token
    want = _brute_force_tova(d, s.seq_id, row, out.q, pos, need)
    d.kv.observe([s], d.last_scores)
    _, after = d.held(s)
    assert sorted(set(pos) - set(after)) == want
    assert len(after) == budget - 1
