"""The scorer seam: a token-eviction method is its options, a score and a trigger.

A method writes one options dataclass (deriving from :class:`ScorerOptions`: its budget,
its trigger ``prefill``, its own knobs), read by its backend and its policy alike, and one
:meth:`ScoredBackend.score`: what each key is worth this layer. ``reads`` says from what:

* ``weights``: every query's attention weights over the keys it reads (h2o, tova; the
  base then runs an explicit float32 softmax, as SDPA does not return them);
* ``keys``: the keys alone, scored once, in the step that writes them (knorm; attention
  stays SDPA);
* ``window``: the weights of the prompt's last ``opts.window`` queries (the observation
  window) over the prompt tokens before them, kept by position across prefill chunks
  (a window may span chunks) and finished by :meth:`ScoredBackend.pool` when the chunk
  that ends the window has run (snapkv; attention stays SDPA, the window's rows computed
  again for their weights);
* ``held``: every key the sequence holds, scored together when a selection follows (the
  prompt's last chunk under ``full``, every chunk under ``streaming``): a score that is a
  statistic over all of them (keydiff: similarity to their mean); attention stays SDPA.

The base does the rest once: the weights when asked for, per-slot scores summed over
layers on the device, the one device-to-host transfer per step (:meth:`take_scores`); the
KV manager's policy (a :class:`~harness.kv.policies.budget.BudgetPolicy`) keeps them,
selects at the trigger, frees and compacts.

The trigger (``backend.prefill``): ``full``, the whole prompt under full attention, then
one compression by the score at its end (the papers' long-context evaluations, kvpress);
``streaming``, bounded memory while prefilling (chunks, each followed by an eviction).

``backend.kernel=triton`` (backends.slotted: the paged kernels over slot lists): a method
that reads ``weights`` declares them as sums (:attr:`ScoredBackend.weight_rows`,
:meth:`ScoredBackend.weight_scale`, held to :meth:`score` by the tests) and gets them from
the attention's own launches: the decode writes its logits and log-sum-exp, one launch
turns them into each slot's weight (harness.kernels.scores.decode_weights); the prefill
writes each row's log-sum-exp and one launch recomputes q.k for the scoring rows
(``prefill_weights``). ``window`` (snapkv) adds its window's weights per head with the
same prefill launch (per head, by position) in the chunk that holds window queries.
``keys`` (knorm) scores the step's new keys in torch, not the cache; ``held`` (keydiff,
expected attention) gathers the held keys in torch once, at the selection that ends a
prompt (or chunk, streaming): prefill work, never a decode's.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from harness.backends.base import (
    AttentionBatch,
    BackendOptions,
    CacheSizing,
    KVLayout,
    LayerSlot,
    PrefillChunk,
)
from harness.backends.kernel_option import check_kernel
from harness.backends.slotted import SlottedBackend
from harness.kv.base import StepScores
from harness.kv.policies.base import EvictionPolicy
from harness.kv.policies.budget import PREFILL, BudgetPolicy, check_budget_options
from harness.validate import one_of

if TYPE_CHECKING:
    from harness.sched.sequence import Sequence


@dataclass
class ScorerOptions(BackendOptions):
    """What every scored method takes; a method's own dataclass extends it (and may set
    another ``prefill`` default: its paper's)."""

    budget: int = 0  # tokens per sequence; or
    budget_ratio: float = 0.2  # share of the request (set exactly one)
    prefill: str = "streaming"  # the trigger: full | streaming
    # auto | torch | triton (backends.kernel_option; the Triton path: backends.slotted)
    kernel: str = "auto"
    # Whether the method's storage has a Triton path (the per-head presses' has not).
    triton_built: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_budget_options(self.budget, self.budget_ratio)
        one_of(self, "backend", "prefill", PREFILL)
        check_kernel(self, triton_built=self.triton_built)


@dataclass
class PressOptions(ScorerOptions):
    """A kvpress-style press's options (with :class:`~harness.kv.policies.budget.
    PressPolicy`): a share of the prompt kept, compressed once at its end by default."""

    budget_ratio: float = 0.2  # share of the prompt kept (or budget: tokens)
    prefill: str = "full"  # full (kvpress: once, after the prompt) | streaming


READS = ("weights", "keys", "window", "held")  # what a method's score reads


class ScoredBackend(SlottedBackend):
    """The base of a scored method: subclasses set ``Options``, ``Policy`` (the KV
    manager's side, built from the same options), ``reads`` and write :meth:`score`."""

    policy: BudgetPolicy
    Options: ClassVar[type[BackendOptions]] = ScorerOptions
    # A hybrid model: the policy chooses the full layers' tokens (their KV cache group),
    # the sliding layers keep their own window (harness.stack.kv_plan).
    supports_groups = True
    Policy: ClassVar[Callable[[Any], BudgetPolicy]]
    reads: ClassVar[str] = "weights"  # weights | keys | window | held (module docstring)
    # reads == "weights" on the Triton path: which of a prefill chunk's query rows score
    # ("all", or "last": the chunk's last query; a decode's one row either way); their
    # weights summed over query heads and rows, times weight_scale(), are the layer's
    # score(w, k).
    weight_rows: ClassVar[str] = "all"

    def __init__(self, layout: KVLayout, device: torch.device, **options: Any) -> None:
        super().__init__(layout, device, **options)
        assert self.reads in READS, f"{type(self).__name__}.reads: one of {READS}"
        self.policy = type(self).Policy(self.opts)
        # Compress-once methods keep compressed prefixes (harness.kv.compressed); h2o and
        # tova re-score every step, so each prompt is compressed anew.
        self.supports_prefix_caching = self.compressed_prefixes = self.policy.compresses_once
        # The first and last layers that score keys (a selection follows the last): every
        # layer's, or a hybrid model's full layers' (use_layer_slots).
        self.first_scored, self.last_scored = 0, layout.num_layers - 1
        # reads == "window": seq id -> (layers, query heads, first window position): the
        # layer's scores by key position so far (scratch beside the cache, not charged).
        self._obs: dict[int, torch.Tensor] = {}

    @property
    def trigger(self) -> str | None:
        return self.policy.prefill

    def full_group_policy(self) -> EvictionPolicy | None:
        return self.policy

    def use_layer_slots(self, slots: tuple[LayerSlot, ...]) -> None:
        super().use_layer_slots(slots)
        full = [i for i, s in enumerate(slots) if not s.window]
        self.first_scored, self.last_scored = full[0], full[-1]

    @abstractmethod
    def score(self, w: torch.Tensor | None, k: torch.Tensor) -> torch.Tensor:
        """One layer's contribution to each key's score (higher: kept longer).

        ``weights``: w (B, KV, G, n, L) softmax weights of n queries (G query heads per KV
        head) over the L keys read, k (B, L, KV, D) those keys -> (B, L).
        ``keys``: w None, k (T, KV, D) the step's new keys -> (T,).
        ``held``: w None, k (T, KV, D) every key one sequence holds -> (T,).
        ``window``: w (KV, G, n, L) the window queries' weights (those of this chunk) over
        the L keys before the window, k (L, KV, D) -> (H, L), per query head (pooled by
        :meth:`pool` once the window is complete)."""

    def weight_scale(self, num_heads: int) -> float:
        """reads == "weights", Triton path: the factor on a key's weights summed over the
        ``num_heads`` query heads and the scoring rows (:attr:`weight_rows`)."""
        return 1.0

    def pool(self, acc: torch.Tensor) -> torch.Tensor:
        """``window``: acc (layers, H, P) the window's scores by key position, summed over
        its chunks -> each position's score (P,). Default: the sum over layers and heads."""
        return acc.sum(dim=(0, 1))

    def window_size(self) -> int:
        """``window``: how many of the prompt's last queries score the rest."""
        raise NotImplementedError(f"{type(self).__name__} reads a window: say its size")

    def allocate(self, sizing: CacheSizing) -> None:
        super().allocate(sizing)
        n = sizing.num_blocks * sizing.block_size
        # The step's score per slot, summed over layers (reset by take_scores).
        self._received = torch.zeros(n, dtype=torch.float32, device=self.device)

    def begin_step(self, batch: AttentionBatch) -> None:
        super().begin_step(batch)
        # Slots scored for a selection this step (window, held): what take_scores sends.
        self._selected_slots: list[torch.Tensor] = []
        if self.reads == "keys":  # a key is scored once, in the step that writes it
            self._touched = batch.slot_mapping if batch.slot_mapping.numel() else None
            return
        if self.reads in ("window", "held"):  # set by the chunks a selection follows
            self._touched = None
            return
        # The slots this step's attention scores, with duplicates and (for decodes)
        # the slots of held blocks that hold no token marked -1: what take_scores sends,
        # deduplicated on the host (a unique or a mask here reads a size back, a sync).
        touched = list(self._chunk_slots)
        if batch.num_decode:
            touched.append(torch.where(self._decode_valid, self._decode_slots, -1).flatten())
        self._touched = torch.cat(touched) if touched else None

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        super().store(layer, k, v)
        if self.reads == "keys":
            b = self.batch
            assert b is not None
            self._received.index_add_(0, b.slot_mapping, self.score(None, k.float()))

    def attend_rows(self, layer: int, q: torch.Tensor, slots: torch.Tensor,
                    valid: torch.Tensor) -> torch.Tensor:
        if self.reads != "weights":
            return super().attend_rows(layer, q, slots, valid)
        k, v = self.gather(layer, slots, torch.float32)  # (B, L, KV, D)
        w = self.weights(q, k, valid)
        bsz, n, h, d = q.shape
        out = torch.einsum("bkgnl,blkd->bnkgd", w, v).reshape(bsz, n, h, d)
        self._received.index_add_(0, slots.flatten(), self.score(w, k).flatten())
        return out.to(q.dtype)

    def weights(self, q: torch.Tensor, k: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Float32 softmax weights of q (B, n, H, D) over k (B, L, KV, D) where ``valid``
        (B, n, L): (B, KV, G, n, L), G query heads per KV head."""
        kv_heads, d = self.layout.num_kv_heads, self.layout.head_dim
        bsz, n, h, _ = q.shape
        qg = q.to(torch.float32).view(bsz, n, kv_heads, h // kv_heads, d)
        logits = torch.einsum("bnkgd,blkd->bkgnl", qg, k) * d ** -0.5
        logits = logits.masked_fill(~valid[:, None, None, :, :], float("-inf"))
        return torch.softmax(logits, dim=-1)

    def after_chunk(self, layer: int, q: torch.Tensor, c: PrefillChunk,
                    slots: torch.Tensor) -> None:
        if self.reads == "window":
            self.observe_window(layer, q, c, slots)
        elif self.reads == "held":
            self.score_held(layer, c, slots)

    # -- the Triton path's scores (backends.slotted.attend_triton) ---------------------
    def begin_triton(self, batch: AttentionBatch) -> None:
        super().begin_triton(batch)
        self._scratch: tuple[torch.Tensor, torch.Tensor] | None = None
        self._lse: torch.Tensor | None = None
        self._rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._window_args: dict[int, torch.Tensor] = {}  # reads == "window": by chunk row
        if self.reads == "weights" and batch.prefills:
            # Each chunk's scoring rows (chunk-relative) and no key limit.
            n = [c.num_tokens for c in batch.prefills]
            lo = [0 if self.weight_rows == "all" else k - 1 for k in n]
            dev = self.device
            self._rows = (torch.tensor(lo, dtype=torch.int64, device=dev),
                          torch.tensor(n, dtype=torch.int64, device=dev),
                          torch.full((len(n),), 1 << 62, dtype=torch.int64, device=dev))

    def decode_scratch(self, q: torch.Tensor) -> tuple[torch.Tensor | None,
                                                        torch.Tensor | None]:
        b = self.batch
        if self.reads != "weights" or b is None or not b.num_decode:
            return None, None
        if self._scratch is None:  # one per step, every layer's (read before the next)
            nd, h = b.num_decode, q.shape[1]
            width = b.decode_tables.shape[1] * self.block_size
            self._scratch = (
                torch.empty((nd, h, width), dtype=torch.float32, device=self.device),
                torch.empty((nd, h), dtype=torch.float32, device=self.device))
        return self._scratch

    def prefill_lse(self, q: torch.Tensor) -> torch.Tensor | None:
        b = self.batch
        if self.reads not in ("weights", "window") or b is None or not b.prefills:
            return None
        if self._lse is None:
            self._lse = torch.empty(q.shape[:2], dtype=torch.float32, device=self.device)
        return self._lse

    def triton_scores(self, layer: int, q: torch.Tensor, logits: torch.Tensor | None,
                      lse: torch.Tensor | None) -> None:
        if self.reads != "weights":
            return
        b = self.batch
        assert b is not None
        scale = self.weight_scale(q.shape[1])
        if logits is not None and lse is not None:
            torch.ops.kvbench.decode_weights(logits, lse, b.decode_tables, self._slot_lens,
                                             self.slot_pos, self.block_size, self._received,
                                             scale)
        p = self._prefill
        if p is not None and self._rows is not None and self._lse is not None:
            kc = self.k_cache[self.layer_slots[layer].storage]
            torch.ops.kvbench.prefill_weights(q, kc, self.slot_pos, p.cu_rows, p.starts,
                                              p.tables, self._kv_lens, *self._rows,
                                              self._lse, self._received, self._max_slots,
                                              scale, False)

    def selects(self, seq: Sequence) -> bool:
        """Whether ``seq``'s prompt will be compressed at all: it is longer than what its
        budget keeps, and it did not start from a compressed prefix (harness.kv.compressed:
        compressed already, so not again)."""
        if seq.compressed_prefix:
            return False
        p = seq.num_prompt_tokens
        return self.policy.keep(p, seq.group.params.max_tokens) < p

    def selection_follows(self, c: PrefillChunk) -> bool:
        """Whether the policy selects after chunk ``c`` (``held``): never when the prompt
        fits its budget; under ``full`` after the prompt's last chunk, under
        ``streaming`` after every chunk."""
        seq = c.sched.seq
        if not self.selects(seq):
            return False
        return self.policy.streaming or c.start + c.num_tokens >= seq.num_prompt_tokens

    def score_held(self, layer: int, c: PrefillChunk, slots: torch.Tensor) -> None:
        """``held``: when a selection follows this chunk (the prompt's end under ``full``,
        each chunk under ``streaming``), score every key the sequence holds (slots (L,) its
        table's, this chunk's own keys stored already) by :meth:`held_scores`."""
        if not self.selection_follows(c):
            return
        held = slots[self.slot_pos[slots] >= 0]
        scored, s = self.held_scores(layer, c, held)
        if scored.numel():
            self._received.index_add_(0, scored, s)
        if layer == self.last_scored:
            self._selected_slots.append(held)

    def held_scores(self, layer: int, c: PrefillChunk,
                    held: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``held``: (slots scored, their float32 scores) of one layer, from ``held`` (T,)
        the slots the sequence holds. Default: :meth:`score` of all their keys at once."""
        k, _ = self.gather(layer, held, torch.float32)  # (T, KV, D)
        return held, self.score(None, k)

    def observe_window(self, layer: int, q: torch.Tensor, c: PrefillChunk,
                       slots: torch.Tensor) -> None:
        """``window``: add this chunk's window queries' scores (q: (n, H, D) the chunk's
        queries; slots (L,) its table's) by key position; the chunk that ends the window
        pools them onto the held slots. Full trigger: the prompt's last ``window`` queries
        (they may span chunks) score the keys before them; streaming: each chunk's own last
        ones score what is held before them."""
        seq = c.sched.seq
        p, win = seq.num_prompt_tokens, self.window_size()
        end = min(c.start + c.num_tokens, p)
        lo = max(c.start, end - win) if self.policy.streaming else p - win
        first = max(c.start, lo)
        if not self.selects(seq) or first >= end or lo <= 0:
            return  # nothing to select, no window query in this chunk, or no key before it
        if layer == self.first_scored and c.start <= lo:  # the window starts: (re)start
            self._obs[seq.seq_id] = torch.zeros(
                (self.layout.num_layers, q.shape[1], lo), dtype=torch.float32,
                device=self.device)
        kpos = self.slot_pos[slots]
        scored = (kpos >= 0) & (kpos < lo)
        if self._kernel == "triton":
            self.window_triton_weights(layer, q, c, slots, first, end, lo)
        else:
            k, _ = self.gather(layer, slots, torch.float32)  # (L, KV, D)
            qpos = torch.arange(first, end, device=q.device)
            seen = (kpos[None, :] >= 0) & (kpos[None, :] <= qpos[:, None])  # causal (n, L)
            w = self.weights(q[first - c.start:end - c.start].unsqueeze(0), k.unsqueeze(0),
                             seen.unsqueeze(0))[0]
            self._obs[seq.seq_id][layer].index_add_(
                1, kpos[scored], self.score(w[..., scored], k[scored]))
        if (end == p or self.policy.streaming) and layer == self.last_scored:
            # Pooled by position; each held key takes its position's score (streaming: the
            # positions evicted by earlier chunks hold nothing, and pool as zeros).
            pooled = self.pool(self._obs.pop(seq.seq_id))
            held = slots[scored]
            self._received[held] += pooled[kpos[scored]]
            self._selected_slots.append(held)

    def window_triton_weights(self, layer: int, q: torch.Tensor, c: PrefillChunk,
                              slots: torch.Tensor, first: int, end: int, lo: int) -> None:
        """``window`` on the Triton path: the weights chunk ``c``'s window queries (positions
        ``first .. end - 1``) give the keys before position ``lo``, per query head and by
        position, added to the sequence's window buffer in one launch (the rows'
        log-sum-exp from the layer's prefill launch; q: (n, H, D) the chunk's)."""
        assert self._lse is not None
        args = self._window_args.get(c.row)
        if args is None:  # made once a step (host values), read by every layer
            args = torch.tensor([0, c.num_tokens, c.start, slots.numel(), first - c.start,
                                 end - c.start, lo], dtype=torch.int64, device=self.device)
            self._window_args[c.row] = args
        kc = self.k_cache[self.layer_slots[layer].storage]
        obs = self._obs[c.sched.seq.seq_id][layer].unsqueeze(0)  # (1, H, lo)
        lse = self._lse[c.row:c.row + c.num_tokens]
        torch.ops.kvbench.prefill_weights(q, kc, self.slot_pos, args[0:2], args[2:3],
                                          c.table[None], args[3:4], args[4:5], args[5:6],
                                          args[6:7], lse, obs, slots.numel(), 1.0, True)

    def take_scores(self) -> StepScores | None:
        if self.reads in ("window", "held") and self._selected_slots:
            self._touched = torch.cat(self._selected_slots)
        if self._touched is None:
            return None
        t = self._touched
        both = torch.stack([t.to(torch.float64), self._received[t].to(torch.float64)])
        # Read above before it is cleared (stream order). A -1 (weights) reads and clears
        # the last slot: 0 unless touched this step, and then read first all the same.
        self._received[t] = 0.0
        host = both.cpu().numpy()  # the step's one device-to-host transfer
        slots = host[0].astype(np.int64)
        if self.reads != "weights":  # each slot once, every one held
            return StepScores(slots=slots, values=host[1])
        # Candidates with repeats and -1s (begin_step); a slot's value is the same
        # wherever it repeats.
        keep = slots >= 0
        slots, first = np.unique(slots[keep], return_index=True)  # sorted, as torch.unique
        return StepScores(slots=slots, values=host[1][keep][first])
