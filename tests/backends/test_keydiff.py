"""keydiff: after the prompt, the kept tokens are those whose keys are least similar to
the mean unit key of all the keys held (per layer and KV head, the cosine averaged over
both); a brute force over the random keys the Driver drew says which, however the prompt
was chunked (the score is a statistic of every held key: the prompt's last chunk scores
them together). Streaming (the paper's block-wise form) rescores what is held after each
chunk."""

from __future__ import annotations

import pytest
import torch

from tests.backend_steps import Driver


def _brute_force_keydiff(keys: torch.Tensor, positions: list[int], keep: int) -> list[int]:
    """keys: (layers, P, KV, D). The ``keep`` of ``positions`` with the lowest cosine to
    the anchor (mean of the unit keys at ``positions``), per (layer, KV head), mean over
    both, kept by highest score = lowest similarity; ties to the earlier position."""
    k = keys[:, positions].double()  # (layers, T, KV, D)
    unit = k / k.norm(dim=-1, keepdim=True)
    anchor = unit.mean(dim=1, keepdim=True)  # (layers, 1, KV, D)
    cos = (k * anchor).sum(-1) / (k.norm(dim=-1) * anchor.norm(dim=-1))  # (layers, T, KV)
    score = -cos.mean(dim=(0, 2))
    order = sorted(range(len(positions)), key=lambda i: (-float(score[i]), i))
    return sorted(positions[i] for i in order[:keep])


@pytest.mark.parametrize("chunks", [[40], [23, 17], [39, 1]])
@pytest.mark.parametrize("seed", range(3))
def test_kept_prompt_is_the_least_similar_to_the_mean_key(chunks: list[int], seed: int) -> None:
    keep = 11
    d = Driver("keydiff", options={"budget": keep, "budget_ratio": 0.0}, seed=seed)
    s = d.add(prompt_len=sum(chunks), max_tokens=6)
    d.prefill(s, chunks)  # full: nothing goes before the end
    _, pos = d.held(s)
    p = s.num_prompt_tokens
    assert pos == _brute_force_keydiff(d.k[s.seq_id], list(range(p)), keep)
    d.check_compressed_once(s, keep)


def test_streaming_rescores_what_is_held_after_each_chunk() -> None:
    keep = 10
    d = Driver("keydiff", options={"budget": keep, "budget_ratio": 0.0, "prefill": "streaming"},
               seed=5)
    s = d.add(prompt_len=40, max_tokens=4)
    assert d.kv.max_chunk(s) == keep // 2
    while s.num_computed < s.num_prompt_tokens:
        before = d.held(s)[1] if s.num_computed else []
        n = min(keep // 2, s.num_uncomputed)
        first = s.num_computed
        d.step([(s, n)])
        held_now = [*before, *range(first, first + n)]
        _, pos = d.held(s)
        assert len(pos) <= keep + keep // 2
        if len(held_now) > keep:  # the block-wise rule: rescore everything held, keep the top
            assert pos == _brute_force_keydiff(d.k[s.seq_id], held_now, keep)
    assert len(d.held(s)[1]) == keep
