"""Per-head K/V pages and their attention: the base of the methods whose heads keep
different tokens (pyramidkv, adakv, duo_attention), over per-head tables that free what
each head drops (harness.kv.headwise).

Storage: one tensor of pages for K and one for V, ``(pages, block_size, head_dim)``, a
page holding ``block_size`` tokens of one (layer, KV head); pool block b is pages
``[b * heads, (b + 1) * heads)``. The KV manager's tables are, per sequence,
``[count_0, ..., count_{heads-1}]`` then every head's pages in head order
(``HeadwiseKVManager.tables``); :meth:`HeadwiseBackend.begin_step` unpacks them once for
every layer, on the device (no value read back): each head's slots in index order and
which of them hold a token, and where each new token goes in every head. A decode attends
per KV head over what that head holds (a masked SDPA whose mask differs by head); a prefill
chunk runs before its prompt's selection, when a head's index is the position: causal SDPA.
A prompt that started from a compressed prefix (harness.kv.compressed: each head holds
what the method kept of the prefix, then every token after it) is never selected again;
its chunk's position ``t`` sits at index ``t - (end - count)`` in each head, and a query
sees every index up to its own (causal per head, the offset its head's).

A method that ranks by an observation window (``policy.needs_scores``: pyramidkv, adakv)
has the prompt's last ``window`` queries' float32 softmax weights over the keys before the
window summed by key position, per layer and query head (scratch beside the cache, kept
across prefill chunks as the window may span them, freed at the selection, not charged);
the chunk that ends the prompt turns them into each head's score (:meth:`head_scores`) and
the step's one transfer hands them to the policy by slot (the heads' own slots).
"""

from __future__ import annotations

import dataclasses
from abc import abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from harness.backends.base import AttentionBatch, CacheSizing, KVLayout, PrefillChunk
from harness.backends.costs import HeadwiseCosts, KVCosts, cdiv
from harness.backends.paged_storage import PagedStorageBackend
from harness.backends.scored import PressOptions
from harness.errors import UserError
from harness.kv.base import KVManager, StepScores
from harness.kv.headwise import HeadwiseKVManager
from harness.kv.policies.headwise import HeadPolicy, check_window
from harness.validate import one_of

POOLING = ("avg", "max")


def refuse_streaming(name: str, prefill: str) -> None:
    """Per-head tables are compacted once, when a prompt's prefill ends (a press)."""
    if prefill != "full":
        raise UserError(f"backend.prefill={prefill}: backend={name} compresses a prompt once, "
                        "at its end (each head's table is compacted then); use "
                        "backend.prefill=full")


@dataclass
class HeadPressOptions(PressOptions):
    """A per-head press ranked by SnapKV's score (kvpress's ``SnapKVPress.score``, its
    defaults): ``budget`` tokens or ``budget_ratio`` of the prompt kept on average per
    head, the prompt's last ``window`` queries scoring the rest, pooled over ``pool_width``
    positions."""

    # torch only: a kernel reading one table per (layer, KV head) is not built
    # (backends.kernel_option refuses backend.kernel=triton)
    triton_built: ClassVar[bool] = False
    window: int = 64  # the observation window (kvpress's windowtsize)
    pool_width: int = 5  # pooling over neighbouring positions (kvpress's kernel_size; odd)
    pooling: str = "avg"  # avg (kvpress) | max (the SnapKV paper's code)

    def __post_init__(self) -> None:
        super().__post_init__()
        refuse_streaming(self.name, self.prefill)
        check_window(self.window, self.pool_width)
        one_of(self, "backend", "pooling", POOLING)


def snapkv_head_scores(acc: torch.Tensor, window: int, pool_width: int, pooling: str,
                       kv_heads: int) -> torch.Tensor:
    """kvpress's SnapKV score per KV head (``SnapKVPress.score``): ``acc`` (layers, query
    heads, P - window), the window queries' weights summed per key position -> their mean,
    pooled per query head over ``pool_width`` positions (avg counts the padding, as
    ``avg_pool1d`` does), averaged over each KV head's query heads: (layers * kv_heads,
    P - window), layer-major."""
    layers, h, n = acc.shape
    x = (acc / window).reshape(layers * h, 1, n)
    pool = F.avg_pool1d if pooling == "avg" else F.max_pool1d
    x = pool(x, pool_width, stride=1, padding=pool_width // 2)
    return x.view(layers, kv_heads, h // kv_heads, n).mean(dim=2).reshape(-1, n)


class HeadwiseBackend(PagedStorageBackend):
    """Per-head pages + attention over each head's own tokens; subclasses build the
    policy (:meth:`make_policy`) and, when it reads scores, :meth:`head_scores`."""

    exact = False

    def __init__(self, layout: KVLayout, device: torch.device, **options: Any) -> None:
        super().__init__(layout, device, **options)
        self.heads = layout.num_layers * layout.num_kv_heads
        self.policy = self.make_policy()
        # Compressed once, at a prompt's end: its compressed prefixes are cached by name
        # (harness.kv.compressed), which carries every option of the method.
        self.policy.options = dataclasses.asdict(self.opts)
        self.supports_prefix_caching = self.compressed_prefixes = True
        # seq id -> (layers, query heads, P - window) window weights so far (scratch).
        self._obs: dict[int, torch.Tensor] = {}
        self._selected: list[tuple[torch.Tensor, torch.Tensor]] = []

    @abstractmethod
    def make_policy(self) -> HeadPolicy:
        """The KV manager's side of the method, from the options."""

    def head_scores(self, acc: torch.Tensor) -> torch.Tensor:
        """``acc`` (layers, query heads, P - window): the window queries' weights summed
        per key position -> each head's score of each position (heads, P - window)."""
        raise NotImplementedError(f"{type(self).__name__} reads no scores")

    @property
    def trigger(self) -> str | None:
        return "full"  # a prompt is compressed once, at its end

    def make_manager(self, sizing: CacheSizing, **options: Any) -> KVManager:
        return HeadwiseKVManager(sizing.num_blocks, sizing.block_size, self.heads,
                                 self.policy, watermark=float(options.get("watermark", 0.01)),
                                 enable_prefix_caching=bool(
                                     options.get("enable_prefix_caching", False)))

    def allocate(self, sizing: CacheSizing) -> None:
        if sizing.num_cpu_blocks:
            raise ValueError(f"backend {self.name} does not swap (its pages move per head): "
                             "use scheduler.preemption_mode=recompute and cache.swap_space=0")
        lay = self.layout
        self.block_size = sizing.block_size
        shape = (sizing.num_blocks * self.heads, sizing.block_size, lay.head_dim)
        self.k_cache = [torch.zeros(shape, dtype=lay.dtype, device=self.device)]
        self.v_cache = [torch.zeros_like(self.k_cache[0])]
        self.k_cpu: list[torch.Tensor] = []
        self.v_cpu: list[torch.Tensor] = []

    def declare_costs(self) -> KVCosts:
        return HeadwiseCosts(self.full_slot_bytes(), self.block_size, self.heads)

    # -- per step ------------------------------------------------------------------------
    def unpack(self, tables: torch.Tensor,
               pages: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``tables`` (B, W) in the KV manager's form, each head holding at most ``pages``
        pages -> (slots (B, heads, pages * block_size) of each head's indices, valid (same
        shape) those holding a token, counts (B, heads))."""
        k, bs, dev = self.heads, self.block_size, tables.device
        counts = tables[:, :k]
        npages = (counts + bs - 1) // bs
        first = k + torch.cumsum(npages, dim=1) - npages
        idx = (first.unsqueeze(-1) + torch.arange(pages, device=dev)).clamp(
            max=tables.shape[1] - 1)
        pg = tables.gather(1, idx.flatten(1)).view(-1, k, pages)
        slots = (pg.unsqueeze(-1) * bs + torch.arange(bs, device=dev)).flatten(2)
        valid = torch.arange(pages * bs, device=dev) < counts.unsqueeze(-1)
        return slots, valid, counts

    def begin_step(self, batch: AttentionBatch) -> None:
        super().begin_step(batch)
        self._selected = []
        bs, writes = self.block_size, []
        if batch.num_decode:
            # A head holds at most the context: its pages, a bound known on the host.
            ctx = max(s.start for s in batch.decode_seqs) + 1
            slots, valid, counts = self.unpack(batch.decode_tables, cdiv(ctx, bs))
            self._dec = (slots, valid)
            writes.append(slots.gather(2, (counts - 1).unsqueeze(-1)).squeeze(-1))
        self._chunk_slots: list[torch.Tensor] = []
        self._chunk_offsets: list[torch.Tensor | None] = []
        for c in batch.prefills:
            end = c.start + c.num_tokens
            # Before its selection a head holds every token, its index the position.
            slots, _, counts = self.unpack(c.table.unsqueeze(0), cdiv(end, bs))
            s = slots[0, :, :end]
            self._chunk_slots.append(s)
            if not c.sched.seq.compressed_prefix:
                self._chunk_offsets.append(None)
                writes.append(s[:, c.start:end].T)
                continue
            # From a compressed prefix: each head holds ``count`` of the ``end`` positions,
            # position t at index t + (count - end) (module docstring).
            off = counts[0] - end  # (heads,), <= 0
            self._chunk_offsets.append(off)
            idx = off[:, None] + torch.arange(c.start, end, device=off.device)
            writes.append(s.gather(1, idx).T)
        # (T, heads): where each of the step's tokens goes in every head.
        self._write = torch.cat(writes) if writes else torch.zeros(
            (0, self.heads), dtype=torch.int64, device=self.device)

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v (T, KV, D) of ``layer`` into its heads' pages."""
        kv, d = self.layout.num_kv_heads, self.layout.head_dim
        idx = self._write[:, layer * kv:(layer + 1) * kv].reshape(-1)
        for cache, x in ((self.k_cache[0], k), (self.v_cache[0], v)):
            cache.view(-1, d).index_copy_(0, idx, x.reshape(-1, d).to(cache.dtype))

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        b = self.batch
        assert b is not None
        self.store(layer, k, v)
        if layer == 0 and self.track_touches:
            self._touch()
        out = torch.empty_like(q)
        nd = b.num_decode
        if nd:
            out[:nd] = self._attend_decodes(layer, q[:nd])
        for c, s, off in zip(b.prefills, self._chunk_slots, self._chunk_offsets):
            rows = slice(c.row, c.row + c.num_tokens)
            out[rows] = self._attend_chunk(layer, q[rows], c, s) if off is None else \
                self._attend_carried(layer, q[rows], c, s, off)
        return out

    def _heads_of(self, layer: int) -> slice:
        kv = self.layout.num_kv_heads
        return slice(layer * kv, (layer + 1) * kv)

    def _gather(self, slots: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at ``slots`` (any shape S) as (*S, D)."""
        d = self.layout.head_dim
        return (self.k_cache[0].view(-1, d)[slots].to(dtype),
                self.v_cache[0].view(-1, d)[slots].to(dtype))

    def _attend_decodes(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q (B, H, D): each query head over what its KV head holds -> (B, H, D)."""
        slots, valid = self._dec
        hs = self._heads_of(layer)
        kk, vv = self._gather(slots[:, hs], q.dtype)  # (B, KV, S, D)
        bsz, h, d = q.shape
        kv, s = kk.shape[1], kk.shape[2]
        out = F.scaled_dot_product_attention(
            q.view(bsz * kv, h // kv, 1, d), kk.reshape(bsz * kv, 1, s, d),
            vv.reshape(bsz * kv, 1, s, d), attn_mask=valid[:, hs].reshape(bsz * kv, 1, 1, s),
            enable_gqa=True)
        return out.view(bsz, h, d)

    def _attend_chunk(self, layer: int, q: torch.Tensor, c: PrefillChunk,
                      slots: torch.Tensor) -> torch.Tensor:
        """q (n, H, D) of a prefill chunk; slots (heads, end) every head's, by position."""
        kk, vv = self._gather(slots[self._heads_of(layer)], q.dtype)  # (KV, end, D)
        end = c.start + c.num_tokens
        qpos = torch.arange(c.start, end, device=q.device)
        causal = torch.arange(end, device=q.device)[None, :] <= qpos[:, None]
        if layer == 0 and self.track_touches:  # every layer's mask is this one
            self.touch_prefill(causal.sum() * self.layout.num_layers)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), kk.unsqueeze(0), vv.unsqueeze(0),
            attn_mask=causal[None, None], enable_gqa=True)
        if self.policy.needs_scores:
            self._observe(layer, q, c, kk, slots)
        return out[0].transpose(0, 1)

    def _attend_carried(self, layer: int, q: torch.Tensor, c: PrefillChunk,
                        slots: torch.Tensor, off: torch.Tensor) -> torch.Tensor:
        """A chunk of a prompt that started from a compressed prefix: q (n, H, D); slots
        (heads, end) every head's by index; off (heads,) each head's index minus position.
        Each query sees its head's indices up to its own; nothing is scored (no selection
        follows)."""
        hs = self._heads_of(layer)
        kk, vv = self._gather(slots[hs], q.dtype)  # (KV, end, D)
        end = c.start + c.num_tokens
        last = torch.arange(c.start, end, device=q.device)[None, :, None] + off[:, None, None]
        seen = torch.arange(end, device=q.device) <= last  # (heads, n, end)
        if layer == 0 and self.track_touches:  # the mean over heads (HeadwiseCosts)
            self.touch_prefill(seen.sum() // self.heads * self.layout.num_layers)
        g = q.shape[1] // kk.shape[0]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), kk.unsqueeze(0), vv.unsqueeze(0),
            attn_mask=seen[hs].repeat_interleave(g, dim=0).unsqueeze(0), enable_gqa=True)
        return out[0].transpose(0, 1)

    def _observe(self, layer: int, q: torch.Tensor, c: PrefillChunk, k: torch.Tensor,
                 slots: torch.Tensor) -> None:
        """Add this chunk's window queries' weights over the keys before the window, by
        position; the chunk holding the prompt's last token hands each head's scores
        over (to :meth:`take_scores`). k (KV, end, D) this layer's keys."""
        seq = c.sched.seq
        p, w = seq.num_prompt_tokens, self.policy.window()
        lo, end = p - w, c.start + c.num_tokens
        first, last = max(c.start, lo), min(end, p)
        if lo <= 0 or first >= last or not self.policy.compresses(p) \
                or seq.compressed_prefix:
            return
        lay = self.layout
        if layer == 0 and c.start <= lo:  # the window starts in this chunk: (re)start
            self._obs[seq.seq_id] = torch.zeros((lay.num_layers, q.shape[1], lo),
                                                dtype=torch.float32, device=self.device)
        kv, d = lay.num_kv_heads, lay.head_dim
        qw = q[first - c.start:last - c.start].float()  # (n, H, D)
        n = qw.shape[0]
        qg = qw.view(n, kv, -1, d)
        logits = torch.einsum("nkgd,kld->kgnl", qg, k.float()[:, :last]) * d ** -0.5
        qpos = torch.arange(first, last, device=q.device)
        seen = torch.arange(last, device=q.device)[None, :] <= qpos[:, None]
        wt = torch.softmax(logits.masked_fill(~seen, float("-inf")), dim=-1)
        acc = self._obs.get(seq.seq_id)
        assert acc is not None, "a window's chunks run in order from its first"
        acc[layer] += wt[..., :lo].sum(dim=2).reshape(-1, lo)
        if last == p and layer == lay.num_layers - 1:
            scores = self.head_scores(self._obs.pop(seq.seq_id))  # (heads, lo)
            self._selected.append((slots[:, :lo].reshape(-1), scores.reshape(-1)))

    def take_scores(self) -> StepScores | None:
        if not self._selected:
            return None
        slots = torch.cat([s for s, _ in self._selected]).to(torch.float64)
        vals = torch.cat([v for _, v in self._selected]).to(torch.float64)
        self._selected = []
        host = torch.stack([slots, vals]).cpu().numpy()  # the step's one transfer
        return StepScores(host[0].astype(np.int64), host[1])

    # -- what the attention touched (held to the declaration under KVBENCH_CHECK) -------
    def _touch(self) -> None:
        """Every layer's decode reads at once, from the mask the layers slice: each
        decode's head-tokens (their mean over heads rounded down per decode, as declared)
        and their bytes."""
        b = self.batch
        assert b is not None
        if b.num_decode:
            held = self._dec[1].sum(dim=(1, 2))  # (B,) head-tokens
            self.touch_decode((held // self.heads * self.heads).sum(),
                              held.sum() * (self.full_slot_bytes() // self.heads))
