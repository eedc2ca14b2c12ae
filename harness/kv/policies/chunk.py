"""Chunked attention (Llama 4's local layers): a positional policy.

A query at position p sees the keys of its own chunk, ``[p - p % chunk, p]``. After each
step, every block wholly before the next query's chunk is given back (a chunk's blocks go
all at once when the next chunk starts). The cursor makes the per-step cost O(blocks given
back), as the window's does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from harness.kv.policies.base import Eviction, EvictionPolicy, HeldBlocks, HeldTokens

if TYPE_CHECKING:
    from harness.sched.sequence import Sequence


@dataclass
class ChunkPolicy(EvictionPolicy):
    chunk: int = 8192
    name = "chunked"
    positional = True

    def __post_init__(self) -> None:
        if self.chunk < 1:
            raise ValueError(f"attention chunk must be >= 1, got {self.chunk}")

    def select(self, seq: Sequence, held: HeldBlocks | HeldTokens, need: int) -> Eviction:
        assert isinstance(held, HeldBlocks), "a positional policy decides by blocks"
        # The next query sits at position num_computed; its chunk starts at the multiple
        # of `chunk` at or below it.
        start = seq.num_computed - seq.num_computed % self.chunk
        upto = start // held.block_size
        if upto <= held.cursor:
            return Eviction()
        return Eviction(blocks=[i for i in range(held.cursor, upto) if held.table[i] >= 0],
                        considered=upto)
