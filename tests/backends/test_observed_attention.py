"""observed_attention: after the prompt, the kept tokens are those with the highest mean
attention received from the queries that saw them (a brute-force causal softmax over the
whole prompt, per layer and query head: each key's weights summed over the queries at or
after it, divided by their number, mean over heads and layers), however the prompt was
chunked; what is generated afterwards is kept."""

from __future__ import annotations

import pytest
import torch

from harness.kv.evicting import EvictingKVManager
from tests.backend_steps import NUM_HEADS, Driver


def _brute_force_observed(keys: torch.Tensor, qs: dict[int, list[torch.Tensor]],
                          prompt: int, keep: int, kv_heads: int, d: int,
                          average: bool = True) -> list[int]:
    """keys (layers, P, KV, D); qs[pos] = that query's (H, D) per layer. kvpress's rule:
    attentions summed over queries / (P - j), averaged over heads (and layers here)."""
    layers = keys.shape[0]
    g = NUM_HEADS // kv_heads
    score = torch.zeros(prompt, dtype=torch.float64)
    for layer in range(layers):
        for i in range(prompt):
            for h in range(NUM_HEADS):
                k = keys[layer, :i + 1, h // g].double()  # causal: keys 0..i
                w = torch.softmax(k @ qs[i][layer][h].double() / d ** 0.5, 0)
                score[:i + 1] += w
    if average:
        score /= torch.arange(prompt, 0, -1, dtype=torch.float64)  # queries that saw each key
    score /= layers * NUM_HEADS
    order = sorted(range(prompt), key=lambda j: (-float(score[j]), j))
    return sorted(order[:keep])


@pytest.mark.parametrize("chunks", [[30], [17, 13], [29, 1]])
@pytest.mark.parametrize("seed", range(2))
def test_kept_prompt_is_the_most_attended_per_query_that_saw_it(chunks: list[int],
                                                                seed: int) -> None:
    keep = 9
    d = Driver("observed_attention", options={"budget": keep, "budget_ratio": 0.0}, seed=seed)
    s = d.add(prompt_len=sum(chunks), max_tokens=6)
    lay = d.layout
    qs = d.prefill(s, chunks)
    _, pos = d.held(s)
    want = _brute_force_observed(d.k[s.seq_id], qs, s.num_prompt_tokens, keep,
                                 lay.num_kv_heads, lay.head_dim)
    assert pos == want
    assert isinstance(d.kv, EvictingKVManager)
    for _ in range(4):
        d.step([(s, 1)])
    _, after = d.held(s)
    assert after[:keep] == pos and len(after) == keep + 4


def test_the_division_decides() -> None:
    # Summed instead of averaged (h2o's rule), the first keys, seen by every query, win:
    # on these draws the two rules keep different tokens, so the test above tells them apart.
    keep = 9
    d = Driver("observed_attention", options={"budget": keep, "budget_ratio": 0.0}, seed=0)
    s = d.add(prompt_len=30, max_tokens=6)
    out = d.step([(s, 30)])
    lay = d.layout
    qs = {i: [out.q[layer][out.rows[s.seq_id].start + i] for layer in range(lay.num_layers)]
          for i in range(30)}
    averaged = _brute_force_observed(d.k[s.seq_id], qs, 30, keep, lay.num_kv_heads,
                                     lay.head_dim)
    summed = _brute_force_observed(d.k[s.seq_id], qs, 30, keep, lay.num_kv_heads,
                                   lay.head_dim, average=False)
    assert d.held(s)[1] == averaged != summed
