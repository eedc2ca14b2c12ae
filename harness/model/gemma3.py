"""Gemma 3's decoder (Gemma Team, "Gemma 3 Technical Report", 2025), as transformers'
``Gemma3ForCausalLM`` computes it, over the same flat batch and attention seam as
:class:`~harness.model.llama.LlamaModel`.

What differs from Llama, each matched to transformers' arithmetic (logits to 1e-4 in fp32,
tests/engine/test_gemma3.py):

- RMSNorm scales by ``1 + w`` in float32, then casts (Llama: ``w x`` after the cast);
- the embedding is scaled by ``sqrt(hidden)`` (a float32 scalar cast to the weights' dtype);
- q and k are RMS-normalised per head (QK-norm) before RoPE;
- attention and MLP outputs are normalised before the residual add (post-norms), and the MLP
  has its own pre-norm; the MLP is GeGLU (tanh-approximated GELU on the gate);
- sliding layers rotate with their own RoPE base (``rope_local_theta``, 10,000), full layers
  with ``rope_theta`` (1,000,000) and ``rope_scaling``;
- the query scale is ``1/sqrt(query_pre_attn_scalar)``: the backend scales by
  ``1/sqrt(head_dim)``, so q is multiplied by ``sqrt(head_dim / query_pre_attn_scalar)``
  first (1 in the 270M, where both are 256).

Which layers slide, and how far, is the model's ``layer_attention``; the window itself is
applied by the KV backend (its per-layer window, backends.base.LayerSlot), never here.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from harness.model.config import ModelConfig
from harness.model.llama import AttentionFn, LlamaLayer, LlamaModel, empty_param
from harness.model.rope import RotaryEmbedding, rotate_pairs


def gemma_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Gemma's RMSNorm over the last dim: ``x / rms(x) * (1 + w)`` in float32, then cast."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).to(x.dtype)


class Gemma3Layer(LlamaLayer):
    """A Llama block plus QK-norms and the feed-forward's pre- and post-norms
    (``post_norm`` is the attention's post-norm here, Llama's pre-MLP norm there)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__(cfg, dtype, device)
        h, hd = cfg.hidden_size, cfg.head_dim
        self.q_norm = empty_param(hd, dtype=dtype, device=device)
        self.k_norm = empty_param(hd, dtype=dtype, device=device)
        self.pre_ff_norm = empty_param(h, dtype=dtype, device=device)
        self.post_ff_norm = empty_param(h, dtype=dtype, device=device)


class Gemma3Model(LlamaModel):
    """Gemma 3 text decoder; weights in Hugging Face's naming and convention (norm weights
    are ``w`` of ``1 + w``: the GGUF loader subtracts llama.cpp's stored shift)."""

    layer_class = Gemma3Layer

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__(config, dtype, device)
        c = config
        local = c.rope_local_theta if c.rope_local_theta is not None else c.rope_theta
        self.local_rope = RotaryEmbedding(c.head_dim, local, None, device)
        self.sliding = [bool(c.layer_attention) and c.layer_attention[i].kind != "full"
                        for i in range(c.num_layers)]
        qpas = c.query_pre_attn_scalar or c.head_dim
        self.q_scale = math.sqrt(c.head_dim / qpas)
        # transformers keeps sqrt(hidden) as a float32 tensor and casts it to the weights'
        # dtype (bf16 rounds 25.3 to 25.25): the same here.
        self.embed_scale = torch.tensor(c.hidden_size**0.5).to(dtype).item()

    def use_fused_layers(self, on: bool) -> None:
        """Gemma's norms (1 + w, four a layer) and GELU have no fused kernels here: its
        layers stay torch ops under every backend.kernel."""

    def reserve_positions(self, num_positions: int) -> None:
        super().reserve_positions(num_positions)
        self.local_rope.reserve(num_positions)

    @torch.no_grad()
    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        attn: AttentionFn,
        logits_indices: Tensor | None = None,
    ) -> Tensor:
        """As :meth:`LlamaModel.forward`: T flat tokens, int64 (T,) ids and positions,
        ``attn`` per layer; float32 logits (N or T, vocab)."""
        c = self.config
        t, eps = input_ids.shape[0], c.rms_norm_eps
        h = F.embedding(input_ids, self.embed) * self.embed_scale
        split = [c.q_size, c.kv_size, c.kv_size]
        # Each RoPE base's cos/sin gathered once a step, shared by its layers.
        rot = {False: self.rope.at(positions, h.dtype), True: self.local_rope.at(positions,
                                                                                 h.dtype)}
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, Gemma3Layer)
            x = gemma_norm(h, layer.input_norm, eps)
            q, k, v = torch.split(F.linear(x, layer.qkv_weight, layer.qkv_bias), split, dim=-1)
            q = gemma_norm(q.view(t, c.num_heads, c.head_dim), layer.q_norm, eps)
            k = gemma_norm(k.view(t, c.num_kv_heads, c.head_dim), layer.k_norm, eps)
            cos, sin = rot[self.sliding[i]]
            q, k = rotate_pairs(q, cos, sin), rotate_pairs(k, cos, sin)
            if self.q_scale != 1.0:
                q = q * self.q_scale
            o = attn(i, q, k, v.reshape(t, c.num_kv_heads, c.head_dim))
            assert o.shape == (t, c.num_heads, c.head_dim), o.shape
            h = h + gemma_norm(F.linear(o.reshape(t, c.q_size), layer.o_weight),
                               layer.post_norm, eps)
            x = gemma_norm(h, layer.pre_ff_norm, eps)
            gate, up = F.linear(x, layer.gate_up_weight).chunk(2, dim=-1)
            mlp = F.linear(F.gelu(gate, approximate="tanh") * up, layer.down_weight)
            h = h + gemma_norm(mlp, layer.post_ff_norm, eps)
        return self.logits(h, logits_indices)

    def norm(self, x: Tensor, weight: Tensor) -> Tensor:
        return gemma_norm(x, weight, self.config.rms_norm_eps)

    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """Llama's names, with Gemma's norms: ``post_attention_layernorm`` follows the
        attention, ``pre_``/``post_feedforward_layernorm`` wrap the MLP."""
        yield from super().named_weights()
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, Gemma3Layer)
            p = f"model.layers.{i}."
            yield p + "self_attn.q_norm.weight", layer.q_norm
            yield p + "self_attn.k_norm.weight", layer.k_norm
            yield p + "pre_feedforward_layernorm.weight", layer.pre_ff_norm
            yield p + "post_feedforward_layernorm.weight", layer.post_ff_norm


def make_model(config: ModelConfig, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> LlamaModel:
    """The decoder of ``config.family``, weights uninitialised."""
    cls = Gemma3Model if config.family == "gemma3" else LlamaModel
    return cls(config, dtype, device)
