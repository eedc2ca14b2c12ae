"""A strict pure-torch stand-in for flash-attn's two paged functions, and random paged steps
to drive backends with.

flash-attn does not install without CUDA, and its Triton fallback ignores block tables, so
on CPU the flash_attn backend is tested against this stand-in: same signatures as
flash-attn 2.6-2.8, every argument rule of flash_api.cpp asserted (dtypes, int32 tables and
lengths, contiguous last dims, shapes, page size, cu_seqlens), plus the adapter's own
(causal, K/V already stored: no ``k=``/``v=``). It computes paged attention in float32 from
exactly the blocks the table names, with its own softmax (no SDPA).
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass, field

import torch

from harness.backends import get_backend
from harness.backends.base import CacheSizing, KVBackend, KVLayout
from harness.backends.flash_attn_seam import FlashAttnFns
from harness.engine.batch import build_inputs
from harness.sched.sequence import SamplingParams, SeqStatus, Sequence, SequenceGroup
from harness.sched.step import ScheduledSeq, StepRecord

HALF = (torch.float16, torch.bfloat16)


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, q: torch.Tensor,
                 block_table: torch.Tensor | None, batch: int, multiple: int) -> None:
    assert q.dtype in HALF, f"flash-attn only supports fp16 and bf16, got {q.dtype}"
    assert k_cache.dtype == q.dtype and v_cache.dtype == q.dtype, "q, k, v dtypes differ"
    assert q.device == k_cache.device == v_cache.device, "tensors on different devices"
    for t in (q, k_cache, v_cache):
        assert t.stride(-1) == 1, "Input tensor must have contiguous last dimension"
    assert block_table is not None, "the adapter always passes a block_table (paged KV)"
    assert block_table.dtype == torch.int32, "block_table must have dtype torch.int32"
    assert block_table.stride(-1) == 1, "block_table must have contiguous last dimension"
    assert block_table.device == q.device
    assert block_table.dim() == 2 and block_table.shape[0] == batch, \
        "block_table must have shape (batch_size, max_num_blocks_per_seq)"
    assert k_cache.dim() == 4 and v_cache.shape == k_cache.shape, \
        "paged k/v cache: (num_blocks, page_block_size, nheads_k, headdim)"
    num_blocks, page, kv_heads, d = k_cache.shape
    assert page % multiple == 0, f"Paged KV cache block size must be divisible by {multiple}"
    assert q.shape[-1] == d and d <= 256 and d % 8 == 0, f"head_dim {d}"
    assert q.shape[-2] % kv_heads == 0, \
        "Number of heads in key/value must divide number of heads in query"
    assert bool(((block_table >= 0) & (block_table < num_blocks)).all()), "block id out of range"


def _check_lengths(t: torch.Tensor, name: str, n: int) -> None:
    assert isinstance(t, torch.Tensor) and t.dtype == torch.int32, f"{name} must be int32"
    assert t.is_contiguous() and t.shape == (n,), f"{name} must be contiguous of shape ({n},)"


def paged_attention_f32(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        table: torch.Tensor, ctx: int, scale: float) -> torch.Tensor:
    """Causal attention of q (n, H, D), the last n of ``ctx`` positions, over the keys in
    the first ceil(ctx / page) blocks ``table`` names; float32. Returns (n, H, D)."""
    n, heads, _ = q.shape
    page, kv_heads = k_cache.shape[1], k_cache.shape[2]
    blocks = table[:-(-ctx // page)].long()
    k = k_cache[blocks].flatten(0, 1)[:ctx].float().repeat_interleave(heads // kv_heads, 1)
    v = v_cache[blocks].flatten(0, 1)[:ctx].float().repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    # Bottom-right aligned causal mask: query i sits at position ctx - n + i.
    qpos = torch.arange(ctx - n, ctx).unsqueeze(1)
    scores = scores.masked_fill(torch.arange(ctx).unsqueeze(0) > qpos, -math.inf)
    p = torch.exp(scores - scores.amax(-1, keepdim=True))
    return torch.einsum("hqk,khd->qhd", p / p.sum(-1, keepdim=True), v)


@dataclass
class FlashAttnStandin:
    """Strict CPU stand-in; ``calls`` records ("kvcache" | "varlen", batch size)."""

    block_multiple: int = 256
    calls: list[tuple[str, int]] = field(default_factory=list)

    def fns(self) -> FlashAttnFns:
        return FlashAttnFns(with_kvcache=self.flash_attn_with_kvcache,
                            varlen=self.flash_attn_varlen_func, version="standin",
                            block_multiple=self.block_multiple, device_types=("cpu", "cuda"))

    def flash_attn_with_kvcache(  # the signature of flash-attn 2.6-2.8
            self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            k: torch.Tensor | None = None, v: torch.Tensor | None = None,
            rotary_cos: torch.Tensor | None = None, rotary_sin: torch.Tensor | None = None,
            cache_seqlens: int | torch.Tensor | None = None,
            cache_batch_idx: torch.Tensor | None = None,
            cache_leftpad: torch.Tensor | None = None,
            block_table: torch.Tensor | None = None, softmax_scale: float | None = None,
            causal: bool = False, window_size: tuple[int, int] = (-1, -1),
            softcap: float = 0.0, rotary_interleaved: bool = True,
            alibi_slopes: torch.Tensor | None = None, num_splits: int = 0,
            return_softmax_lse: bool = False) -> torch.Tensor:
        assert k is None and v is None, "K/V are stored by the backend: no k=/v="
        assert rotary_cos is None and rotary_sin is None, "q and k arrive rotated"
        assert cache_batch_idx is None, "Paged KVcache does not support cache_batch_idx"
        assert cache_leftpad is None and alibi_slopes is None and softcap == 0.0
        assert window_size == (-1, -1) and not return_softmax_lse
        assert causal is True, "the adapter asks for causal attention"
        assert q.dim() == 4, "q: (batch_size, seqlen_q, nheads, headdim)"
        batch, seqlen_q = q.shape[0], q.shape[1]
        assert batch > 0 and seqlen_q == 1, "the adapter decodes one token per sequence"
        _check_cache(k_cache, v_cache, q, block_table, batch, self.block_multiple)
        assert block_table is not None
        assert isinstance(cache_seqlens, torch.Tensor), "cache_seqlens: int32 tensor"
        _check_lengths(cache_seqlens, "cache_seqlens", batch)
        page = k_cache.shape[1]
        lens = cache_seqlens.tolist()
        assert all(1 <= n <= block_table.shape[1] * page for n in lens), lens
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        self.calls.append(("kvcache", batch))
        out = torch.stack([paged_attention_f32(q[b], k_cache, v_cache, block_table[b], n,
                                               scale) for b, n in enumerate(lens)])
        return out.to(q.dtype)

    def flash_attn_varlen_func(  # the signature of flash-attn 2.6-2.8
            self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
            max_seqlen_k: int, dropout_p: float = 0.0, softmax_scale: float | None = None,
            causal: bool = False, window_size: tuple[int, int] = (-1, -1),
            softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None,
            deterministic: bool = False, return_attn_probs: bool = False,
            block_table: torch.Tensor | None = None) -> torch.Tensor:
        assert dropout_p == 0.0 and not return_attn_probs and alibi_slopes is None
        assert window_size == (-1, -1) and softcap == 0.0
        assert causal is True, "the adapter asks for causal attention"
        assert q.dim() == 3, "q: (total_q, nheads, headdim)"
        assert isinstance(cu_seqlens_q, torch.Tensor) and cu_seqlens_q.dim() == 1
        batch = cu_seqlens_q.shape[0] - 1
        assert batch > 0, "batch size must be positive"
        _check_lengths(cu_seqlens_q, "cu_seqlens_q", batch + 1)
        _check_lengths(cu_seqlens_k, "cu_seqlens_k", batch + 1)
        _check_cache(k, v, q, block_table, batch, self.block_multiple)
        assert block_table is not None
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        nq = [b - a for a, b in itertools.pairwise(cq)]
        nk = [b - a for a, b in itertools.pairwise(ck)]
        assert cq[0] == 0 and ck[0] == 0 and cq[-1] == q.shape[0], (cq, q.shape)
        assert min(nq) >= 1 and min(nk) >= 1, "cu_seqlens must increase"
        # The kernel sizes its grid from these: too small silently drops rows.
        assert isinstance(max_seqlen_q, int) and isinstance(max_seqlen_k, int)
        assert max_seqlen_q == max(nq) and max_seqlen_k == max(nk), (max_seqlen_q, nq)
        assert all(a <= b for a, b in zip(nq, nk)), "a chunk's context includes its queries"
        assert max(nk) <= block_table.shape[1] * k.shape[1], "block_table too narrow"
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        self.calls.append(("varlen", batch))
        out = torch.cat([paged_attention_f32(q[cq[b]:cq[b + 1]], k, v, block_table[b], nk[b],
                                             scale) for b in range(batch)])
        return out.to(q.dtype)


# -- random paged steps -------------------------------------------------------------------

@dataclass
class PagedScenario:
    """Sequences with shuffled (non-identity) block tables and random K/V, and the steps
    that write and read them. ``steps``: per step, (sequence, start, num_tokens) items;
    an item of one token is a decode (attention-wise), others are prefill chunks.
    """

    block_size: int
    num_blocks: int
    tables: list[list[int]]
    k: list[torch.Tensor]  # float32 (len, KV, D) per sequence
    v: list[torch.Tensor]
    q: list[list[torch.Tensor]]  # per step, per item: float32 (num_tokens, H, D)
    steps: list[list[tuple[int, int, int]]]


def make_scenario(lens: list[int], steps: list[list[tuple[int, int, int]]], block_size: int,
                  heads: int, kv_heads: int, head_dim: int, share: tuple[int, int] | None = None,
                  seed: int = 0) -> PagedScenario:
    """``share=(i, j)``: sequence j's first block is sequence i's (a prefix-cache hit: the
    same physical block and the same K/V), so j's steps must start at ``block_size``."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 3  # spare blocks no table names
    ids = list(range(num_blocks))
    random.Random(seed).shuffle(ids)
    tables = []
    for n in need:
        tables.append(ids[:n])
        ids = ids[n:]
    k = [torch.randn(n, kv_heads, head_dim, generator=g) for n in lens]
    v = [torch.randn(n, kv_heads, head_dim, generator=g) for n in lens]
    if share is not None:
        i, j = share
        tables[j][0] = tables[i][0]
        k[j][:block_size], v[j][:block_size] = k[i][:block_size], v[i][:block_size]
    q = [[torch.randn(n, heads, head_dim, generator=g) for _, _, n in items] for items in steps]
    return PagedScenario(block_size, num_blocks, tables, k, v, q, steps)


class FixedTables:
    """The scenario's block tables, served as a KV manager serves them (by seq id)."""

    def __init__(self, tables: list[list[int]]) -> None:
        self._tables = tables

    def tables(self, seqs: list[Sequence]) -> list[list[int]]:
        return [list(self._tables[s.seq_id]) for s in seqs]


def run_scenario(be: KVBackend, sc: PagedScenario,
                 dtype: torch.dtype) -> list[list[torch.Tensor]]:
    """Run every step through ``be`` (layer 0; already allocated with ``sc.num_blocks``
    blocks of ``sc.block_size``) via the engine's build_inputs; returns, per step and
    item, the output rows (num_tokens, H, D)."""
    bs, dev = sc.block_size, be.device
    seqs = []
    for i in range(len(sc.tables)):
        grp = SequenceGroup(i, [1], SamplingParams())
        s = Sequence(i, grp, [1] * len(sc.k[i]))
        # A one-token item is meant as a decode: the prompt ends before the first one (a
        # prompt's own last token would be prefill, ScheduledSeq.is_decode).
        s.num_prompt_tokens = min([st for steps in sc.steps for j, st, n in steps
                                   if j == i and n == 1], default=len(sc.k[i]))
        s.status = SeqStatus.RUNNING
        seqs.append(s)
    fixed = FixedTables(sc.tables)
    outs = []
    for items, qs in zip(sc.steps, sc.q):
        rec = StepRecord(0)
        for i, start, n in items:
            t = sc.tables[i]
            slots = [t[p // bs] * bs + p % bs for p in range(start, start + n)]
            rec.seqs.append(ScheduledSeq(seqs[i], start, n, slots, True))
        inputs = build_inputs(rec, fixed, dev)
        # build_inputs puts the decodes first, then the chunks, in order.
        order = ([j for j, sc_ in enumerate(rec.seqs) if sc_.is_decode]
                 + [j for j, sc_ in enumerate(rec.seqs) if not sc_.is_decode])
        q = torch.cat([qs[j] for j in order])
        k = torch.cat([sc.k[items[j][0]][items[j][1]:items[j][1] + items[j][2]] for j in order])
        v = torch.cat([sc.v[items[j][0]][items[j][1]:items[j][1] + items[j][2]] for j in order])
        be.begin_step(inputs.attn)
        out = be.attend(0, q.to(dtype).to(dev), k.to(dtype).to(dev), v.to(dtype).to(dev))
        rows, row = [torch.empty(0)] * len(items), 0
        for j in order:
            rows[j] = out[row:row + items[j][2]].cpu()
            row += items[j][2]
        outs.append(rows)
    return outs


def standard_scenario(bs: int, heads: int = 4, kv_heads: int = 2,
                      head_dim: int = 32) -> PagedScenario:
    """Three steps over five sequences (B = block size): a 1-token context, chunks ending
    mid-block, on a block boundary and one past it, an extend after a cached prefix, a
    sequence whose first block is another's (prefix hit), decodes mixed with a new
    prefill. Tables are shuffled, so logical order is not physical order."""
    h = bs // 2 + 3
    steps = [
        [(0, 0, 1), (1, 0, bs), (2, 0, h)],
        [(0, 1, 1), (1, bs, 44), (2, h, bs + 1 - h), (3, bs, bs)],
        [(1, bs + 44, 1), (2, bs + 1, 1), (3, 2 * bs, 1), (4, 0, 7)],
    ]
    return make_scenario([2, bs + 45, bs + 2, 2 * bs + 1, 7], steps, bs, heads, kv_heads,
                         head_dim, share=(1, 3))


def allocated(name: str, sc: PagedScenario, dtype: torch.dtype,
              device: torch.device | str = "cpu", **opts: object) -> KVBackend:
    """Backend ``name`` for one layer of the scenario's shape, its cache allocated."""
    heads_kv, head_dim = sc.k[0].shape[1], sc.k[0].shape[2]
    layout = KVLayout(num_layers=1, num_kv_heads=heads_kv, head_dim=head_dim, dtype=dtype)
    be = get_backend(name)(layout, torch.device(device), block_size=sc.block_size, **opts)
    be.allocate(CacheSizing(kv_budget_bytes=0, bytes_per_slot=be.bytes_per_slot(),
                            num_slots=sc.num_blocks * sc.block_size, block_size=sc.block_size,
                            num_blocks=sc.num_blocks, num_cpu_blocks=0))
    return be
