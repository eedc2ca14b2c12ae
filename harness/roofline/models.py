"""Model specs for the roofline executor: KV geometry and weight bytes, no weights.

A spec says what a step costs, never what it computes: the linear parameters every token
uses (attention projections and MLP; for a mixture of experts the shared path, plus the
routed experts apart), the vocabulary (embedding and lm_head), the attention product's
shape (query heads and the per-head dims of q.k and of the values) and what the cache
holds per token and layer (``kv_elems_per_layer``).

GQA models cache K and V: ``2 x kv_heads x head_dim`` elements per token per layer.
DeepSeek-V3's MLA caches the compressed latent (512) and the decoupled RoPE key (64):
576 elements per token per layer, for all 128 heads together; decode runs attention in
the absorbed form (q.k over 512 + 64 dims, values over the 512-dim latent), prefill
(and each chunk of a chunked prefill) un-absorbed as vLLM and SGLang run it: each cached
latent the chunk reads is up-projected (kv_b_proj) to per-head keys and values, then q.k
over 128 + 64 dims and values over 128, ~3.4x fewer FLOPs a pair. Its KV layout for
the backends is one "head" of 288 elements for K and 288 for V, so that a backend's
``2 x layers x heads x head_dim x dtype`` bytes per token is the latent's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness.errors import UserError
from harness.layer_types import FULL, LayerAttention
from harness.roofline.arch import MLA, ArchSpec, fine_grained_moe, llama_like
from harness.roofline.hf_config import from_hf_config


def _deepseek_v3() -> ArchSpec:
    # config.json of deepseek-ai/DeepSeek-V3: 61 layers (first 3 dense, FFN 18432), hidden
    # 7168, 128 heads, q_lora 1536, kv_lora 512, qk_nope 128, qk_rope 64, v_head 128;
    # 256 routed experts (FFN 2048) + 1 shared, 8 per token; vocab 129280. 671B / 37B.
    return fine_grained_moe("DeepSeek-V3", 61, 7168, 129280, 163840, 128, experts=256,
                            per_token=8, expert_ffn=2048, shared_ffn=2048, dense_layers=3,
                            dense_ffn=18432, mla=MLA(1536, 512, 128, 64, 128),
                            fp8_block_scaled=True)


# GLM-4.5 and GLM-4.5-Air (zai-org/GLM-4.5*/config.json, model_type glm4_moe; the keys as
# transformers' Glm4MoeConfig names them, read 2026-12-05 through slime's Megatron
# scripts scripts/models/glm4.5-355B-A32B.sh and glm4.5-106B-A12B.sh): GQA, 96 heads, 8 KV
# heads x 128 (q 12288 wide, above the hidden size), q/k/v biases, untied, vocab 151552,
# 131072 positions. GLM-4.5: 92 layers (3 dense of FFN 12288, then 89 of 160 experts of
# 1536, 8 a token, + 1 shared of 1536), hidden 5120: 353B without its MTP layer (published
# 355B with it), 32B active. Air: 46 layers (1 dense of 10944, then 45 of 128 experts of
# 1408, 8 a token, + 1 shared), hidden 4096: 107B (published 106B), 12B active.
GLM_4_5 = fine_grained_moe("GLM-4.5", 92, 5120, 151552, 131072, 96, experts=160,
                           per_token=8, expert_ffn=1536, shared_ffn=1536, dense_layers=3,
                           dense_ffn=12288, kv_heads=8, head_dim=128, qkv_bias=True)
GLM_4_5_AIR = fine_grained_moe("GLM-4.5-Air", 46, 4096, 151552, 131072, 96, experts=128,
                               per_token=8, expert_ffn=1408, shared_ffn=1408,
                               dense_layers=1, dense_ffn=10944, kv_heads=8, head_dim=128,
                               qkv_bias=True)


def _hybrid(name: str, layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int,
            vocab: int, max_pos: int, attention: tuple[LayerAttention, ...], tied: bool,
            dense_ffn: int = 0, experts: int = 0, expert_ffn: int = 0, per_token: int = 0,
            shared_ffn: int = 0, experts_only_quant: bool = False) -> ArchSpec:
    """A decoder whose layers differ in attention (harness.layer_types): GQA projections,
    then a dense gated MLP of ``dense_ffn``, or ``experts`` gated experts of
    ``expert_ffn`` (``per_token`` of them per token) with a router and a shared expert
    of ``shared_ffn`` (0: none), on every layer."""
    q, kv = heads * head_dim, kv_heads * head_dim
    attn = hidden * (q + 2 * kv) + q * hidden
    shared = 3 * hidden * shared_ffn + (hidden * experts if experts else 0)
    dense = layers * (attn + 3 * hidden * dense_ffn + shared)
    width = dense_ffn or expert_ffn * per_token + shared_ffn
    return ArchSpec(name, layers, hidden, vocab, heads, kv_heads, head_dim, head_dim, head_dim,
                    dense, max_pos, tied, expert_params=layers * experts * 3 * hidden
                    * expert_ffn, num_experts=experts, experts_per_token=per_token,
                    intermediate_size=width, layer_attention=attention,
                    experts_only_quant=experts_only_quant)


def _every(n: int, period: int, odd: LayerAttention, even: LayerAttention) -> tuple[
        LayerAttention, ...]:
    """``n`` layers: layer i is ``odd`` when (i + 1) % period == 0, else ``even``."""
    return tuple(odd if (i + 1) % period == 0 else even for i in range(n))


# Hybrid-attention models (config.json of each on Hugging Face; read 2026-12-02 through
# copies in TensorRT-LLM's and others' tests, transformers' defaults where a key is absent):
# - gpt-oss-120b: 36 layers alternating sliding (128, layer 0) and full, 64 heads, 8 KV
#   heads x 64, hidden 2880, 128 experts of 2880 (4 per token), no shared expert,
#   vocab 201088, 131072 positions, untied. 116.8B parameters (published: 117B). Its
#   MXFP4 checkpoint keeps attention, the router, embeddings and lm_head in bf16
#   (quantization_config.modules_to_not_convert).
# - Gemma-3-27B: 62 layers, 5 sliding (1024) then 1 global (layers 5, 11, .., 59: 10),
#   32 heads, 16 KV heads x 128, hidden 5376, GeGLU 21504, vocab 262208, 131072
#   positions, tied. 27.0B.
# - Llama-4-Scout: 48 layers, chunked attention (8192) on the 3 of 4 with RoPE, every 4th
#   (NoPE) global, 40 heads, 8 KV heads x 128, hidden 5120, 16 experts of 8192 (1 per
#   token) + a shared expert of 8192 on every layer, vocab 202048, untied. 107.8B
#   (published: 109B total, 17B active).
GPT_OSS_120B = _hybrid(
    "gpt-oss-120b", 36, 2880, 64, 8, 64, 201088, 131072,
    _every(36, 2, FULL, LayerAttention("sliding", 128)), tied=False, experts=128,
    expert_ffn=2880, per_token=4, experts_only_quant=True)
GEMMA_3_27B = _hybrid(
    "Gemma-3-27B", 62, 5376, 32, 16, 128, 262208, 131072,
    _every(62, 6, FULL, LayerAttention("sliding", 1024)), tied=True, dense_ffn=21504)
# - Gemma-2-27B: 46 layers alternating sliding (4096, layer 0) and full, 32 heads, 16 KV
#   heads x 128, hidden 4608, GeGLU 36864, vocab 256000, 8192 positions, tied (the Gemma 2
#   report's table; transformers' layer_types rule). The model of vLLM's hybrid-allocator
#   benchmark (PR #11938): docs/hybrid_at_scale.md.
GEMMA_2_27B = _hybrid(
    "Gemma-2-27B", 46, 4608, 32, 16, 128, 256000, 8192,
    _every(46, 2, FULL, LayerAttention("sliding", 4096)), tied=True, dense_ffn=36864)
LLAMA_4_SCOUT = _hybrid(
    "Llama-4-Scout", 48, 5120, 40, 8, 128, 202048, 262144,
    _every(48, 4, FULL, LayerAttention("chunked", 8192)), tied=False, experts=16,
    expert_ffn=8192, per_token=1, shared_ffn=8192)

MODEL_SPECS: dict[str, ArchSpec] = {s.name.lower(): s for s in (
    llama_like("Llama-2-7B", 32, 4096, 11008, 32, 32, 32000, 4096),
    llama_like("Llama-2-13B", 40, 5120, 13824, 40, 40, 32000, 4096),
    llama_like("Llama-3.1-8B", 32, 4096, 14336, 32, 8, 128256, 131072),
    llama_like("Llama-3.1-70B", 80, 8192, 28672, 64, 8, 128256, 131072),
    llama_like("Qwen2.5-7B", 28, 3584, 18944, 28, 4, 152064, 32768, qkv_bias=True),
    llama_like("Qwen2.5-72B", 80, 8192, 29568, 64, 8, 152064, 32768, qkv_bias=True),
    llama_like("Mistral-7B", 32, 4096, 14336, 32, 8, 32768, 32768),
    # Qwen3 dense (Qwen/Qwen3-*/config.json: no qkv bias, q/k RMSNorm (no weights that
    # matter here), untied, 40960 positions, head_dim 128; 32B's 64 heads x 128 = 8192 >
    # hidden 5120). 8.19B / 14.77B / 32.76B. GPUStack's vLLM V1 points (fit.yaml).
    llama_like("Qwen3-8B", 36, 4096, 12288, 32, 8, 151936, 40960),
    llama_like("Qwen3-14B", 40, 5120, 17408, 40, 8, 151936, 40960),
    llama_like("Qwen3-32B", 64, 5120, 25600, 64, 8, 151936, 40960),
    llama_like("SmolLM2-135M", 30, 576, 1536, 9, 3, 49152, 8192, head_dim=64, tied=True),
    _deepseek_v3(), GLM_4_5, GLM_4_5_AIR,
    GPT_OSS_120B, GEMMA_2_27B, GEMMA_3_27B, LLAMA_4_SCOUT,
)}


def hf_config_of(config: Any) -> dict[str, Any]:
    """A loaded model's ``ModelConfig`` (harness.model.config) as the Hugging Face
    config.json fields :func:`~harness.roofline.hf_config.from_hf_config` reads:
    ``roofline.model=<that file>`` is the model the real runs ran."""
    c = config
    return {"_name_or_path": c.name, "num_hidden_layers": c.num_layers,
            "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
            "head_dim": c.head_dim, "vocab_size": c.vocab_size,
            "max_position_embeddings": c.max_position_embeddings,
            "tie_word_embeddings": c.tie_word_embeddings, "attention_bias": c.attention_bias}


def arch_of(config: Any) -> ArchSpec:
    """The spec of a loaded model's ``ModelConfig``."""
    c = hf_config_of(config)
    return llama_like(c["_name_or_path"], c["num_hidden_layers"], c["hidden_size"],
                      c["intermediate_size"], c["num_attention_heads"],
                      c["num_key_value_heads"], c["vocab_size"], c["max_position_embeddings"],
                      head_dim=c["head_dim"], tied=c["tie_word_embeddings"],
                      qkv_bias=c["attention_bias"])


def get_model_spec(name: str) -> ArchSpec:
    """A preset by name (case-insensitive) or a path to a config.json / its folder."""
    spec = MODEL_SPECS.get(name.lower())
    if spec is not None:
        return spec
    if name.endswith(".json") or Path(name).is_dir():
        return from_hf_config(name)
    names = ", ".join(s.name for s in MODEL_SPECS.values())
    raise UserError(f"unknown roofline.model {name!r}: use one of {names}, or a path to a "
                    "Hugging Face config.json")
