"""`snapkv`: SnapKV (Li et al., 2024), prefill-time and query-aware, with the memory it
frees given back.

At the end of a prompt's prefill, the attention the prompt's last ``window`` queries (the
observation window) pay to each earlier prompt token, summed over those queries, is pooled
over ``pool_width`` neighbouring positions per query head (``pooling``: max, as the paper's
code, or avg), then summed over the heads and layers (one selection per sequence: the
variant that frees memory; harness.kv.policies.snapkv). The KV manager keeps the top
``budget`` (or ``budget_ratio`` of the prompt) and the window, gives back the rest and
compacts the kept tokens into fewer blocks, so whole blocks return to the pool right after
the prefill. Decoding then appends as usual (``max_tokens`` caps what a sequence holds).

On the scorer seam (backends/scored.py) with ``reads = "window"``: a prompt prefilled in
several chunks may have its window span them, and the base keeps the window queries'
scores by position across them (scratch beside the cache, (layers, heads, prompt -
window) floats per sequence whose window is being prefilled, freed at the selection, not
charged); the chunk that ends the prompt pools them (:meth:`SnapKVBackend.pool`) and the
base hands them over in the step's one transfer. Attention is masked SDPA over the held
slots (backends.slotted); the window rows are also computed as an explicit softmax, for
their weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from harness.backends.scored import ScoredBackend, ScorerOptions
from harness.errors import UserError
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
    pool_width: int = 7  # max/avg pooling over neighbouring positions (odd; the paper's kernel)
    pooling: str = "max"  # max | avg
    max_tokens: int = 0  # cap on tokens held while decoding (0: none)

    def __post_init__(self) -> None:
        refuse_old_pool_width(self.kernel)
        super().__post_init__()
        check_snapkv_options(self.budget, self.budget_ratio, self.window, self.max_tokens)
        if self.pool_width < 1 or self.pool_width % 2 == 0:
            raise UserError(f"backend.pool_width (SnapKV's pooling width) must be odd and "
                            f">= 1, got {self.pool_width}")
        one_of(self, "backend", "pooling", POOLING)


def refuse_old_pool_width(kernel: object) -> None:
    """``backend.kernel`` was snapkv's pooling width until issue #56 made it the attention
    kernel of every method: a number there is the old key, refused with the new one."""
    if isinstance(kernel, int) or str(kernel).strip().lstrip("+-").isdigit():
        raise UserError(f"backend.kernel={kernel}: snapkv's pooling width is now "
                        f"backend.pool_width (backend.kernel is the attention kernel: auto | "
                        f"torch | triton); use backend.pool_width={kernel}")


class SnapKVBackend(ScoredBackend):
    name = "snapkv"
    Options = SnapKVOptions
    Policy = SnapKVPolicy
    reads = "window"

    def window_size(self) -> int:
        o = self.opts
        assert isinstance(o, SnapKVOptions)
        return o.window

    def score(self, w: torch.Tensor | None, k: torch.Tensor) -> torch.Tensor:
        # The window's weights (KV, G, n, L), summed over its queries, per query head.
        assert w is not None
        return w.sum(dim=2).flatten(0, 1)

    def pool(self, acc: torch.Tensor) -> torch.Tensor:
        """acc: (layers, heads, P - window) summed window weights by position -> the
        score of each position: pooled per head over ``pool_width`` neighbours, summed over
        heads and layers. (P - window,)"""
        o = self.opts
        assert isinstance(o, SnapKVOptions)
        x = acc.flatten(0, 1).unsqueeze(1)  # (layers * heads, 1, positions)
        pool = F.max_pool1d if o.pooling == "max" else F.avg_pool1d
        return pool(x, o.pool_width, stride=1, padding=o.pool_width // 2).sum((0, 1))
