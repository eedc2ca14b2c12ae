"""Real models' shapes with random weights (harness.model.random_shapes): the shapes, the
loader's dispatch, seeded weights with the intended statistics, a finite forward."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from harness.model import SOURCES, load_model
from harness.model.llama import LlamaLayer
from harness.model.random_shapes import RANDOM_PRESETS, build_random


def test_shapes_are_smollm2_135m_and_llama_3_1_8b() -> None:
    small, big = RANDOM_PRESETS["random-smollm2"], RANDOM_PRESETS["random-llama8b"]
    assert round(small.num_params() / 1e6, 1) == 134.5  # FACTS.md: 134.5M
    assert round(big.num_params() / 1e9, 2) == 8.03  # Llama-3.1-8B: 8.03B
    assert (big.num_layers, big.num_heads, big.num_kv_heads, big.head_dim) == (32, 32, 8, 128)
    assert big.rope_scaling is not None and big.rope_scaling["rope_type"] == "llama3"
    assert set(RANDOM_PRESETS) <= set(SOURCES)


def test_loader_builds_a_seeded_model_whose_forward_is_finite() -> None:
    a = load_model("random-smollm2", dtype="bfloat16")
    b = load_model("random-smollm2", dtype="bfloat16")
    assert a.config.vocab_size == 49152 and "134.5M params" in a.description
    la, lb = a.model.layers[3], b.model.layers[3]
    assert isinstance(la, LlamaLayer) and isinstance(lb, LlamaLayer)
    assert torch.equal(la.qkv_weight, lb.qkv_weight)
    ids = torch.tensor(a.tokenizer.encode("hello"))

    def attn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                           v.transpose(0, 1), is_causal=True, enable_gqa=True)
        return o.transpose(0, 1)

    logits = a.model(ids, torch.arange(len(ids)), attn)
    assert logits.shape == (len(ids), 49152) and bool(torch.isfinite(logits).all())
    with pytest.raises(ValueError, match=r"takes no model\.path"):
        load_model("random-llama8b", path="/x")


def test_weights_have_the_intended_scale() -> None:
    cfg = dataclasses.replace(RANDOM_PRESETS["random-llama8b"], num_layers=1,
                              vocab_size=512, name="one-layer")
    model, _ = build_random(cfg, torch.float32, "cpu", seed=3)
    layer = model.layers[0]
    assert isinstance(layer, LlamaLayer)
    assert layer.down_weight.std().item() == pytest.approx(1 / math.sqrt(14336), rel=0.02)
    assert layer.qkv_weight.std().item() == pytest.approx(1 / math.sqrt(4096), rel=0.02)
    assert layer.input_norm.mean().item() == pytest.approx(1.0, abs=0.02)
    assert model.lm_head is not None and model.lm_head.std().item() == pytest.approx(0.4,
                                                                                     rel=0.02)
    again, _ = build_random(cfg, torch.float32, "cpu", seed=3)
    other = again.layers[0]
    assert isinstance(other, LlamaLayer) and torch.equal(other.o_weight, layer.o_weight)
