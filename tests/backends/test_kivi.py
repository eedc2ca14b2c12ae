"""kivi: every cached value dequantizes to, bit for bit, what a plain reference round
trip of KIVI's rule gives (keys per channel over a block's tokens, values per token,
asymmetric, float16 scale and zero); the partly filled last block reads back exactly
(full precision); its bytes are all charged; residual blocks are given back."""

from __future__ import annotations

import pytest
import torch

from harness.backends.attention_ref import attend_decode
from harness.backends.base import KVLayout
from harness.backends.kivi import KIVIBackend
from harness.backends.paged import PagedBackend
from harness.errors import UserError
from harness.runner import run
from harness.sched.sequence import Sequence
from harness.sched.step import StepRecord
from tests.backend_steps import CPU, Driver
from tests.compose import tiny

BS = 8


def _round_trip(group: torch.Tensor, bits: int) -> torch.Tensor:
    """KIVI's asymmetric quantization of one group (a 1-D tensor) and back."""
    qmax = 2**bits - 1
    lo, hi = float(group.min()), float(group.max())
    scale = torch.tensor((hi - lo) / qmax, dtype=torch.float32).half().float()
    zero = torch.tensor(lo, dtype=torch.float32).half().float()
    if scale == 0:
        return zero.expand_as(group).clone()
    codes = torch.clamp(torch.round((group - zero) / scale), 0, qmax)
    return codes * scale + zero


def _reference_block(k: torch.Tensor, v: torch.Tensor,
                     bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One full block, k and v (bs, KV, D): keys per (head, channel) over the block's
    tokens, values per (token, head) over the channels."""
    kr, vr = torch.empty_like(k), torch.empty_like(v)
    for h in range(k.shape[1]):
        for c in range(k.shape[2]):
            kr[:, h, c] = _round_trip(k[:, h, c], bits)
        for t in range(k.shape[0]):
            vr[t, h] = _round_trip(v[t, h], bits)
    return kr, vr


def _expected(d: Driver, s: Sequence, layer: int, bits: int,
              n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What the cache must read back for ``s``'s first ``n`` tokens."""
    k, v = d.k[s.seq_id][layer, :n], d.v[s.seq_id][layer, :n]
    ek, ev = k.clone(), v.clone()  # the partial last block: exact
    for b in range(n // BS):
        rows = slice(b * BS, (b + 1) * BS)
        ek[rows], ev[rows] = _reference_block(k[rows], v[rows], bits)
    return ek, ev


@pytest.mark.parametrize("bits,residual", [(2, 4), (4, 4), (2, 1)])
def test_cache_reads_back_a_reference_round_trip_bit_for_bit(bits: int,
                                                             residual: int) -> None:
    # residual=1: three sequences hold a partial block at once, so the pool grows.
    d = Driver("kivi", block_size=BS, options={"bits": bits, "residual_blocks": residual},
               seed=bits)
    a, b = d.add(29, max_tokens=12), d.add(8, max_tokens=12)
    # Chunks that start blocks, fill them from the residual, and write whole blocks.
    d.step([(a, 5), (b, 8)])
    d.step([(a, 11)])
    d.step([(a, 13)])
    child = Sequence(99, a.group, list(a.token_ids))  # a fork sharing a's partial block
    child.num_computed, child.num_prompt_tokens = a.num_computed, a.num_prompt_tokens
    d.kv.fork(a, child)
    d.k[99], d.v[99] = d.k[a.seq_id].clone(), d.v[a.seq_id].clone()
    d.k[99][:, 29:] = d.randn(*d.k[99][:, 29:].shape)  # its own next tokens
    d.v[99][:, 29:] = d.randn(*d.v[99][:, 29:].shape)
    for _ in range(5):  # decodes: a's and the child's copies of the block diverge
        out = d.step([(a, 1), (b, 1), (child, 1)])
    be = d.be
    assert isinstance(be, KIVIBackend)
    for layer in range(d.layout.num_layers):
        for s in (a, b, child):
            n = s.num_computed
            table = torch.tensor(d.kv.tables([s])[0])
            k, v = be.read_blocks(layer, table)
            ek, ev = _expected(d, s, layer, bits, n)
            assert torch.equal(k.flatten(0, 1)[:n], ek)
            assert torch.equal(v.flatten(0, 1)[:n], ev)
            # ... and the decode attended over exactly those values.
            row = out.rows[s.seq_id].start
            ref = attend_decode(out.q[layer][row:row + 1], ek[None], ev[None],
                                torch.tensor([n]))
            torch.testing.assert_close(out.out[layer][row:row + 1], ref, atol=1e-5,
                                       rtol=1e-5)
    # Every sequence freed: each residual block comes back (the step record's
    # invalidated slots name the dead partial blocks).
    for s in (a, b, child):
        d.kv.free(s)
    rec = StepRecord(0)
    rec.invalidated = d.kv.take_cache_ops().invalidated
    be.apply_cache_ops(rec)
    pool = be.residual
    assert pool.slab_of == {} and sorted(pool.free) == list(range(len(pool.k[0])))
    assert pool.peak == 3


def test_bytes_per_token_are_charged_and_give_4_to_8x_of_bf16() -> None:
    # SmolLM2-135M's geometry in bf16, block 16.
    lay = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)
    full = PagedBackend(lay, CPU, block_size=16).bytes_per_slot()
    two = KIVIBackend(lay, CPU, block_size=16, bits=2)
    four = KIVIBackend(lay, CPU, block_size=16, bits=4)
    # Per (token, head): 2-bit K and V codes (32 B) + value scale and zero (4 B) + a block's
    # share of the keys' per-channel scale and zero (64 x 2 x 2 / 16 = 16 B) = 52 B.
    assert two.bytes_per_slot() == 30 * 3 * 52
    assert four.bytes_per_slot() == 30 * 3 * 84
    assert full / two.bytes_per_slot() == pytest.approx(4.92, abs=0.01)
    assert full / four.bytes_per_slot() == pytest.approx(3.05, abs=0.01)
    # The residual blocks come off the budget first, in full precision.
    assert two.reserved_bytes() == 32 * 16 * full


def test_run_charges_the_residual_and_keeps_prefix_caching() -> None:
    r = run(tiny("backend=kivi", "backend.residual_blocks=4", "cache.kv_budget=1MiB"))
    m = r.metrics
    be = KIVIBackend(KVLayout(2, 2, 16, torch.float32), CPU, block_size=16,
                     residual_blocks=4)
    assert m["memory.token_capacity"] == \
        (2**20 - be.reserved_bytes()) // (be.bytes_per_slot() * 16) * 16
    assert m["run.prefix_caching"] is True and m["cache.prefix_hit_rate"] > 0
    assert m["requests.finished"] == len(r.requests)


def test_a_budget_the_residual_fills_says_which_option_to_lower() -> None:
    """Issue #59's refusal at 18 MiB: the residual pool (32 full-precision blocks by
    default) took the whole budget, and the message named only a bigger budget. It now
    names backend.residual_blocks too; with fewer residual blocks the same budget runs."""
    be = KIVIBackend(KVLayout(2, 2, 16, torch.float32), CPU, block_size=16)
    small = be.reserved_bytes() + 1024  # the residual, and less than one block besides
    with pytest.raises(UserError, match=r"backend\.residual_blocks=32 full-precision"):
        run(tiny("backend=kivi", f"cache.kv_budget={small}"))
    r = run(tiny("backend=kivi", "backend.residual_blocks=1", f"cache.kv_budget={small}"))
    assert r.metrics["requests.finished"] == len(r.requests) > 0
