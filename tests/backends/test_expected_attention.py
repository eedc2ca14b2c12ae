"""expected_attention: after the prompt, the kept tokens are the sinks and those with the
highest expected attention from future queries: the prompt's queries (past the sinks)
rotated back to before RoPE, their mean and covariance per layer and query head moved by
the average rotation of the next positions, exp(k.mu/sqrt(d) + k^T S k/(2d)) softmaxed over
the non-sink keys, averaged over each KV head's query heads, times the value norms,
averaged over KV heads and layers (kvpress's ExpectedAttentionPress, per sequence). A
brute force in float64 loops, written from the paper's formula, says which."""

from __future__ import annotations

import math

import pytest
import torch

from harness.backends.base import KVLayout
from harness.backends.expected_attention import ExpectedAttentionBackend
from harness.errors import UserError
from harness.model.rope import inverse_frequencies
from tests.backend_steps import NUM_HEADS, Driver

HEAD_DIM = 16
INV_FREQ = inverse_frequencies(HEAD_DIM, 10000.0)
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=HEAD_DIM, dtype=torch.float32,
                  rope_inv_freq=tuple(INV_FREQ.tolist()))


def _rotation(pos: float) -> torch.Tensor:
    """RoPE's (D, D) matrix at ``pos``, rotate-half pairs (j, j + D/2), from its definition."""
    d, half = HEAD_DIM, HEAD_DIM // 2
    r = torch.zeros(d, d, dtype=torch.float64)
    for j in range(half):
        a = pos * float(INV_FREQ[j])
        r[j, j], r[j, j + half] = math.cos(a), -math.sin(a)
        r[j + half, j], r[j + half, j + half] = math.sin(a), math.cos(a)
    return r


def _brute_force(d: Driver, seq_id: int, qs: dict[int, list[torch.Tensor]], prompt: int,
                 keep: int, sink: int, future: int, cov_on: bool = True,
                 vnorm: bool = True) -> list[int]:
    lay = d.layout
    g = NUM_HEADS // lay.num_kv_heads
    r_avg = sum(_rotation(t) for t in range(prompt, prompt + future)) / future
    cand = list(range(sink, prompt))
    score = torch.zeros(len(cand), dtype=torch.float64)
    for layer in range(lay.num_layers):
        keys = d.k[seq_id][layer].double()
        vals = d.v[seq_id][layer].double()
        for kvh in range(lay.num_kv_heads):
            per_head = torch.zeros(len(cand), dtype=torch.float64)
            for h in range(kvh * g, (kvh + 1) * g):
                pre = torch.stack([_rotation(i).T @ qs[i][layer][h].double()
                                   for i in range(sink, prompt)])  # R(-i) = R(i)^T
                mu = pre.mean(0)
                cov = ((pre - mu).T @ (pre - mu)) / len(pre)
                mu_f, cov_f = r_avg @ mu, r_avg @ cov @ r_avg.T
                logits = torch.tensor([
                    float(keys[j, kvh] @ mu_f) / math.sqrt(HEAD_DIM)
                    + (float(keys[j, kvh] @ cov_f @ keys[j, kvh]) / HEAD_DIM / 2
                       if cov_on else 0.0) for j in cand], dtype=torch.float64)
                per_head += torch.softmax(logits, 0)
            per_head /= g
            if vnorm:
                per_head *= torch.tensor([float(vals[j, kvh].norm()) for j in cand])
            score += per_head
    order = sorted(range(len(cand)), key=lambda i: (-float(score[i]), i))
    return sorted([*range(sink), *(cand[i] for i in order[:keep - sink])])


def _drive(options: dict[str, object], chunks: list[int], seed: int
           ) -> tuple[Driver, object, dict[int, list[torch.Tensor]]]:
    d = Driver("expected_attention", layout=LAYOUT, options=options, seed=seed)
    s = d.add(prompt_len=sum(chunks), max_tokens=6)
    return d, s, d.prefill(s, chunks)


@pytest.mark.parametrize("chunks", [[30], [17, 13], [29, 1]])
@pytest.mark.parametrize("seed", range(2))
def test_kept_prompt_is_the_sinks_and_the_highest_expected_attention(
        chunks: list[int], seed: int) -> None:
    keep, sink, future = 10, 4, 64
    opts = {"budget": keep, "budget_ratio": 0.0, "n_sink": sink, "n_future_positions": future}
    d, s, qs = _drive(opts, chunks, seed)
    _, pos = d.held(s)
    assert pos == _brute_force(d, s.seq_id, qs, sum(chunks), keep, sink, future)
    for _ in range(4):  # decoding keeps every generated token
        d.step([(s, 1)])
    _, after = d.held(s)
    assert after[:keep] == pos and len(after) == keep + 4


def test_without_covariance_or_value_norms() -> None:
    keep, sink, future = 10, 2, 16
    opts = {"budget": keep, "budget_ratio": 0.0, "n_sink": sink, "n_future_positions": future,
            "use_covariance": False, "use_vnorm": False}
    d, s, qs = _drive(opts, [24], 3)
    want = _brute_force(d, s.seq_id, qs, 24, keep, sink, future, cov_on=False, vnorm=False)
    assert d.held(s)[1] == want
    # ... and the terms matter: with them, these draws keep other tokens.
    assert want != _brute_force(d, s.seq_id, qs, 24, keep, sink, future)


def test_refuses_a_layout_without_rope() -> None:
    d = Driver("expected_attention", options={"budget": 8, "budget_ratio": 0.0})
    s = d.add(prompt_len=20)
    with pytest.raises(UserError, match="RoPE"):
        d.step([(s, 20)])


def test_no_query_statistics_are_kept_for_prompts_it_will_not_compress() -> None:
    # A prompt within its budget is never scored: its statistics (layers x heads x D^2
    # floats) must not be gathered and left behind; a compressed one's go at its end.
    d = Driver("expected_attention", layout=LAYOUT,
               options={"budget": 64, "budget_ratio": 0.0}, seed=0)
    short, long_ = d.add(prompt_len=20), d.add(prompt_len=90)
    d.prefill(short, [12, 8])
    be = d.be
    assert isinstance(be, ExpectedAttentionBackend)
    assert be._qstats == {}
    d.step([(long_, 50)])
    assert list(be._qstats) == [long_.seq_id]  # gathered while its prompt is read
    d.step([(long_, 40)])
    assert be._qstats == {}
