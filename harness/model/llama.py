"""Llama-family decoder over a flat batch of tokens, with attention supplied by the caller.

The model owns weights, norms, projections, RoPE and the MLP; it never sees a KV cache. At
every layer it hands the rotated q and the new k/v to ``attn``, the KV backend, which knows
which sequence each token belongs to, stores k/v wherever it likes and returns the attention
output. This is what lets one model run under every backend of the benchmark.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from harness.model.config import ModelConfig
from harness.model.rope import RotaryEmbedding, rotate_pairs

AttentionFn = Callable[[int, Tensor, Tensor, Tensor], Tensor]
"""``attn(layer_idx, q (T, n_heads, hd), k (T, n_kv, hd), v (T, n_kv, hd)) -> (T, n_heads, hd)``.

q and k are already rotated. The callee stores k/v and attends with scale 1/sqrt(hd).
v (and q/k on some paths) may be a non-contiguous view: copy it, do not ``.view`` it.
"""


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim, in float32 then back, as Hugging Face's LlamaRMSNorm."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def empty_param(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    # Uninitialised on purpose: every loader overwrites all weights, and initialising
    # 135M parameters only to discard them costs seconds on 2 cores.
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class LlamaLayer(nn.Module):
    """One decoder block. q/k/v and gate/up are fused into single matmuls (fewer CPU calls)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        h, qkv = cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size
        self.input_norm = empty_param(h, dtype=dtype, device=device)
        self.qkv_weight = empty_param(qkv, h, dtype=dtype, device=device)
        self.qkv_bias = empty_param(qkv, dtype=dtype, device=device) if cfg.attention_bias else None
        self.o_weight = empty_param(h, cfg.q_size, dtype=dtype, device=device)
        self.post_norm = empty_param(h, dtype=dtype, device=device)
        self.gate_up_weight = empty_param(2 * cfg.intermediate_size, h, dtype=dtype, device=device)
        self.down_weight = empty_param(h, cfg.intermediate_size, dtype=dtype, device=device)


class LlamaModel(nn.Module):
    """Llama / Mistral / Qwen2-style decoder; weights live in ``dtype`` on ``device``.

    Weight names follow Hugging Face (``model.layers.0.self_attn.q_proj.weight``...) at the
    boundary: ``load_weights`` takes them and ``hf_state_dict`` gives them back, so one
    mapping serves the safetensors loader, the GGUF loader and the random presets.
    """

    layer_class: type[LlamaLayer] = LlamaLayer

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        c = config
        self.embed = empty_param(c.vocab_size, c.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(self.layer_class(c, dtype, device)
                                    for _ in range(c.num_layers))
        self.final_norm = empty_param(c.hidden_size, dtype=dtype, device=device)
        self.lm_head = (
            None
            if c.tie_word_embeddings
            else empty_param(c.vocab_size, c.hidden_size, dtype=dtype, device=device)
        )
        self.rope = RotaryEmbedding(c.head_dim, c.rope_theta, c.rope_scaling, device)

    @property
    def device(self) -> torch.device:
        return self.embed.device

    fused = False  # the forward through harness.kernels' fused layer kernels

    def use_fused_layers(self, on: bool) -> None:
        """Run norms (with their residual adds), RoPE and SiLU x mul as the fused Triton
        kernels of harness.kernels.layers (``backend.kernel=triton``; compiled on CUDA,
        interpreted on the CPU), each a torch custom op (torch.ops.kvbench.*): ~11
        launches a layer instead of ~40. Needs the RoPE tables reserved first."""
        if on:
            assert self.rope.reserved, "reserve_positions() before the fused forward"
            import harness.kernels.ops  # noqa: F401  (registers torch.ops.kvbench.*)
        self.fused = on

    def reserve_positions(self, num_positions: int) -> None:
        """Size the RoPE tables for positions ``[0, num_positions)`` now (the engine's
        max_model_len), so that no forward reads a position back to grow them."""
        self.rope.reserve(num_positions)

    # no_grad, not inference_mode: tensors a backend allocates inside attn() would become
    # inference tensors, and the engine's later in-place writes to them outside inference
    # mode (block copies, say) would raise. Callers may still wrap the call in inference_mode.
    @torch.no_grad()
    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        attn: AttentionFn,
        logits_indices: Tensor | None = None,
    ) -> Tensor:
        """Run a flat batch of T tokens drawn from any number of sequences.

        Args:
            input_ids: int64 (T,).
            positions: int64 (T,), each token's position inside its own sequence.
            attn: the KV backend's attention, called once per layer in order.
            logits_indices: int64 (N,) rows of the batch that need logits (usually each
                sequence's last token); None means all T.

        Returns:
            float32 logits (N, vocab) or (T, vocab).
        """
        c = self.config
        t = input_ids.shape[0]
        assert positions.shape == (t,), (positions.shape, t)
        if self.fused:
            return self._forward_fused(input_ids, positions, attn, logits_indices)
        h = F.embedding(input_ids, self.embed)
        split = [c.q_size, c.kv_size, c.kv_size]
        cos, sin = self.rope.at(positions, h.dtype)  # once a step, shared by every layer
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, LlamaLayer)
            x = rms_norm(h, layer.input_norm, c.rms_norm_eps)
            q, k, v = torch.split(F.linear(x, layer.qkv_weight, layer.qkv_bias), split, dim=-1)
            q = rotate_pairs(q.view(t, c.num_heads, c.head_dim), cos, sin)
            k = rotate_pairs(k.view(t, c.num_kv_heads, c.head_dim), cos, sin)
            o = attn(i, q, k, v.reshape(t, c.num_kv_heads, c.head_dim))
            assert o.shape == (t, c.num_heads, c.head_dim), o.shape
            h = h + F.linear(o.reshape(t, c.q_size), layer.o_weight)
            x = rms_norm(h, layer.post_norm, c.rms_norm_eps)
            gate, up = F.linear(x, layer.gate_up_weight).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, layer.down_weight)
        return self.logits(h, logits_indices)

    def _forward_fused(self, input_ids: Tensor, positions: Tensor, attn: AttentionFn,
                       logits_indices: Tensor | None) -> Tensor:
        """:meth:`forward` with the fused layer kernels: the residual stream is kept apart
        and added inside the next norm (vLLM's layout), RoPE rotates q and k in the fused
        projection's output in place, the MLP's activation is one kernel."""
        ops = torch.ops.kvbench
        c, eps = self.config, self.config.rms_norm_eps
        t = input_ids.shape[0]
        residual = F.embedding(input_ids, self.embed)
        x = torch.empty_like(residual)  # each norm's output, reused layer after layer
        act = residual.new_empty(t, c.intermediate_size)
        cos, sin = self.rope.tables(residual.dtype)
        qs, ks = c.q_size, c.kv_size
        h: Tensor | None = None  # the last sublayer's output, not yet in the residual
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, LlamaLayer)
            if h is None:
                ops.rms_norm(residual, layer.input_norm, eps, x)
            else:
                ops.add_rms_norm(h, residual, layer.input_norm, eps, x)
            qkv = F.linear(x, layer.qkv_weight, layer.qkv_bias)
            ops.rope_qkv(qkv, cos, sin, positions, c.num_heads, c.num_kv_heads, c.head_dim)
            o = attn(i, qkv[:, :qs].view(t, c.num_heads, c.head_dim),
                     qkv[:, qs:qs + ks].view(t, c.num_kv_heads, c.head_dim),
                     qkv[:, qs + ks:].view(t, c.num_kv_heads, c.head_dim))
            h = F.linear(o.reshape(t, qs), layer.o_weight)
            ops.add_rms_norm(h, residual, layer.post_norm, eps, x)
            ops.silu_mul(F.linear(x, layer.gate_up_weight), act)
            h = F.linear(act, layer.down_weight)
        return self.logits(residual if h is None else residual + h, logits_indices)

    def norm(self, x: Tensor, weight: Tensor) -> Tensor:
        """The model's RMSNorm (Llama's; Gemma's scales by 1 + w)."""
        return rms_norm(x, weight, self.config.rms_norm_eps)

    def logits(self, h: Tensor, logits_indices: Tensor | None) -> Tensor:
        """float32 logits of the rows ``logits_indices`` of the last hidden states ``h``
        (T, hidden) (None: all): the final norm, then the head (tied or not)."""
        if logits_indices is not None:
            h = h[logits_indices]
        head = self.embed if self.lm_head is None else self.lm_head
        return F.linear(self.norm(h, self.final_norm), head).float()

    # ---- weights in Hugging Face naming -------------------------------------------------

    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """(HF name, destination view) for every weight, fused tensors split into views."""
        c = self.config
        yield "model.embed_tokens.weight", self.embed
        yield "model.norm.weight", self.final_norm
        if self.lm_head is not None:
            yield "lm_head.weight", self.lm_head
        qkv = [("q_proj", c.q_size), ("k_proj", c.kv_size), ("v_proj", c.kv_size)]
        ffn = c.intermediate_size
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, LlamaLayer)
            p = f"model.layers.{i}."
            yield p + "input_layernorm.weight", layer.input_norm
            yield p + "post_attention_layernorm.weight", layer.post_norm
            yield p + "self_attn.o_proj.weight", layer.o_weight
            yield p + "mlp.gate_proj.weight", layer.gate_up_weight[:ffn]
            yield p + "mlp.up_proj.weight", layer.gate_up_weight[ffn:]
            yield p + "mlp.down_proj.weight", layer.down_weight
            start = 0
            for name, size in qkv:
                yield p + f"self_attn.{name}.weight", layer.qkv_weight[start : start + size]
                if layer.qkv_bias is not None:
                    yield p + f"self_attn.{name}.bias", layer.qkv_bias[start : start + size]
                start += size

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Copy HF-named tensors in, casting to the model's dtype; every weight must appear.

        Extra ``lm_head.weight`` of a tied model and stale ``rotary_emb.inv_freq`` buffers are
        ignored; any other unknown name, a wrong shape or a missing weight is a ValueError.
        """
        targets = dict(self.named_weights())
        missing = set(targets)
        for name, tensor in weights:
            if "rotary_emb" in name or (name == "lm_head.weight" and self.lm_head is None):
                continue
            if name not in targets:
                raise ValueError(f"unexpected weight {name!r} for {self.config.name}")
            dst = targets[name]
            if tuple(tensor.shape) != tuple(dst.shape):
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} != {tuple(dst.shape)}")
            dst.copy_(tensor)
            missing.discard(name)
        if missing:
            raise ValueError(f"{self.config.name}: missing weights {sorted(missing)[:8]}...")

    def hf_state_dict(self) -> dict[str, Tensor]:
        """Weights under Hugging Face names, as contiguous copies (for safetensors)."""
        return {name: t.detach().clone().contiguous() for name, t in self.named_weights()}
