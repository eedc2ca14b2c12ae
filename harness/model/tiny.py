"""Tiny Llama-shaped models with seeded random weights, for CPU tests (like gpt-fast's
``stories15M`` in ``transformer_configs``). Vocabulary is the byte tokenizer's."""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor

from harness import layer_types
from harness.model.config import ModelConfig
from harness.model.gemma3 import make_model
from harness.model.llama import LlamaModel
from harness.model.tokenizer import ByteTokenizer

_VOCAB = ByteTokenizer().vocab_size

TINY_PRESETS: dict[str, ModelConfig] = {
    # GQA with 2 query heads per KV head, tied embeddings: the SmolLM2 shape, shrunk.
    "tiny": ModelConfig(
        name="tiny",
        vocab_size=_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        bos_token_id=ByteTokenizer.BOS,
        eos_token_ids=[ByteTokenizer.EOS],
    ),
    # Qwen2-like: q/k/v bias, untied head, odd head count, q_size (48) != hidden (64).
    "tiny-bias": ModelConfig(
        name="tiny-bias",
        vocab_size=_VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=3,
        num_kv_heads=1,
        head_dim=16,
        rope_theta=10000.0,
        attention_bias=True,
        tie_word_embeddings=False,
        max_position_embeddings=4096,
        bos_token_id=ByteTokenizer.BOS,
        eos_token_ids=[ByteTokenizer.EOS],
    ),
    # Gemma 3's architecture, shrunk: a 24-token window on 2 of every 3 layers (4 sliding, 2
    # full: three KV cache groups of 2 layers), two RoPE bases, and a query scale that is
    # not 1/sqrt(head_dim) (query_pre_attn_scalar 24, head_dim 16), so every Gemma-specific
    # path is exercised in milliseconds.
    "tiny-gemma3": ModelConfig(
        name="tiny-gemma3",
        vocab_size=_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_layers=6,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        bos_token_id=ByteTokenizer.BOS,
        eos_token_ids=[ByteTokenizer.EOS],
        layer_attention=layer_types.from_hf(
            {"sliding_window": 24, "sliding_window_pattern": 3}, 6),
        family="gemma3",
        rope_local_theta=10000.0,
        query_pre_attn_scalar=24.0,
    ),
}
# tiny's shape at SmolLM2-135M's depth (30 layers): per-layer host work (launches, syncs,
# wrappers) shows at its real multiple while the arithmetic stays negligible
# (scripts/bench_host_step.py).
TINY_PRESETS["tiny-deep"] = dataclasses.replace(TINY_PRESETS["tiny"], name="tiny-deep",
                                                num_layers=30)


# Logits are ~N(0, (_HEAD_STD * sqrt(hidden))^2), std ~3 at hidden 64: peaked enough that
# greedy choices are stable, flat enough that they depend on the whole prompt.
_HEAD_STD = 0.4


def random_weights(model: LlamaModel, seed: int = 0) -> dict[str, Tensor]:
    """Seeded float32 weights under HF names, the same whatever the model's dtype/device.

    Matrices are N(0, 1/fan_in) so every block adds unit-scale updates to the residual stream;
    embeddings and head are N(0, _HEAD_STD^2), small next to those updates.
    """
    gen = torch.Generator().manual_seed(seed)
    gemma = model.config.family == "gemma3"
    out: dict[str, Tensor] = {}
    for name, dst in model.named_weights():
        shape = tuple(dst.shape)
        if name == "model.norm.weight":
            # Zero-mean on purpose: with a tied head the logit of the current token contains
            # sum_d w_d * e_d^2, a large self-bias when w ~ 1 (greedy decoding then repeated
            # the last byte forever); random-sign w cancels it.
            w = torch.randn(shape, generator=gen)
        elif name.endswith("norm.weight"):
            # Gemma's norms scale by 1 + w: w ~ N(0, 0.01) is the same scale ~1 as Llama's.
            w = (0.0 if gemma else 1.0) + 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith(".bias"):
            w = 0.1 * torch.randn(shape, generator=gen)
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            w = _HEAD_STD * torch.randn(shape, generator=gen)
        else:
            w = torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
        out[name] = w
    return out


def build_tiny(
    name: str, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", seed: int = 0
) -> tuple[LlamaModel, ByteTokenizer]:
    """A preset from ``TINY_PRESETS`` with seeded random weights and the byte tokenizer."""
    if name not in TINY_PRESETS:
        raise ValueError(f"unknown tiny preset {name!r}; known: {sorted(TINY_PRESETS)}")
    model = make_model(TINY_PRESETS[name], dtype, device)
    model.load_weights(random_weights(model, seed).items())
    return model, ByteTokenizer()
