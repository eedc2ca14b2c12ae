"""Plain torch references of every kernel in this package (no triton needed).

Each mirrors one public kernel function's signature and semantics; the tests compare the
two on random data. Attention is computed in float32 with an explicit softmax, one sequence
at a time: slow, obviously correct.

Cache layout (flash-attn's): ``(num_blocks, block_size, num_kv_heads, head_dim)``. A token
at position ``p`` of a sequence lives in block ``table[p // block_size]``, slot
``p % block_size``. 1-byte caches carry float32 scales shaped
``(num_blocks, block_size, num_kv_heads)``: value = stored * scale.
"""

from __future__ import annotations

import torch

# Symmetric per-(token, KV head) quantization: scale = amax / QMAX[dtype].
QMAX: dict[torch.dtype, float] = {torch.float8_e4m3fn: 448.0, torch.int8: 127.0}


def quantize_ref(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x: (..., D) -> (stored (..., D) of ``dtype``, float32 scale (...)).

    fp8: round to nearest even onto e4m3; int8: round half to even. An all-zero vector gets
    scale 0 and stores zeros.
    """
    qmax = QMAX[dtype]
    xf = x.float()
    # A tensor divisor on x's device, not a Python number: PyTorch's CUDA division by a
    # CPU scalar multiplies by its reciprocal (BinaryDivTrueKernel.cu), 1 ulp off amax /
    # qmax for some amax; that failed the fp8/int8 store checks on the H200 (2026-12-04).
    scale = xf.abs().amax(-1) / torch.full((), qmax, dtype=torch.float32, device=x.device)
    y = (xf / torch.where(scale > 0, scale, 1.0).unsqueeze(-1)).clamp(-qmax, qmax)
    if dtype == torch.int8:
        y = torch.round(y)
    return y.to(dtype), scale


def dequantize_ref(stored: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """stored (..., D), scale (...) -> float32 (..., D)."""
    return stored.float() * scale.unsqueeze(-1)


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Write k, v (T, KV, D) into the caches at flat slots (T,) in place; slot < 0 skips."""
    keep = slots >= 0
    for x, cache in ((k, k_cache), (v, v_cache)):
        flat = cache.view(-1, *cache.shape[2:])
        flat[slots[keep]] = x[keep].to(cache.dtype)


def store_kv_quant_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
                       slots: torch.Tensor) -> None:
    """:func:`store_kv_ref` for 1-byte caches: quantize each (token, KV head) vector and
    write its scale to ``k_scale`` / ``v_scale`` (num_blocks, block_size, KV)."""
    keep = slots >= 0
    for x, cache, scales in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        stored, scale = quantize_ref(x[keep], cache.dtype)
        cache.view(-1, *cache.shape[2:])[slots[keep]] = stored
        scales.view(-1, scales.shape[2])[slots[keep]] = scale


def _sequence_kv(cache: torch.Tensor, scale: torch.Tensor | None, table: torch.Tensor,
                 ctx: int) -> torch.Tensor:
    """float32 (ctx, KV, D): a sequence's first ``ctx`` tokens through its block table."""
    nb = -(-ctx // cache.shape[1])
    x = cache[table[:nb]].flatten(0, 1)[:ctx]
    if scale is None:
        return x.float()
    return dequantize_ref(x, scale[table[:nb]].flatten(0, 1)[:ctx])


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qpos: torch.Tensor,
            window: int, sinks: int) -> torch.Tensor:
    """q (n, H, D) at positions qpos (n,) over float32 k, v (ctx, KV, D) -> float32 (n, H, D)."""
    g = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(g, dim=1)
    v = v.repeat_interleave(g, dim=1)
    kpos = torch.arange(k.shape[0], device=q.device)
    mask = kpos[None, :] <= qpos[:, None]
    if window > 0:
        mask &= (kpos[None, :] > qpos[:, None] - window) | (kpos[None, :] < sinks)
    s = torch.einsum("nhd,chd->hnc", q.float(), k) / q.shape[-1] ** 0.5
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.einsum("hnc,chd->nhd", p, v)


def paged_decode_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     tables: torch.Tensor, lens: torch.Tensor, *, window: int = 0,
                     sinks: int = 0, k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per sequence over its paged context.

    q: (B, H, D), the token at position ``lens[b] - 1``; tables: int (B, max_blocks);
    lens: int (B,) context lengths including the query token. ``window > 0``: attend only
    to the last ``window`` positions plus the first ``sinks``. Returns (B, H, D) in q.dtype.
    """
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        ctx = int(lens[b])
        k = _sequence_kv(k_cache, k_scale, tables[b], ctx)
        v = _sequence_kv(v_cache, v_scale, tables[b], ctx)
        qpos = torch.tensor([ctx - 1], device=q.device)
        out[b] = _attend(q[b:b + 1], k, v, qpos, window, sinks)[0].to(q.dtype)
    return out


def quest_blocks_ref(q: torch.Tensor, k_min: torch.Tensor, k_max: torch.Tensor,
                     table: torch.Tensor, n: int, k_sel: int) -> list[list[int]]:
    """Quest's chosen table columns of one sequence, per KV head: the last (``n - 1``)
    and the ``k_sel - 1`` others with the largest bound ``sum_d max(q_d min_d, q_d max_d)``
    (the largest over the KV head's query heads), ties to the lower column.

    q: (H, D) its query; k_min, k_max: (num_blocks, KV, D); table: int (>= n,) block ids.
    """
    kv = k_min.shape[1]
    g = q.shape[0] // kv
    out = []
    for h in range(kv):
        lo = k_min[table[:n - 1], h].float()  # (n - 1, D)
        hi = k_max[table[:n - 1], h].float()
        qs = q[h * g:(h + 1) * g].float()[:, None, :]  # (G, 1, D)
        bound = torch.maximum(qs * lo, qs * hi).sum(-1).amax(0)  # (n - 1,)
        order = sorted(range(n - 1), key=lambda c: (-float(bound[c]), c))
        out.append([*order[:k_sel - 1], n - 1])
    return out


def quest_decode_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     tables: torch.Tensor, num_blocks: torch.Tensor, lens: torch.Tensor,
                     k_min: torch.Tensor, k_max: torch.Tensor, k_sel: int) -> torch.Tensor:
    """Each KV head of each decode attends only to its :func:`quest_blocks_ref` blocks'
    tokens (explicit float32 softmax). q: (B, H, D); k_cache, v_cache: (num_blocks,
    block_size, KV, D); tables: int (B, W); num_blocks, lens: int (B,). -> (B, H, D)."""
    out = torch.empty_like(q)
    bs, kv = k_cache.shape[1], k_cache.shape[2]
    g = q.shape[1] // kv
    for b in range(q.shape[0]):
        n, ctx = int(num_blocks[b]), int(lens[b])
        for h, cols in enumerate(quest_blocks_ref(q[b], k_min, k_max, tables[b], n, k_sel)):
            pos = torch.tensor([c * bs + o for c in cols for o in range(bs)
                                if c * bs + o < ctx])
            blk, off = tables[b][pos // bs], pos % bs
            k, v = k_cache[blk, off, h].float(), v_cache[blk, off, h].float()  # (T, D)
            qs = q[b, h * g:(h + 1) * g].float()  # (G, D)
            w = torch.softmax(qs @ k.T / q.shape[-1] ** 0.5, dim=-1)
            out[b, h * g:(h + 1) * g] = (w @ v).to(q.dtype)
    return out


def kivi_unpack_ref(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 (..., D * bits / 8) -> int64 (..., D) codes: byte i holds codes
    ``i * 8 / bits ...`` from its low bits up."""
    per = 8 // bits
    out = torch.empty((*packed.shape[:-1], packed.shape[-1] * per), dtype=torch.int64)
    for j in range(per):
        out[..., j::per] = (packed.long() >> (j * bits)) & ((1 << bits) - 1)
    return out


def kivi_decode_ref(q: torch.Tensor, k_q: torch.Tensor, v_q: torch.Tensor,
                    k_scale: torch.Tensor, k_zero: torch.Tensor, v_scale: torch.Tensor,
                    v_zero: torch.Tensor, slab_map: torch.Tensor, res_k: torch.Tensor,
                    res_v: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                    bits: int) -> torch.Tensor:
    """:func:`paged_decode_ref` over a KIVI cache, one token at a time: a token of a block
    with a residual slab (``slab_map[block] >= 0``) reads it in full precision, any other
    ``code * scale + zero`` in float32 (keys' scale and zero per (block, KV head, channel),
    values' per (slot, KV head)). Shapes: :func:`harness.kernels.kivi.kivi_decode`."""
    out = torch.empty_like(q)
    bs = k_q.shape[1]
    for b in range(q.shape[0]):
        ctx = int(lens[b])
        ks, vs = [], []
        for p in range(ctx):
            blk, off = int(tables[b, p // bs]), p % bs
            slab = int(slab_map[blk])
            if slab >= 0:
                ks.append(res_k[slab, off].float())
                vs.append(res_v[slab, off].float())
                continue
            kc = kivi_unpack_ref(k_q[blk, off], bits).float()  # (KV, D)
            vc = kivi_unpack_ref(v_q[blk, off], bits).float()
            ks.append(kc * k_scale[blk].float() + k_zero[blk].float())
            vs.append(vc * v_scale[blk, off].float()[:, None] + v_zero[blk, off].float()[:, None])
        qpos = torch.tensor([ctx - 1])
        out[b] = _attend(q[b:b + 1], torch.stack(ks), torch.stack(vs), qpos, 0, 0)[0].to(q.dtype)
    return out


def paged_prefill_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      cu_rows: torch.Tensor, starts: torch.Tensor, tables: torch.Tensor, *,
                      window: int = 0, sinks: int = 0, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """Chunks of query tokens, each over its cached prefix and causally over itself.

    q: (T, H, D); chunk c is rows ``[cu_rows[c], cu_rows[c+1])`` at positions
    ``starts[c] ...``, its K/V (prefix and the chunk's own) already in the cache;
    tables: int (C, max_blocks). Rows of ``out`` (default: zeros like q) outside every
    chunk are left as they are. Returns out (T, H, D).
    """
    out = torch.zeros_like(q) if out is None else out
    for c in range(tables.shape[0]):
        r0, r1, start = int(cu_rows[c]), int(cu_rows[c + 1]), int(starts[c])
        ctx = start + r1 - r0
        k = _sequence_kv(k_cache, k_scale, tables[c], ctx)
        v = _sequence_kv(v_cache, v_scale, tables[c], ctx)
        qpos = torch.arange(start, ctx, device=q.device)
        out[r0:r1] = _attend(q[r0:r1], k, v, qpos, window, sinks).to(q.dtype)
    return out


def _held(k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor, n_slots: int,
          slot_pos: torch.Tensor) -> tuple[list[int], list[int], torch.Tensor, torch.Tensor]:
    """A slot list's keys: (slots, positions, float32 K and V (L, KV, D)) of the tokens in
    the first ``n_slots`` slots of ``table`` (holes, position < 0, left out), table order."""
    bs = k_cache.shape[1]
    slots = [int(table[j // bs]) * bs + j % bs for j in range(n_slots)]
    slots = [s for s in slots if int(slot_pos[s]) >= 0]
    pos = [int(slot_pos[s]) for s in slots]
    idx = torch.tensor(slots, dtype=torch.int64)
    k = k_cache.flatten(0, 1)[idx].float()
    v = v_cache.flatten(0, 1)[idx].float()
    return slots, pos, k, v


def _weights(q: torch.Tensor, k: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """float32 softmax weights (n, H, L) of q (n, H, D) over k (L, KV, D) where seen (n, L)."""
    g = q.shape[1] // k.shape[1]
    s = torch.einsum("nhd,lhd->nhl", q.float(), k.repeat_interleave(g, dim=1))
    s = s / q.shape[-1] ** 0.5
    return torch.softmax(s.masked_fill(~seen[:, None, :], float("-inf")), dim=-1)


def slotted_decode_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       tables: torch.Tensor, lens: torch.Tensor,
                       slot_pos: torch.Tensor) -> torch.Tensor:
    """:func:`paged_decode_ref` over slot lists: each decode attends to every token its
    table's first ``lens[b]`` slots hold (``slot_pos >= 0``), whatever their order.
    q: (B, H, D); tables: int (B, W); lens: int (B,) slots; slot_pos: int64 (slots,)."""
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        _, _, k, v = _held(k_cache, v_cache, tables[b], int(lens[b]), slot_pos)
        w = _weights(q[b:b + 1], k, torch.ones(1, k.shape[0], dtype=torch.bool))
        g = q.shape[1] // k.shape[1]
        out[b] = torch.einsum("nhl,lhd->nhd", w, v.repeat_interleave(g, dim=1))[0].to(q.dtype)
    return out


def decode_weights_ref(q: torch.Tensor, k_cache: torch.Tensor, tables: torch.Tensor,
                       lens: torch.Tensor, slot_pos: torch.Tensor, num_slots: int,
                       coef: float = 1.0) -> torch.Tensor:
    """Each slot's attention weight from its decode, summed over query heads, times
    ``coef``: float32 (num_slots,), 0 where no decode reads. Shapes: as
    :func:`slotted_decode_ref`."""
    out = torch.zeros(num_slots)
    for b in range(q.shape[0]):
        slots, _, k, _ = _held(k_cache, k_cache, tables[b], int(lens[b]), slot_pos)
        w = _weights(q[b:b + 1], k, torch.ones(1, k.shape[0], dtype=torch.bool))
        out.index_add_(0, torch.tensor(slots), w[0].sum(0) * coef)
    return out


def slotted_prefill_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        cu_rows: torch.Tensor, starts: torch.Tensor, tables: torch.Tensor,
                        kv_lens: torch.Tensor, slot_pos: torch.Tensor) -> torch.Tensor:
    """:func:`paged_prefill_ref` over slot lists: a row at position p of chunk c sees the
    tokens of its table's first ``kv_lens[c]`` slots at positions <= p. -> (T, H, D)."""
    out = torch.zeros_like(q)
    for c in range(tables.shape[0]):
        r0, r1, start = int(cu_rows[c]), int(cu_rows[c + 1]), int(starts[c])
        _, pos, k, v = _held(k_cache, v_cache, tables[c], int(kv_lens[c]), slot_pos)
        qpos = torch.arange(start, start + r1 - r0)
        w = _weights(q[r0:r1], k, torch.tensor(pos)[None, :] <= qpos[:, None])
        g = q.shape[1] // k.shape[1]
        out[r0:r1] = torch.einsum("nhl,lhd->nhd", w, v.repeat_interleave(g, dim=1)).to(q.dtype)
    return out


def prefill_weights_ref(q: torch.Tensor, k_cache: torch.Tensor, slot_pos: torch.Tensor,
                        cu_rows: torch.Tensor, starts: torch.Tensor, tables: torch.Tensor,
                        kv_lens: torch.Tensor, row_lo: torch.Tensor, row_hi: torch.Tensor,
                        key_limit: torch.Tensor, out_shape: tuple[int, ...],
                        coef: float = 1.0, per_head: bool = False) -> torch.Tensor:
    """The weights chunk rows ``[row_lo[c], row_hi[c])`` give the keys at positions below
    ``key_limit[c]`` (softmax over every key the row sees, as
    :func:`slotted_prefill_ref`), times ``coef``: summed over heads and rows by slot
    (``per_head=False``, out (num_slots,)) or over rows by (chunk, head, position) (out
    (C, H, P)). Shapes: :func:`harness.kernels.scores.prefill_weights`."""
    out = torch.zeros(out_shape)
    for c in range(tables.shape[0]):
        r0, r1, start = int(cu_rows[c]), int(cu_rows[c + 1]), int(starts[c])
        slots, pos, k, _ = _held(k_cache, k_cache, tables[c], int(kv_lens[c]), slot_pos)
        qpos = torch.arange(start, start + r1 - r0)
        kpos = torch.tensor(pos)
        w = _weights(q[r0:r1], k, kpos[None, :] <= qpos[:, None])  # (n, H, L)
        lo, hi = int(row_lo[c]), int(row_hi[c])
        w = w[lo:hi].sum(0) * coef  # (H, L)
        keep = kpos < int(key_limit[c])
        if per_head:
            out[c].index_add_(1, kpos[keep], w[:, keep])
        else:
            out.index_add_(0, torch.tensor(slots)[keep], w[:, keep].sum(0))
    return out


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) * weight, x + residual); x, residual (T, C), weight (C,).
    RMSNorm as Hugging Face's LlamaRMSNorm: in float32, rounded to x's dtype, then the
    weight."""
    s = x if residual is None else x + residual
    sf = s.float()
    y = (sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight * y, s


def rope_qk_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated copies of q (T, H, D) and k (T, KV, D): pair (i, i + D/2) of each head by
    the angle whose cos / sin (P, D/2) tables hold at its token's position (T,)."""
    c, s = cos[positions].float().unsqueeze(1), sin[positions].float().unsqueeze(1)

    def rot(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        a, b = x[..., :half].float(), x[..., half:].float()
        return torch.cat((a * c - b * s, b * c + a * s), dim=-1).to(x.dtype)

    return rot(q), rot(k)


def silu_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :I]) * x[:, I:] of x (T, 2I), in float32, in x's dtype."""
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)
