"""The architecture of a model as the step model sees it (:class:`ArchSpec`): what a step
costs, never what it computes. Presets live in harness.roofline.models, the config.json
reader in harness.roofline.hf_config; both build on this module."""

from __future__ import annotations

from dataclasses import dataclass

from harness.errors import UserError
from harness.layer_types import LayerAttention


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
    moe_layers: int = 0  # layers with routed experts (0: every layer, when it has experts)
    # The MLP's width a token's activation passes through (MoE: one expert's times the
    # experts it picks, plus a shared one); 0 = unknown: the non-GEMM term then reads it
    # off the dense parameters (:meth:`mlp_width`).
    intermediate_size: int = 0
    # Every layer's attention (harness.layer_types); empty: full attention everywhere.
    layer_attention: tuple[LayerAttention, ...] = ()
    # How prefill runs its attention where it differs from decode (0: as decode). MLA:
    # vLLM and SGLang run prefill un-absorbed, q.k over the 128 + 64 dims of each head
    # and values over 128, after up-projecting each cached latent a chunk reads
    # (``prefill_upproj_params`` weights per layer: kv_b_proj); decode absorbed (576/512).
    prefill_qk_dim: int = 0
    prefill_v_dim: int = 0
    prefill_upproj_params: int = 0
    # Its FP8 checkpoint's scales are block-wise (DeepSeek-V3's 128x128; a config.json's
    # quantization_config.weight_block_size): such GEMMs reach less of the fp8 peak than
    # per-tensor ones (HardwareSpec.gemm_eff).
    fp8_block_scaled: bool = False
    # Its quantized checkpoint quantizes only the routed experts: gpt-oss's MXFP4 lists
    # self_attn, the router, the embeddings and lm_head in modules_to_not_convert (and
    # vLLM's Mxfp4Config quantizes FusedMoE alone), so the dense path reads 16-bit weights
    # whatever ``weight_dtype`` says (:meth:`dense_weight_bytes`).
    experts_only_quant: bool = False

    def dense_weight_bytes(self, weight_bytes: float) -> float:
        """Bytes a weight of the dense path (attention, router, shared and dense MLPs)
        takes when the checkpoint's linear layers are at ``weight_bytes``."""
        return max(weight_bytes, 2.0) if self.experts_only_quant else weight_bytes

    def prefill_dims(self) -> tuple[int, int]:
        """The per-head dims of q.k and of the values in prefill (chunks included)."""
        return (self.prefill_qk_dim or self.attn_qk_dim, self.prefill_v_dim or self.attn_v_dim)

    def mlp_width(self) -> float:
        """The per-token MLP activation width (the non-GEMM term's SiLU-and-mul)."""
        if self.intermediate_size:
            return float(self.intermediate_size)
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, \
            self.num_kv_heads * self.head_dim
        attn = h * (q + 2 * kv) + q * h
        return max(0.0, (self.active_params / self.num_layers - attn) / (3 * h))

    def nongemm_bytes_per_token(self, tp: int, act_bytes: float) -> float:
        """Bytes one token's non-GEMM kernels move per layer on one rank
        (:func:`nongemm_bytes`)."""
        return nongemm_bytes(self.hidden_size, self.mlp_width(), self.num_heads,
                             self.num_kv_heads, self.head_dim, tp, act_bytes)

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


def nongemm_bytes(hidden: float, ffn: float, heads: int, kv_heads: int, head_dim: int,
                  tp: int, act_bytes: float) -> float:
    """Bytes a decoder layer's non-GEMM kernels move per token on one rank: each of the two
    RMSNorms reads and writes the hidden state and reads the residual it fuses, RoPE reads
    and writes q and k (split over the ranks), SiLU-and-mul reads gate and up and writes
    their product (split), and the residual add reads two hidden states and writes one."""
    q_k = (heads + kv_heads) * head_dim / tp
    return act_bytes * (2 * 3 * hidden + 2 * q_k + 3 * ffn / tp + 3 * hidden)


def llama_like(name: str, layers: int, hidden: int, ffn: int, heads: int, kv_heads: int,
               vocab: int, max_pos: int, head_dim: int = 128, tied: bool = False,
               qkv_bias: bool = False) -> ArchSpec:
    """A Llama-family decoder: q/k/v/o projections + SwiGLU MLP per layer."""
    q, kv = heads * head_dim, kv_heads * head_dim
    attn = hidden * (q + 2 * kv) + q * hidden + ((q + 2 * kv) if qkv_bias else 0)
    per_layer = attn + 3 * hidden * ffn
    return ArchSpec(name, layers, hidden, vocab, heads, kv_heads, head_dim, head_dim,
                    head_dim, layers * per_layer, max_pos, tied, intermediate_size=ffn)


@dataclass(frozen=True)
class MLA:
    """Multi-head latent attention's sizes (DeepSeek-V2/V3, Kimi-K2): queries through a
    rank-``q_lora`` bottleneck (0: a plain projection), keys and values cached as one
    ``kv_lora`` latent plus a ``rope``-dim shared key, each head's q.k over ``nope +
    rope`` dims and values over ``v`` in prefill (up-projected from the latent)."""

    q_lora: int
    kv_lora: int
    nope: int
    rope: int
    v: int

    def __post_init__(self) -> None:
        if (self.kv_lora + self.rope) % 2:
            raise UserError(f"kv_lora_rank + qk_rope_head_dim = {self.kv_lora + self.rope} "
                            "must be even (the cache is laid out as K and V halves of the "
                            "latent)")


def fine_grained_moe(name: str, layers: int, hidden: int, vocab: int, max_pos: int,
                     heads: int, *, experts: int, per_token: int, expert_ffn: int,
                     shared_ffn: int, dense_layers: int, dense_ffn: int,
                     kv_heads: int = 0, head_dim: int = 128, qkv_bias: bool = False,
                     mla: MLA | None = None, tied: bool = False,
                     fp8_block_scaled: bool = False) -> ArchSpec:
    """A DeepSeek-style mixture of experts: the first ``dense_layers`` layers a dense
    SwiGLU of ``dense_ffn``, every later one ``experts`` routed SwiGLU experts of
    ``expert_ffn`` (``per_token`` of them a token) beside a shared expert of
    ``shared_ffn`` (0: none) and a router (hidden x experts), all run for every token.
    Attention is GQA (``kv_heads`` x ``head_dim``, GLM-4.5) or, with ``mla``, the latent
    form (DeepSeek-V3: the cache one "head" of (kv_lora + rope) / 2 elements for K and as
    many for V, so that its 2 x 1 x head_dim elements are the latent's kv_lora + rope;
    decode absorbed, prefill un-absorbed: :class:`ArchSpec`'s prefill dims). A
    multi-token-prediction layer (``num_nextn_predict_layers``) is not counted: engines
    load it only to speculate."""
    moe_layers = layers - dense_layers
    if mla is None:
        q, kv = heads * head_dim, kv_heads * head_dim
        attn = hidden * (q + 2 * kv) + q * hidden + ((q + 2 * kv) if qkv_bias else 0)
        cache_heads, cache_dim, qk, v = kv_heads, head_dim, head_dim, head_dim
        pre_qk = pre_v = upproj = 0  # prefill runs as decode
    else:
        m = mla
        q_proj = (hidden * m.q_lora + m.q_lora * heads * (m.nope + m.rope) if m.q_lora
                  else hidden * heads * (m.nope + m.rope))
        upproj = m.kv_lora * heads * (m.nope + m.v)  # kv_b_proj
        attn = q_proj + hidden * (m.kv_lora + m.rope) + upproj + heads * m.v * hidden
        cache_heads, cache_dim = 1, (m.kv_lora + m.rope) // 2
        qk, v = m.kv_lora + m.rope, m.kv_lora
        pre_qk, pre_v = m.nope + m.rope, m.v
    dense = (layers * attn + dense_layers * 3 * hidden * dense_ffn
             + moe_layers * (3 * hidden * shared_ffn + hidden * experts))
    return ArchSpec(name, layers, hidden, vocab, heads, cache_heads, cache_dim, qk, v,
                    dense, max_pos, tied,
                    expert_params=moe_layers * experts * 3 * hidden * expert_ffn,
                    num_experts=experts, experts_per_token=per_token, moe_layers=moe_layers,
                    intermediate_size=per_token * expert_ffn + shared_ffn,
                    prefill_qk_dim=pre_qk, prefill_v_dim=pre_v,
                    prefill_upproj_params=upproj, fp8_block_scaled=fp8_block_scaled)
