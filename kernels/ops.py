"""The Triton kernels as torch custom ops: ``torch.ops.kvbench.<name>``.

A custom op is one opaque node to dynamo and to CUDA graph capture: the decode forward of
a Triton backend traces as one graph, where calling the launchers directly made dynamo
trace into Triton's Python (or, under the interpreter, into numpy) and break. Each op
mutates its outputs in place and returns nothing; its fake implementation (for tracing)
does nothing either, so it costs nothing to trace. Host values a launch depends on (the
decode's split count, the prefill's longest chunk) are arguments, never read from a
tensor inside.

Registering imports nothing of triton (the launchers are imported when an op first runs,
after :func:`harness.kernels.runtime.triton_for` has chosen compiled or interpreted).
"""

from __future__ import annotations

import torch
from torch import Tensor

_M = "kvbench"


@torch.library.custom_op(f"{_M}::store_kv", mutates_args=("k_cache", "v_cache"))
def store_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor) -> None:
    """:func:`harness.kernels.store.store_kv`."""
    from harness.kernels import store

    store.store_kv(k, v, k_cache, v_cache, slots)


@store_kv.register_fake
def _(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor) -> None:
    return None


@torch.library.custom_op(f"{_M}::store_kv_quant",
                         mutates_args=("k_cache", "v_cache", "k_scale", "v_scale"))
def store_kv_quant(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, k_scale: Tensor,
                   v_scale: Tensor, slots: Tensor) -> None:
    """:func:`harness.kernels.store.store_kv_quant`."""
    from harness.kernels import store

    store.store_kv_quant(k, v, k_cache, v_cache, k_scale, v_scale, slots)


@store_kv_quant.register_fake
def _(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, k_scale: Tensor,
      v_scale: Tensor, slots: Tensor) -> None:
    return None


@torch.library.custom_op(f"{_M}::paged_decode", mutates_args=("out",))
def paged_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, tables: Tensor, lens: Tensor,
                 out: Tensor, num_splits: int, window: int, sinks: int,
                 k_scale: Tensor | None, v_scale: Tensor | None) -> None:
    """:func:`harness.kernels.decode.paged_decode` into ``out`` (B, H, D)."""
    from harness.kernels import decode

    decode.paged_decode(q, k_cache, v_cache, tables, lens, num_splits=num_splits,
                        window=window, sinks=sinks, k_scale=k_scale, v_scale=v_scale,
                        out=out)


@paged_decode.register_fake
def _(q: Tensor, k_cache: Tensor, v_cache: Tensor, tables: Tensor, lens: Tensor, out: Tensor,
      num_splits: int, window: int, sinks: int, k_scale: Tensor | None,
      v_scale: Tensor | None) -> None:
    return None


@torch.library.custom_op(f"{_M}::paged_prefill", mutates_args=("out",))
def paged_prefill(q: Tensor, k_cache: Tensor, v_cache: Tensor, cu_rows: Tensor,
                  starts: Tensor, tables: Tensor, max_tokens: int, out: Tensor, window: int,
                  sinks: int, k_scale: Tensor | None, v_scale: Tensor | None) -> None:
    """:func:`harness.kernels.prefill.paged_prefill` into ``out`` (T, H, D)."""
    from harness.kernels import prefill

    prefill.paged_prefill(q, k_cache, v_cache, cu_rows, starts, tables, max_tokens,
                          window=window, sinks=sinks, k_scale=k_scale, v_scale=v_scale,
                          out=out)


@paged_prefill.register_fake
def _(q: Tensor, k_cache: Tensor, v_cache: Tensor, cu_rows: Tensor, starts: Tensor,
      tables: Tensor, max_tokens: int, out: Tensor, window: int, sinks: int,
      k_scale: Tensor | None, v_scale: Tensor | None) -> None:
    return None


@torch.library.custom_op(f"{_M}::rms_norm", mutates_args=("out",))
def rms_norm(x: Tensor, weight: Tensor, eps: float, out: Tensor) -> None:
    """:func:`harness.kernels.layers.add_rms_norm` without a residual: ``out`` (T, C)."""
    from harness.kernels import layers

    layers.add_rms_norm(x, None, weight, eps, out)


@rms_norm.register_fake
def _(x: Tensor, weight: Tensor, eps: float, out: Tensor) -> None:
    return None


@torch.library.custom_op(f"{_M}::add_rms_norm", mutates_args=("residual", "out"))
def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float, out: Tensor) -> None:
    """:func:`harness.kernels.layers.add_rms_norm`: ``residual += x``, ``out`` its norm."""
    from harness.kernels import layers

    layers.add_rms_norm(x, residual, weight, eps, out)


@add_rms_norm.register_fake
def _(x: Tensor, residual: Tensor, weight: Tensor, eps: float, out: Tensor) -> None:
    return None


@torch.library.custom_op(f"{_M}::rope_qkv", mutates_args=("qkv",))
def rope_qkv(qkv: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, num_heads: int,
             num_kv_heads: int, head_dim: int) -> None:
    """:func:`harness.kernels.layers.rope_qk` on the q and k parts of a fused projection's
    output ``qkv`` (T, (H + 2 KV) x D), in place (one tensor: the op's mutated inputs
    must not alias each other)."""
    from harness.kernels import layers

    t = qkv.shape[0]
    qs, ks = num_heads * head_dim, num_kv_heads * head_dim
    layers.rope_qk(qkv[:, :qs].view(t, num_heads, head_dim),
                   qkv[:, qs:qs + ks].view(t, num_kv_heads, head_dim), cos, sin, positions)


@rope_qkv.register_fake
def _(qkv: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, num_heads: int,
      num_kv_heads: int, head_dim: int) -> None:
    return None


@torch.library.custom_op(f"{_M}::silu_mul", mutates_args=("out",))
def silu_mul(x: Tensor, out: Tensor) -> None:
    """:func:`harness.kernels.layers.silu_mul`: ``out`` (T, I) from gate/up x (T, 2I)."""
    from harness.kernels import layers

    layers.silu_mul(x, out)


@silu_mul.register_fake
def _(x: Tensor, out: Tensor) -> None:
    return None
