"""The calibrated cpu spec's pieces against hand counts: the GEMM profile's interpolation,
the gather path's reads, the step shapes they come from, and the fit recovering known
factors from steps a known spec timed."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from harness.backends import costs
from harness.backends.costs import KVCosts, LaneSums, QuantCosts
from harness.errors import UserError
from harness.roofline.hardware import (
    CALIBRATION,
    CPU_PRIOR,
    HARDWARE,
    HardwareSpec,
    load_cpu,
    spec_from_calibration,
)
from harness.roofline.models import MODEL_SPECS
from harness.roofline.shape import StepShape, step_shape
from harness.roofline.steptime import StepModel, profile_tau
from harness.roofline_tools.calibrate import Measured, bounded_lsq, fit, predict
from harness.sched.sequence import SamplingParams, Sequence, SequenceGroup
from harness.sched.step import ScheduledSeq, StepRecord

SMOL = MODEL_SPECS["smollm2-135m"]
FP32_BYTES = 2 * 30 * 3 * 64 * 4  # K and V, 30 layers, 3 KV heads of 64, fp32
PROFILE = {"dtype": "fp32", "rows": [1, 2, 4, 8],
           "layers_s_per_param": [2e-10, 3e-10, 3.2e-10, 4e-10],
           "lm_head_s_per_param": [2.5e-10, 5e-10, 4e-10, 5e-10]}


def cpu(**fit: float) -> HardwareSpec:
    return spec_from_calibration({"fit": fit, "profile": PROFILE,
                                  "measured": {"peak_flops_fp32": 1e11, "mem_bw": 1.6e10}})


def test_profile_tau_interpolates_and_extrapolates_like_a_brute_force_lookup() -> None:
    rows = np.array(PROFILE["rows"], dtype=float)
    tau = np.array(PROFILE["layers_s_per_param"])
    for m in [1, 2, 3, 4, 5, 7, 8, 16, 100]:
        if m in (1, 2, 4, 8):
            want = tau[list(rows).index(m)]
        elif m < 8:
            lo = max(r for r in rows if r < m)
            hi = min(r for r in rows if r > m)
            i, j = list(rows).index(lo), list(rows).index(hi)
            want = tau[i] + (tau[j] - tau[i]) * (m - lo) / (hi - lo)
        else:  # past the table: compute-bound, time per parameter grows with the rows
            want = tau[-1] * m / 8
        assert profile_tau(m, rows, tau) == pytest.approx(want)
    assert profile_tau(0, rows, tau) == 0.0  # no rows sampled: no lm_head
    arr = profile_tau(np.array([1.0, 3.0, 16.0]), rows, tau)
    assert list(arr) == pytest.approx([profile_tau(x, rows, tau) for x in (1, 3, 16)])


def test_profiled_gemms_and_the_gather_path_against_hand_counts() -> None:
    hw = cpu(eff_profile=0.5, eff_attn=0.25, eff_bw=0.5)
    m = StepModel(SMOL, hw, FP32_BYTES, "fp32", 4.0)
    w = m.work(tokens=3, rows=2, seqs=3, pairs=10.0, ctx_prefill=7, ctx_decode=50,
               pairs_full=14.0, gather_decode=64)
    t = m.time(w)
    tau3 = (3e-10 + 3.2e-10) / 2
    assert t.gemm == pytest.approx(SMOL.active_params * tau3 / 0.5)
    assert t.lm_head == pytest.approx(SMOL.vocab_size * SMOL.hidden_size * 5e-10 / 0.5)
    # Gather: the full pairs and the padded keys count; a key moves 2 x 4 B + 4 B per elem.
    fpp = 2 * 9 * (64 + 64) * 30
    assert w.pre_flops == fpp * 14 and w.dec_flops == fpp * 64
    assert w.dec_bytes == 64 * 3 * FP32_BYTES and w.pre_bytes == 7 * 3 * FP32_BYTES
    assert t.decode_attn == pytest.approx(fpp * 64 / (1e11 * 0.25)
                                          + 64 * 3 * FP32_BYTES / (1.6e10 * 0.5))
    # A quantized cache (1 B + a 4 B scale per head-token): stored 3x, compute dtype 4x.
    q = 2 * 30 * 3 * (64 + 4)
    mq = StepModel(SMOL, hw, q, "fp32", 4.0)
    assert mq.work(1, 1, 1, 0, 0, 10, 0, 16).dec_bytes == 16 * (3 * q + 4 * FP32_BYTES)
    # fp8's widening is software on a CPU: its measured seconds per element ride on top of
    # the bytes, for every gathered key's 2 x 30 x 3 x 64 elements; only a 1-byte cache's.
    hq = dataclasses.replace(hw, widen_s_per_elem={"fp8": 2e-9})
    wq = StepModel(SMOL, hq, q, "fp32", 4.0, kv_dtype="fp8").work(1, 1, 1, 0, 8, 10, 0, 16)
    assert wq.dec_bytes == 16 * (3 * q + 4 * FP32_BYTES)
    assert wq.dec_widen_s == pytest.approx(16 * 11520 * 2e-9)
    assert wq.pre_widen_s == pytest.approx(8 * 11520 * 2e-9)
    tq = StepModel(SMOL, hq, q, "fp32", 4.0, kv_dtype="fp8").time(wq)
    assert tq.decode_attn == pytest.approx(wq.dec_flops / (1e11 * 0.25)
                                           + wq.dec_bytes / (1.6e10 * 0.5) + wq.dec_widen_s)
    assert StepModel(SMOL, hq, q, "fp32", 4.0, kv_dtype="int8").work(  # not measured
        1, 1, 1, 0, 0, 10, 0, 16).dec_widen_s == 0.0
    assert StepModel(SMOL, hq, FP32_BYTES, "fp32", 4.0, kv_dtype="fp8").work(  # not 1-byte
        1, 1, 1, 0, 0, 10, 0, 16).dec_widen_s == 0.0
    # Another compute dtype than the profile's: the roofline, not the table.
    bf = StepModel(SMOL, hw, FP32_BYTES // 2, "bf16", 2.0).time(w)
    assert bf.gemm != pytest.approx(t.gemm)


def test_fused_hardware_ignores_the_gather_counts() -> None:
    m = StepModel(SMOL, HARDWARE["h100-sxm"], FP32_BYTES // 2)
    w = m.work(1, 1, 1, 10.0, 7, 50, pairs_full=99.0, gather_decode=999)
    assert w.dec_bytes == 50 * FP32_BYTES // 2 and w.pre_flops == m.attn_flops_per_pair * 10


def sched(n: int, start: int, sample: bool = True, prompt: int = 2) -> ScheduledSeq:
    g = SequenceGroup(0, [1] * prompt, SamplingParams())
    seq = Sequence(0, g, [1] * prompt)
    seq.token_ids += [1] * max(0, start + n - prompt)  # outputs so far
    seq.num_computed = start + n
    return ScheduledSeq(seq, start, n, list(range(n)), sample)


class Held:
    """Every computed token held (a manager without eviction)."""

    def held_tokens(self, seq: Sequence) -> int:
        return seq.num_computed


def test_step_shape_counts_padded_decodes_and_full_prefill_pairs() -> None:
    rec = StepRecord(0, [sched(1, 40), sched(1, 3), sched(5, 10, prompt=15)],
                     num_prefill_tokens=5, num_decode_tokens=2)
    sh = step_shape(rec, KVCosts(FP32_BYTES, 16), Held())
    # Decodes at 41 and 4 keys: both gathered to the widest table, 3 blocks of 16.
    assert sh.ctx_decode == 45 and sh.gather_decode == 2 * 48
    assert sh.pairs_full == 5 * 15 and sh.pairs == 5 * (10 + 3) and sh.ctx_prefill == 15
    assert sh.dec_bytes == 45 * FP32_BYTES and sh.pre_bytes == 15 * FP32_BYTES
    contiguous = KVCosts(FP32_BYTES)  # no block granule: a range gathers its context
    assert step_shape(rec, contiguous, Held()).gather_decode == 2 * 41
    assert StepShape(1, 1, 0, 0, 1, 1, [sched(1, 0)]).rows == 1


def test_a_prompts_last_token_alone_is_prefill_in_the_step_shape() -> None:
    # A 1-token chunk at the prompt's last position (prompt 41): prefill, not a decode.
    rec = StepRecord(0, [sched(1, 40, prompt=41)], num_prefill_tokens=1)
    sh = step_shape(rec, KVCosts(FP32_BYTES, 16), Held())
    assert sh.num_decode == 0 and sh.ctx_decode == 0 and sh.pairs == 41
    assert sh.reads.decode_queries == 0 and sh.reads.prefill_pairs == 41


def lane_sums(ctxs: list[int], split: int | None, bs: int = 16) -> LaneSums:
    over = [c for c in ctxs if split is not None and c > split]
    return LaneSums(len(ctxs), sum(ctxs), max(ctxs),
                    tuple(sum(c % bs == r for c in ctxs) for r in range(bs)),
                    len(over), sum(over), tuple(sum(c % bs == r for c in over)
                                                for r in range(bs)))


@pytest.mark.parametrize("costs", [KVCosts(FP32_BYTES, 16), KVCosts(FP32_BYTES),
                                   QuantCosts(130, 512, 16, 4), costs.KIVICosts(900, 512, 16, 4096),
                                   costs.QuestCosts(700, 96, 16, 32),
                                   costs.WindowCosts(FP32_BYTES, 16, 30, 4)],
                         ids=["paged", "range", "fp8", "kivi", "quest", "window"])
@pytest.mark.parametrize("ctxs", [[41, 4, 17, 16], [16, 32, 4], [15, 31, 47, 5, 33, 49, 64],
                                  [32, 33, 48, 80, 81, 96, 97]])
def test_decode_lane_sums_shape_a_step_as_its_listed_decodes(
        costs: KVCosts, ctxs: list[int]) -> None:
    """Decode-lane members (harness/roofline/fastpath) reach the step shape as a count and
    their contexts' sum, max and remainders: the same shape as those decodes listed one
    by one."""
    prefill = sched(5, 10, prompt=15)
    listed = StepRecord(0, [*(sched(1, c - 1) for c in ctxs), prefill],
                        num_prefill_tokens=5, num_decode_tokens=len(ctxs))
    summed = StepRecord(0, [prefill], num_prefill_tokens=5, num_decode_tokens=len(ctxs),
                        lane_n=len(ctxs), lane_sums=lane_sums(ctxs, costs.lane_split()))
    a, b = step_shape(listed, costs, Held()), step_shape(summed, costs, Held())
    for k in ("tokens", "seqs", "pairs", "ctx_prefill", "ctx_decode", "num_decode", "rows",
              "pairs_full", "gather_decode", "dec_bytes", "pre_bytes", "reads"):
        assert getattr(a, k) == getattr(b, k), k


def test_bounded_lsq_recovers_coefficients_and_respects_bounds() -> None:
    rng = np.random.default_rng(0)
    a = rng.uniform(0.1, 1.0, (200, 3))
    assert bounded_lsq(a, a @ np.array([2.0, 0.5, 3.0]), np.zeros(3)) == \
        pytest.approx([2.0, 0.5, 3.0], rel=1e-9)
    # A true coefficient under its bound comes back at the bound.
    x = bounded_lsq(a, a @ np.array([2.0, 0.1, 3.0]), np.array([0.0, 0.4, 0.0]))
    assert x[1] == pytest.approx(0.4) and x[0] > 0 and x[2] > 0


def test_fit_recovers_the_factors_of_a_known_spec() -> None:
    truth = cpu(eff_profile=0.8, eff_attn=0.3, eff_bw=0.4, step_overhead_s=2e-3,
                per_seq_overhead_s=50e-6)
    rng = np.random.default_rng(1)
    shapes = []
    for _ in range(60):  # decode batches and prefill chunks of assorted sizes
        nd, pre = int(rng.integers(1, 17)), int(rng.integers(0, 300))
        shapes.append(StepShape(nd + pre, nd + (pre > 0), pre * 100.0, 100.0 + pre,
                                nd * 200.0, nd, [None] * (nd + (pre > 0)),  # type: ignore[list-item]
                                pre * (100.0 + pre), nd * 256.0))
    m = Measured("synthetic", [], shapes, np.zeros(len(shapes)), 100, FP32_BYTES)
    m.step_s = predict(m, truth)
    got = fit([m], cpu())
    for k in ("eff_profile", "eff_attn", "eff_bw", "step_overhead_s", "per_seq_overhead_s"):
        assert getattr(got, k) == pytest.approx(getattr(truth, k), rel=1e-6), k
    assert got.source == "calibrated"


def test_the_committed_calibration_loads_and_a_broken_one_says_what_to_do(
        tmp_path: Path) -> None:
    hw = load_cpu()
    report = json.loads(CALIBRATION.read_text())
    assert hw.source == "calibrated" and hw.attention == "gather" and hw.profiled("float32")
    assert hw.eff_profile == report["fit"]["eff_profile"]
    assert report["summary"]["held_out_step_mdape_pct"] > 0  # measured, not a placeholder
    bad = tmp_path / "cal.json"
    bad.write_text(json.dumps({"profile": PROFILE}))
    with pytest.raises(UserError, match=r"rerun python -m harness\.roofline_tools\.calibrate"):
        load_cpu(bad)
    assert load_cpu(tmp_path / "absent.json") == CPU_PRIOR
    with pytest.raises(UserError, match="attention must be one of"):
        dataclasses.replace(CPU_PRIOR, attention="sparse")


def test_the_profile_times_the_models_own_gemms() -> None:
    import torch

    from harness.model.tiny import TINY_PRESETS, build_tiny
    from harness.roofline.profile import kv_dtype_of, profile_gemms, weights_of

    model, _ = build_tiny(next(iter(TINY_PRESETS)))
    layers, head = weights_of(model)
    c = model.config
    per_layer = (c.q_size + 2 * c.kv_size) * c.hidden_size + c.q_size * c.hidden_size \
        + 3 * c.intermediate_size * c.hidden_size  # qkv, o, gate_up, down
    assert sum(w.numel() for w in layers) == c.num_layers * per_layer
    assert head.shape == (c.vocab_size, c.hidden_size)
    prof = profile_gemms(model, repeats=1, rows=(1, 2, 4))
    assert prof.rows == [1, 2, 4] and prof.dtype == "fp32"
    assert all(t > 0 for t in [*prof.layers_s_per_param, *prof.lm_head_s_per_param])
    assert prof.peak_flops > 0 and prof.mem_bw > 0
    assert set(prof.widen_s_per_elem) == {"int8", "fp8"}
    assert kv_dtype_of(SimpleNamespace(cache_dtype=torch.float8_e4m3fn)) == "fp8"
    assert kv_dtype_of(SimpleNamespace(cache_dtype=torch.float32)) == ""
    assert kv_dtype_of(SimpleNamespace()) == ""


def test_fit_recovers_a_gpu_spec_where_each_attention_term_is_a_max() -> None:
    # A fused GPU spec (overlap 1: max(compute, memory)) with a GEMM profile: prefill
    # attention compute-bound, decode memory-bound; the fit must find which side binds.
    llama = MODEL_SPECS["llama-3.1-8b"]
    prof = {**PROFILE, "dtype": "bf16", "layers_s_per_param": [1e-13, 1.1e-13, 1.2e-13, 2e-13],
            "lm_head_s_per_param": [1e-13, 1.2e-13, 1.3e-13, 2.1e-13]}
    prior = spec_from_calibration({"fit": {}, "profile": prof}, HARDWARE["h200"])
    truth = dataclasses.replace(prior, eff_profile=0.9, eff_attn=0.6, eff_bw=0.85,
                                step_overhead_s=3e-3, per_seq_overhead_s=20e-6)
    rng = np.random.default_rng(2)
    shapes = []
    for i in range(80):
        nd = int(rng.integers(1, 64))
        pre = int(rng.integers(256, 2048)) if i % 3 == 0 else 0
        ctx = float(rng.integers(200, 4000))
        pairs = pre * (ctx + pre / 2)
        shapes.append(StepShape(nd + pre, nd + (pre > 0), pairs, ctx + pre, nd * ctx, nd,
                                [None] * (nd + (pre > 0)), pairs, nd * ctx))  # type: ignore[list-item]
    kv = llama.num_layers * llama.kv_elems_per_layer * 2
    m = Measured("synthetic", [], shapes, np.zeros(len(shapes)), 100, kv, arch=llama,
                 compute="bf16", weight_bytes=2.0)
    m.step_s = predict(m, truth)
    w = m.work(StepModel(llama, truth, kv, "bf16", 2.0))
    fa, bw = 989e12 * 0.6, 4.8e12 * 0.85
    assert (w.pre_flops / fa > w.pre_bytes / bw)[w.pre_flops > 0].all()  # compute-bound
    assert (w.dec_bytes / bw > w.dec_flops / fa).all()  # memory-bound
    got = fit([m], prior)
    for k in ("eff_profile", "eff_attn", "eff_bw", "step_overhead_s", "per_seq_overhead_s"):
        assert getattr(got, k) == pytest.approx(getattr(truth, k), rel=1e-6), k


def test_the_gpu_calibration_runs_end_to_end_on_the_cpu_as_the_dry_target(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import harness.roofline.hardware as hardware
    from harness.roofline.hardware import calibration_path, get_hardware
    from harness.roofline_tools.calibrate import calibrate
    from harness.roofline_tools.targets import TARGETS

    # The spec's own file (so the held-out replay under executor=roofline reads it), here.
    monkeypatch.setattr(hardware, "CALIBRATION", tmp_path / "cpu_calibration.json")
    out = calibration_path("h200")
    assert out == tmp_path / "h200_calibration.json"
    report = calibrate(TARGETS["dry"], 1, out)
    assert report["target"] == "h200" and set(report["fit"]) == {
        "eff_profile", "eff_attn", "eff_bw", "step_overhead_s", "per_seq_overhead_s"}
    (held,) = report["held_out"].values()
    assert held["steps"] > 0 and held["roofline_run_steps"] == held["steps"]
    assert held["attention"] == "gather"  # the torch path ran, whatever the spec says
    assert held["roofline_run_throughput"] == pytest.approx(held["throughput_pred"])
    spec = get_hardware("h200")  # now read from the file just written
    assert spec.source == "calibrated" and spec.attention == "fused" and spec.overlap == 1.0
    assert spec.profiled("float32") and spec.eff_profile == report["fit"]["eff_profile"]
    assert spec.peak_flops["bf16"] == HARDWARE["h200"].peak_flops["bf16"]  # not measured


def test_every_calibration_run_of_every_target_composes_and_validates() -> None:
    from harness.config import run_config
    from harness.roofline_tools.calibrate import compose
    from harness.roofline_tools.targets import TARGETS

    for t in TARGETS.values():
        assert t.train and t.held_out and not set(t.train) & set(t.held_out)
        for overrides in [*t.train.values(), *t.held_out.values()]:
            rc = run_config(compose([*t.base, *overrides]))
            assert rc.quality.enabled is False, overrides
            assert getattr(rc.workload, "rate", 0.0) == 0.0, overrides  # all at once


def test_roofline_attention_can_be_forced_and_gather_costs_more_on_a_gpu_spec() -> None:
    from harness.runner import run
    from tests.compose import compose_cfg

    base = ["executor=roofline", "cache.kv_budget=auto", "roofline.hardware=h100-sxm",
            "workload=random", "workload.num_requests=16", "workload.input_max=512"]
    fused = run(compose_cfg(base)).metrics
    gather = run(compose_cfg([*base, "roofline.attention=gather"])).metrics
    assert fused["sched.steps"] == gather["sched.steps"]  # the same schedule, all at t=0
    assert gather["roofline.decode_attn_s"] > 2 * fused["roofline.decode_attn_s"]
    assert gather["roofline.gemm_s"] == fused["roofline.gemm_s"]
    with pytest.raises(UserError, match=r"unknown roofline\.attention 'sparse'"):
        run(compose_cfg([*base, "roofline.attention=sparse"]))


def test_repeats_that_disagree_on_the_schedule_are_left_out() -> None:
    from harness.roofline_tools.calibrate import agreeing

    def r(steps: int, tokens: int, tag: float) -> tuple:  # type: ignore[type-arg]
        return ([], [tag] * steps, tokens, tag, 0, "", "")

    runs = [r(5, 40, 1.0), r(6, 41, 2.0), r(5, 40, 3.0)]
    assert [x[3] for x in agreeing(runs)] == [1.0, 3.0]  # type: ignore[arg-type]
    assert [x[3] for x in agreeing(runs[:2])] == [1.0]  # a tie: the first's schedule
