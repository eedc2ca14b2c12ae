"""`flex`: PyTorch FlexAttention over the paged cache: a second paged attention
implementation, independent of the torch reference and of the Triton kernels.

The whole step is one ``flex_attention`` call per layer: the step's T query rows (decodes
and prefill chunks packed) against the cache's slots viewed as one KV sequence. Which slot
a row may see comes from the block tables, as in torch's experimental PagedAttention helper
(torch/nn/attention/experimental/_paged_attention.py):

- the ``mask_mod`` maps a KV slot to its physical block, the block to its sequence
  position (``block_pos``: the logical index of every physical block the step's tables
  name), and admits the slot when the row's own table holds that block there and the
  position is not after the row's;
- the ``BlockMask`` lists, per 128-row query block, the cache blocks named by the tables
  of the sequences in it (KV block = cache block), so compiled kernels skip the rest.

``block_pos`` is one vector (not a sequences x blocks inverse table) because a physical
block holds the same positions in every table naming it: prefix caching and forks share
leading blocks position for position (RoPE'd keys are only valid there). begin_step
asserts it.

Two KV views, one mask. On CUDA, flex_attention is compiled (fused, block-sparse) and reads
the whole cache in place. On CPU it runs eagerly, torch's unfused reference, which scores
every row against every KV slot whatever the block mask says, so there the KV sequence is
only the blocks the step's tables name, gathered once per layer. Measured on 1 CPU thread,
9 query / 3 KV heads x 64, a 256 + 99 + 39-token prefill step then 2 decodes, one layer:
in place over a 64k-slot cache 8.9 s, gathered 71 ms (whatever the cache size), `paged`'s
torch path 5 ms.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from harness.backends.base import AttentionBatch, KVLayout
from harness.backends.costs import KVCosts
from harness.backends.paged_storage import PagedStorageBackend

Q_BLOCK = 128  # query rows per BlockMask row; flex's default tile


@dataclass(slots=True)
class FlexStep:
    """The step's paged mask, built once in begin_step (not per layer).

    row_seq: int64 (T,) sequence of each row (decodes 0..nd-1, then one per chunk).
    q_pos: int64 (T,) position of each row. tables: int64 (S, W) block tables, padded with
    0. block_pos: int64 (num_blocks,) logical index of each physical block some table
    names this step, -1 for the others. kv_blocks: int64 (U,) the physical blocks gathered
    as the KV sequence, ascending; None when the whole cache is read in place.
    block_mask: over (T, KV slots).
    """

    row_seq: torch.Tensor
    q_pos: torch.Tensor
    tables: torch.Tensor
    block_pos: torch.Tensor
    kv_blocks: torch.Tensor | None
    block_mask: BlockMask
    mask_mod: Callable[..., torch.Tensor]
    num_kv: int  # KV slots the mask ranges over (gathered blocks or the whole cache)


def paged_mask_mod(tables: torch.Tensor, row_seq: torch.Tensor, q_pos: torch.Tensor,
                   block_pos: torch.Tensor, block_size: int,
                   kv_blocks: torch.Tensor | None) -> Callable[..., torch.Tensor]:
    """mask_mod(b, h, q_idx, kv_idx): kv_idx is a cache slot, or with ``kv_blocks`` a slot
    of the gathered blocks (block kv_idx // block_size is physical block kv_blocks[...])."""

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor,
                 kv_idx: torch.Tensor) -> torch.Tensor:
        blk = kv_idx // block_size
        if kv_blocks is not None:  # fixed per closure, not traced
            blk = kv_blocks[blk]
        lb = block_pos[blk]
        # lb < W always: block_pos holds table columns. -1 (not in any table) reads column
        # 0 and is rejected by lb >= 0.
        owned = tables[row_seq[q_idx], lb.clamp(min=0)] == blk
        pos = lb * block_size + kv_idx % block_size
        return (lb >= 0) & owned & (pos <= q_pos[q_idx])

    return mask_mod


class FlexBackend(PagedStorageBackend):
    name = "flex"

    def __init__(self, layout: KVLayout, device: torch.device, **options: Any) -> None:
        super().__init__(layout, device, **options)
        compiled = device.type == "cuda"
        # In place when compiled; gathered when eager (see the module docstring). Tests
        # set it to check the in-place mask on CPU.
        self.in_place = compiled
        self._flex: Callable[..., Any] = flex_attention
        self._options: dict[str, Any] | None = None
        if compiled:  # dynamic shapes after the first recompile
            bs = self.block_size
            if bs < 16 or bs & (bs - 1):
                raise ValueError(f"backend=flex on CUDA tiles each cache block with Triton: "
                                 f"backend.block_size must be a power of two >= 16, got {bs}")
            self._flex = torch.compile(flex_attention)
            # The kernel's KV tile must divide the KV block (= cache block): its default
            # tiles (64, 128) do not divide 16 or 32. The main template always: a step of
            # under 128 query rows would take flex_decoding's, which for this layout (one
            # packed sequence of all the step's rows over the whole cache) generated no
            # kernel on torch 2.11 / an H200 (NoValidChoicesError, results/gpu/2026-12-04-run1).
            self._options = {"BLOCK_N": min(bs, 64), "FORCE_USE_FLEX_ATTENTION": True}
        self._step: FlexStep | None = None

    @property
    def kernel(self) -> str:
        return "flex_compiled" if self._options is not None else "flex_eager"

    def declare_costs(self) -> KVCosts:
        return KVCosts(self.full_slot_bytes(), self.block_size)  # paged, dense

    def begin_step(self, batch: AttentionBatch) -> None:
        super().begin_step(batch)
        self._step = self._build_step(batch)

    def _build_step(self, b: AttentionBatch) -> FlexStep:
        dev, bs = self.device, self.block_size
        num_blocks = self.k_cache[0].shape[0]
        nd, chunks = b.num_decode, b.prefills
        chunk_blocks = [-(-(c.start + c.num_tokens) // bs) for c in chunks]
        width = max([b.decode_tables.shape[1] if nd else 1, *chunk_blocks])
        num_seqs = nd + len(chunks)
        tables = torch.zeros((num_seqs, width), dtype=torch.int64, device=dev)
        tables[:nd, :b.decode_tables.shape[1]] = b.decode_tables
        for i, (c, n) in enumerate(zip(chunks, chunk_blocks)):
            tables[nd + i, :n] = c.table[:n]
        nblk = torch.cat([(b.decode_lens + bs - 1) // bs,
                          torch.tensor(chunk_blocks, dtype=torch.int64, device=dev)])
        cols = torch.arange(width, device=dev)
        valid = cols < nblk.unsqueeze(1)  # (S, W): table entries holding the context
        # Invalid entries go to a spare block id (num_blocks), dropped after the scatter.
        named = torch.where(valid, tables, num_blocks)
        block_pos = torch.full((num_blocks + 1,), -1, dtype=torch.int64, device=dev)
        block_pos.scatter_(0, named.flatten(), cols.expand(num_seqs, width).flatten())
        block_pos = block_pos[:num_blocks]
        assert bool((block_pos[tables] == cols)[valid].all()), \
            "a physical block named at two positions: block_pos needs one position per block"

        kv_blocks = None
        num_kv = num_blocks
        if not self.in_place:  # KV block ids become indices into the gathered blocks
            kv_blocks = torch.unique(tables[valid])
            num_kv = len(kv_blocks)
            index = torch.full((num_blocks + 1,), num_kv, dtype=torch.int64, device=dev)
            index[kv_blocks] = torch.arange(num_kv, device=dev)
            named = index[named]
        counts = [1] * nd + [c.num_tokens for c in chunks]
        num_rows = sum(counts)
        row_seq = torch.repeat_interleave(
            torch.arange(num_seqs, device=dev),
            torch.tensor(counts, dtype=torch.int64, device=dev), output_size=num_rows)
        mask_mod = paged_mask_mod(tables, row_seq, b.positions, block_pos, bs, kv_blocks)
        block_mask = self._block_mask(b, named, chunk_blocks, num_rows, num_kv, mask_mod)
        return FlexStep(row_seq, b.positions, tables, block_pos, kv_blocks, block_mask,
                        mask_mod, num_kv * bs)

    def _block_mask(self, b: AttentionBatch, named: torch.Tensor, chunk_blocks: list[int],
                    num_rows: int, num_kv: int,
                    mask_mod: Callable[..., torch.Tensor]) -> BlockMask:
        """Per query block of Q_BLOCK rows, the KV blocks its sequences' tables name.
        named: (S, W) KV block of each table entry, num_kv where it holds no context."""
        nqb = -(-num_rows // Q_BLOCK)
        dense = torch.zeros((nqb, num_kv + 1), dtype=torch.bool, device=self.device)
        nd = b.num_decode
        if nd:
            qb = (torch.arange(nd, device=self.device) // Q_BLOCK).unsqueeze(1)
            dense[qb.expand(nd, named.shape[1]), named[:nd]] = True
        for i, (c, n) in enumerate(zip(b.prefills, chunk_blocks)):
            first, last = c.row // Q_BLOCK, (c.row + c.num_tokens - 1) // Q_BLOCK
            dense[first:last + 1].index_fill_(1, named[nd + i, :n], True)
        dense = dense[:, :num_kv]
        kv_num = dense.sum(-1, dtype=torch.int32)
        # Listed blocks first (stable: ascending ids), then the unlisted ones.
        kv_idx = torch.argsort(dense.to(torch.int8), dim=-1, descending=True, stable=True)
        return BlockMask.from_kv_blocks(
            kv_num[None, None], kv_idx.to(torch.int32)[None, None],
            BLOCK_SIZE=(Q_BLOCK, self.block_size), mask_mod=mask_mod,
            seq_lengths=(num_rows, num_kv * self.block_size), compute_q_blocks=False)

    def touch_mask(self, st: FlexStep, layers: int) -> None:
        """Count the keys the step's mask_mod admits for ``layers`` layers, evaluated on
        every (row, KV slot): decode rows first, then the prefill chunks' rows."""
        rows = torch.arange(len(st.q_pos), device=self.device)[:, None]
        kv = torch.arange(st.num_kv, device=self.device)[None, :]
        admitted = st.mask_mod(0, 0, rows, kv).sum(-1) * layers  # (T,)
        b = self.batch
        assert b is not None
        nd = b.num_decode
        self.touch_full_keys(admitted[:nd].sum())
        self.touch_prefill(admitted[nd:].sum())

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        self.store(layer, k, v)
        st = self._step
        assert st is not None
        if f := self.touch_factor(layer):
            self.touch_mask(st, f)
        kc, vc = self.k_cache[layer], self.v_cache[layer]
        if st.kv_blocks is not None:
            kc, vc = kc[st.kv_blocks], vc[st.kv_blocks]
        # (blocks, bs, KV, D) -> (1, KV, blocks * bs, D)
        keys = kc.flatten(0, 1).transpose(0, 1).unsqueeze(0)
        values = vc.flatten(0, 1).transpose(0, 1).unsqueeze(0)
        query = q.transpose(0, 1).unsqueeze(0)
        with warnings.catch_warnings():
            # Eager on CPU is the intent (torch's unfused reference), not an oversight.
            warnings.filterwarnings("ignore", message="flex_attention called without")
            out = self._flex(query, keys, values, block_mask=st.block_mask, enable_gqa=True,
                             kernel_options=self._options)
        return out.squeeze(0).transpose(0, 1)
