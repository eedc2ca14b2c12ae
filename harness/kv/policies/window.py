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

    def _first(self, cursor: int, block_size: int) -> int:
        """The first block that may be given back: past the sinks' blocks and the cursor."""
        return max(-(-self.sinks // block_size), cursor)

    def gives_back_at(self, cursor: int, block_size: int) -> int:
        """The fewest computed tokens at which :meth:`select` gives a block back, the
        table's cursor at ``cursor`` (the roofline's decode lane files a member by it)."""
        # The next query sits at position num_computed and sees from num_computed+1-window:
        # blocks up to (num_computed + 1 - window) // bs are wholly before it.
        return (self._first(cursor, block_size) + 1) * block_size + self.window - 1

    def select(self, seq: Sequence, held: HeldBlocks | HeldTokens, need: int) -> Eviction:
        assert isinstance(held, HeldBlocks), "a positional policy decides by blocks"
        bs = held.block_size
        if seq.num_computed < self.gives_back_at(held.cursor, bs):
            return Eviction()
        upto = (seq.num_computed + 1 - self.window) // bs
        first = self._first(held.cursor, bs)
        # The manager moves the cursor to what this decided about (considered).
        return Eviction(blocks=[i for i in range(first, upto) if held.table[i] >= 0],
                        considered=upto)
