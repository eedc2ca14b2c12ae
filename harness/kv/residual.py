"""A paged manager that also says when a partly filled block dies, for a backend that
keeps such blocks elsewhere until they fill (kivi's full-precision residual)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from harness.kv.paged import PagedKVManager

if TYPE_CHECKING:
    from harness.sched.sequence import Sequence


class ResidualKVManager(PagedKVManager):
    """:class:`PagedKVManager` + ``invalidated`` slots for every partly filled block whose
    last holder frees it (a finished, pruned or preempted sequence's last block): the
    backend then frees what it kept for that block. Full blocks are not listed; they
    stay what their hash names (prefix caching)."""

    def free(self, seq: Sequence) -> None:
        st = self._seqs.get(seq.seq_id)
        if st is not None:
            pool, bs = self.pool, self.block_size
            for b in st.table:
                if b >= 0 and pool.ref[b] == 1 and pool.fill[b] < bs:
                    self._ops.invalidated += range(b * bs, b * bs + pool.fill[b])
        super().free(seq)
