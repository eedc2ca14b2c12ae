"""The what-if's physics (issue #52): memory as CUDA reports it, MLA prefill as the
engines run it, GEMMs by dtype from kernel profiles, MoE experts at their own token counts,
and a floor no step may beat: reading its bytes once at the datasheet's bandwidth."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pytest

from harness.errors import UserError
from harness.roofline.arch import ArchSpec
from harness.roofline.config import WEIGHT_BYTES, RooflineConfig, weights_bytes
from harness.roofline.hardware import HARDWARE, get_hardware
from harness.roofline.models import MODEL_SPECS
from harness.roofline.steptime import StepModel, expert_load
from harness.roofline_tools import kernel_fit
from harness.runner import run
from tests.compose import compose_cfg


def test_memory_is_what_cuda_reports_and_every_quantity_is_cited() -> None:
    # An 80 GB H100 is 79.11 GiB to CUDA (84.9e9 bytes), an H200 139.8 GiB (150.1e9):
    # taken as 80e9 and 141e9, batches the engines held did not fit the what-if.
    assert get_hardware("h100-sxm").mem_bytes == pytest.approx(84.94e9, rel=1e-3)
    assert get_hardware("h200").mem_bytes == pytest.approx(150.11e9, rel=1e-3)
    for h in HARDWARE.values():
        assert set(h.cited) == {"peaks", "mem_bw", "mem_bytes"}, h.name
        assert all(len(v) > 20 for v in h.cited.values()), h.name
        # Near the datasheet's "GB" (HBM's GiB less what the driver keeps; the L40S's
        # GDDR6 also keeps its ECC), never a round 1e9 multiple.
        nominal = {"h100-sxm": 80, "h200": 141, "a100-80gb": 80, "a100-40gb": 40,
                   "l40s": 48, "b200": 180}[h.name] * 1e9
        assert 0.95 * nominal < h.mem_bytes < 1.10 * nominal and h.mem_bytes % 10**9, h.name


@pytest.mark.parametrize("name,hw,tp,wdt", [
    ("llama-3.1-8b", "h100-sxm", 1, "bfloat16"), ("llama-3.1-8b", "h200", 1, "fp8"),
    ("llama-3.1-70b", "h100-sxm", 4, "bfloat16"), ("llama-3.1-70b", "a100-80gb", 8, "int8"),
    ("deepseek-v3", "h200", 8, "fp8"), ("gpt-oss-120b", "h100-sxm", 2, "fp8"),
    ("mistral-7b", "l40s", 1, "int4")])
def test_batch_one_decode_never_beats_reading_the_weights_and_kv_once(
        name: str, hw: str, tp: int, wdt: str) -> None:
    a, h = MODEL_SPECS[name], get_hardware(hw)
    wb = WEIGHT_BYTES[wdt]
    kvb = 2 * a.num_layers * a.kv_elems_per_layer
    m = StepModel(a, h, kvb, weight_bytes=wb, tp=tp,
                  gemm_dtype="fp8" if wdt == "fp8" else "")
    for ctx in (1, 4096, 100_000):
        t = m.time(m.work(1, 1, 1, 0.0, 0.0, float(ctx)))
        # One token reads the dense weights, its k experts, the lm_head and its keys once.
        routed = a.expert_params * a.experts_per_token / max(1, a.num_experts)
        floor = (wb * (a.dense_params + routed) + m.lm_weight_bytes * a.vocab_size
                 * a.hidden_size) / tp / h.mem_bw + ctx * kvb / m.kv_split / h.mem_bw
        assert t.forward >= floor, (name, hw, ctx, t.forward, floor)


def test_mla_prefill_is_priced_unabsorbed_by_hand_for_one_layer() -> None:
    # DeepSeek-V3, one layer, one chunk of n = 1000 tokens after s = 3000 cached:
    # pairs = n s + n (n + 1) / 2; un-absorbed q.k over 128 + 64 dims and values over
    # 128, for each of 128 heads, 2 FLOPs a multiply-add; and each cached latent
    # up-projected to 128 heads x (128 + 128) by kv_b_proj (512 in).
    a = MODEL_SPECS["deepseek-v3"]
    one = ArchSpec(**{**a.__dict__, "num_layers": 1, "name": "one-layer"})
    m = StepModel(one, get_hardware("h200"), 2 * one.kv_elems_per_layer)
    n, s = 1000, 3000
    pairs = n * s + n * (n + 1) / 2
    w = m.work(n, 1, 1, pairs, float(s + n), 0.0, pre_cached=float(s))
    assert w.pre_flops == 2 * 128 * (192 + 128) * pairs
    assert w.gemm_flops == 2 * one.dense_params * n + 2 * 512 * 128 * 256 * s
    # Decode stays absorbed: q.k over 512 + 64, values over the 512-dim latent.
    d = m.work(1, 1, 1, 0.0, 0.0, float(s))
    assert d.dec_flops == 2 * 128 * (576 + 512) * s


def test_mla_32k_prompt_prefill_attention_shrinks_3_4x() -> None:
    a, h = MODEL_SPECS["deepseek-v3"], get_hardware("h200")
    m = StepModel(a, h, 2 * a.num_layers * a.kv_elems_per_layer, weight_bytes=1.0, tp=8,
                  gemm_dtype="fp8")
    n = 32768
    t = m.time(m.work(n, 1, 1, n * (n + 1) / 2, float(n), 0.0))
    absorbed = 2 * 128 * (576 + 512) * a.num_layers / 8 * n * (n + 1) / 2
    assert t.prefill_attn < 0.35 * absorbed / (h.flops("bf16") * h.eff_attn)


def test_fp8_gemm_shares_are_their_kernel_profiles_fits() -> None:
    eg, eb, p, t0, _ = kernel_fit.fit_gemm("h100")
    assert eg == pytest.approx(0.70)  # Vidur's bf16 share, the spec's
    shares = kernel_fit.fp8_shares(eg, eb, p, t0)
    # Per-tensor / per-row scales: FP8 runs ~1.92x bf16 (FBGEMM, one H100, one run);
    # block-wise scales ~1.49x; DeepSeek's own block-wise table fits 0.50 of the peak.
    assert shares == {"fp8": 0.67, "fp8_block": 0.50, "fp8_block_check": 0.52}
    for name in ("h100-sxm", "h200"):
        h = get_hardware(name)
        assert h.gemm_eff("fp8") == shares["fp8"]
        assert h.gemm_eff("fp8", block_scaled=True) == shares["fp8_block"]
        assert h.gemm_eff("bf16", block_scaled=True) == pytest.approx(eg)
    _, rel = kernel_fit.fit_fp8(eb, p, t0)
    assert float(np.median(np.abs(rel))) < 0.2


def test_block_scaled_fp8_gemms_are_no_faster_than_the_profiles_best() -> None:
    # DeepSeek-V3's FP8 weights are block-scaled: at 4096 tokens a step its dense GEMMs
    # cannot run faster than the fastest large-M row of the block-wise table's CUTLASS
    # kernels (1,185 TFLOP/s); at 0.70 of 1,979 (1,385) they did. Per-tensor FP8 (Llama)
    # runs at 0.67: faster than block-wise, slower than the old flat 0.70.
    a = MODEL_SPECS["deepseek-v3"]
    assert a.fp8_block_scaled and not MODEL_SPECS["llama-3.1-8b"].fp8_block_scaled
    m = StepModel(a, get_hardware("h100-sxm"), 65536, weight_bytes=1.0, gemm_dtype="fp8",
                  tp=8)
    t = m.time(m.work(4096, 1, 1, 0.0, 4096.0, 0.0))
    mm, nn, kk, y = kernel_fit.fp8_rows()
    best = float(np.max((2 * mm * nn * kk / y)[mm == 4096]))
    assert 1.1e15 < best < 1.3e15
    dense = t.gemm - m._expert_s(4096.0, m.hw, False)
    assert dense >= 2 * a.dense_params / 8 * 4096 / best


def test_a_config_json_with_block_scales_is_block_scaled(tmp_path: Path) -> None:
    import json

    cfg = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 256,
           "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
           "vocab_size": 1000, "max_position_embeddings": 2048}
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "config.json").write_text(json.dumps(
        {**cfg, "quantization_config": {"quant_method": "fp8",
                                        "weight_block_size": [128, 128]}}))
    from harness.roofline.hf_config import from_hf_config
    assert not from_hf_config(tmp_path / "a").fp8_block_scaled
    assert from_hf_config(tmp_path / "b").fp8_block_scaled


def test_a_config_json_that_leaves_attention_unquantized_quantizes_experts_alone(
        tmp_path: Path) -> None:
    import json

    from harness.roofline.hf_config import from_hf_config
    cfg = {"model_type": "mixtral", "num_hidden_layers": 2, "hidden_size": 256,
           "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
           "vocab_size": 1000, "max_position_embeddings": 2048, "num_local_experts": 8,
           "num_experts_per_tok": 2,
           "quantization_config": {"quant_method": "mxfp4",
                                   "modules_to_not_convert": ["model.layers.*.self_attn",
                                                              "lm_head"]}}
    for name, c, want in (("moe", cfg, True),
                          ("all", {**cfg, "quantization_config": {"quant_method": "mxfp4"}},
                           False),
                          ("dense", {k: v for k, v in cfg.items() if "experts" not in k},
                           False)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({**c, "model_type": (
            "llama" if name == "dense" else "mixtral")}))
        assert from_hf_config(tmp_path / name).experts_only_quant is want, name


def test_lm_head_stays_16_bit_in_a_quantized_checkpoint() -> None:
    a = MODEL_SPECS["llama-3.1-8b"]
    m = StepModel(a, get_hardware("h100-sxm"), 65536, weight_bytes=1.0, gemm_dtype="fp8")
    w = m.work(1, 1, 1, 0.0, 0.0, 10.0)
    assert w.lm_bytes == 2 * a.vocab_size * a.hidden_size
    assert w.gemm_bytes == 1 * a.dense_params
    cfg = RooflineConfig(weight_dtype="fp8")
    embed = 2 * a.vocab_size * a.hidden_size  # embedding and lm_head, untied
    assert weights_bytes(a, cfg) == a.dense_params + 2 * embed


def _tiny_moe() -> ArchSpec:
    return ArchSpec("tiny-moe", 2, 64, 100, 4, 4, 16, 16, 16, dense_params=10_000,
                    max_position_embeddings=1024, expert_params=4 * 2 * 3 * 64 * 4096,
                    num_experts=4, experts_per_token=2)


def test_expert_load_is_the_binomial_routing_gives() -> None:
    counts, prob = expert_load(40, 8, 2)
    assert prob.sum() == pytest.approx(1.0)
    assert float(np.dot(counts, prob)) == pytest.approx(40 * 2 / 8)
    exact = math.comb(40, 3) * 0.25 ** 3 * 0.75 ** 37
    assert prob[list(counts).index(3)] == pytest.approx(exact)


@pytest.mark.parametrize("hw", ["h100-sxm", "l40s"])
def test_moe_experts_are_priced_at_their_own_token_counts_brute_force(hw: str) -> None:
    # 3 tokens, each picking 2 of 4 experts: all 6^3 routings, equally likely. Each
    # expert's GEMM is a roofline at its own count (weights read only if it has a token);
    # the step's expert time is the mean over routings of their sum. With a MoE kernel
    # profile (the H100): at the datasheet's peaks over the profile's share at the
    # step's tokens per busy expert (3 x 2 / (4 (1 - 0.5^3)) = 12/7: the first bucket),
    # plus its floor per layer; without one (the L40S), at the dense GEMM shares.
    a, h = _tiny_moe(), get_hardware(hw)
    m = StepModel(a, h, 2 * a.num_layers * a.kv_elems_per_layer)
    per = a.expert_params / a.num_experts
    prof = h.moe_kernels("bf16")
    assert (prof is not None) == (hw == "h100-sxm")
    share, floor = (prof[1][0][1], a.num_layers * prof[0]) if prof else (1.0, 0.0)
    c1 = 2 * per / (h.flops("bf16") * (1.0 if prof else h.gemm_eff("bf16")))
    mem = 2.0 * per / (h.mem_bw * (1.0 if prof else h.eff_bw))
    p = 0.0 if prof else h.gemm_corner_p

    def roof(c: float) -> float:
        t = (c ** p + mem ** p) ** (1 / p) if p > 0 else max(c, mem)
        return t / share

    picks = list(itertools.combinations(range(4), 2))
    total = 0.0
    for routing in itertools.product(picks, repeat=3):
        load = [sum(e in r for r in routing) for e in range(4)]
        total += sum(roof(c1 * k) for k in load if k)
    want = total / len(picks) ** 3 + floor
    dense = m.time(m.work(3, 0, 3, 0.0, 0.0, 0.0))
    no_experts = StepModel(ArchSpec(**{**a.__dict__, "expert_params": 0, "num_experts": 0,
                                       "experts_per_token": 0}), h, 1)
    base = no_experts.time(no_experts.work(3, 0, 3, 0.0, 0.0, 0.0))
    assert dense.gemm - base.gemm == pytest.approx(want, rel=1e-9)


def test_int8_w8a8_runs_on_the_int8_units() -> None:
    # SmoothQuant-style W8A8: int8 GEMMs at the A100's 624 TOPS (no kernel profile yet:
    # the bf16 share, a prior); weight-only int8 (W8A16) stays on the bf16 units.
    a, h = MODEL_SPECS["llama-3.1-8b"], get_hardware("a100-80gb")
    cfg = RooflineConfig(hardware="a100-80gb", weight_dtype="int8", compute_dtype="int8")
    assert cfg.gemm_dtype() == "int8"
    assert RooflineConfig(weight_dtype="int8").gemm_dtype() == "bf16"
    w8a8 = StepModel(a, h, 65536, weight_bytes=1.0, gemm_dtype=cfg.gemm_dtype())
    w8a16 = StepModel(a, h, 65536, weight_bytes=1.0)
    work = dict(tokens=8192, rows=1, seqs=1, pairs=0.0, ctx_prefill=8192.0, ctx_decode=0.0)
    ratio = w8a16.time(w8a16.work(**work)).gemm / w8a8.time(w8a8.work(**work)).gemm  # type: ignore[arg-type]
    assert ratio == pytest.approx(624 / 312, rel=0.02)  # compute-bound at 8192 tokens
    with pytest.raises(UserError, match="weight_dtype=int8"):
        RooflineConfig(compute_dtype="int8")


@pytest.mark.parametrize("overrides", [
    ["roofline.engine=vllm-0.6"], ["roofline.engine=vllm-v1"], ["roofline.engine=sglang"],
    ["roofline.engine=trtllm", "roofline.weight_dtype=fp8", "roofline.compute_dtype=fp8"],
    ["roofline.weight_dtype=int4"], ["roofline.weight_dtype=float16", "roofline.dtype=float16"],
    ["roofline.gpu_memory_utilization=0.5", "roofline.hardware=h200"],
    ["workload=trace",
     f"workload.path={Path(__file__).parents[2] / 'traces' / 'kvbench_example.jsonl'}"],
])
def test_overrides_that_ran_before_still_run_with_the_same_metric_names(
        overrides: list[str], tmp_path: Path) -> None:
    base = ["executor=roofline", "cache.kv_budget=auto", "roofline.model=Llama-3.1-8B"]
    if not any(o.startswith("workload=") for o in overrides):
        base += ["workload=random", "workload.num_requests=6", "workload.output_max=16",
                 "workload.input_max=64"]
    m = run(compose_cfg([*base, *overrides], tmp_path)).metrics
    for key in ("throughput.output_tokens_per_s", "latency.ttft_ms.p50",
                "latency.tpot_ms.p50", "memory.max_running_seqs"):
        assert m[key] is not None and m[key] > 0, (key, overrides)
    header = (tmp_path / "requests.csv").read_text().splitlines()[0].split(",")
    assert {"ttft_ms", "tpot_ms", "e2e_ms"} <= set(header)


def test_a_gpu_checks_gemm_profile_gives_the_shares_it_measured() -> None:
    # Rows as harness.gpucheck.gemm_profile writes them: the median share over shapes at
    # 1024 rows or more, per dtype; small row counts (memory-bound) and errors left out.
    rows = [{"dtype": "bf16", "m": 4096, "n": 1, "k": 1, "tflops": 700.0},
            {"dtype": "bf16", "m": 8192, "n": 1, "k": 1, "tflops": 760.0},
            {"dtype": "bf16", "m": 1024, "n": 1, "k": 1, "tflops": 600.0},
            {"dtype": "bf16", "m": 64, "n": 1, "k": 1, "tflops": 90.0},
            {"dtype": "fp8", "m": 4096, "n": 1, "k": 1, "tflops": 1300.0},
            {"dtype": "fp8", "m": 8192, "n": 1, "k": 1, "ms": None, "error": "x"}]
    got = kernel_fit.device_shares(rows, {"bf16": 1000e12, "fp8": 2000e12, "int8": 2000e12})
    assert got == {"bf16": 0.7, "fp8": 0.65, "int8": None}


def test_b200_and_fp4_weights() -> None:
    # Issue #53's finding 9, in part: a B200 spec (cited; its memory as CUDA reports it,
    # 178.35 GiB) and MXFP4 / NVFP4 weights: bytes with their scales, weight-only on any
    # card, W4A4 on the B200's FP4 units; int4 keeps working.
    b200 = get_hardware("b200")
    assert b200.mem_bytes == int(178.35 * 2**30) and b200.flops("fp4") == 9000e12
    assert WEIGHT_BYTES["mxfp4"] == 0.5 + 1 / 32 and WEIGHT_BYTES["nvfp4"] == 0.5 + 1 / 16
    assert WEIGHT_BYTES["int4"] == 0.5
    a = MODEL_SPECS["llama-3.1-70b"]
    w4a4 = RooflineConfig(hardware="b200", weight_dtype="nvfp4", compute_dtype="fp4")
    work = dict(tokens=8192, rows=1, seqs=1, pairs=0.0, ctx_prefill=8192.0, ctx_decode=0.0)
    fp4 = StepModel(a, b200, 65536, weight_bytes=WEIGHT_BYTES["nvfp4"],
                    gemm_dtype=w4a4.gemm_dtype())
    fp8 = StepModel(a, b200, 65536, weight_bytes=1.0, gemm_dtype="fp8")
    ratio = fp8.time(fp8.work(**work)).gemm / fp4.time(fp4.work(**work)).gemm  # type: ignore[arg-type]
    # Compute-bound: each dtype's peak times its share (hardware.BLACKWELL_GEMM).
    shares = b200.eff_gemm_dtype
    assert ratio == pytest.approx(9000 * shares["fp4"] / (4500 * shares["fp8"]), rel=0.02)
    # Decode reads the weights: nvfp4 reads 0.5625 B a weight where fp8 reads 1.
    d4, d8 = (m.work(1, 1, 1, 0.0, 0.0, 1.0) for m in (fp4, fp8))
    assert d4.gemm_bytes / d8.gemm_bytes == pytest.approx(0.5625)
    # Weight-only on a Hopper card; W4A4 refused there, with where FP4 units are.
    assert RooflineConfig(weight_dtype="mxfp4").gemm_dtype() == "bf16"
    with pytest.raises(UserError, match=r"Blackwell's: roofline\.hardware=b200"):
        StepModel(a, get_hardware("h100-sxm"), 65536, weight_bytes=0.5625, gemm_dtype="fp4")
    with pytest.raises(UserError, match="weight_dtype=mxfp4 or nvfp4"):
        RooflineConfig(hardware="b200", compute_dtype="fp4", weight_dtype="fp8")
