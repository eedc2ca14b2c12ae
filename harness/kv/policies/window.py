"""Sliding window with attention sinks (StreamingLLM): a positional policy.

A query at position p sees keys in ``(p - window, p]`` and the first ``sinks`` positions.
After each step, every block wholly before the next query's window, except the blocks
holding the sinks, is given back. The cursor makes the per-step cost O(blocks given back).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from harness.errors import UserError
from harness.kv.policies.base import Eviction, EvictionPolicy, HeldBlocks, HeldTokens

if TYPE_CHECKING:
    from harness.sched.sequence import Sequence


@dataclass
class WindowPolicy(EvictionPolicy):
    window: int = 256
    sinks: int = 4
    name = "sliding_window"
    positional = True

    def __post_init__(self) -> None:
        if self.window < 1 or self.sinks < 0:
            raise UserError(f"need backend.window >= 1 and backend.sink_tokens >= 0, got "
                            f"{self.window} and {self.sinks}")

    def select(self, seq: Sequence, held: HeldBlocks | HeldTokens, need: int) -> Eviction:
        assert isinstance(held, HeldBlocks), "a positional policy decides by blocks"
        bs = held.block_size
        # The next query sits at position num_computed and sees from num_computed+1-window.
        upto = max(0, seq.num_computed + 1 - self.window) // bs
        first = max(-(-self.sinks // bs), held.cursor)
        if upto <= first:
            return Eviction()
        # The manager moves the cursor to what this decided about (considered).
        return Eviction(blocks=[i for i in range(first, upto) if held.table[i] >= 0],
                        considered=upto)
