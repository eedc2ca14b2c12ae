"""knorm: after the prompt, the kept tokens are those whose keys have the lowest L2 norm,
the norm averaged over layers and KV heads (one slot holds a token for all of them); a
brute force over the random keys the Driver drew says which. What is generated afterwards
is kept (no decode budget), and the kept prompt is compacted into whole blocks."""

from __future__ import annotations

import pytest

from tests.backend_steps import Driver


def _brute_force_knorm(d: Driver, seq_id: int, prompt: int, keep: int) -> list[int]:
    """The ``keep`` prompt positions of lowest mean key norm: norm per (layer, KV head),
    mean over both; ties to the earlier position."""
    k = d.k[seq_id][:, :prompt]  # (layers, positions, KV, D)
    norm = k.double().norm(dim=-1).mean(dim=(0, 2))  # (positions,)
    order = sorted(range(prompt), key=lambda p: (float(norm[p]), p))
    return sorted(order[:keep])


@pytest.mark.parametrize("chunks", [[40], [23, 17], [39, 1]])
@pytest.mark.parametrize("seed", range(3))
def test_kept_prompt_is_the_lowest_key_norms(chunks: list[int], seed: int) -> None:
    keep = 11
    d = Driver("knorm", options={"budget": keep, "budget_ratio": 0.0}, seed=seed)
    s = d.add(prompt_len=sum(chunks), max_tokens=6)
    d.prefill(s, chunks)  # full: nothing goes before the end
    _, pos = d.held(s)
    assert pos == _brute_force_knorm(d, s.seq_id, s.num_prompt_tokens, keep)
    d.check_compressed_once(s, keep)


def test_streaming_bounds_memory_while_prefilling() -> None:
    keep = 10
    d = Driver("knorm", options={"budget": keep, "budget_ratio": 0.0, "prefill": "streaming"})
    s = d.add(prompt_len=40, max_tokens=4)
    assert d.kv.max_chunk(s) == keep // 2
    while s.num_computed < s.num_prompt_tokens:
        d.step([(s, min(keep // 2, s.num_uncomputed))])
        assert len(d.held(s)[1]) <= keep + keep // 2
    assert len(d.held(s)[1]) == keep
