"""`quest`: query-aware sparse reads (Tang et al., 2024, "Quest"). Nothing is evicted.

Storage is `paged`'s, plus per block and KV head the elementwise minimum and maximum of
its keys (``k_min``, ``k_max``: (num_blocks, KV, D) per layer), kept up to date as tokens
are stored; their bytes are charged in :meth:`QuestBackend.bytes_per_slot` (1 / block_size
of the keys' bytes again). At each decode, every block of the context gets an upper bound
of the attention logit any of its keys can give the query,
``sum_d max(q_d * min_d, q_d * max_d)``, and attention reads only the top
``token_budget // block_size`` blocks (the last, partly filled block always among them).
Prefill attends densely, as in the paper. Ties rank the lower block first.

``backend.kernel``: ``torch`` gathers the chosen blocks and runs one masked SDPA call;
``triton`` (harness.kernels.quest) chooses the blocks in one kernel (bounds in float32,
as the torch path's) and attends with the paged decode kernel over each KV head's chosen
table, reading only those blocks; prefill is the paged prefill kernel, dense. ``auto``:
triton on CUDA, torch elsewhere (backends.paged).

GQA: the query heads of a KV group share one selection (a kernel reads K/V per KV head),
ranked by the largest bound over the group's heads: a block that could matter most to any
of them ranks first. A context of at most the budget reads every block: exact.

What is saved is bytes read, not held: ``attention.kv_read_bytes_per_token`` counts the
chosen blocks' K/V and every context block's min/max. The stored blocks stay what their
hashes name (the metadata is a function of a block's keys and travels with it: copies,
swaps), so prefix caching stays on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from harness.backends.base import AttentionBatch, CacheSizing, KVLayout
from harness.backends.costs import KVCosts, QuestCosts
from harness.backends.paged import PagedBackend, PagedOptions
from harness.errors import UserError
from harness.sched.step import StepRecord


@dataclass
class QuestOptions(PagedOptions):
    token_budget: int = 256  # tokens a decode attends to: token_budget // block_size blocks

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.token_budget < self.block_size:
            raise UserError(f"backend.token_budget={self.token_budget} must be at least one "
                            f"block (backend.block_size={self.block_size})")


class QuestBackend(PagedBackend):
    name = "quest"
    exact = False
    supports_groups = False  # per-layer residuals / page bounds: not per group yet
    Options = QuestOptions

    def __init__(self, layout: KVLayout, device: torch.device, **options: Any) -> None:
        super().__init__(layout, device, **options)
        assert isinstance(self.opts, QuestOptions)
        self.token_budget = self.opts.token_budget

    def meta_bytes_per_block(self) -> int:
        """k_min and k_max of one block, every layer and KV head."""
        lay = self.layout
        return 2 * lay.num_layers * lay.num_kv_heads * lay.head_dim * lay.elem_bytes

    def declare_costs(self) -> KVCosts:
        return QuestCosts(self.full_slot_bytes(), self.meta_bytes_per_block(), self.block_size,
                          self.token_budget)

    def allocate(self, sizing: CacheSizing) -> None:
        super().allocate(sizing)
        lay = self.layout
        shape = (sizing.num_blocks, lay.num_kv_heads, lay.head_dim)
        self.k_min = [torch.zeros(shape, dtype=lay.dtype, device=self.device)
                      for _ in range(lay.num_layers)]
        self.k_max = [torch.zeros_like(t) for t in self.k_min]
        cpu = (sizing.num_cpu_blocks, *shape[1:])
        self.k_min_cpu = [torch.zeros(cpu, dtype=lay.dtype) for _ in range(lay.num_layers)]
        self.k_max_cpu = [torch.zeros_like(t) for t in self.k_min_cpu]

    def swap_pairs(self) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
        return [*super().swap_pairs(), (self.k_min, self.k_min_cpu),
                (self.k_max, self.k_max_cpu)]

    def apply_cache_ops(self, rec: StepRecord) -> None:
        super().apply_cache_ops(rec)
        bs = self.block_size
        for op in rec.copies:
            # Copy-on-write copies the first slots of a block that holds exactly those
            # tokens (it is shared, so nobody wrote past them): its bounds are theirs.
            assert op.src % bs == 0 and op.dst % bs == 0 and not op.move
            for t in (*self.k_min, *self.k_max):
                t[op.dst // bs] = t[op.src // bs]

    def begin_step(self, batch: AttentionBatch) -> None:
        super().begin_step(batch)
        # A token at a block's first slot starts that block's content: the blocks whose
        # bounds every layer forgets this step, from the host's slots (a mask of the
        # device's slot mapping would read its size back, a sync a layer). None: no block
        # starts (most decode steps).
        bs = self.block_size
        slots = [d.slots[0] for d in batch.decode_seqs]
        slots += (s for c in batch.prefills for s in c.sched.slots)
        fresh = [s // bs for s in slots if s % bs == 0]
        self._fresh = self.staging.put("fresh", fresh, len(fresh)) if fresh else None
        self._select: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        if self._kernel == "triton" and batch.num_decode:
            # The selection's scratch bounds and its per-KV-head tables and lengths, shared
            # by every layer of the step (each layer's selection is read by its own decode
            # launch before the next layer writes).
            nd, width = batch.decode_tables.shape
            kv, dev = self.layout.num_kv_heads, self.device
            self._select = (
                torch.empty((nd, kv, width), dtype=torch.float32, device=dev),
                torch.empty((nd, kv, self.blocks_read(width)), dtype=torch.int64, device=dev),
                torch.empty((nd, kv), dtype=torch.int64, device=dev))

    def blocks_read(self, width: int) -> int:
        """Blocks each KV head of a decode reads, of a table ``width`` blocks wide (the last
        one among them): ``token_budget // block_size``, at most the table."""
        return min(max(1, self.token_budget // self.block_size), width)

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if self._kernel == "triton":
            # Imported here: importing triton fixes the interpreter switch for the
            # process, which triton_for() had to decide first (backends.paged).
            import harness.kernels.ops  # noqa: F401  (registers torch.ops.kvbench.*)

            self.store_triton(layer, k, v)
        else:
            super().store(layer, k, v)
        b = self.batch
        assert b is not None
        blocks = b.slot_mapping // self.block_size
        # Forget the bounds of whatever a starting block held before, then fold in every
        # key written this step.
        kmin, kmax = self.k_min[layer], self.k_max[layer]
        if self._fresh is not None:
            kmin[self._fresh] = float("inf")
            kmax[self._fresh] = float("-inf")
        k = k.to(kmin.dtype)
        idx = blocks[:, None, None].expand_as(k)
        kmin.scatter_reduce_(0, idx, k, "amin", include_self=True)
        kmax.scatter_reduce_(0, idx, k, "amax", include_self=True)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        self.store(layer, k, v)
        b = self.batch
        assert b is not None
        if self._kernel == "triton":
            return self.triton_attend(layer, q)
        out = torch.empty_like(q)
        if b.num_decode:
            out[:b.num_decode] = self.sparse_decode(layer, q[:b.num_decode])
        self.torch_prefills(layer, q, out)
        return out

    def triton_attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """The Triton path, after the store: the decodes' selection and sparse decode, the
        prefill chunks dense (two launches and one). q: (T, H, D) -> (T, H, D)."""
        from harness.kernels.decode import default_splits

        b = self.batch
        assert b is not None
        kc, vc = self.k_cache[layer], self.v_cache[layer]
        out = torch.empty_like(q)
        nd = b.num_decode
        if nd:
            assert self._select is not None
            bounds, sel, sel_lens = self._select
            k_sel = sel.shape[2]
            torch.ops.kvbench.quest_select(q[:nd], self.k_min[layer], self.k_max[layer],
                                           b.decode_tables, b.decode_num_blocks, b.decode_lens,
                                           k_sel, self.block_size, bounds, sel, sel_lens)
            splits = default_splits(nd, kc.shape[2], k_sel * self.block_size, q.device)
            torch.ops.kvbench.paged_decode(q[:nd], kc, vc, sel, sel_lens, out[:nd], splits,
                                           0, 0, None, None)
            if self.track_touches:
                self.touch_sparse(sel_lens.sum())
        self.touch_by_bounds(layer, decodes=False)
        if self._prefill is not None:
            p = self._prefill
            torch.ops.kvbench.paged_prefill(q, kc, vc, p.cu_rows, p.starts, p.tables,
                                            p.max_tokens, out, 0, 0, None, None)
        return out

    def touch_sparse(self, keys: torch.Tensor) -> None:
        """One layer's decodes read ``keys`` (key, KV head) pairs of K and V, and every
        context block's bounds."""
        b = self.batch
        assert b is not None
        lay = self.layout
        meta = self.meta_bytes_per_block() // lay.num_layers
        self.touch_decode(keys, keys * 2 * lay.head_dim * lay.elem_bytes
                          + b.decode_num_blocks.sum() * meta)

    def select_blocks(self, layer: int, q: torch.Tensor) -> tuple[torch.Tensor,
                                                                  torch.Tensor]:
        """The blocks each decode's KV heads read. q: (B, H, D). Returns ``top``: int64
        (B, k, KV) logical block indices (table columns), and ``chosen``: bool (B, k, KV),
        False where a short context leaves fewer than k blocks to choose."""
        b = self.batch
        assert b is not None
        tables, nblk = b.decode_tables, b.decode_num_blocks
        bsz, width = tables.shape
        kv_heads = self.layout.num_kv_heads
        # In float32 whatever the model's dtype (as the Triton selection): a 16-bit bound
        # would tie blocks that differ.
        qg = q.float().view(bsz, 1, kv_heads, -1, q.shape[-1])  # (B, 1, KV, G, D)
        lo = self.k_min[layer][tables].unsqueeze(3).float()  # (B, W, KV, 1, D)
        hi = self.k_max[layer][tables].unsqueeze(3).float()
        bound = torch.maximum(qg * lo, qg * hi).sum(-1).amax(-1)  # (B, W, KV)
        col = torch.arange(width, device=tables.device)[None, :, None]
        n = nblk[:, None, None]
        bound = bound.masked_fill(col >= n, float("-inf")).masked_fill(col == n - 1,
                                                                       float("inf"))
        # The k largest, ties to the lower column (a stable sort; topk's order among equal
        # values is unspecified).
        top = bound.sort(dim=1, descending=True, stable=True).indices[:, :self.blocks_read(width)]
        return top, top < n

    def sparse_decode(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Attention of each decode over its chosen blocks only. q: (B, H, D) -> (B, H, D)."""
        b = self.batch
        assert b is not None
        bs, lay = self.block_size, self.layout
        top, chosen = self.select_blocks(layer, q)
        bsz, k, kv_heads = top.shape
        phys = b.decode_tables.gather(1, top.flatten(1)).view(bsz, k, kv_heads)
        heads = torch.arange(kv_heads, device=q.device)[None, None, :]
        # (NB, KV, bs, D) views: one gather per chosen (block, KV head) -> (B, k, KV, bs, D)
        ks = self.k_cache[layer].permute(0, 2, 1, 3)[phys, heads]
        vs = self.v_cache[layer].permute(0, 2, 1, 3)[phys, heads]
        pos = top.unsqueeze(-1) * bs + torch.arange(bs, device=q.device)  # (B, k, KV, bs)
        valid = chosen.unsqueeze(-1) & (pos < b.decode_lens[:, None, None, None])
        keys = ks.permute(0, 2, 1, 3, 4).reshape(bsz, kv_heads, k * bs, lay.head_dim)
        vals = vs.permute(0, 2, 1, 3, 4).reshape(bsz, kv_heads, k * bs, lay.head_dim)
        mask = valid.permute(0, 2, 1, 3).reshape(bsz, kv_heads, 1, k * bs)
        mask = mask.repeat_interleave(q.shape[1] // kv_heads, dim=1)  # (B, H, 1, k * bs)
        out = F.scaled_dot_product_attention(q.unsqueeze(2), keys.to(q.dtype),
                                             vals.to(q.dtype), attn_mask=mask,
                                             enable_gqa=True)
        if self.track_touches:
            self.touch_sparse(valid.sum())  # the chosen tokens, per KV head
        return out.squeeze(2)
