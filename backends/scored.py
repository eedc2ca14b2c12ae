"""The scorer seam: a token-eviction method is its options, a score and a trigger.

A method writes one options dataclass (deriving from :class:`ScorerOptions`: its budget,
its trigger ``prefill``, its own knobs), read by its backend and its policy alike, and one
:meth:`ScoredBackend.score`: what each key is worth this layer, from the step's attention
weights (``uses_weights``: the base then runs an explicit float32 softmax, as SDPA does
not return them), from the keys alone, or both. The base does the rest once: the weights
when asked for, per-slot scores summed over layers on the device, the one device-to-host
transfer per step (:meth:`take_scores`); the KV manager's policy (a
:class:`~harness.kv.policies.budget.BudgetPolicy`) keeps them, selects at the trigger,
frees and compacts.

The trigger (``backend.prefill``): ``full``, the whole prompt under full attention, then
one compression by the score at its end (the papers' long-context evaluations, kvpress);
``streaming``, bounded memory while prefilling (chunks, each followed by an eviction).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from harness.backends.base import AttentionBatch, BackendOptions, CacheSizing, KVLayout
from harness.backends.slotted import SlottedBackend
from harness.kv.base import StepScores
from harness.kv.policies.budget import PREFILL, BudgetPolicy, check_budget_options
from harness.validate import one_of


@dataclass
class ScorerOptions(BackendOptions):
    """What every scored method takes; a method's own dataclass extends it (and may set
    another ``prefill`` default: its paper's)."""

    budget: int = 0  # tokens per sequence; or
    budget_ratio: float = 0.2  # share of the request (set exactly one)
    prefill: str = "streaming"  # the trigger: full | streaming

    def __post_init__(self) -> None:
        super().__post_init__()
        check_budget_options(self.budget, self.budget_ratio)
        one_of(self, "backend", "prefill", PREFILL)


class ScoredBackend(SlottedBackend):
    """The base of a scored method: subclasses set ``Options``, ``Policy`` (the KV
    manager's side, built from the same options) and write :meth:`score`."""

    policy: BudgetPolicy
    Options: ClassVar[type[BackendOptions]] = ScorerOptions
    Policy: ClassVar[Callable[[Any], BudgetPolicy]]
    # The score reads the step's attention weights (explicit softmax over every key read);
    # False: keys only, scored once when written, and attention stays SDPA.
    uses_weights: ClassVar[bool] = True

    def __init__(self, layout: KVLayout, device: torch.device, **options: Any) -> None:
        super().__init__(layout, device, **options)
        self.policy = type(self).Policy(self.opts)

    @property
    def trigger(self) -> str | None:
        return self.policy.prefill

    @abstractmethod
    def score(self, w: torch.Tensor | None, k: torch.Tensor) -> torch.Tensor:
        """One layer's contribution to each key's score (higher: kept longer).

        With ``uses_weights``: w (B, KV, G, n, L) softmax weights of n queries (G query
        heads per KV head) over the L keys read, k (B, L, KV, D) those keys -> (B, L).
        Without: w None, k (T, KV, D) the step's new keys -> (T,)."""

    def allocate(self, sizing: CacheSizing) -> None:
        super().allocate(sizing)
        n = sizing.num_blocks * sizing.block_size
        # The step's score per slot, summed over layers (reset by take_scores).
        self._received = torch.zeros(n, dtype=torch.float32, device=self.device)

    def begin_step(self, batch: AttentionBatch) -> None:
        super().begin_step(batch)
        if not self.uses_weights:  # a key is scored once, in the step that writes it
            self._touched = batch.slot_mapping if batch.slot_mapping.numel() else None
            return
        touched = list(self._chunk_slots)
        if batch.num_decode:
            touched.append(self._decode_slots[self._decode_valid])
        self._touched = torch.unique(torch.cat(touched)) if touched else None

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        super().store(layer, k, v)
        if not self.uses_weights:
            b = self.batch
            assert b is not None
            self._received.index_add_(0, b.slot_mapping, self.score(None, k.float()))

    def attend_rows(self, layer: int, q: torch.Tensor, slots: torch.Tensor,
                    valid: torch.Tensor) -> torch.Tensor:
        if not self.uses_weights:
            return super().attend_rows(layer, q, slots, valid)
        kv_heads, d = self.layout.num_kv_heads, self.layout.head_dim
        bsz, n, h, _ = q.shape
        k, v = self.gather(layer, slots, torch.float32)  # (B, L, KV, D)
        qg = q.to(torch.float32).view(bsz, n, kv_heads, h // kv_heads, d)
        logits = torch.einsum("bnkgd,blkd->bkgnl", qg, k) * d ** -0.5
        logits = logits.masked_fill(~valid[:, None, None, :, :], float("-inf"))
        w = torch.softmax(logits, dim=-1)
        out = torch.einsum("bkgnl,blkd->bnkgd", w, v).reshape(bsz, n, h, d)
        self._received.index_add_(0, slots.flatten(), self.score(w, k).flatten())
        return out.to(q.dtype)

    def take_scores(self) -> StepScores | None:
        if self._touched is None:
            return None
        t = self._touched
        both = torch.stack([t.to(torch.float64), self._received[t].to(torch.float64)])
        self._received[t] = 0.0
        host = both.cpu().numpy()  # the step's one device-to-host transfer
        return StepScores(slots=host[0].astype(np.int64), values=host[1])
