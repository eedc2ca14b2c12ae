"""MoE expert GEMMs from published kernel tables (issue #53): the Hopper and A100 specs' MoE
kernel profiles are the fits of harness/roofline_tools/data/moe and DeepGEMM's grouped
table, and the step model at each table row's shape gives the table's time within that
fit's error."""

from __future__ import annotations

import csv
import math

import numpy as np
import pytest

from harness.roofline.arch import ArchSpec
from harness.roofline.config import WEIGHT_BYTES, RooflineConfig, weights_bytes
from harness.roofline.hardware import AMPERE_MOE, HARDWARE, HOPPER_MOE, get_hardware
from harness.roofline.models import MODEL_SPECS
from harness.roofline.steptime import StepModel, expert_load, mean_busy_tokens, moe_kind
from harness.roofline_tools import kernel_fit

PROFILES = {"hopper": HOPPER_MOE, "ampere": AMPERE_MOE}


@pytest.fixture(scope="module")
def fit() -> dict:
    return {f: kernel_fit.fit_moe(f) for f in PROFILES}


def test_moe_profiles_are_the_tables_fit(fit: dict) -> None:
    # The constants in hardware.py are what `kernel_fit --moe` derives from the CSVs:
    # a table edited, or a constant hand-tuned, fails here.
    for family, consts in PROFILES.items():
        assert set(fit[family]) == set(consts), family
        for kind, (t0, buckets) in consts.items():
            got = fit[family][kind]
            assert got["t0_s"] == pytest.approx(t0, abs=1e-9), (family, kind)
            assert [tuple(b) for b in got["buckets"]] == [tuple(map(float, b))
                                                         for b in buckets], (family, kind)
    # The fits' residuals as hardware.py's comment states them (median, worst %).
    stated = {("hopper", "bf16"): (1.4, 10.8), ("hopper", "fp8"): (5.4, 51.4),
              ("hopper", "fp8_block"): (7.4, 18.7), ("ampere", "bf16"): (9.7, 18.2)}
    for (family, kind), errs in stated.items():
        got = fit[family][kind]
        assert (got["median_err_pct"], got["worst_err_pct"]) == errs, (family, kind)
    # Block-wise FP8 has no row between 2 and 256 tokens per expert: a gap, filled from
    # its nearest bucket, and said so.
    assert fit["hopper"]["fp8_block"]["filled"] == [2.0, 4.0, 16.0, 64.0]
    for name in ("h100-sxm", "h200"):
        assert HARDWARE[name].moe_profile == HOPPER_MOE, name
    for name in ("a100-80gb", "a100-40gb"):
        assert HARDWARE[name].moe_profile == AMPERE_MOE, name


def _fused_rows() -> list[dict[str, str]]:
    with open(kernel_fit.MOE_TABLE, newline="") as f:
        return list(csv.DictReader(f))


def test_step_model_reproduces_every_fused_moe_row_within_the_fit(fit: dict) -> None:
    # Brute force through the step model itself: one MoE layer of each row's shape
    # (experts, top-k, hidden, intermediate, tensor-parallel degree) on the spec of the
    # card it ran on, its routed experts' seconds at the row's token count.
    errs: dict[tuple[str, str], list[float]] = {}
    for r in _fused_rows():
        e, k, h, inter, tp = (int(r[c]) for c in ("experts", "topk", "hidden", "inter", "tp"))
        arch = ArchSpec(f"moe-{r['model']}", 1, h, 1000, 8, 8, 64, 64, 64, 0, 4096,
                        expert_params=3 * h * inter * e, num_experts=e,
                        experts_per_token=k, fp8_block_scaled=r["kind"] == "fp8_block")
        fp8 = r["kind"] != "bf16"
        m = StepModel(arch, get_hardware(kernel_fit.MOE_CARDS[r["gpu"]]), 1024, tp=tp,
                      weight_bytes=1.0 if fp8 else 2.0, gemm_dtype="fp8" if fp8 else "")
        t = m._expert_s(float(r["tokens"]), m.hw, False)
        got = abs(t / (float(r["time_us"]) * 1e-6) - 1)
        errs.setdefault((kernel_fit.MOE_FAMILY[r["gpu"]], r["kind"]), []).append(got)
    for (family, kind), a in errs.items():
        # Every fused row within the kind's worst, and their median no worse than the
        # whole fit's (DeepGEMM's rows included) by more than rounding.
        assert max(a) * 100 <= fit[family][kind]["worst_err_pct"] + 0.1, (family, kind)
        assert np.median(a) * 100 <= fit[family][kind]["median_err_pct"] + 2.0, kind


def test_mixtral_one_token_by_hand() -> None:
    # Mixtral-8x7B at TP2, one token: its 2 experts each read 3 x 4096 x 7168 bf16
    # weights on one H100 (3.35 TB/s), at the bf16 profile's share for one token per
    # expert, after the fused kernel's floor: 18.5 us + 2 x 176.2 MB / 3.35 TB/s / 0.86
    # = 140.8 us (vLLM's table: 144.03 us).
    a = ArchSpec("mixtral-layers", 32, 4096, 32000, 32, 8, 128, 128, 128, 0, 32768,
                 expert_params=32 * 8 * 3 * 4096 * 14336, num_experts=8, experts_per_token=2)
    m = StepModel(a, get_hardware("h100-sxm"), 1024, tp=2)
    per_layer = m._expert_s(1.0, m.hw, False) / a.num_layers
    by_hand = 18.5e-6 + 2 * 3 * 4096 * 7168 * 2 / 3.35e12 / 0.86
    assert per_layer == pytest.approx(by_hand, rel=1e-9)
    assert per_layer == pytest.approx(144.03e-6, rel=0.03)


def test_mxfp4_experts_are_weight_only_at_the_bf16_kernels_share() -> None:
    # gpt-oss-120b's MXFP4 experts on Hopper: 4.25 bits a weight read, bf16 compute,
    # the bf16 kernels' profile (a prior: no published W4A16 MoE table).
    a, h = MODEL_SPECS["gpt-oss-120b"], get_hardware("h100-sxm")
    m = StepModel(a, h, 1024, weight_bytes=WEIGHT_BYTES["mxfp4"])
    assert m.moe_kind == "w4a16" and h.moe_kernels("w4a16") == HOPPER_MOE["bf16"]
    t0, buckets = HOPPER_MOE["bf16"]
    per = a.expert_params / a.num_experts
    by_hand = a.num_layers * t0 + 4 * per * 4.25 / 8 / h.mem_bw / buckets[0][1]
    assert m._expert_s(1.0, h, False) == pytest.approx(by_hand, rel=1e-9)
    # A spec without a profile keeps the dense GEMM shares (the L40S).
    assert get_hardware("l40s").moe_kernels("w4a16") is None


def test_gpt_oss_keeps_its_dense_path_in_bf16() -> None:
    # gpt-oss's MXFP4 checkpoint quantizes the experts alone (modules_to_not_convert:
    # attention, router, embeddings, lm_head). Its weights then come to the checkpoint's
    # size: llama.cpp's GGUF of gpt-oss-120b (108 mxfp4 tensors, 146 bf16) is 60.87 GiB
    # (ollama/ollama#16416's load log, 2026); with every linear layer at MXFP4 the
    # what-if said 59.4 GiB, 2.5% short.
    a = MODEL_SPECS["gpt-oss-120b"]
    cfg = RooflineConfig(model="gpt-oss-120b", weight_dtype="mxfp4")
    assert weights_bytes(a, cfg) / 2**30 == pytest.approx(60.87, rel=0.005)
    # A decode step reads the dense path's weights at 2 bytes, the experts' at 4.25 bits.
    m = StepModel(a, get_hardware("h100-sxm"), 1024, weight_bytes=WEIGHT_BYTES["mxfp4"])
    assert m.work(1, 1, 1, 0.0, 0.0, 1.0).gemm_bytes == pytest.approx(2.0 * a.dense_params)
    # A dense model's quantized checkpoint quantizes its linear layers (no exception).
    llama = MODEL_SPECS["llama-3.1-8b"]
    assert not llama.experts_only_quant and llama.dense_weight_bytes(0.5) == 0.5


@pytest.mark.parametrize("dtype,wb,block,kind", [
    ("bf16", 2.0, False, "bf16"), ("fp8", 1.0, False, "fp8"), ("fp8", 1.0, True, "fp8_block"),
    ("bf16", WEIGHT_BYTES["mxfp4"], False, "w4a16"), ("bf16", 0.5, False, "w4a16"),
    ("bf16", 1.0, False, "w8a16"), ("fp4", WEIGHT_BYTES["nvfp4"], False, "fp4")])
def test_moe_kind(dtype: str, wb: float, block: bool, kind: str) -> None:
    assert moe_kind(dtype, wb, block) == kind


@pytest.mark.parametrize("tokens,experts,k", [(1, 128, 4), (7, 8, 2), (300, 256, 8),
                                             (4096, 128, 8)])
def test_mean_busy_tokens_is_the_binomials_conditional_mean(tokens: int, experts: int,
                                                             k: int) -> None:
    counts, prob = expert_load(tokens, experts, k)
    busy = counts > 0
    brute = float(np.dot(counts[busy], prob[busy]) / prob[busy].sum())
    assert mean_busy_tokens(tokens, experts, k) == pytest.approx(brute, rel=1e-9)
    assert not math.isnan(brute)
