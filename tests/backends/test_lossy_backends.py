"""fp8 / int8 / sliding_window: each checked against a plain reference on random inputs,
and their memory accounting checked against the allocator's."""

from __future__ import annotations

import pytest
import torch

from harness.backends import get_backend
from harness.backends.attention_ref import attend_chunk, attend_decode
from harness.backends.base import CacheSizing, KVLayout
from harness.engine.batch import build_inputs
from harness.kernels.reference import dequantize_ref, quantize_ref
from harness.kv.base import Demand
from harness.runner import run
from harness.sched.sequence import SamplingParams, SeqStatus, Sequence, SequenceGroup
from harness.sched.step import ScheduledSeq, StepRecord
from tests.compose import tiny

CPU = torch.device("cpu")
LAYOUT = KVLayout(num_layers=1, num_kv_heads=2, head_dim=32, dtype=torch.float32)
BS = 8


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_quantize_round_trip_within_format_error(dtype: torch.dtype) -> None:
    x = torch.randn(64, 4, 32) * torch.logspace(-2, 2, 64).view(64, 1, 1)
    stored, scale = quantize_ref(x, dtype)
    back = dequantize_ref(stored, scale)
    amax = x.abs().amax(-1, keepdim=True)
    err = (back - x).abs()
    if dtype == torch.int8:
        assert (err <= scale.unsqueeze(-1) / 2 + 1e-6 * amax).all()  # half a step
    else:
        # e4m3: 3 mantissa bits -> relative error <= 2^-4 on normals; subnormals (below
        # 2^-6 of the scaled range) are off by at most half their spacing 2^-9 * scale.
        bound = torch.maximum(x.abs() * 2.0**-4, scale.unsqueeze(-1) * 2.0**-10)
        assert (err <= bound + 1e-6 * amax).all()
    assert (back.abs() <= amax * (1 + 1e-6)).all()


def _backend(name: str, num_blocks: int = 32, **opts: object):  # type: ignore[no-untyped-def]
    be = get_backend(name)(LAYOUT, CPU, block_size=BS, **opts)
    sizing = CacheSizing(kv_budget_bytes=0, bytes_per_slot=be.bytes_per_slot(),
                         num_slots=num_blocks * BS, block_size=BS, num_blocks=num_blocks,
                         num_cpu_blocks=0)
    kv = be.make_manager(sizing, enable_prefix_caching=False, watermark=0.0)
    be.allocate(sizing)
    return be, kv


def _prefill_then_decode(name: str, lens: list[int], **opts: object):  # type: ignore[no-untyped-def]
    """Prefill random K/V for sequences of ``lens`` tokens, then one decode step; returns
    the backend, the step's q, its output, and each sequence's full K/V and table."""
    torch.manual_seed(0)
    be, kv = _backend(name, **opts)
    seqs = []
    for i, n in enumerate(lens):
        g = SequenceGroup(i, [1] * n, SamplingParams())
        s = Sequence(i, g, [1] * (n + 1))
        s.status = SeqStatus.RUNNING
        g.seqs.append(s)
        seqs.append(s)
    full_k = {s.seq_id: torch.randn(len(s.token_ids), 2, 32) for s in seqs}
    full_v = {s.seq_id: torch.randn(len(s.token_ids), 2, 32) for s in seqs}
    # Prefill: one chunk per sequence.
    rec = StepRecord(0)
    for s, n in zip(seqs, lens):
        rec.seqs.append(ScheduledSeq(s, 0, n, kv.allocate_group([Demand(s, n)])[0], True))
        s.num_computed = n
    inputs = build_inputs(rec, kv, CPU)
    be.begin_step(inputs.attn)
    k = torch.cat([full_k[s.seq_id][:n] for s, n in zip(seqs, lens)])
    v = torch.cat([full_v[s.seq_id][:n] for s, n in zip(seqs, lens)])
    be.attend(0, torch.randn(len(k), 4, 32), k, v)
    # Decode: token n of every sequence.
    rec = StepRecord(1)
    for s, n in zip(seqs, lens):
        rec.seqs.append(ScheduledSeq(s, n, 1, kv.allocate_group([Demand(s, 1)])[0], True))
        s.num_computed = n + 1
    inputs = build_inputs(rec, kv, CPU)
    be.begin_step(inputs.attn)
    q = torch.randn(len(seqs), 4, 32)
    k = torch.stack([full_k[s.seq_id][n] for s, n in zip(seqs, lens)])
    v = torch.stack([full_v[s.seq_id][n] for s, n in zip(seqs, lens)])
    out = be.attend(0, q, k, v)
    return be, kv, q, out, seqs, full_k, full_v


@pytest.mark.parametrize("name", ["int8", "fp8"])
@pytest.mark.parametrize("sinks", [0, 4])
def test_quantized_attention_equals_attention_over_dequantized_cache(name: str,
                                                                     sinks: int) -> None:
    lens = [1, 7, 8, 20]  # one token, mid-block, on a boundary, several blocks
    be, _, q, out, seqs, fk, fv = _prefill_then_decode(name, lens, sink_tokens=sinks)
    dt = be.cache_dtype
    for i, (s, n) in enumerate(zip(seqs, lens)):
        k = dequantize_ref(*quantize_ref(fk[s.seq_id][:n + 1], dt))
        v = dequantize_ref(*quantize_ref(fv[s.seq_id][:n + 1], dt))
        k[:sinks], v[:sinks] = fk[s.seq_id][:sinks], fv[s.seq_id][:sinks]
        ref = attend_decode(q[i:i + 1], k[None], v[None], torch.tensor([n + 1]))
        torch.testing.assert_close(out[i:i + 1], ref, atol=1e-5, rtol=1e-5)
        exact = attend_decode(q[i:i + 1], fk[s.seq_id][None, :n + 1],
                              fv[s.seq_id][None, :n + 1], torch.tensor([n + 1]))
        assert (out[i:i + 1] - exact).abs().max() < 0.15  # lossy, but close


@pytest.mark.parametrize("window,sinks", [(5, 0), (9, 4), (16, 2)])
def test_sliding_window_equals_dense_window_attention_and_frees_blocks(window: int,
                                                                       sinks: int) -> None:
    lens = [3, 12, 30]
    _, kv, q, out, seqs, fk, fv = _prefill_then_decode("sliding_window", lens,
                                                        window=window, sink_tokens=sinks)
    for i, (s, n) in enumerate(zip(seqs, lens)):
        ref = attend_chunk(q[i:i + 1], fk[s.seq_id][:n + 1], fv[s.seq_id][:n + 1], n,
                           window=window, sinks=sinks)
        torch.testing.assert_close(out[i:i + 1], ref, atol=1e-5, rtol=1e-5)
    kv.observe(seqs, None)
    keep_first = -(-sinks // BS)
    for s in seqs:
        # Blocks whose last token is before the next query's window are gone, sinks stay.
        table = kv.table_of(s)
        gone = [i for i, b in enumerate(table) if b < 0]
        dead = [i for i in range(len(table))
                if i >= keep_first and (i + 1) * BS <= s.num_computed + 1 - window]
        assert gone == dead


def test_sliding_window_memory_stays_bounded() -> None:
    r = run(tiny("backend=sliding_window", "backend.window=32", "backend.sink_tokens=4",
                 "backend.block_size=8", "workload.conversations=1", "workload.turns=1",
                 "workload.answer_tokens=96", "workload.ignore_eos=true",
                 "cache.enable_prefix_caching=false"))
    # One sequence: at most the sink block + ceil(window / bs) + 1 blocks once it runs.
    per_slot = r.metrics["memory.kv_budget_bytes"] // r.metrics["memory.token_capacity"]
    bound = (1 + 32 // 8 + 1 + 1) * 8 * per_slot  # + 1 block in flight during a step
    late = [s.reserved_bytes for s in r.steps[5:]]
    assert max(late) <= bound
    assert r.metrics["cache.evicted_tokens"] > 0
    # steps.csv shows reserved bytes falling while the sequence still runs.
    st = r.steps
    assert any(st[i].reserved_bytes < st[i - 1].reserved_bytes for i in range(1, len(st) - 1))


def test_one_byte_backends_hold_the_byte_ratio_of_tokens() -> None:
    caps = {b: run(tiny(f"backend={b}")).metrics["memory.token_capacity"]
            for b in ("paged", "int8", "fp8")}
    # tiny: head_dim 16 -> fp32 64 bytes per (token, head) vs 16 + a 4-byte scale.
    assert caps["int8"] == caps["fp8"]
    assert caps["int8"] / caps["paged"] == pytest.approx(64 / 20, rel=0.02)


@pytest.mark.parametrize("backend", ["paged", "contiguous"])
def test_exact_backends_have_reference_quality(backend: str) -> None:
    extra = ["backend.reserve=exact"] if backend == "contiguous" else []
    m = run(tiny(f"backend={backend}", *extra, "quality.enabled=true",
                 "quality.text_tokens=96", "quality.prefill_tokens=16")).metrics
    assert abs(m["quality.ppl_delta_pct"]) < 1e-3
    assert m["quality.top1_agreement"] == 1.0 and m["quality.kl_mean"] < 1e-6
    assert m["quality.gen_exact_match_rate"] == 1.0


def test_lossy_backend_quality_is_measured_not_assumed() -> None:
    m = run(tiny("backend=sliding_window", "backend.window=24", "backend.sink_tokens=0",
                 "quality.enabled=true", "quality.text_tokens=96",
                 "quality.prefill_tokens=16", "quality.generation_agreement=false")).metrics
    assert m["quality.kl_mean"] > 0.01 and m["quality.top1_agreement"] < 1.0


# ~20 s a case under the interpreter: int8 (the quantizing store and its scales) in the
# default run; the window's bound with -m slow (its decode kernel is the paged one).
@pytest.mark.parametrize("backend", ["int8", pytest.param("sliding_window",
                                                          marks=pytest.mark.slow)])
def test_triton_path_gives_the_torch_path_tokens(backend: str) -> None:
    # Under TRITON_INTERPRET (tests/conftest.py): the kernels' scales and window bound.
    extra = ["backend.window=48"] if backend == "sliding_window" else []
    common = (f"backend={backend}", *extra, "workload.conversations=2")
    torch_run = run(tiny(*common, "backend.kernel=torch"))
    triton_run = run(tiny(*common, "backend.kernel=triton"))
    assert triton_run.metrics["run.kernel"] == "triton"
    assert triton_run.outputs == torch_run.outputs


def test_streaming_llm_is_sliding_window_with_4_sinks_by_name() -> None:
    common = ("backend.block_size=8", "workload.answer_tokens=48", "workload.ignore_eos=true")
    s = run(tiny("backend=streaming_llm", "backend.window=32", *common))
    w = run(tiny("backend=sliding_window", "backend.window=32", "backend.sink_tokens=4",
                 *common))
    assert s.metrics["run.backend"] == "streaming_llm"
    assert s.outputs == w.outputs and s.metrics["cache.evicted_tokens"] > 0
