"""`kivi`: 2- or 4-bit asymmetric K/V (Liu et al., 2024, "KIVI"), with a full-precision
residual.

Keys are quantized per channel, in groups of one block's tokens (outlier channels keep
their own range); values per token (one group per token and KV head); scale and zero point
in float16 (backends.kivi_quant). A block is quantized when it fills: until then it lives
in full precision in a residual block, KIVI's residual of recent tokens. Attention
reads the residual as it is and dequantizes the rest: ``backend.kernel=torch`` in torch,
every block a decode reads, per layer; ``triton`` inside the decode kernel
(harness.kernels.kivi: codes, scales and zeros into registers, nothing dequantized in
memory); prefill chunks dequantize in torch on both (its kernel is not built). ``auto``:
triton on CUDA, torch elsewhere (backends.paged).

Bytes, all charged: per slot, the packed codes of K and V, the values' scale and zero, and
a block's share of the keys' per-channel scale and zero (:meth:`bytes_per_slot`); and
``backend.residual_blocks`` full-precision blocks taken off the budget before it is divided
into slots (:meth:`reserved_bytes`). A sequence holds at most one partly filled block
(forks sharing it hold one between them), so the default (32) covers
scheduler.max_num_seqs' default; more sequences at once grow the residual pool, with a
warning, beyond the budget.

The residual is tracked per block (backends.kivi_residual): a block starting at this
step's first slot takes a free residual block, one that fills is quantized from it and
gives it back, and a partly filled block that dies (its sequence finished or was
preempted) gives it back through the step record's ``invalidated`` slots
(:class:`~harness.kv.residual.ResidualKVManager`).
Quantization is deterministic, so a full block is what its hash names: prefix caching
stays on. It does not swap.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from harness.backends.base import AttentionBatch, CacheSizing, KVLayout
from harness.backends.costs import KIVICosts, KVCosts
from harness.backends.kivi_quant import SCALE_DTYPE, dequantize, pack, quantize, unpack
from harness.backends.kivi_residual import ResidualPool
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


class KIVIBackend(PagedBackend):
    name = "kivi"
    exact = False
    supports_groups = False  # per-layer residuals / page bounds: not per group yet
    Options = KIVIOptions

    def __init__(self, layout: KVLayout, device: torch.device, **options: Any) -> None:
        super().__init__(layout, device, **options)
        o = self.opts
        assert isinstance(o, KIVIOptions)
        self.bits, self.residual_blocks = o.bits, o.residual_blocks

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

    def declare_costs(self) -> KVCosts:
        full = self.full_slot_bytes()
        return KIVICosts(self._block_bytes(), full, self.block_size,
                         self.residual_blocks * self.block_size * full)

    def reserved_why(self) -> str:
        return (f"backend.residual_blocks={self.residual_blocks} full-precision blocks for "
                "the sequences' partly filled blocks, one a running sequence")

    def touch_decode_mask(self, tables: torch.Tensor, mask: torch.Tensor, layers: int) -> None:
        # As read_blocks reads: a block with a residual slab in full precision, any other
        # as codes + value scales per key and the keys' per-channel scales per block.
        lay, bs = self.layout, self.block_size
        res = self.residual.slab_map[tables] >= 0  # (B, W)
        keys = mask.view(*tables.shape, bs).sum(-1) * layers  # (B, W) keys read per block
        full_keys, quant_keys = keys[res].sum(), keys[~res].sum()
        quant_blocks = ((keys > 0) & ~res).sum() * layers
        d = lay.head_dim
        nbytes = lay.num_kv_heads * (quant_keys * self._token_bytes()
                                     + quant_blocks * 2 * d * SCALE_BYTES
                                     + full_keys * 2 * d * lay.elem_bytes)
        self.touch_decode((full_keys + quant_keys) * lay.num_kv_heads, nbytes)

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
        self.k_cpu: list[torch.Tensor] = []
        self.v_cpu: list[torch.Tensor] = []
        self.residual = ResidualPool(self.residual_blocks, nb, bs, lay, dev)

    def slot_tensors(self) -> list[torch.Tensor]:
        return []  # only partial blocks are copied (copy-on-write): their residual moves

    def block_tensors(self) -> list[torch.Tensor] | None:
        # A named block is full, so sealed: its packed codes and scales are all of it
        # (only a partly filled block lives in the residual).
        return [*self.k_q, *self.v_q, *self.k_scale, *self.k_zero, *self.v_scale,
                *self.v_zero]

    def apply_cache_ops(self, rec: StepRecord) -> None:
        assert not rec.swap_in and not rec.swap_out
        bs = self.block_size
        self.residual.drop({s // bs for s in rec.invalidated})
        for op in rec.copies:  # a shared partial block copied for its writer
            self.residual.copy(op.src // bs, op.dst // bs, op.num_slots)

    def begin_step(self, batch: AttentionBatch) -> None:
        super().begin_step(batch)
        self._plan = self.residual.plan(batch)

    def _prefill_tables(self, batch: AttentionBatch) -> None:
        return None  # prefill chunks run the torch path (dequantized in torch) on both

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        if self.kernel != "triton":
            return super().attend(layer, q, k, v)
        # Imported here: importing triton fixes the interpreter switch for the process,
        # which triton_for() had to decide first (backends.paged).
        import harness.kernels.ops  # noqa: F401  (registers torch.ops.kvbench.*)
        from harness.kernels.decode import default_splits

        b = self.batch
        assert b is not None
        self.store(layer, k, v)
        out = torch.empty_like(q)
        nd = b.num_decode
        if nd:
            res = self.residual
            splits = default_splits(nd, self.layout.num_kv_heads,
                                    b.decode_tables.shape[1] * self.block_size, q.device)
            torch.ops.kvbench.kivi_decode(
                q[:nd], self.k_q[layer], self.v_q[layer], self.k_scale[layer],
                self.k_zero[layer], self.v_scale[layer], self.v_zero[layer], res.slab_map,
                res.k[layer], res.v[layer], b.decode_tables, b.decode_lens, out[:nd],
                self.bits, splits)
            self.touch_by_bounds(layer, prefills=False)  # torch_prefills counts its own
        self.torch_prefills(layer, q, out)
        return out

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        p, lay, bs = self._plan, self.layout, self.block_size
        k, v = k.to(lay.dtype), v.to(lay.dtype)
        rk, rv = self.residual.k[layer], self.residual.v[layer]
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
        res = self.residual
        slab = res.slab_map[blocks]
        has = (slab >= 0)[..., None, None, None]
        k = torch.where(has, res.k[layer][slab.clamp(min=0)], k)
        v = torch.where(has, res.v[layer][slab.clamp(min=0)], v)
        return k, v
