"""The KV backend contract: owns the physical cache tensors and the attention call.

The engine turns each :class:`~harness.sched.step.StepRecord` into an
:class:`AttentionBatch` (tensors), calls :meth:`KVBackend.apply_cache_ops` and
:meth:`KVBackend.begin_step`, then runs the model, whose every layer calls
:meth:`KVBackend.attend`. A backend never decides who runs; it only stores and attends.

Flat batch order: the ``num_decode`` decode tokens (one per sequence) come first, then each
prefill chunk's tokens in order.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from harness.backends.costs import KVCosts, QuantCosts, Read, WindowCosts
from harness.backends.staging import Staging
from harness.errors import UserError
from harness.kv.base import KVManager, StepScores
from harness.kv.policies.base import EvictionPolicy
from harness.sched.step import CHECKS, ScheduledSeq, StepRecord

if TYPE_CHECKING:
    from harness.backends.tier_storage import TierStorage
    from harness.model.llama import LlamaModel
    from harness.model.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape of what is cached per token: K and V for every layer and KV head."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    # The model's RoPE speeds, (head_dim // 2,) in Hugging Face's rotate-half convention
    # (harness.model.rope.inverse_frequencies); () when unknown (the roofline's specs).
    # Only a method that reasons about positions (expected_attention) reads it.
    rope_inv_freq: tuple[float, ...] = ()

    @property
    def elem_bytes(self) -> int:
        return torch.tensor([], dtype=self.dtype).element_size()


@dataclass(frozen=True, slots=True)
class LayerSlot:
    """Where one model layer's K/V live and what it attends (a hybrid-attention model's
    KV cache groups, harness.kv.groups): ``group``, the KV cache group whose block tables
    and slot mapping it uses (the step's ``AttentionBatch`` of that group); ``storage``,
    the cache tensor that holds it (a pool page holds one layer of each group position:
    layer j of every group shares tensor j, as in vLLM); ``window``, its sliding window in
    tokens, itself included (0: it sees every held token)."""

    group: int = 0
    storage: int = 0
    window: int = 0


@dataclass(slots=True)
class PrefillChunk:
    """``num_tokens`` query tokens at batch rows ``[row, row + num_tokens)``, positions
    ``[start, start + num_tokens)`` of a sequence whose first ``start`` tokens are cached.

    ``table`` is the sequence's block table (paged) or ``[range_start]`` (contiguous), as an
    int64 tensor on the cache's device.
    """

    row: int
    num_tokens: int
    start: int
    table: torch.Tensor
    sched: ScheduledSeq


@dataclass(slots=True)
class AttentionBatch:
    """The tensors of one step, as every backend needs them.

    slot_mapping: int64 (T,) cache slot of each new token.
    decode_tables: int64 (num_decode, max_blocks) the KV manager's tables (``tables()``:
        paged block ids, rows padded with 0 past ``decode_num_blocks``; contiguous: one
        column, the range's first slot).
    decode_lens: int64 (num_decode,) context length of each decode including its new token.
    decode_num_blocks: int64 (num_decode,) table entries of each row before the padding.
    """

    slot_mapping: torch.Tensor
    positions: torch.Tensor  # int64 (T,) position of each new token in its sequence
    num_decode: int
    decode_tables: torch.Tensor
    decode_lens: torch.Tensor
    decode_num_blocks: torch.Tensor
    decode_seqs: list[ScheduledSeq] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)


@dataclass
class BackendOptions:
    """What every backend takes; each backend's ``Options`` extends it with its own, and
    that dataclass is the one place for their defaults (it is also the Hydra schema of
    ``conf/backend/<name>.yaml``, registered from the backend registry)."""

    name: str = ""
    block_size: int = 16  # paged backends; contiguous storage ignores it

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise UserError(f"backend.block_size must be >= 1, got {self.block_size}")


@dataclass(frozen=True, slots=True)
class CacheSizing:
    """How the run's KV budget became token slots (the same bytes for every backend)."""

    kv_budget_bytes: int
    bytes_per_slot: int
    num_slots: int  # token capacity
    block_size: int
    num_blocks: int
    num_cpu_blocks: int

    @property
    def block_bytes(self) -> int:
        """Bytes of one block (a swap block, a lower tier's slot, a KV cache group's page)."""
        return self.block_size * self.bytes_per_slot


class KVBackend(ABC):
    """Base of every backend. Subclasses set ``name`` and ``storage`` and implement the
    abstract methods; :mod:`backends.paged_storage` holds the shared paged machinery."""

    name: str = ""
    storage: str = ""  # "paged" or "contiguous": which KV manager the run uses
    exact: bool = True  # False for lossy backends (quantized, evicting)
    # False where a block's content stops being what its hash names (H2O rewrites slots).
    supports_prefix_caching: bool = True
    # Its prefix cache keeps compressed states by name (harness.kv.compressed: a method
    # that compresses once, at a prompt's end), not blocks by their tokens: no lower
    # tiers, no KV cache groups, no handoff.
    compressed_prefixes: bool = False
    # Runs a hybrid-attention model under executor=model: attends each layer through its
    # LayerSlot (its group's tables, its storage tensor, its window).
    supports_groups: ClassVar[bool] = False
    Options: ClassVar[type[BackendOptions]] = BackendOptions
    # Options of ``Options`` this backend never reads, {key: why}: set away from their
    # defaults (by the user or a preset), the run is refused when its config is typed
    # (harness.config.refuse_ignored), never run as if they had been honoured.
    ignored_options: ClassVar[Mapping[str, str]] = {}

    def __init__(self, layout: KVLayout, device: torch.device, **options: Any) -> None:
        """``options``: the fields of :attr:`Options` (keywords; defaults there)."""
        known = [f.name for f in dataclasses.fields(self.Options) if f.name != "name"]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise UserError(f"backend {self.name!r} has no option(s) {', '.join(unknown)}; "
                            f"it takes: {', '.join(known)}")
        self.opts = self.Options(name=self.name, **options)
        self.layout = layout
        self.device = device
        self.block_size = self.opts.block_size  # paged storage; contiguous ignores it
        self.batch: AttentionBatch | None = None
        # A step's small index lists (copies, invalidated slots, the slots a method reads
        # differently), in buffers that live for the run; the executor ends each step's
        # writes after begin_step (backends.staging).
        self.staging = Staging(device, capacity=256)
        self._costs: KVCosts | None = None
        if type(self).declare_costs is KVBackend.declare_costs:
            raise UserError(
                f"backend {self.name!r} ({type(self).__name__}) declares no costs: implement "
                "declare_costs() returning a harness.backends.costs.KVCosts (bytes per slot, "
                "what a decode query reads, the keys a prefill query sees; "
                "docs/architecture.md, 'How to add a backend')")
        # Counting what the attention touched costs a few reductions per layer: on under
        # KVBENCH_CHECK (the tests), where the engine holds it to the declaration.
        self.track_touches = CHECKS
        self._touch_acc: list[torch.Tensor | int] = [0, 0, 0]
        # Every layer in its own storage, one group, no window: a uniform model.
        self.layer_slots = tuple(LayerSlot(0, i, 0) for i in range(layout.num_layers))
        self.per_layer_masks = False  # layers attend differently: touches counted per layer

    def use_layer_slots(self, slots: tuple[LayerSlot, ...]) -> None:
        """Attend each layer through its :class:`LayerSlot` (a hybrid-attention model:
        harness.stack.kv_plan), before :meth:`allocate` (which then creates one storage
        tensor per group position, not per layer)."""
        assert len(slots) == self.layout.num_layers, (len(slots), self.layout.num_layers)
        self.layer_slots = slots
        self.per_layer_masks = len({s.window for s in slots}) > 1 or any(
            s.group for s in slots)

    @property
    def storage_layers(self) -> int:
        """Cache tensors per K and V: one per layer, or one per group position."""
        return max(s.storage for s in self.layer_slots) + 1

    # -- costs: declared once (harness.backends.costs) --------------------------------
    def declare_costs(self) -> KVCosts:
        """What this backend's method costs: bytes per slot, what a decode query reads,
        the keys a prefill query sees (a :class:`~harness.backends.costs.KVCosts`, from
        the options and the layout). Every backend declares it; the engine's read metrics
        and the roofline's step model read nothing else."""
        raise NotImplementedError

    def costs(self) -> KVCosts:
        """The declaration, built once per block size (allocate may set the block size)."""
        c = self._costs
        if c is None or c.block_size != self._costs_block_size():
            c = self._costs = self.declare_costs()
        return c

    def per_layer_bytes(self) -> int | None:
        """Bytes one token costs per layer when the declaration is dense attention whose
        bytes scale with the layers (paged, and 1-byte caches without sinks): what KV cache
        groups (harness.kv.groups) can split by layer. None: this method's costs do not
        split so (per-block metadata, overlays, residuals, evictions)."""
        c = self.costs()
        if type(c) in (KVCosts, WindowCosts) or (type(c) is QuantCosts and not c.sinks):
            n = self.layout.num_layers
            return c.slot_bytes // n if c.slot_bytes % n == 0 else None
        return None

    def layer_costs(self, layer_bytes: int) -> KVCosts:
        """One full-attention layer's declaration at ``layer_bytes`` a token: what a
        hybrid model's full layers read under this method (dense here; a window backend
        its window: it then compresses the full layers only, the sliding ones keeping
        their own window)."""
        c = self.costs()
        if isinstance(c, WindowCosts):
            return WindowCosts(layer_bytes, c.block_size, c.window, c.sinks)
        return KVCosts(layer_bytes, c.block_size)

    def full_group_policy(self) -> EvictionPolicy | None:
        """The eviction policy a hybrid model's full KV cache groups take from this
        backend (None: they keep every token)."""
        return None

    def use_costs(self, costs: KVCosts) -> None:
        """Replace the declaration with ``costs`` (KV cache groups: the same method read
        per layer type; the roofline stack sets it before sizing)."""
        assert costs.block_size == self._costs_block_size()
        self._costs = costs

    def _costs_block_size(self) -> int:
        return self.block_size if self.storage == "paged" else 1

    def bytes_per_slot(self) -> int:
        """Bytes one token takes in the cache, all layers, K and V (scales included)."""
        return self.costs().slot_bytes

    def reserved_bytes(self) -> int:
        """Bytes of the budget held outside the per-slot cache, taken off before the
        budget is divided into slots (kivi: its full-precision residual blocks)."""
        return self.costs().reserved_bytes

    def reserved_why(self) -> str:
        """What :meth:`reserved_bytes` holds and the option that sizes it, for a message
        that says what to change ("" where the backend reserves nothing)."""
        return ""

    def full_slot_bytes(self) -> int:
        """One token's K and V at the layout's dtype, all layers: 2 x L x KV x D x bytes."""
        lay = self.layout
        return 2 * lay.num_layers * lay.num_kv_heads * lay.head_dim * lay.elem_bytes

    @property
    def kernel(self) -> str:
        """The attention implementation actually used (part of the run's record)."""
        return "torch"

    def graph_unsafe_reason(self) -> str | None:
        """Why a decode step of this backend cannot be replayed from a captured graph
        (harness.engine.graphs), or None when it can: everything its attention reads
        per step is the step's batch (whose tensors a replay refreshes in place), no
        per-step tensor made in begin_step, no host value that changes between steps of
        one batch bucket, and padded rows (slot :attr:`pad_slot`, length 1) harmless."""
        return f"backend {self.name} prepares per-step state outside the batch"

    pad_slot: int = -1  # where a padded row of a replayed batch stores its K/V

    @property
    def trigger(self) -> str | None:
        """When an eviction method compresses a prompt (``run.prefill``: ``full``, once
        after the whole prompt; ``streaming``, while it is read); None for the others."""
        return None

    def calibrate(self, model: LlamaModel, tokenizer: Tokenizer) -> None:  # noqa: B027
        """Measure on the model what the method needs before it serves (executor=model,
        when the stack is built; duo_attention: its retrieval heads). Default: nothing."""

    @abstractmethod
    def allocate(self, sizing: CacheSizing) -> None:
        """Create the cache tensors for ``sizing`` (device slots, and CPU swap blocks)."""

    tier_storage: TierStorage | None = None  # the lower tiers' bytes (executor=model)

    def block_tensors_supported(self) -> bool:
        """Whether :meth:`block_tensors` is implemented (asked before allocation)."""
        return type(self).block_tensors is not KVBackend.block_tensors

    def block_tensors(self) -> list[torch.Tensor] | None:
        """Every tensor of the cache indexed by block first whose rows make up a named
        block's content (K/V with scales, overlays and per-block metadata): what the
        prefix cache's lower tiers move (harness.kv.tiers). None: this storage cannot
        move whole blocks, so it takes no tiers."""
        return None

    @abstractmethod
    def make_manager(self, sizing: CacheSizing, **options: Any) -> KVManager:
        """The KV manager (bookkeeping) matching this backend's storage."""

    # -- per step ------------------------------------------------------------------------
    @abstractmethod
    def apply_cache_ops(self, rec: StepRecord) -> None:
        """Perform the step's swaps, invalidations and copies, in the order StepRecord
        documents."""

    def begin_step(self, batch: AttentionBatch) -> None:
        self.batch = batch
        self.group_batches: tuple[AttentionBatch, ...] = (batch,)
        self._touch_acc = [0, 0, 0]

    def begin_groups(self, batches: list[AttentionBatch]) -> None:
        """One step of KV cache groups: ``batches[g]`` is group g's batch (its slot mapping
        and tables; the tokens and positions are the same in all), kept in
        :attr:`group_batches`; the step begins on the first group's (:meth:`begin_step`).
        A backend that :attr:`supports_groups` attends each layer with its group's."""
        if len(batches) > 1 and not self.supports_groups:
            raise NotImplementedError(f"backend {self.name} does not run KV cache groups")
        self.begin_step(batches[0])
        self.group_batches = tuple(batches)

    @abstractmethod
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        """Store this step's K/V of ``layer``, then attend.

        q: (T, num_heads, head_dim) rotated; k, v: (T, num_kv_heads, head_dim).
        Returns (T, num_heads, head_dim).
        """

    def take_scores(self) -> StepScores | None:
        """After the forward: the scores the KV manager's eviction policy asked for, in one
        device-to-host transfer (None: the policy needs none)."""
        return None

    # -- what the attention touched (held to costs() under KVBENCH_CHECK) ---------------
    def touch_decode(self, keys: torch.Tensor | int, nbytes: torch.Tensor | int) -> None:
        """Count, from the attention's own masks and selections, ``keys`` (key, KV head)
        pairs one layer's decodes read and the ``nbytes`` they cost (device scalars: no
        sync). Only while :attr:`track_touches`."""
        t = self._touch_acc
        t[0] = t[0] + keys
        t[1] = t[1] + nbytes

    def touch_full_keys(self, n: torch.Tensor | int) -> None:
        """Count ``n`` decode keys read (layers counted) at the layout's dtype: K and V
        for every KV head, nothing beside them."""
        lay = self.layout
        self.touch_decode(n * lay.num_kv_heads, n * (self.full_slot_bytes() // lay.num_layers))

    def touch_factor(self, layer: int) -> int:
        """How many layers to count a layer-independent mask for at ``layer``: all of them
        at layer 0, none after (0 also when not tracking). Most masks come from the step's
        lengths, tables and positions alone, the same for every layer; counting them once
        per layer cost a streamed quality run of the 30-layer model ~20% more."""
        if self.per_layer_masks:  # layers see different keys: each counts its own
            return 1 if self.track_touches else 0
        return self.layout.num_layers if self.track_touches and layer == 0 else 0

    def touch_prefill(self, pairs: torch.Tensor | int) -> None:
        """Count the (query, key) pairs one layer's prefill masks admitted."""
        self._touch_acc[2] = self._touch_acc[2] + pairs

    def held_slots(self) -> int | None:
        """Slots whose tensors hold a live token, counted on the device (None: the
        storage keeps no per-slot liveness; checked against the KV manager's used slots
        under KVBENCH_CHECK)."""
        return None

    def touched(self) -> tuple[Read, int]:
        """What this step's attention touched, all layers: the decodes' (tokens, bytes)
        and the prefill pairs, in the units of :class:`~harness.backends.costs.StepReads`
        (one host sync; for checks and tests)."""
        lay = self.layout
        keys, nbytes, pairs = (int(x.item()) if isinstance(x, torch.Tensor) else int(x)
                               for x in self._touch_acc)
        per_token, rem = divmod(keys, lay.num_layers * lay.num_kv_heads)
        per_layer, rem2 = divmod(pairs, lay.num_layers)
        if not self.per_layer_masks:  # layer-weighted averages where layers differ
            assert not rem, f"{self.name}: layers or KV heads read different token counts"
            assert not rem2, f"{self.name}: layers saw different prefill pairs"
        return Read(per_token, nbytes), per_layer
