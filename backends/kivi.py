"""`kivi`: 2- or 4-bit asymmetric K/V (Liu et al., 2024, "KIVI"), with a full-precision
residual.

Keys are quantized per channel, in groups of one block's tokens (outlier channels keep
their own range); values per token (one group per token and KV head); scale and zero point
in float16 (backends.kivi_quant). A block is quantized when it fills: until then it lives
in full precision in a residual block, KIVI's residual of recent tokens. Attention
dequantizes (torch path) and reads the residual as it is.

Bytes, all charged: per slot, the packed codes of K and V, the values' scale and zero, and
a block's share of the keys' per-channel scale and zero (:meth:`bytes_per_slot`); and
``backend.residual_blocks`` full-precision blocks taken off the budget before it is divided
into slots (:meth:`reserved_bytes`). A sequence holds at most one partly filled block
(forks sharing it hold one between them), so the default (32) covers
scheduler.max_num_seqs' default; more sequences at once grow the residual pool, with a
warning, beyond the budget.

The residual is tracked per block: a block starting at this step's first slot takes a free
residual block, one that fills is quantized from it and gives it back, and a partly filled
block that dies (its sequence finished or was preempted) gives it back through the step
record's ``invalidated`` slots (:class:`~harness.kv.residual.ResidualKVManager`).
Quantization is deterministic, so a full block is what its hash names: prefix caching
stays on. It does not swap.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch

from harness.backends.base import AttentionBatch, CacheSizing, KVLayout
from harness.backends.kivi_quant import SCALE_DTYPE, dequantize, pack, quantize, unpack
from harness.backends.paged import PagedBackend, PagedOptions
from harness.errors import UserError
from harness.kv.base import KVManager
from harness.kv.residual import ResidualKVManager
from harness.sched.step import StepRecord

SCALE_BYTES = SCALE_DTYPE.itemsize


@dataclass
class KIVIOptions(PagedOptions):
    bits: int = 2  # 2 or 4
    residual_blocks: int = 32  # full-precision blocks for the sequences' partial blocks

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.bits not in (2, 4):
            raise UserError(f"backend.bits must be 2 or 4, got {self.bits}")
        if self.residual_blocks < 1:
            raise UserError(f"backend.residual_blocks must be >= 1, got "
                            f"{self.residual_blocks}")
        if self.kernel == "triton":
            raise UserError("kivi runs on the torch path: use backend.kernel=torch or auto")


@dataclass(slots=True)
class StorePlan:
    """Where this step's new tokens go, built once per step on the host. Batch rows
    ``res_rows`` go to residual slots ``res_slots``; the blocks ``blocks`` are quantized
    this step, the first from the rows ``direct_rows`` (whole blocks written this step,
    bs rows each), the rest from their residual blocks ``seal_slabs``."""

    res_rows: torch.Tensor
    res_slots: torch.Tensor
    direct_rows: torch.Tensor
    seal_slabs: torch.Tensor
    blocks: torch.Tensor


class KIVIBackend(PagedBackend):
    name = "kivi"
    exact = False
    Options = KIVIOptions

    def __init__(self, layout: KVLayout, device: torch.device, **options: Any) -> None:
        super().__init__(layout, device, **options)
        o = self.opts
        assert isinstance(o, KIVIOptions)
        self.bits, self.residual_blocks = o.bits, o.residual_blocks

    def requested_kernel(self) -> str:
        return "torch"

    # -- bytes ----------------------------------------------------------------------------
    def _token_bytes(self) -> int:
        """One token, one layer and KV head: packed K and V codes + the value's scale and
        zero."""
        return 2 * self.layout.head_dim * self.bits // 8 + 2 * SCALE_BYTES

    def _block_bytes(self) -> int:
        """One quantized block, all layers and KV heads, with its keys' scales and zeros."""
        lay = self.layout
        per_head = self.block_size * self._token_bytes() + 2 * lay.head_dim * SCALE_BYTES
        return lay.num_layers * lay.num_kv_heads * per_head

    def bytes_per_slot(self) -> int:
        return -(-self._block_bytes() // self.block_size)

    def reserved_bytes(self) -> int:
        full = super().bytes_per_slot()  # 2 x L x KV x D x compute dtype bytes
        return self.residual_blocks * self.block_size * full

    def decode_read_bytes(self, batch: AttentionBatch) -> torch.Tensor:
        # The context's full blocks quantized, its partial last block in full precision.
        lens, bs = batch.decode_lens, self.block_size
        return ((lens // bs).sum() * self._block_bytes()
                + (lens % bs).sum() * super().bytes_per_slot())

    # -- storage --------------------------------------------------------------------------
    def make_manager(self, sizing: CacheSizing, **options: Any) -> KVManager:
        return ResidualKVManager(sizing.num_blocks, sizing.block_size,
                                 num_cpu_blocks=sizing.num_cpu_blocks, **options)

    def allocate(self, sizing: CacheSizing) -> None:
        if sizing.num_cpu_blocks:
            raise ValueError("backend kivi does not swap: use "
                             "scheduler.preemption_mode=recompute and cache.swap_space=0")
        lay, dev = self.layout, self.device
        if lay.head_dim * self.bits % 8:
            raise ValueError(f"kivi packs codes along head_dim: {lay.head_dim} x "
                             f"{self.bits} bits is not whole bytes")
        self.block_size = bs = sizing.block_size
        nb, kvh, d = sizing.num_blocks, lay.num_kv_heads, lay.head_dim
        packed = (nb, bs, kvh, d * self.bits // 8)
        self.k_q = [torch.zeros(packed, dtype=torch.uint8, device=dev)
                    for _ in range(lay.num_layers)]
        self.v_q = [torch.zeros_like(t) for t in self.k_q]
        # Keys: scale and zero per (block, KV head, channel); values: per (slot, KV head).
        self.k_scale = [torch.zeros((nb, kvh, d), dtype=SCALE_DTYPE, device=dev)
                        for _ in range(lay.num_layers)]
        self.k_zero = [torch.zeros_like(t) for t in self.k_scale]
        self.v_scale = [torch.zeros((nb, bs, kvh), dtype=SCALE_DTYPE, device=dev)
                        for _ in range(lay.num_layers)]
        self.v_zero = [torch.zeros_like(t) for t in self.v_scale]
        self.res_k = [torch.zeros((self.residual_blocks, bs, kvh, d), dtype=lay.dtype,
                                  device=dev) for _ in range(lay.num_layers)]
        self.res_v = [torch.zeros_like(t) for t in self.res_k]
        self.k_cpu: list[torch.Tensor] = []
        self.v_cpu: list[torch.Tensor] = []
        self.slab_of: dict[int, int] = {}  # block -> its residual block (partial blocks)
        self.free_slabs = list(range(self.residual_blocks - 1, -1, -1))
        self.slab_map = torch.full((nb,), -1, dtype=torch.int64, device=dev)
        self.residual_peak = 0

    def slot_tensors(self) -> list[torch.Tensor]:
        return []  # only partial blocks are copied (copy-on-write): their residual moves

    def apply_cache_ops(self, rec: StepRecord) -> None:
        assert not rec.swap_in and not rec.swap_out
        bs = self.block_size
        dead = {s // bs for s in rec.invalidated}
        for b in dead & self.slab_of.keys():
            self.free_slabs.append(self.slab_of.pop(b))
        if dead:
            self.slab_map[torch.tensor(sorted(dead), device=self.device)] = -1
        for op in rec.copies:  # a shared partial block copied for its writer
            src, dst = op.src // bs, op.dst // bs
            slab = self._take_slab()
            self.slab_of[dst] = slab
            self.slab_map[dst] = slab
            for t in (*self.res_k, *self.res_v):
                t[slab, :op.num_slots] = t[self.slab_of[src], :op.num_slots]

    def _take_slab(self) -> int:
        if not self.free_slabs:
            # More sequences hold a partial block than residual_blocks: grow beyond the
            # budget rather than fail, and say so.
            n = len(self.slab_of)
            print(f"kvbench: kivi needs more than backend.residual_blocks={n} residual "
                  "blocks (more sequences at once than it was sized for); growing beyond "
                  "the budget", file=sys.stderr)
            self.res_k = [torch.cat([t, torch.zeros_like(t[:n])]) for t in self.res_k]
            self.res_v = [torch.cat([t, torch.zeros_like(t[:n])]) for t in self.res_v]
            self.free_slabs = list(range(2 * n - 1, n - 1, -1))
        slab = self.free_slabs.pop()
        self.residual_peak = max(self.residual_peak, len(self.slab_of) + 1)
        return slab

    def begin_step(self, batch: AttentionBatch) -> None:
        super().begin_step(batch)
        bs = self.block_size
        res_rows: list[int] = []
        res_slots: list[int] = []
        direct_rows: list[int] = []
        direct_blocks: list[int] = []
        seal_slabs: list[int] = []
        seal_blocks: list[int] = []
        started: list[int] = []
        chunks = [(i, s) for i, s in enumerate(batch.decode_seqs)]
        chunks += [(c.row, c.sched) for c in batch.prefills]
        for row0, sc in chunks:
            i = 0
            while i < sc.num_tokens:
                b, off = divmod(sc.slots[i], bs)
                run = min(sc.num_tokens - i, bs - off)  # this chunk's tokens in block b
                rows = range(row0 + i, row0 + i + run)
                i += run
                if off == 0 and run == bs:  # written whole this step: quantize directly
                    direct_rows += rows
                    direct_blocks.append(b)
                    continue
                if off == 0:
                    self.slab_of[b] = self._take_slab()
                    started.append(b)
                slab = self.slab_of[b]
                res_rows += rows
                res_slots += range(slab * bs + off, slab * bs + off + run)
                if off + run == bs:  # it fills: quantize from the residual
                    seal_slabs.append(slab)
                    seal_blocks.append(b)
        # Freed only now: a residual block sealed this step is read by this step's store.
        for b in seal_blocks:
            self.free_slabs.append(self.slab_of.pop(b))
        dev = self.device

        def t(xs: list[int]) -> torch.Tensor:
            return torch.tensor(xs, dtype=torch.int64, device=dev)

        if started:  # none of them fills this step (that would be a direct block)
            self.slab_map[t(started)] = t([self.slab_of[b] for b in started])
        if seal_blocks:
            self.slab_map[t(seal_blocks)] = -1
        self._plan = StorePlan(t(res_rows), t(res_slots), t(direct_rows), t(seal_slabs),
                               t(direct_blocks + seal_blocks))

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        p, lay, bs = self._plan, self.layout, self.block_size
        k, v = k.to(lay.dtype), v.to(lay.dtype)
        rk, rv = self.res_k[layer], self.res_v[layer]
        if p.res_rows.numel():
            rk.view(-1, *rk.shape[2:])[p.res_slots] = k[p.res_rows]
            rv.view(-1, *rv.shape[2:])[p.res_slots] = v[p.res_rows]
        if not p.blocks.numel():
            return
        shape = (-1, bs, lay.num_kv_heads, lay.head_dim)
        kb = torch.cat([k[p.direct_rows].view(shape), rk[p.seal_slabs]])
        vb = torch.cat([v[p.direct_rows].view(shape), rv[p.seal_slabs]])
        self.seal(layer, p.blocks, kb, vb)

    def seal(self, layer: int, blocks: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
        """Quantize whole blocks: k, v (n, bs, KV, D) -> the blocks' codes and scales."""
        codes, scale, zero = quantize(k, dim=1, bits=self.bits)  # per channel over tokens
        self.k_q[layer][blocks] = pack(codes, self.bits)
        self.k_scale[layer][blocks] = scale.squeeze(1)
        self.k_zero[layer][blocks] = zero.squeeze(1)
        codes, scale, zero = quantize(v, dim=-1, bits=self.bits)  # per token
        self.v_q[layer][blocks] = pack(codes, self.bits)
        self.v_scale[layer][blocks] = scale.squeeze(-1)
        self.v_zero[layer][blocks] = zero.squeeze(-1)

    def read_blocks(self, layer: int, blocks: torch.Tensor) -> tuple[torch.Tensor,
                                                                       torch.Tensor]:
        bits, dt = self.bits, self.layout.dtype
        k = dequantize(unpack(self.k_q[layer][blocks], bits),
                       self.k_scale[layer][blocks].unsqueeze(-3),
                       self.k_zero[layer][blocks].unsqueeze(-3)).to(dt)
        v = dequantize(unpack(self.v_q[layer][blocks], bits),
                       self.v_scale[layer][blocks].unsqueeze(-1),
                       self.v_zero[layer][blocks].unsqueeze(-1)).to(dt)
        # A partly filled block is read from its residual block, in full precision (a
        # where, not a mask test: no host sync per layer).
        slab = self.slab_map[blocks]
        has = (slab >= 0)[..., None, None, None]
        k = torch.where(has, self.res_k[layer][slab.clamp(min=0)], k)
        v = torch.where(has, self.res_v[layer][slab.clamp(min=0)], v)
        return k, v
