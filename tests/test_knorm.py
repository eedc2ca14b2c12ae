"""knorm: after the prompt, the kept tokens are those whose keys have the lowest L2 norm,
the norm averaged over layers and KV heads (one slot holds a token for all of them); a
brute force over the random keys the Driver drew says which. What is generated afterwards
is kept (no decode budget), and the kept prompt is compacted into whole blocks."""

from __future__ import annotations

import pytest

from harness.kv.evicting import EvictingKVManager
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
    for n in chunks:
        d.step([(s, n)])
        if s.num_computed < s.num_prompt_tokens:  # full: nothing goes before the end
            assert len(d.held(s)[1]) == s.num_computed
    _, pos = d.held(s)
    assert pos == _brute_force_knorm(d, s.seq_id, s.num_prompt_tokens, keep)
    kv = d.kv
    assert isinstance(kv, EvictingKVManager)
    assert len(kv.table_of(s)) == -(-keep // d.block_size)  # compacted: whole blocks back
    for _ in range(5):  # decoding keeps every generated token
        d.step([(s, 1)])
    _, after = d.held(s)
    assert after[:keep] == pos and len(after) == keep + 5


def test_streaming_bounds_memory_while_prefilling() -> None:
    keep = 10
    d = Driver("knorm", options={"budget": keep, "budget_ratio": 0.0, "prefill": "streaming"})
    s = d.add(prompt_len=40, max_tokens=4)
    assert d.kv.max_chunk(s) == keep // 2
    while s.num_computed < s.num_prompt_tokens:
        d.step([(s, min(keep // 2, s.num_uncomputed))])
        assert len(d.held(s)[1]) <= keep + keep // 2
    assert len(d.held(s)[1]) == keep
