"""attention.kv_read_bytes_per_token: what each backend's decode attention reads, against
a hand count (paged: the whole context; a window: its window and sinks; 1-byte caches:
values, scales and full-precision sinks; kivi: quantized full blocks and the residual)."""

from __future__ import annotations

import pytest

from tests.backend_steps import Driver

LENS = [5, 30, 77]


def _decode_reads(name: str, **opts: object) -> tuple[Driver, float]:
    d = Driver(name, block_size=8, options=dict(opts))
    seqs = [d.add(n) for n in LENS]
    d.step([(s, s.num_prompt_tokens) for s in seqs])
    d.step([(s, 1) for s in seqs])
    reads = d.read_bytes_per_token()
    assert reads is not None
    return d, reads


def _mean(xs: list[int]) -> float:
    return sum(xs) / len(xs)


def test_paged_reads_the_whole_context() -> None:
    d, reads = _decode_reads("paged", kernel="torch")
    assert reads == pytest.approx(_mean([n + 1 for n in LENS]) * d.be.bytes_per_slot())


def test_window_reads_its_window_and_sinks() -> None:
    d, reads = _decode_reads("sliding_window", window=16, sink_tokens=4, kernel="torch")
    seen = [min(n + 1, 16) + min(4, max(0, n + 1 - 16)) for n in LENS]
    assert reads == pytest.approx(_mean(seen) * d.be.bytes_per_slot())


def test_one_byte_cache_reads_values_scales_and_sinks() -> None:
    d, reads = _decode_reads("int8", sink_tokens=4, kernel="torch")
    lay = d.layout
    quant = 2 * lay.num_layers * lay.num_kv_heads * (lay.head_dim + 4)
    full = 2 * lay.num_layers * lay.num_kv_heads * lay.head_dim * 4
    assert reads == pytest.approx(_mean([(n + 1) * quant + min(n + 1, 4) * full
                                         for n in LENS]))


def test_kivi_reads_quantized_blocks_and_the_residual_in_full() -> None:
    d, reads = _decode_reads("kivi", bits=2, residual_blocks=4)
    lay = d.layout
    per_head_block = 8 * (2 * lay.head_dim * 2 // 8 + 4) + 2 * lay.head_dim * 2
    block = lay.num_layers * lay.num_kv_heads * per_head_block
    full = 2 * lay.num_layers * lay.num_kv_heads * lay.head_dim * 4
    assert reads == pytest.approx(_mean([(n + 1) // 8 * block + (n + 1) % 8 * full
                                         for n in LENS]))
