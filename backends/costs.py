"""What a KV method costs, declared once per backend (``KVBackend.declare_costs``).

Three things, as plain functions of what the KV manager holds for one sequence at a step's
forward: its ``context`` (tokens so far, this step's included: the last query's position
+ 1) and ``held`` (of those, the tokens whose K/V the sequence still holds: an eviction
method's count, the whole context without one):

- the bytes one slot costs (K/V of every layer and KV head, plus what the method stores
  beside them: scales, overlays, per-block metadata), and bytes held outside the slots;
- the tokens and bytes one decode query reads (:meth:`KVCosts.decode_read`);
- the keys a prefill query sees (:meth:`KVCosts.prefill_pairs`, summed over a chunk's
  queries) and the keys a chunk reads (:meth:`KVCosts.prefill_read`).

No tensors and no attribute guessing: the engine's ``attention.kv_read_bytes_per_token``
(and steps.csv's ``kv_read_*``) and the roofline's step model (harness.roofline.shape)
both call these. Under ``KVBENCH_CHECK=1`` (the test suite sets it) every step of the real
engine holds the declaration to what the backend's attention touched
(``KVBackend.touched``: its masks, chosen blocks, residual and overlays), so a
declaration that drifts from the code fails the tests, not the users' numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from harness.sched.step import LaneSums

if TYPE_CHECKING:
    from harness.layer_types import LayerAttention
    from harness.sched.sequence import Sequence
    from harness.sched.step import StepRecord


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class Read:
    """``tokens`` cached tokens read (each for every layer and KV head) and the ``bytes``
    that costs in memory traffic: their K/V and whatever the method reads with them."""

    tokens: int
    bytes: int


class KVCosts:
    """Dense attention over what a sequence holds: a decode reads every held token, a
    prefill query at position p sees every held key at or before p. ``slot_bytes``: one
    token's K/V in the cache, all layers; ``block_size``: the storage granule (1 for
    contiguous ranges); ``reserved_bytes``: held outside the slots."""

    def __init__(self, slot_bytes: int, block_size: int = 1, reserved_bytes: int = 0) -> None:
        self.slot_bytes = slot_bytes
        self.block_size = block_size
        self.reserved_bytes = reserved_bytes

    def decode_read(self, context: int, held: int) -> Read:
        """What one decode query reads, its sequence holding ``held`` of ``context``."""
        return Read(held, held * self.slot_bytes)

    def prefill_pairs(self, start: int, n: int, held: int) -> int:
        """(query, key) pairs a chunk of ``n`` tokens after ``start`` computes: the sum over
        its queries of the keys each sees. ``held`` includes the chunk."""
        return n * (held - n) + n * (n + 1) // 2

    def prefill_read(self, start: int, n: int, held: int) -> Read:
        """The distinct cached tokens (and their bytes) a chunk's queries read together."""
        return self.decode_read(start + n, held)

    def gathered(self, context: int, held: int) -> int:
        """Keys the torch reference path copies for one decode: its table's blocks, whole
        (what a CPU's gather attention costs; harness.roofline.steptime)."""
        return cdiv(held, self.block_size) * self.block_size

    def summed_decode_read(self, s: LaneSums) -> Read:
        """:meth:`decode_read` summed over decodes that hold their whole contexts, given
        as sums (the roofline's decode lanes, harness/roofline/fastpath; only for the
        declarations it lists in LANE_COSTS)."""
        return Read(s.ctx_sum, s.ctx_sum * self.slot_bytes)

    def lane_split(self) -> int | None:
        """A context past which :meth:`decode_read` takes another form (the lane then
        sums those contexts apart: :class:`LaneSums`); None: one form throughout."""
        return None


def _window_sum(c: int, window: int, sinks: int) -> int:
    """Sum over contexts j = 1..c of the keys a query at position j - 1 sees: its last
    ``window`` tokens, and the first ``sinks`` before them (closed form: prefill chunks
    reach thousands of tokens, summed every step of a roofline run)."""
    w = min(c, window)
    seen = w * (w + 1) // 2 + max(0, c - window) * window
    m = max(0, c - window)  # contexts past the window, whose sinks are extra keys
    s = min(m, sinks)
    return seen + s * (s + 1) // 2 + max(0, m - sinks) * sinks


class WindowCosts(KVCosts):
    """A sliding window of ``window`` tokens plus ``sinks`` first tokens: what a query sees
    is bounded whatever the manager still holds (blocks free only once wholly outside)."""

    def __init__(self, slot_bytes: int, block_size: int, window: int, sinks: int) -> None:
        super().__init__(slot_bytes, block_size)
        self.window, self.sinks = window, sinks

    def seen(self, context: int) -> int:
        """Keys the query at position ``context - 1`` sees."""
        return min(context, self.window) + min(self.sinks, max(0, context - self.window))

    def decode_read(self, context: int, held: int) -> Read:
        t = self.seen(context)
        return Read(t, t * self.slot_bytes)

    def lane_split(self) -> int | None:
        return self.window + self.sinks  # seen(c) = min(c, window + sinks)

    def summed_decode_read(self, s: LaneSums) -> Read:
        t = s.ctx_sum - s.over_sum + s.over_n * (self.window + self.sinks)
        return Read(t, t * self.slot_bytes)

    def prefill_pairs(self, start: int, n: int, held: int) -> int:
        w, s = self.window, self.sinks
        return _window_sum(start + n, w, s) - _window_sum(start, w, s)

    def prefill_read(self, start: int, n: int, held: int) -> Read:
        first = max(0, start - self.window + 1)  # the chunk's first query's window start
        t = start + n - first + min(self.sinks, first)
        return Read(t, t * self.slot_bytes)

    def gathered(self, context: int, held: int) -> int:
        # Given-back table entries read as block 0 and are still gathered (then masked).
        return cdiv(context, self.block_size) * self.block_size


class QuantCosts(KVCosts):
    """1-byte K/V: ``quant_bytes`` per token (codes and scales) for every token read, and
    a full-precision overlay (``full_bytes`` per token) of each sequence's first ``sinks``
    tokens, whose storage is charged to every slot as ``sinks / block_size`` of a token."""

    def __init__(self, quant_bytes: int, full_bytes: int, block_size: int, sinks: int) -> None:
        share = cdiv(full_bytes * sinks, block_size) if sinks else 0
        super().__init__(quant_bytes + share, block_size)
        self.quant_bytes, self.full_bytes, self.sinks = quant_bytes, full_bytes, sinks

    def decode_read(self, context: int, held: int) -> Read:
        return Read(held, held * self.quant_bytes + min(context, self.sinks) * self.full_bytes)

    def summed_decode_read(self, s: LaneSums) -> Read:
        # Lane members hold at least ``sinks`` tokens (they join only then).
        return Read(s.ctx_sum, s.ctx_sum * self.quant_bytes + s.n * self.sinks * self.full_bytes)


class KIVICosts(KVCosts):
    """Full blocks quantized (``block_bytes`` each, all layers, with the keys' per-channel
    scales and zeros); a sequence's partly filled last block in its full-precision
    residual (``full_bytes`` per token), the residual pool held outside the slots."""

    def __init__(self, block_bytes: int, full_bytes: int, block_size: int,
                 reserved_bytes: int) -> None:
        super().__init__(cdiv(block_bytes, block_size), block_size, reserved_bytes)
        self.block_bytes, self.full_bytes = block_bytes, full_bytes

    def decode_read(self, context: int, held: int) -> Read:
        bs = self.block_size
        return Read(context, context // bs * self.block_bytes + context % bs * self.full_bytes)

    def summed_decode_read(self, s: LaneSums) -> Read:
        # Residual tokens: the remainders; full blocks: (sum - remainders) / block_size.
        rest = sum(r * c for r, c in enumerate(s.by_mod))
        full = (s.ctx_sum - rest) // self.block_size
        return Read(s.ctx_sum, full * self.block_bytes + rest * self.full_bytes)


class QuestCosts(KVCosts):
    """Quest: a decode reads the K/V (``kv_bytes`` a token) of its top ``token_budget //
    block_size`` blocks, the partly filled last among them, and every context block's key
    bounds (``meta_bytes`` a block); a prefill reads densely and no bounds. The bounds'
    storage is charged to every slot as ``meta_bytes / block_size``."""

    def __init__(self, kv_bytes: int, meta_bytes: int, block_size: int,
                 token_budget: int) -> None:
        super().__init__(kv_bytes + cdiv(meta_bytes, block_size), block_size)
        self.kv_bytes, self.meta_bytes = kv_bytes, meta_bytes
        self.top_blocks = max(1, token_budget // block_size)

    def chosen_tokens(self, context: int) -> int:
        bs, k = self.block_size, self.top_blocks
        blocks = cdiv(context, bs)
        if blocks <= k:
            return context
        return (k - 1) * bs + context - (blocks - 1) * bs  # k - 1 full blocks + the last

    def decode_read(self, context: int, held: int) -> Read:
        t = self.chosen_tokens(context)
        return Read(t, t * self.kv_bytes + cdiv(context, self.block_size) * self.meta_bytes)

    def lane_split(self) -> int | None:
        return self.top_blocks * self.block_size  # past it: k - 1 full blocks + the last

    def summed_decode_read(self, s: LaneSums) -> Read:
        bs, k = self.block_size, self.top_blocks
        # Contexts up to k blocks read whole; past them k - 1 blocks + the last one's
        # ((context - 1) mod bs) + 1 tokens. Every context's bounds: cdiv(context, bs).
        chosen = (s.ctx_sum - s.over_sum + s.over_n * ((k - 1) * bs + 1)
                  + sum(c * ((r - 1) % bs) for r, c in enumerate(s.over_by_mod)))
        blocks = (s.ctx_sum + sum(c * (-r % bs) for r, c in enumerate(s.by_mod))) // bs
        return Read(chosen, chosen * self.kv_bytes + blocks * self.meta_bytes)

    def prefill_read(self, start: int, n: int, held: int) -> Read:
        return Read(held, held * self.kv_bytes)

    def gathered(self, context: int, held: int) -> int:
        return min(self.top_blocks, cdiv(context, self.block_size)) * self.block_size


def _chunk_sum(c: int, chunk: int) -> int:
    """Sum over contexts j = 1..c of the keys a query at position j - 1 sees under
    chunked attention: the tokens of its own chunk up to itself (closed form)."""
    whole, rest = divmod(c, chunk)
    return whole * chunk * (chunk + 1) // 2 + rest * (rest + 1) // 2


class GroupedCosts(KVCosts):
    """A model whose layers differ in attention (harness.layer_types): each layer type
    reads what it sees, a full layer what the backend's own declaration says for one layer
    (``full``: every held token for paged; a window's keys for a window backend, which then
    compresses the full layers only), a sliding layer its window, a chunked layer its
    chunk, at ``layer_bytes`` per token and layer (K/V with scales, bytes that scale with
    layers). ``slot_bytes`` is what one slot of the cache costs: a KV cache group's page
    (``group_layers`` layers) under KV cache groups, every layer under a uniform cache.
    Counts are layer-weighted: ``Read.tokens`` and the prefill pairs are full-model
    equivalents (tokens x the share of layers that read them)."""

    def __init__(self, layers: list[tuple[LayerAttention, int]], layer_bytes: int,
                 block_size: int, slot_bytes: int, full: KVCosts | None = None) -> None:
        """``layers``: (attention, layer count) per attention type
        (:func:`harness.layer_types.groups`); ``full``: one full layer's declaration
        (default: dense, ``layer_bytes`` a token)."""
        super().__init__(slot_bytes, block_size)
        self.layers, self.layer_bytes = layers, layer_bytes
        self.full = full if full is not None else KVCosts(layer_bytes, block_size)
        self.total_layers = sum(n for _, n in layers)

    def decode_read(self, context: int, held: int) -> Read:
        layer_tokens = nbytes = 0
        for a, n in self.layers:
            if a.kind == "full":
                r = self.full.decode_read(context, held)
                layer_tokens, nbytes = layer_tokens + n * r.tokens, nbytes + n * r.bytes
            else:
                t = a.held(context)
                layer_tokens, nbytes = layer_tokens + n * t, nbytes + n * t * self.layer_bytes
        return Read(layer_tokens // self.total_layers, nbytes)

    def prefill_pairs(self, start: int, n: int, held: int) -> int:
        total = 0
        for a, count in self.layers:
            if a.kind == "sliding":
                p = _window_sum(start + n, a.span, 0) - _window_sum(start, a.span, 0)
            elif a.kind == "chunked":
                p = _chunk_sum(start + n, a.span) - _chunk_sum(start, a.span)
            else:
                p = self.full.prefill_pairs(start, n, held)
            total += count * p
        return total // self.total_layers

    def prefill_read(self, start: int, n: int, held: int) -> Read:
        """The distinct keys a chunk's queries read together: the full layers' own count,
        else from what its first query sees (its window or chunk) to the chunk's end."""
        layer_tokens = nbytes = 0
        for a, count in self.layers:
            if a.kind == "full":
                r = self.full.prefill_read(start, n, held)
                layer_tokens, nbytes = layer_tokens + count * r.tokens, nbytes + count * r.bytes
            else:
                t = n - 1 + a.held(start + 1)
                layer_tokens += count * t
                nbytes += count * t * self.layer_bytes
        return Read(layer_tokens // self.total_layers, nbytes)


class HeldSource(Protocol):
    """Where ``held`` comes from: the KV manager (``KVManager.held_tokens``)."""

    def held_tokens(self, seq: Sequence) -> int: ...


@dataclass(slots=True)
class StepReads:
    """A step's attention as the declaration counts it: ``decode_queries`` decodes reading
    ``decode_tokens`` cached tokens (``decode_bytes``), and the prefill chunks'
    ``prefill_pairs`` (query, key) pairs. steps.csv's ``kv_read_*`` columns."""

    decode_queries: int = 0
    decode_tokens: int = 0
    decode_bytes: int = 0
    prefill_pairs: int = 0


def step_reads(rec: StepRecord, kv: HeldSource, costs: KVCosts) -> StepReads:
    """The declared reads of ``rec``'s forward (the KV manager in its state during that
    forward: after scheduling, before the step's evictions). Decode or prefill is
    :attr:`~harness.sched.step.ScheduledSeq.is_decode`, the rule the forward uses."""
    out = StepReads()
    for s in rec.seqs:
        held = kv.held_tokens(s.seq)
        if s.is_decode:
            r = costs.decode_read(s.start + 1, held)
            out.decode_queries += 1
            out.decode_tokens += r.tokens
            out.decode_bytes += r.bytes
        else:
            out.prefill_pairs += costs.prefill_pairs(s.start, s.num_tokens, held)
    return out


class HeadwiseCosts(KVCosts):
    """Per-head tables (harness.kv.headwise: pyramidkv, adakv, duo_attention): ``held`` is
    in head-tokens (the tokens each of the ``heads`` = layers x KV heads keeps, summed),
    one costing ``slot_bytes / heads``. A decode reads every head-token its sequence holds
    (``tokens``: their mean over the heads, rounded down per decode); a prefill chunk runs
    before the prompt's selection, every head holding every token, and sees each key at or
    before its query (dense); a chunk of a prompt that started from a compressed prefix
    (harness.kv.compressed) sees in each head what that head holds: the pairs are their
    mean over the heads, rounded down per chunk (the same count when every head holds
    every token)."""

    def __init__(self, slot_bytes: int, block_size: int, heads: int) -> None:
        super().__init__(slot_bytes, block_size)
        assert slot_bytes % heads == 0, (slot_bytes, heads)
        self.heads, self.head_bytes = heads, slot_bytes // heads

    def decode_read(self, context: int, held: int) -> Read:
        return Read(held // self.heads, held * self.head_bytes)

    def prefill_pairs(self, start: int, n: int, held: int) -> int:
        # Head h holding c_h (its chunk's n included) gives n (c_h - n) + n (n + 1) / 2.
        return (n * held - self.heads * (n * (n - 1) // 2)) // self.heads

    def gathered(self, context: int, held: int) -> int:
        # The torch path gathers each head's pages up to the context's blocks.
        return cdiv(context, self.block_size) * self.block_size

    def summed_decode_read(self, s: LaneSums) -> Read:
        raise NotImplementedError("per-head tables do not take the what-if's decode lanes")
