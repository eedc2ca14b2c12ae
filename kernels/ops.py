"""The Triton kernels as torch ops: ``torch.ops.kvbench.<name>``.

An op is one opaque node to dynamo, to ``make_fx`` tracing (the CPU stand-in for graph
capture) and to CUDA graph capture: the decode forward of a Triton backend traces as one
graph, where calling the launchers directly made dynamo trace into Triton's Python (or,
under the interpreter, into numpy) and break. Each op mutates its outputs in place (the
schema's ``Tensor(a!)``) and returns nothing; its fake implementation, for tracing, does
nothing. Host values a launch depends on (the decode's split count, the prefill's longest
chunk) are arguments, never read from a tensor inside.

Defined with ``torch.library.Library`` and a CompositeExplicitAutograd kernel: ~1.7 us of
dispatch a call on this CPU, against ~14 us through ``torch.library.custom_op`` (whose
Python-side autograd and schema handling run every call), measured side by side on a
no-op body. Registering imports nothing of triton (the launchers are imported when an op
first runs, after :func:`harness.kernels.runtime.triton_for` has chosen compiled or
interpreted).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

_LIB = torch.library.Library("kvbench", "DEF")  # defined once, at import


def _op(schema: str, impl: Callable[..., None]) -> None:
    """Define ``kvbench::<schema>`` with ``impl`` on every device, and a fake that does
    nothing (the op only mutates its ``!`` arguments)."""
    name = schema.split("(", 1)[0]
    _LIB.define(schema)
    _LIB.impl(name, impl, "CompositeExplicitAutograd")

    def fake(*args: Any, **kwargs: Any) -> None:
        return None
    torch.library.register_fake(f"kvbench::{name}", fake, lib=_LIB)


def _store_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor) -> None:
    from harness.kernels import store

    store.store_kv(k, v, k_cache, v_cache, slots)


def _store_kv_quant(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, k_scale: Tensor,
                    v_scale: Tensor, slots: Tensor) -> None:
    from harness.kernels import store

    store.store_kv_quant(k, v, k_cache, v_cache, k_scale, v_scale, slots)


def _paged_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, tables: Tensor, lens: Tensor,
                  out: Tensor, num_splits: int, window: int, sinks: int,
                  k_scale: Tensor | None, v_scale: Tensor | None) -> None:
    from harness.kernels import decode

    decode.paged_decode(q, k_cache, v_cache, tables, lens, num_splits=num_splits,
                        window=window, sinks=sinks, k_scale=k_scale, v_scale=v_scale, out=out)


def _paged_prefill(q: Tensor, k_cache: Tensor, v_cache: Tensor, cu_rows: Tensor,
                   starts: Tensor, tables: Tensor, max_tokens: int, out: Tensor, window: int,
                   sinks: int, k_scale: Tensor | None, v_scale: Tensor | None) -> None:
    from harness.kernels import prefill

    prefill.paged_prefill(q, k_cache, v_cache, cu_rows, starts, tables, max_tokens,
                          window=window, sinks=sinks, k_scale=k_scale, v_scale=v_scale,
                          out=out)


def _quest_select(q: Tensor, k_min: Tensor, k_max: Tensor, tables: Tensor, num_blocks: Tensor,
                  lens: Tensor, k_sel: int, block_size: int, bounds: Tensor, sel: Tensor,
                  sel_lens: Tensor) -> None:
    from harness.kernels import quest

    quest.quest_select(q, k_min, k_max, tables, num_blocks, lens, k_sel, block_size, bounds,
                       sel, sel_lens)


def _kivi_decode(q: Tensor, k_q: Tensor, v_q: Tensor, k_scale: Tensor, k_zero: Tensor,
                 v_scale: Tensor, v_zero: Tensor, slab_map: Tensor, res_k: Tensor, res_v: Tensor,
                 tables: Tensor, lens: Tensor, out: Tensor, bits: int, num_splits: int) -> None:
    from harness.kernels import kivi

    kivi.kivi_decode(q, k_q, v_q, k_scale, k_zero, v_scale, v_zero, slab_map, res_k, res_v,
                     tables, lens, bits, num_splits=num_splits, out=out)


def _slotted_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, tables: Tensor, lens: Tensor,
                    slot_pos: Tensor, out: Tensor, num_splits: int, logits: Tensor | None,
                    lse: Tensor | None) -> None:
    from harness.kernels import decode

    decode.paged_decode(q, k_cache, v_cache, tables, lens, num_splits=num_splits, out=out,
                        slot_pos=slot_pos, logits=logits, lse=lse)


def _slotted_prefill(q: Tensor, k_cache: Tensor, v_cache: Tensor, cu_rows: Tensor,
                     starts: Tensor, tables: Tensor, kv_lens: Tensor, slot_pos: Tensor,
                     max_tokens: int, out: Tensor, lse: Tensor | None) -> None:
    from harness.kernels import prefill

    prefill.paged_prefill(q, k_cache, v_cache, cu_rows, starts, tables, max_tokens, out=out,
                          slot_pos=slot_pos, kv_lens=kv_lens, lse=lse)


def _decode_weights(logits: Tensor, lse: Tensor, tables: Tensor, lens: Tensor,
                    slot_pos: Tensor, block_size: int, out: Tensor, coef: float) -> None:
    from harness.kernels import scores

    scores.decode_weights(logits, lse, tables, lens, slot_pos, block_size, out, coef=coef)


def _prefill_weights(q: Tensor, k_cache: Tensor, slot_pos: Tensor, cu_rows: Tensor,
                     starts: Tensor, tables: Tensor, kv_lens: Tensor, row_lo: Tensor,
                     row_hi: Tensor, key_limit: Tensor, lse: Tensor, out: Tensor,
                     max_slots: int, coef: float, per_head: bool) -> None:
    from harness.kernels import scores

    scores.prefill_weights(q, k_cache, slot_pos, cu_rows, starts, tables, kv_lens, row_lo,
                           row_hi, key_limit, lse, out, max_slots, coef=coef,
                           per_head=per_head)


def _rms_norm(x: Tensor, weight: Tensor, eps: float, out: Tensor) -> None:
    from harness.kernels import layers

    layers.add_rms_norm(x, None, weight, eps, out)


def _add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float,
                  out: Tensor) -> None:
    from harness.kernels import layers

    layers.add_rms_norm(x, residual, weight, eps, out)


def _rope_qkv(qkv: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, num_heads: int,
              num_kv_heads: int, head_dim: int) -> None:
    # One tensor, q and k viewed inside: an op's mutated arguments must not alias.
    from harness.kernels import layers

    t = qkv.shape[0]
    qs, ks = num_heads * head_dim, num_kv_heads * head_dim
    layers.rope_qk(qkv[:, :qs].view(t, num_heads, head_dim),
                   qkv[:, qs:qs + ks].view(t, num_kv_heads, head_dim), cos, sin, positions)


def _silu_mul(x: Tensor, out: Tensor) -> None:
    from harness.kernels import layers

    layers.silu_mul(x, out)


# harness.kernels.store.store_kv / store_kv_quant
_op("store_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots) -> ()",
    _store_kv)
_op("store_kv_quant(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
    "Tensor(c!) k_scale, Tensor(d!) v_scale, Tensor slots) -> ()", _store_kv_quant)
# harness.kernels.decode.paged_decode into out (B, H, D)
_op("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables, Tensor lens, "
    "Tensor(a!) out, int num_splits, int window, int sinks, Tensor? k_scale, "
    "Tensor? v_scale) -> ()", _paged_decode)
# harness.kernels.prefill.paged_prefill into out (T, H, D)
_op("paged_prefill(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cu_rows, Tensor starts, "
    "Tensor tables, int max_tokens, Tensor(a!) out, int window, int sinks, Tensor? k_scale, "
    "Tensor? v_scale) -> ()", _paged_prefill)
# harness.kernels.quest.quest_select: each (decode, KV head)'s chosen blocks into sel (B, KV,
# k_sel) and sel_lens (B, KV), through the scratch bounds (B, KV, W); paged_decode then
# reads them (its per-KV-head tables)
_op("quest_select(Tensor q, Tensor k_min, Tensor k_max, Tensor tables, Tensor num_blocks, "
    "Tensor lens, int k_sel, int block_size, Tensor(a!) bounds, Tensor(b!) sel, "
    "Tensor(c!) sel_lens) -> ()", _quest_select)
# harness.kernels.kivi.kivi_decode into out (B, H, D): 2/4-bit codes dequantized in the
# kernel, the residual slabs read as they are
_op("kivi_decode(Tensor q, Tensor k_q, Tensor v_q, Tensor k_scale, Tensor k_zero, "
    "Tensor v_scale, Tensor v_zero, Tensor slab_map, Tensor res_k, Tensor res_v, "
    "Tensor tables, Tensor lens, Tensor(a!) out, int bits, int num_splits) -> ()",
    _kivi_decode)
# The token-evicting methods (harness.kernels.decode / prefill over slot lists: every slot
# of the table, holes skipped), with each row's log-sum-exp (and a decode's logits) for
# harness.kernels.scores, which adds the attention weights to the slots (or, per_head, to
# (chunk, head, position): snapkv's window)
_op("slotted_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables, Tensor lens, "
    "Tensor slot_pos, Tensor(a!) out, int num_splits, Tensor(b!)? logits, "
    "Tensor(c!)? lse) -> ()", _slotted_decode)
_op("slotted_prefill(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cu_rows, "
    "Tensor starts, Tensor tables, Tensor kv_lens, Tensor slot_pos, int max_tokens, "
    "Tensor(a!) out, Tensor(b!)? lse) -> ()", _slotted_prefill)
_op("decode_weights(Tensor logits, Tensor lse, Tensor tables, Tensor lens, Tensor slot_pos, "
    "int block_size, Tensor(a!) out, float coef) -> ()", _decode_weights)
_op("prefill_weights(Tensor q, Tensor k_cache, Tensor slot_pos, Tensor cu_rows, "
    "Tensor starts, Tensor tables, Tensor kv_lens, Tensor row_lo, Tensor row_hi, "
    "Tensor key_limit, Tensor lse, Tensor(a!) out, int max_slots, float coef, "
    "bool per_head) -> ()", _prefill_weights)
# harness.kernels.layers: RMSNorm (without, then with the residual add), RoPE on the q and
# k of a fused projection's output (T, (H + 2 KV) x D) in place, SiLU x mul
_op("rms_norm(Tensor x, Tensor weight, float eps, Tensor(a!) out) -> ()", _rms_norm)
_op("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps, "
    "Tensor(b!) out) -> ()", _add_rms_norm)
_op("rope_qkv(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor positions, int num_heads, "
    "int num_kv_heads, int head_dim) -> ()", _rope_qkv)
_op("silu_mul(Tensor x, Tensor(a!) out) -> ()", _silu_mul)
