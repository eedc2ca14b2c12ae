"""Model specs for the roofline executor: KV geometry and weight bytes, no weights.

A spec says what a step costs, never what it computes: the linear parameters every token
uses (attention projections and MLP; for a mixture of experts the shared path, plus the
routed experts apart), the vocabulary (embedding and lm_head), the attention product's
shape (query heads and the per-head dims of q.k and of the values) and what the cache
holds per token and layer (``kv_elems_per_layer``).

GQA models cache K and V: ``2 x kv_heads x head_dim`` elements per token per layer.
DeepSeek-V3's MLA caches the compressed latent (512) and the decoupled RoPE key (64):
576 elements per token per layer, for all 128 heads together; attention runs in the
absorbed form (q.k over 512 + 64 dims, values over the 512-dim latent). Its KV layout for
the backends is one "head" of 288 elements for K and 288 for V, so that a backend's
``2 x layers x heads x head_dim x dtype`` bytes per token is the latent's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.errors import UserError


@dataclass(frozen=True)
class ArchSpec:
    name: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    num_heads: int  # query heads
    num_kv_heads: int  # KV layout heads (MLA: 1)
    head_dim: int  # KV layout head dim (MLA: 288, half the latent + rope key)
    attn_qk_dim: int  # per-head dims of q.k (GQA: head_dim; MLA absorbed: 512 + 64)
    attn_v_dim: int  # per-head dims the weights multiply (GQA: head_dim; MLA: 512)
    dense_params: int  # linear weights every token uses, all layers (no embeddings)
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    expert_params: int = 0  # routed experts' weights, all layers (MoE)
    num_experts: int = 0
    experts_per_token: int = 0

    def check_tp(self, tp: int) -> None:
        """Refuse a tensor-parallel degree the engines refuse (vLLM: the query heads split
        evenly; KV heads split evenly, or, with more ranks than KV heads, each replicated
        on ``tp / kv_heads`` ranks)."""
        h, kv = self.num_heads, self.num_kv_heads
        ok = [d for d in range(1, h + 1) if h % d == 0 and (kv % d == 0 or d % kv == 0)]
        if tp not in ok:
            why = (f"must divide its {h} query heads" if h % tp else
                   f"must divide its {kv} KV heads or be a multiple of them")
            raise UserError(f"roofline.tp={tp} {why} for {self.name} (vLLM refuses it too): "
                            f"use one of {', '.join(map(str, ok))}")

    def kv_shards(self, tp: int) -> int:
        """Distinct KV-head shards over ``tp`` ranks: each rank holds ``kv_heads /
        kv_shards`` heads; past ``tp = kv_heads`` a head is replicated on ``tp /
        kv_heads`` ranks (vLLM's QKVParallelLinear), so the cache content is held
        ``tp / kv_shards`` times. MLA (one latent "head") is held whole by every rank."""
        return min(tp, self.num_kv_heads)

    @property
    def kv_elems_per_layer(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim

    @property
    def active_params(self) -> int:
        """Linear weights one token multiplies (all layers), lm_head excluded."""
        routed = self.expert_params * self.experts_per_token // max(1, self.num_experts)
        return self.dense_params + routed

    def total_params(self) -> int:
        embed = self.vocab_size * self.hidden_size
        return self.dense_params + self.expert_params + embed * (1 if self.tie_word_embeddings
                                                                 else 2)

    def expert_share_touched(self, tokens: int) -> float:
        """Expected share of routed experts a step of ``tokens`` tokens reads (each token
        picks ``experts_per_token`` of ``num_experts``, taken as uniform): the weight bytes
        a MoE step streams grow with the batch until every expert is read."""
        if not self.num_experts:
            return 0.0
        return 1.0 - (1.0 - self.experts_per_token / self.num_experts) ** max(0, tokens)


def llama_like(name: str, layers: int, hidden: int, ffn: int, heads: int, kv_heads: int,
               vocab: int, max_pos: int, head_dim: int = 128, tied: bool = False,
               qkv_bias: bool = False) -> ArchSpec:
    """A Llama-family decoder: q/k/v/o projections + SwiGLU MLP per layer."""
    q, kv = heads * head_dim, kv_heads * head_dim
    attn = hidden * (q + 2 * kv) + q * hidden + ((q + 2 * kv) if qkv_bias else 0)
    per_layer = attn + 3 * hidden * ffn
    return ArchSpec(name, layers, hidden, vocab, heads, kv_heads, head_dim, head_dim,
                    head_dim, layers * per_layer, max_pos, tied)


def _deepseek_v3() -> ArchSpec:
    # config.json of deepseek-ai/DeepSeek-V3: 61 layers (first 3 dense, FFN 18432), hidden
    # 7168, 128 heads, q_lora 1536, kv_lora 512, qk_nope 128, qk_rope 64, v_head 128;
    # 256 routed experts (FFN 2048) + 1 shared, 8 per token; vocab 129280. 671B / 37B.
    h, layers, heads, moe_layers = 7168, 61, 128, 58
    attn = (h * 1536 + 1536 * heads * (128 + 64) + h * (512 + 64)
            + 512 * heads * (128 + 128) + heads * 128 * h)
    dense_ffn = 3 * (3 * h * 18432)
    shared = moe_layers * 3 * h * 2048
    router = moe_layers * h * 256
    routed = moe_layers * 256 * 3 * h * 2048
    return ArchSpec("DeepSeek-V3", layers, h, 129280, heads, 1, 288, 512 + 64, 512,
                    layers * attn + dense_ffn + shared + router, 163840,
                    expert_params=routed, num_experts=256, experts_per_token=8)


MODEL_SPECS: dict[str, ArchSpec] = {s.name.lower(): s for s in (
    llama_like("Llama-2-7B", 32, 4096, 11008, 32, 32, 32000, 4096),
    llama_like("Llama-2-13B", 40, 5120, 13824, 40, 40, 32000, 4096),
    llama_like("Llama-3.1-8B", 32, 4096, 14336, 32, 8, 128256, 131072),
    llama_like("Llama-3.1-70B", 80, 8192, 28672, 64, 8, 128256, 131072),
    llama_like("Qwen2.5-7B", 28, 3584, 18944, 28, 4, 152064, 32768, qkv_bias=True),
    llama_like("Qwen2.5-72B", 80, 8192, 29568, 64, 8, 152064, 32768, qkv_bias=True),
    llama_like("Mistral-7B", 32, 4096, 14336, 32, 8, 32768, 32768),
    llama_like("SmolLM2-135M", 30, 576, 1536, 9, 3, 49152, 8192, head_dim=64, tied=True),
    _deepseek_v3(),
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
        from harness.roofline.hf_config import from_hf_config  # it builds on this module

        return from_hf_config(name)
    names = ", ".join(s.name for s in MODEL_SPECS.values())
    raise UserError(f"unknown roofline.model {name!r}: use one of {names}, or a path to a "
                    "Hugging Face config.json")
