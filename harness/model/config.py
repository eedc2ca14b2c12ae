"""Architecture description shared by every loader and by the Llama forward."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from harness.layer_types import LayerAttention

FAMILIES = ("llama", "gemma3")


@dataclass
class ModelConfig:
    """Shape and numerics of a decoder: the Llama family (Llama, Mistral, Qwen2, SmolLM2) or
    Gemma 3 (``family="gemma3"``: harness.model.gemma3).

    ``rope_scaling`` follows Hugging Face's ``config.json`` dict (``{"rope_type": "llama3",
    "factor": 8.0, ...}`` or ``{"rope_type": "linear", "factor": 2.0}``); ``None`` means plain
    RoPE. ``attention_bias`` adds biases to q/k/v only (Qwen2), never to o_proj.
    """

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # Every layer's attention (harness.layer_types; empty: full everywhere). The forward
    # never masks: each layer's window is applied by the KV backend (its LayerSlot,
    # backends.base, set by harness.stack.kv_plan).
    layer_attention: tuple[LayerAttention, ...] = ()
    # "llama" (harness.model.llama) or "gemma3" (harness.model.gemma3: QK-norm, GeGLU,
    # pre- and post-norms, scaled embeddings).
    family: str = "llama"
    # Gemma 3: the RoPE base of its sliding layers (its full layers use rope_theta and
    # rope_scaling), and the query scale 1/sqrt(query_pre_attn_scalar) (None: 1/sqrt(hd)).
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"{self.name}: num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )
        if self.family not in FAMILIES:
            raise ValueError(f"{self.name}: family must be one of {FAMILIES}, got "
                             f"{self.family!r}")
        if self.head_dim % 2 != 0:
            raise ValueError(f"{self.name}: head_dim={self.head_dim} must be even for RoPE")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        h, f = self.hidden_size, self.intermediate_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        layer = attn + 3 * h * f + 2 * h
        if self.family == "gemma3":  # pre/post feed-forward norms, q and k norms
            layer += 2 * h + 2 * self.head_dim
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_layers * layer + h + head
