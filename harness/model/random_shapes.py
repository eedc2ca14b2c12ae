"""Real models' shapes with seeded random weights: speed runs without any weights file.

``random-smollm2`` is SmolLM2-135M's architecture (FACTS.md), ``random-llama8b`` Llama-3.1-8B's
(32 layers, hidden 4096, 32 query / 8 KV heads of 128, FFN 14336, vocab 128256, llama3 RoPE
scaling, untied head). Both use the byte tokenizer: prompts are bytes (ids < 258), and the
model may sample any id of its full vocabulary, which the byte tokenizer decodes as nothing.
The outputs mean nothing; the FLOPs, bytes and KV geometry are the real ones.

Weights are drawn on the model's own device (an 8B model's fp32 weights drawn on the CPU
would take 32 GB and most of a minute), with the statistics of :mod:`harness.model.tiny`:
the same seed gives the same weights on the same kind of device, not across devices.
"""

from __future__ import annotations

import math

import torch

from harness.model.config import ModelConfig
from harness.model.llama import LlamaModel
from harness.model.tiny import _HEAD_STD as HEAD_STD
from harness.model.tokenizer import ByteTokenizer

RANDOM_PRESETS: dict[str, ModelConfig] = {
    "random-smollm2": ModelConfig(
        name="random-smollm2",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        bos_token_id=ByteTokenizer.BOS,
        eos_token_ids=[ByteTokenizer.EOS],
    ),
    "random-llama8b": ModelConfig(
        name="random-llama8b",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        tie_word_embeddings=False,
        max_position_embeddings=131072,
        bos_token_id=ByteTokenizer.BOS,
        eos_token_ids=[ByteTokenizer.EOS],
    ),
}


@torch.no_grad()
def fill_random(model: LlamaModel, seed: int = 0) -> None:
    """Draw every weight in place on the model's device: matrices N(0, 1/fan_in), norms
    1 + N(0, 0.01) (the final norm N(0, 1), as tiny's), embeddings and head N(0, HEAD_STD^2),
    biases N(0, 0.01)."""
    gen = torch.Generator(device=model.device).manual_seed(seed)
    for name, dst in model.named_weights():
        if name == "model.norm.weight":
            dst.normal_(0.0, 1.0, generator=gen)
        elif name.endswith("norm.weight"):
            dst.normal_(1.0, 0.1, generator=gen)
        elif name.endswith(".bias"):
            dst.normal_(0.0, 0.1, generator=gen)
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            dst.normal_(0.0, HEAD_STD, generator=gen)
        else:
            dst.normal_(0.0, 1.0 / math.sqrt(dst.shape[-1]), generator=gen)


def build_random(config: ModelConfig, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str = "cpu",
                 seed: int = 0) -> tuple[LlamaModel, ByteTokenizer]:
    """A model of ``config``'s shape with seeded random weights, and the byte tokenizer."""
    model = LlamaModel(config, dtype, device)
    fill_random(model, seed)
    return model, ByteTokenizer()
