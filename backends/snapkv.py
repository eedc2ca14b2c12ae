"""`snapkv`: SnapKV (Li et al., 2024), prefill-time and query-aware, with the memory it
frees given back.

At the end of a prompt's prefill, the attention the prompt's last ``window`` queries (the
observation window) pay to each earlier prompt token, summed over those queries, is pooled
over ``kernel`` neighbouring positions per query head (``pooling``: max, as the paper's
code, or avg), then summed over the heads and layers (one selection per sequence: the
variant that frees memory; harness.kv.policies.snapkv). The KV manager keeps the top
``budget`` (or ``budget_ratio`` of the prompt) and the window, gives back the rest and
compacts the kept tokens into fewer blocks, so whole blocks return to the pool right after
the prefill. Decoding then appends as usual (``max_tokens`` caps what a sequence holds).

A prompt prefilled in several chunks may have its window span them: each chunk adds its
window queries' weights (per layer and head, by position) into a per-sequence buffer,
and the chunk that ends the prompt pools them and hands the scores over (one transfer).
That buffer, (layers, heads, prompt - window) floats per sequence whose window is being
prefilled, is scratch beside the cache and freed at the selection; it is not charged.
Attention is masked SDPA over the held slots (backends.slotted); the window rows are
also computed as an explicit softmax, for their weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from harness.backends.base import KVLayout, PrefillChunk
from harness.backends.scored import ScorerOptions
from harness.backends.slotted import SlottedBackend
from harness.errors import UserError
from harness.kv.base import StepScores
from harness.kv.policies.snapkv import SnapKVPolicy, check_snapkv_options
from harness.validate import one_of

POOLING = ("max", "avg")


@dataclass
class SnapKVOptions(ScorerOptions):
    budget: int = 0  # prompt tokens kept besides the window; or
    budget_ratio: float = 0.2  # their share of the prompt (set exactly one)
    # The trigger: full (the paper's: one selection at the prompt's end, by the prompt's
    # last `window` queries) | streaming (bounded memory while prefilling: chunks of the
    # kept prompt, each chunk's own last `window` queries selecting after it ran)
    prefill: str = "full"
    window: int = 32  # observation window: the prompt's last queries
    kernel: int = 7  # pooling width over neighbouring positions (odd; not an attention kernel)
    pooling: str = "max"  # max | avg
    max_tokens: int = 0  # cap on tokens held while decoding (0: none)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_snapkv_options(self.budget, self.budget_ratio, self.window, self.max_tokens)
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise UserError(f"backend.kernel (SnapKV's pooling width) must be odd and >= 1, "
                            f"got {self.kernel}")
        one_of(self, "backend", "pooling", POOLING)


class SnapKVBackend(SlottedBackend):
    name = "snapkv"
    Options = SnapKVOptions
    @property
    def trigger(self) -> str | None:
        return self.policy.prefill

    def __init__(self, layout: KVLayout, device: torch.device, **options: Any) -> None:
        super().__init__(layout, device, **options)
        o = self.opts
        assert isinstance(o, SnapKVOptions)
        self.policy = SnapKVPolicy(o)
        self.window, self.pool_width, self.pooling = o.window, o.kernel, o.pooling
        # seq id -> (layers, query heads, P - window): its window queries' weights so far
        self._obs: dict[int, torch.Tensor] = {}
        self._emit: list[tuple[torch.Tensor, torch.Tensor]] = []  # (slots, scores)

    def attend_chunk(self, layer: int, q: torch.Tensor, c: PrefillChunk,
                     slots: torch.Tensor) -> torch.Tensor:
        out = super().attend_chunk(layer, q, c, slots)
        seq = c.sched.seq
        p = seq.num_prompt_tokens
        end = min(c.start + c.num_tokens, p)
        # The first window query; scored keys are [0, lo). Full: the prompt's last `window`
        # (they may span chunks); streaming: this chunk's own last ones (at most all of it).
        lo = max(c.start, end - self.window) if self.policy.streaming else p - self.window
        first, last = max(c.start, lo), end
        if self.policy.keep(p) >= p or first >= last or lo <= 0:
            return out  # nothing to select, no window query in this chunk, or no key before it
        if layer == 0 and c.start <= lo:  # the window starts here: (re)start its buffer
            self._obs[seq.seq_id] = torch.zeros(
                (self.layout.num_layers, q.shape[1], lo), dtype=torch.float32,
                device=self.device)
        acc = self._obs[seq.seq_id][layer]
        kpos = self.slot_pos[slots]
        w = self.window_weights(layer, q[first - c.start:last - c.start], slots, kpos,
                                first)
        scored = (kpos >= 0) & (kpos < lo)
        acc.index_add_(1, kpos[scored], w[:, scored])
        if (last == p or self.policy.streaming) and layer == self.layout.num_layers - 1:
            # Pooled by position; each held key takes its position's score (streaming: the
            # positions evicted by earlier chunks hold nothing, and pool as zeros).
            order = kpos[scored].argsort()
            pooled = self.pooled_scores(self._obs.pop(seq.seq_id))
            self._emit.append((slots[scored][order], pooled[kpos[scored][order]]))
        return out

    def window_weights(self, layer: int, q: torch.Tensor, slots: torch.Tensor,
                       kpos: torch.Tensor, first: int) -> torch.Tensor:
        """Softmax weights of window queries at positions ``first ..`` (q: (w, H, D)) over
        the keys in ``slots`` (L,) at ``kpos``, causal, summed over the queries: (H, L)."""
        kv_heads, d = self.layout.num_kv_heads, self.layout.head_dim
        n, h, _ = q.shape
        k, _ = self.gather(layer, slots, torch.float32)  # (L, KV, D)
        qg = q.to(torch.float32).view(n, kv_heads, h // kv_heads, d)
        logits = torch.einsum("nkgd,lkd->kgnl", qg, k) * d ** -0.5
        qpos = torch.arange(first, first + n, device=q.device)
        seen = (kpos[None, :] >= 0) & (kpos[None, :] <= qpos[:, None])  # (n, L)
        w = torch.softmax(logits.masked_fill(~seen, float("-inf")), dim=-1)
        return w.sum(dim=2).reshape(h, -1)

    def pooled_scores(self, acc: torch.Tensor) -> torch.Tensor:
        """acc: (layers, heads, P - window) summed window weights by position -> the
        score of each position: pooled per head over ``kernel`` neighbours, summed over
        heads and layers. (P - window,)"""
        x = acc.flatten(0, 1).unsqueeze(1)  # (layers * heads, 1, positions)
        pool = F.max_pool1d if self.pooling == "max" else F.avg_pool1d
        return pool(x, self.pool_width, stride=1, padding=self.pool_width // 2).sum((0, 1))

    def take_scores(self) -> StepScores | None:
        if not self._emit:
            return None
        slots = torch.cat([s for s, _ in self._emit]).to(torch.float64)
        vals = torch.cat([v for _, v in self._emit]).to(torch.float64)
        self._emit = []
        host = torch.stack([slots, vals]).cpu().numpy()  # the step's one transfer
        return StepScores(slots=host[0].astype(np.int64), values=host[1])
