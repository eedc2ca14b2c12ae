"""executor=roofline: specs, the step-time model against hand-computed rooflines, and runs
of the real engine / scheduler / KV manager on the virtual clock."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from harness.errors import UserError
from harness.roofline.config import RooflineConfig, auto_kv_budget
from harness.roofline.engines import EngineProfile
from harness.roofline.hardware import CPU_PRIOR, HARDWARE, get_hardware
from harness.roofline.hf_config import from_hf_config
from harness.roofline.models import MODEL_SPECS, get_model_spec
from harness.roofline.steptime import StepModel, expert_load
from harness.runner import run
from tests.compose import compose_cfg

H100 = HARDWARE["h100-sxm"]


def roof(*overrides: str, out_dir: Path | None = None) -> dict:
    base = ["executor=roofline", "cache.kv_budget=auto", "roofline.model=Llama-3.1-8B",
            "roofline.hardware=h100-sxm", "workload=random", "workload.num_requests=24",
            "workload.output_max=64", "workload.input_max=256"]
    return run(compose_cfg([*base, *overrides], out_dir)).metrics


@pytest.mark.parametrize(("name", "params_b", "kv_bytes"), [
    ("Llama-2-7B", 6.74, 2 * 32 * 32 * 128 * 2),
    ("Llama-2-13B", 13.0, 2 * 40 * 40 * 128 * 2),
    ("Llama-3.1-8B", 8.03, 2 * 32 * 8 * 128 * 2),
    ("Llama-3.1-70B", 70.6, 2 * 80 * 8 * 128 * 2),
    ("Qwen2.5-7B", 7.62, 2 * 28 * 4 * 128 * 2),
    ("Qwen2.5-72B", 72.7, 2 * 80 * 8 * 128 * 2),
    ("Mistral-7B", 7.25, 2 * 32 * 8 * 128 * 2),
    ("SmolLM2-135M", 0.1345, 2 * 30 * 3 * 64 * 2),
    ("DeepSeek-V3", 671, 61 * (512 + 64) * 2),  # MLA: latent + decoupled RoPE key
])
def test_specs_match_published_sizes(name: str, params_b: float, kv_bytes: int) -> None:
    s = get_model_spec(name)
    assert s.total_params() / 1e9 == pytest.approx(params_b, rel=0.02)
    assert s.num_layers * s.kv_elems_per_layer * 2 == kv_bytes  # bf16 bytes per token


def test_deepseek_active_params_and_expert_reads() -> None:
    s = MODEL_SPECS["deepseek-v3"]
    assert (s.active_params + 2 * s.vocab_size * s.hidden_size) / 1e9 == \
        pytest.approx(37, rel=0.05)
    # The share of experts a step reads: one token reads its 8 of 256; 4096 read all.
    for tokens, share in ((1, 8 / 256), (4096, 1.0)):
        counts, prob = expert_load(tokens, s.num_experts, s.experts_per_token)
        assert float(prob[counts > 0].sum()) == pytest.approx(share)


def test_hf_config_json(tmp_path: Path) -> None:
    cfg = {"num_hidden_layers": 30, "hidden_size": 576, "intermediate_size": 1536,
           "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
           "max_position_embeddings": 8192, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    s, ref = from_hf_config(tmp_path), MODEL_SPECS["smollm2-135m"]
    assert (s.dense_params, s.kv_elems_per_layer, s.head_dim) == \
        (ref.dense_params, ref.kv_elems_per_layer, 64)
    with pytest.raises(UserError, match=r"unknown roofline\.model"):
        get_model_spec("gpt-17")
    with pytest.raises(UserError, match=r"unknown roofline\.hardware"):
        get_hardware("tpu")


# The H100 as a plain roofline: no fitted kernel terms (the hand counts below are the
# roofline's; test_kernel_terms_by_hand_count checks the fitted terms).
PLAIN = dataclasses.replace(H100, gemm_corner_p=0.0, gemm_kernel_s=0.0, eff_elem=0.0,
                            eff_bw=0.8, link_latency_s=10e-6, allreduce_latency_s={})


def test_decode_step_is_the_weight_read_and_attention_intensity_is_the_group_size() -> None:
    a = MODEL_SPECS["llama-3.1-70b"]
    m = StepModel(a, PLAIN, kv_bytes_per_token=a.num_layers * a.kv_elems_per_layer * 2, tp=8)
    w = m.work(tokens=32, rows=32, seqs=32, pairs=0, ctx_prefill=0, ctx_decode=32 * 1000)
    t = m.time(w)
    # 32 tokens are far below the ridge (~295 FLOP/byte): the GEMMs are the weights' read.
    assert t.gemm == pytest.approx(2 * a.dense_params / 8 / (3.35e12 * 0.8))
    assert w.dec_flops / w.dec_bytes == pytest.approx(64 / 8)  # H / KV heads, bf16
    assert t.decode_attn == pytest.approx(w.dec_bytes / (3.35e12 * 0.8))
    assert t.allreduce > 0 and t.total > t.forward
    # A large prefill crosses the ridge: compute-bound.
    big = m.time(m.work(8192, 1, 1, 8192 * 4096, 8192, 0))
    assert big.gemm == pytest.approx(2 * a.active_params * 8192 / 8 / (989e12 * 0.7))


def test_kernel_terms_by_hand_count() -> None:
    # Llama-3.1-8B at TP2, 64 decode tokens, on the fitted H100 spec, term by term.
    a, h = MODEL_SPECS["llama-3.1-8b"], H100
    m = StepModel(a, h, kv_bytes_per_token=a.num_layers * a.kv_elems_per_layer * 2, tp=2)
    w = m.work(tokens=64, rows=64, seqs=64, pairs=0, ctx_prefill=0, ctx_decode=64 * 500)
    t = m.time(w)
    L, hid, ffn = 32, 4096, 14336
    params = L * (hid * (4096 + 2 * 1024) + 4096 * hid + 3 * hid * ffn)  # 6.98e9
    c = 2 * params * 64 / 2 / (989e12 * 0.70)
    mem = 2 * params / 2 / (3.35e12 * 0.90)
    p = 1.5
    assert t.gemm == pytest.approx((c ** p + mem ** p) ** (1 / p) + 4 * L * 6e-6)
    # Non-GEMM: 6 kernels a layer, and per token 2 bytes x (2 norms x 3 hidden, RoPE's
    # q and k read and written over 2 ranks, SiLU-and-mul's 3 x ffn / 2, the add's 3 hidden).
    per_tok = 2 * (6 * hid + 2 * (32 + 8) * 128 / 2 + 3 * ffn / 2 + 3 * hid)
    assert t.nongemm == pytest.approx(6 * L * 1.9e-6 + 64 * L * per_tok / (3.35e12 * 0.60))
    # Two all-reduces a layer: NCCL's small-message time at TP2 plus the ring's bytes.
    ring = 2 * (2 - 1) / 2 * 64 * hid * 2 / 340e9
    assert t.allreduce == pytest.approx(2 * L * (ring + 39e-6))
    # The engine's CPU time: the spec's overheads without a profile.
    assert t.overhead == pytest.approx(1e-3 + 5e-6 * 64)


def test_engine_profile_charges_scheduling_only_on_fresh_steps() -> None:
    a = MODEL_SPECS["llama-3.1-8b"]
    prof = EngineProfile("x", "x", schedule_s=2e-3, schedule_per_seq_s=50e-6, step_s=4e-4,
                         step_per_seq_s=2e-6)
    m = StepModel(a, H100, kv_bytes_per_token=131072, engine=prof)
    sh = dict(tokens=100, rows=100, seqs=100, pairs=0, ctx_prefill=0, ctx_decode=100 * 300)
    fresh, later = m.work(**sh), m.work(**sh)  # type: ignore[arg-type]
    later.fresh = 0.0
    tf, tl = m.time(fresh), m.time(later)
    assert tf.overhead == pytest.approx(2e-3 + 100 * 50e-6 + 4e-4 + 100 * 2e-6)
    assert tl.overhead == pytest.approx(4e-4 + 100 * 2e-6)
    assert tf.forward == tl.forward


@pytest.mark.parametrize("hw", [
    H100, PLAIN, HARDWARE["l40s"],
    # the gather path, a 1-byte cache's widening, a profiled GEMM (CPU calibration's form)
    dataclasses.replace(CPU_PRIOR, widen_s_per_elem={"int8": 3e-10},
                        gemm_profile=((1.0, 2e-12, 3e-12), (64.0, 1e-12, 2e-12)),
                        profile_dtype="bf16"),
])
def test_lane_time_is_time_of_work_of_a_decode_only_step(hw: object) -> None:
    # The decode lane's steps (n decodes, nothing else) are timed with the terms of n
    # alone made once per n: the same floats as the full model, step after step.
    a = MODEL_SPECS["llama-3.1-70b"]
    prof = EngineProfile("x", "x", schedule_s=2e-3, schedule_per_seq_s=5e-5, step_s=4e-4,
                         step_per_seq_s=2e-6)
    for kw in (dict(kv_dtype="int8", kv_bytes_per_token=a.num_layers * a.kv_elems_per_layer),
               dict(engine=prof, kv_bytes_per_token=2 * a.num_layers * a.kv_elems_per_layer)):
        m = StepModel(a, hw, tp=8, **kw)  # type: ignore[arg-type]
        for n, ctx in [(3, 1000), (200, 61_234), (3, 1017), (200, 70_001), (1, 9)]:
            gathered, dec_bytes = float(n * (ctx // n + 16)), ctx * 1234.5
            w = m.work(n, n, n, 0.0, 0.0, float(ctx), 0.0, gathered, 0.0, dec_bytes)
            assert m.lane_time(n, float(ctx), gathered, dec_bytes) == m.time(w), (n, ctx)


def test_fp8_compute_uses_the_fp8_peak_for_gemms_only() -> None:
    a = MODEL_SPECS["llama-3.1-8b"]
    kw = dict(kv_bytes_per_token=65536, weight_bytes=1.0)
    bf, f8 = StepModel(a, PLAIN, **kw), StepModel(a, PLAIN, gemm_dtype="fp8", **kw)  # type: ignore[arg-type]
    w = dict(tokens=8192, rows=1, seqs=1, pairs=8192 * 4096, ctx_prefill=8192, ctx_decode=0)
    tb, t8 = bf.time(bf.work(**w)), f8.time(f8.work(**w))  # type: ignore[arg-type]
    # Compute-bound: the ratio of what each dtype's GEMMs reach (per-tensor fp8 0.67 of
    # its doubled peak, from its kernel profile; bf16 0.70), not of the peaks alone.
    assert tb.gemm / t8.gemm == pytest.approx(1979 * 0.67 / (989 * 0.70), rel=1e-3)
    assert tb.prefill_attn == t8.prefill_attn  # attention stays in bf16
    with pytest.raises(UserError, match="weight_dtype=fp8"):
        RooflineConfig(compute_dtype="fp8")


def test_auto_budget_and_weights_that_do_not_fit() -> None:
    a, cfg = MODEL_SPECS["llama-3.1-70b"], RooflineConfig(tp=8)
    want = 8 * (H100.mem_bytes * 0.9 - 2 * 2**30) - a.total_params() * 2
    assert auto_kv_budget(a, H100, cfg) == pytest.approx(want, rel=1e-6)
    with pytest.raises(UserError, match="leave no room"):
        auto_kv_budget(a, H100, RooflineConfig(tp=1))
    # TensorRT-LLM's fraction is of the memory the weights leave free: 70B fp8 on one
    # H100 keeps 0.95 x (84.9 GB - 2 GiB - 71.7 GB) for its cache, not 0.95 x 84.9 GB - ...
    # (fp8 linear layers; the embedding and lm_head stay bf16: 2 x 1.05 GB).
    free = RooflineConfig(tp=1, weight_dtype="fp8", gpu_memory_utilization=0.95,
                          memory_utilization_of="free")
    w = a.total_params() * 1.0 + 2 * a.vocab_size * a.hidden_size
    assert auto_kv_budget(a, H100, free) == pytest.approx(
        0.95 * (H100.mem_bytes - 2 * 2**30 - w), rel=1e-6)
    total = RooflineConfig(tp=1, weight_dtype="fp8", gpu_memory_utilization=0.95)
    assert auto_kv_budget(a, H100, total) == pytest.approx(
        0.95 * H100.mem_bytes - 2 * 2**30 - w, rel=1e-6)


def test_roofline_run_is_deterministic_and_recorded(tmp_path: Path) -> None:
    m1 = roof(out_dir=tmp_path / "a")
    m2 = roof()
    for k in ("latency.ttft_ms.p99", "latency.itl_ms.p50", "throughput.output_tokens_per_s",
              "sched.steps"):
        assert m1[k] == m2[k], k
    assert m1["run.executor"] == "roofline" and m1["run.hardware"] == "h100-sxm"
    assert m1["run.quality"].startswith("absent")
    assert m1["requests.finished"] == 24
    assert json.loads((tmp_path / "a" / "metrics.json").read_text())["run.executor"] == \
        "roofline"


def test_one_byte_cache_halves_reads_and_window_bounds_them() -> None:
    bf16 = roof("backend=paged")
    fp8 = roof("backend=fp8")
    win = roof("backend=sliding_window", "backend.window=32", "backend.sink_tokens=4")
    ratio = fp8["attention.kv_read_bytes_per_token"] / bf16["attention.kv_read_bytes_per_token"]
    assert ratio == pytest.approx((128 + 4) / (2 * 128), rel=1e-6)  # 1 byte + fp32 scale
    assert fp8["memory.token_capacity"] > 1.9 * bf16["memory.token_capacity"]
    assert win["attention.kv_read_bytes_per_token"] <= 36 * win["roofline.kv_bytes_per_token"]


def test_scored_backend_gets_stand_in_scores_and_multiturn_hits_the_prefix_cache() -> None:
    h = roof("backend=h2o", "backend.budget=48", "backend.budget_ratio=0")
    assert h["cache.evicted_tokens"] > 0 and h["requests.finished"] == 24
    mt = run(compose_cfg(["executor=roofline", "cache.kv_budget=auto", "workload=multiturn",
                          "workload.conversations=4"])).metrics
    assert mt["cache.prefix_hit_rate"] > 0.5


def test_auto_budget_needs_roofline() -> None:
    with pytest.raises(UserError, match="needs executor=roofline"):
        run(compose_cfg(["model=tiny", "cache.kv_budget=auto"]))
    with pytest.raises(UserError, match="executor must be"):
        run(compose_cfg(["executor=gpu"]))


def test_the_backends_declared_reads_are_used_and_no_cache_is_allocated(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from harness.backends.costs import KVCosts, Read
    from harness.backends.paged import PagedBackend
    from harness.config import run_config
    from harness.model import ByteTokenizer
    from harness.roofline.run import build_roofline
    from harness.workloads import make_workload

    rc = run_config(compose_cfg(["executor=roofline", "cache.kv_budget=1GiB",
                                 "workload=random", "workload.num_requests=4"]))
    st, _ = build_roofline(rc, make_workload(rc.workload, ByteTokenizer()), quiet=True)
    assert not hasattr(st.backend, "k_cache")  # the roofline never allocates K/V

    class FiveTokens(KVCosts):  # a method whose decodes read 5 tokens, whatever they hold
        def decode_read(self, context: int, held: int) -> Read:
            return Read(min(5, context), min(5, context) * self.slot_bytes)

    monkeypatch.setattr(PagedBackend, "declare_costs",
                        lambda self: FiveTokens(self.full_slot_bytes(), self.block_size))
    m = roof("backend=paged")
    assert m["attention.kv_read_bytes_per_token"] == 5 * m["roofline.kv_bytes_per_token"]


def test_experiments_at_tiny_scale() -> None:
    from harness.roofline_tools.experiments import mla, waste

    t = mla(1.0)
    assert "| DeepSeek-V3 | 8x h200 | fp8 | bf16 | 68.6 |" in t  # 61 x 576 x 2 bytes
    rows = [r.split("|") for r in waste(0.02).splitlines()[2:]]
    share = {r[1].strip(): float(r[2]) for r in rows}
    assert share["paged (block 16)"] > 90 > share["contiguous max"]


def test_long_prompts_quest_reads_less_than_paged_and_snapkv_what_it_holds() -> None:
    # What KVReads once got wrong by guessing from attribute names: quest read more than
    # paged, snapkv's observation window was taken for a sliding window (32 tokens read).
    from harness.backends.snapkv import SnapKVOptions
    from harness.kv.policies.snapkv import SnapKVPolicy

    p, out = 1000, 32
    long = ["workload.distribution=uniform", f"workload.input_min={p}",
            f"workload.input_max={p}", f"workload.output_min={out}",
            f"workload.output_max={out}", "workload.num_requests=8"]
    paged, quest, snap = (roof(f"backend={b}", *long) for b in ("paged", "quest", "snapkv"))
    bps, key = paged["roofline.kv_bytes_per_token"], "attention.kv_read_bytes_per_token"
    # out - 1 decodes (the prefill samples the first) at contexts p + 1 .. p + out - 1
    assert paged[key] == pytest.approx(bps * (p + out / 2))  # the whole context
    assert quest[key] < 0.4 * paged[key]  # 256 tokens of 1000+ and every block's bounds
    keep = SnapKVPolicy(SnapKVOptions()).keep(p)  # what it holds after the prompt
    assert snap[key] == pytest.approx(bps * (keep + out / 2))


def test_one_hot_ids_stand_for_their_rows() -> None:
    """The roofline hands greedy sampling its one-hot rows as ids; what they stand for is
    the tensor temperature sampling and beams read: a 1 at each id, 0 elsewhere, whose
    argmax gives the ids back."""
    import torch

    from harness.backends.costs import StepReads
    from harness.engine.executor import StepOutput
    from harness.roofline.executor import VOCAB

    ids = [97, 0, VOCAB - 1, 97, 122]
    out = StepOutput(None, [], 0.0, StepReads(), one_hot=ids, vocab=VOCAB)
    dense = out.dense_logits()
    assert dense.dtype == torch.float32 and dense.shape == (len(ids), VOCAB)
    assert torch.equal(dense, torch.eye(VOCAB)[ids])
    assert dense.argmax(dim=-1).tolist() == ids
    assert out.dense_logits() is dense  # made once


def test_synthetic_tokens_are_each_positions_token() -> None:
    """A run of synthetic ids (a decode lane's, read from one table per residue of the
    request id) against the per-position formula, for random requests, starts and
    lengths shorter and longer than a period."""
    import random

    from harness.roofline.executor import SYNTHETIC_PERIOD, synthetic_token, synthetic_tokens

    rng = random.Random(5)
    for _ in range(3000):
        rid, start = rng.randrange(10**7), rng.randrange(10**5)
        count = rng.randrange(4 * SYNTHETIC_PERIOD)
        assert synthetic_tokens(rid, start, count) == \
            [synthetic_token(rid, 0, p) for p in range(start, start + count)]
