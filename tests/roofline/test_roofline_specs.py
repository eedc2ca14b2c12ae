"""The what-if's specs read right (issue 27): mixture-of-experts config.json files read as
such, KV heads replicated past tp = KV heads as vLLM does, capacity following.

Published figures the MoE reads are held to: Mixtral 8x7B 46.7B parameters, 12.9B active
per token (mistral.ai, "Mixtral of experts", 2023-12-11); Qwen1.5-MoE-A2.7B 14.3B total,
2.7B activated (qwenlm.github.io, 2024-03-28). The config.json files are theirs (Hugging
Face, the keys this reader uses)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from harness.errors import UserError
from harness.roofline.config import RooflineConfig, auto_kv_budget
from harness.roofline.hardware import get_hardware
from harness.roofline.hf_config import from_hf_config
from harness.roofline.models import MODEL_SPECS
from harness.roofline.steptime import StepModel

MIXTRAL = {"architectures": ["MixtralForCausalLM"], "hidden_size": 4096,
           "intermediate_size": 14336, "max_position_embeddings": 32768,
           "model_type": "mixtral", "num_attention_heads": 32, "num_experts_per_tok": 2,
           "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8,
           "tie_word_embeddings": False, "vocab_size": 32000}
QWEN_MOE = {"architectures": ["Qwen2MoeForCausalLM"], "hidden_size": 2048,
            "intermediate_size": 5632, "moe_intermediate_size": 1408,
            "shared_expert_intermediate_size": 5632, "num_experts": 60,
            "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_attention_heads": 16,
            "num_key_value_heads": 16, "vocab_size": 151936, "decoder_sparse_step": 1,
            "mlp_only_layers": [], "model_type": "qwen2_moe", "tie_word_embeddings": False,
            "max_position_embeddings": 8192}


def _write(tmp_path: Path, cfg: dict[str, object]) -> Path:
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    return p


@pytest.mark.parametrize(("cfg", "total", "active"), [(MIXTRAL, 46.7e9, 12.9e9),
                                                      (QWEN_MOE, 14.3e9, 2.7e9)],
                         ids=["mixtral-8x7b", "qwen1.5-moe-a2.7b"])
def test_moe_config_reads_as_moe(tmp_path: Path, cfg: dict[str, object], total: float,
                                 active: float) -> None:
    a = from_hf_config(_write(tmp_path, cfg))
    embed = 2 * a.vocab_size * a.hidden_size  # untied: embedding + lm_head
    assert a.num_experts > 0
    assert a.total_params() == pytest.approx(total, rel=0.01)
    assert a.active_params + embed == pytest.approx(active, rel=0.02)
    # Read as dense (the bug) its weights were the attention + one MLP: far too few.
    dense = from_hf_config(_write(tmp_path, {k: v for k, v in cfg.items()
                                             if k not in ("num_local_experts",
                                                          "num_experts")} | {
        "model_type": "llama"}))
    assert dense.total_params() < total / 3


def test_mixtral_does_not_fit_one_a100_80gb(tmp_path: Path) -> None:
    # Before: read as dense (~7.2B), it left ~50 GiB of KV on one A100-80GB. Its 46.7B
    # parameters in bf16 (93 GB) do not fit at all; on two they leave ~41 GB.
    a = from_hf_config(_write(tmp_path, MIXTRAL))
    hw = get_hardware("a100-80gb")
    with pytest.raises(UserError, match="leave no room for a KV cache"):
        auto_kv_budget(a, hw, RooflineConfig(model="mixtral", hardware="a100-80gb"))
    two = auto_kv_budget(a, hw, RooflineConfig(hardware="a100-80gb", tp=2))
    assert two == pytest.approx(2 * (hw.mem_bytes * 0.9 - 2**31) - a.total_params() * 2,
                                rel=1e-6)


def test_kv_heads_replicate_past_tp_and_capacity_follows() -> None:
    # Llama-3.1-8B has 8 KV heads: at tp=32 each is held by 4 ranks, so the 32 ranks hold
    # 8 distinct shards of the cache. Before, the budget summed 32 ranks' room as if each
    # held a distinct shard: ~4x the real capacity.
    a, hw = MODEL_SPECS["llama-3.1-8b"], get_hardware("h100-sxm")
    per_rank = hw.mem_bytes * 0.9 - 2**31
    w = a.total_params() * 2
    b32 = auto_kv_budget(a, hw, RooflineConfig(tp=32))
    assert b32 == pytest.approx(8 * (per_rank - w / 32), rel=1e-6)
    assert b32 < 0.26 * (32 * per_rank - w)  # the old figure
    b8 = auto_kv_budget(a, hw, RooflineConfig(tp=8))
    assert b8 == pytest.approx(8 * per_rank - w, rel=1e-6)
    assert 1.0 < b32 / b8 < 1.05  # 4x the ranks: only the weights' share shrinks
    # A decode key's bytes on one rank: one KV head's worth at tp >= 8, split below.
    kvb = a.num_layers * a.kv_elems_per_layer * 2
    for tp, heads_per_rank in ((4, 2), (8, 1), (16, 1), (32, 1)):
        m = StepModel(a, hw, kvb, tp=tp)
        assert m.kv_rank_bytes == pytest.approx(kvb * heads_per_rank / a.num_kv_heads)


def test_deepseek_latent_is_one_replicated_head() -> None:
    # MLA's latent is held whole by every rank: the same rule with one KV "head".
    a, hw = MODEL_SPECS["deepseek-v3"], get_hardware("h200")
    cfg = RooflineConfig(model="DeepSeek-V3", hardware="h200", tp=8, weight_dtype="fp8")
    # fp8 linear layers, the embedding and lm_head in bf16 (weights_bytes).
    embed = 2 * a.vocab_size * a.hidden_size
    want = hw.mem_bytes * 0.9 - 2**31 - (a.total_params() + embed) / 8
    assert auto_kv_budget(a, hw, cfg) == pytest.approx(want, rel=1e-3)
    kvb = a.num_layers * a.kv_elems_per_layer * 2
    assert StepModel(a, hw, kvb, tp=8).kv_rank_bytes == kvb


@pytest.mark.parametrize(("model", "tp", "ok"), [
    ("llama-3.1-8b", 3, False), ("llama-3.1-8b", 6, False), ("llama-3.1-8b", 16, True),
    ("llama-3.1-8b", 64, False), ("qwen2.5-7b", 7, False), ("qwen2.5-7b", 14, False),
    ("qwen2.5-7b", 28, True), ("smollm2-135m", 9, True), ("smollm2-135m", 2, False)])
def test_tp_follows_vllms_rule(model: str, tp: int, ok: bool) -> None:
    a = MODEL_SPECS[model]
    if ok:
        a.check_tp(tp)
    else:
        with pytest.raises(UserError, match=rf"roofline\.tp={tp} must divide"):
            a.check_tp(tp)


# DeepSeek's layout (issue #53, finding 9): the config.json files as zai-org and deepseek-ai
# publish them (the keys this reader uses; transformers' Glm4MoeConfig / DeepseekV3Config).
GLM_4_5 = {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe",
           "attention_bias": True, "head_dim": 128, "hidden_size": 5120,
           "intermediate_size": 12288, "max_position_embeddings": 131072,
           "moe_intermediate_size": 1536, "num_attention_heads": 96, "n_routed_experts": 160,
           "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
           "num_hidden_layers": 92, "num_key_value_heads": 8, "num_nextn_predict_layers": 1,
           "partial_rotary_factor": 0.5, "tie_word_embeddings": False, "use_qk_norm": True,
           "vocab_size": 151552}
GLM_4_5_AIR = {**GLM_4_5, "hidden_size": 4096, "intermediate_size": 10944,
               "moe_intermediate_size": 1408, "n_routed_experts": 128,
               "first_k_dense_replace": 1, "num_hidden_layers": 46, "use_qk_norm": False}
DEEPSEEK_V3 = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
               "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
               "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
               "n_shared_experts": 1, "n_routed_experts": 256, "num_experts_per_tok": 8,
               "first_k_dense_replace": 3, "moe_layer_freq": 1, "q_lora_rank": 1536,
               "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
               "v_head_dim": 128, "vocab_size": 129280, "max_position_embeddings": 163840,
               "tie_word_embeddings": False, "num_nextn_predict_layers": 1,
               "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}


@pytest.mark.parametrize(("cfg", "preset", "total", "active"), [
    # zai-org's model card: 355B total with the MTP layer (353B without it, as engines load
    # it), 32B active; Air 106B / 12B. zai-org's active counts exclude the embeddings
    # (DeepSeek's 37B includes them: test_roofline.py checks it so).
    (GLM_4_5, "glm-4.5", 355e9, 32e9), (GLM_4_5_AIR, "glm-4.5-air", 106e9, 12e9),
    (DEEPSEEK_V3, "deepseek-v3", 671e9, None)], ids=["glm-4.5", "glm-4.5-air", "deepseek-v3"])
def test_deepseek_layout_reads_as_its_preset(tmp_path: Path, cfg: dict[str, object],
                                             preset: str, total: float,
                                             active: float | None) -> None:
    a = from_hf_config(_write(tmp_path, cfg))
    assert a == dataclasses.replace(MODEL_SPECS[preset], name=a.name)
    assert a.total_params() == pytest.approx(total, rel=0.01)
    if active is not None:
        assert a.active_params == pytest.approx(active, rel=0.02)
    # What a step multiplies: one token's 8 experts and the shared one, never all of them.
    assert a.num_experts > 0 and a.active_params < a.total_params() / 8
    assert a.moe_layers == cfg["num_hidden_layers"] - cfg["first_k_dense_replace"]


DEEPSEEK_V2_LITE = {"model_type": "deepseek_v2", "hidden_size": 2048, "intermediate_size": 10944,
                    "moe_intermediate_size": 1408, "num_hidden_layers": 27,
                    "num_attention_heads": 16, "num_key_value_heads": 16,
                    "n_shared_experts": 2, "n_routed_experts": 64, "num_experts_per_tok": 6,
                    "first_k_dense_replace": 1, "moe_layer_freq": 1, "q_lora_rank": None,
                    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                    "v_head_dim": 128, "vocab_size": 102400,
                    "max_position_embeddings": 163840, "tie_word_embeddings": False}


def test_mla_sizes_by_hand(tmp_path: Path) -> None:
    # DeepSeek-V3's sizes as the hand-written preset had them before it was built on
    # fine_grained_moe (7ce1c1c): every term of MLA's attention (q_a, q_b, kv_a, kv_b, o),
    # the dense layers, shared experts, routers and routed experts.
    a = MODEL_SPECS["deepseek-v3"]
    assert (a.dense_params, a.expert_params) == (15263268864, 653908770816)
    # DeepSeek-V2-Lite (deepseek-ai's card: 15.7B total, 2.4B activated: with the lm_head
    # a token multiplies, 2.45B here): no query bottleneck (q_lora_rank null: one q
    # projection), two shared experts of 1408, 64 routed of which 6 a token.
    lite = from_hf_config(_write(tmp_path, DEEPSEEK_V2_LITE))
    h, heads = 2048, 16
    attn = h * heads * 192 + h * (512 + 64) + 512 * heads * 256 + heads * 128 * h
    assert lite.dense_params == 27 * attn + 3 * h * 10944 + 26 * (3 * h * 2 * 1408 + h * 64)
    assert lite.total_params() == pytest.approx(15.7e9, rel=0.01)
    assert lite.active_params + 102400 * h == pytest.approx(2.4e9, rel=0.03)
    assert lite.prefill_upproj_params == 512 * heads * 256


def test_glm_attention_is_gqa_and_its_cache_follows() -> None:
    # GLM-4.5 caches 8 KV heads of 128 on 92 layers (bf16: 368 KiB a token); its queries
    # are 96 x 128 = 12288 wide, above its hidden size (the q/o projections are not square).
    a = MODEL_SPECS["glm-4.5"]
    assert a.num_layers * a.kv_elems_per_layer * 2 == 92 * 2 * 8 * 128 * 2
    h, q, kv = 5120, 96 * 128, 8 * 128
    attn = h * (q + 2 * kv) + q * h + (q + 2 * kv)  # with the q/k/v biases
    moe = 3 * h * 1536 + h * 160  # the shared expert and the router
    assert a.dense_params == 92 * attn + 3 * 3 * h * 12288 + 89 * moe
    a.check_tp(8)
    with pytest.raises(UserError, match=r"roofline\.tp=5"):
        a.check_tp(5)


@pytest.mark.parametrize(("change", "phrase"), [
    ({"moe_layer_freq": 2}, "moe_layer_freq above 1"),
    ({"first_k_dense_replace": 92}, "leaves no sparse layer"),
    ({"num_experts_per_tok": 200}, "num_experts_per_tok=200 exceeds the 160 experts"),
    ({"model_type": "deepseek_v3"}, "without kv_lora_rank"),
    ({"first_k_dense_replace": None}, "lacks 'first_k_dense_replace'"),
    ({"model_type": "deepseek_v3", "kv_lora_rank": 511, "qk_nope_head_dim": 128,
      "qk_rope_head_dim": 64, "v_head_dim": 128}, "must be even"),
])
def test_deepseek_layout_refusals(tmp_path: Path, change: dict[str, object],
                                  phrase: str) -> None:
    with pytest.raises(UserError, match=phrase):
        from_hf_config(_write(tmp_path, {**GLM_4_5, **change}))
