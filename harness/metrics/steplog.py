"""The run's step rows as columns: a typed array per :class:`StepRow` field, 8 bytes a
number per step instead of an object of ~40 (a run of a million requests takes millions of
steps). It reads as a sequence of :class:`StepRow` (made on access), so code that walks
the rows is unchanged; the summary and the writers take whole columns (:meth:`column`)."""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence
from dataclasses import fields
from operator import attrgetter
from typing import Any, overload

import numpy as np

from harness.metrics.rows import StepRow

FIELDS = tuple(f.name for f in fields(StepRow))
_VALUES = attrgetter(*FIELDS)  # a row's values in field order (astuple deep-copies: 48 us)
_KIND = {f.name: ("d" if f.type in ("float", float) else "q" if f.type in ("int", int)
                  else "s") for f in fields(StepRow)}


class StepLog(Sequence[StepRow]):
    """Append-only columns of step rows."""

    def __init__(self) -> None:
        self._cols: list[Any] = [[] if _KIND[n] == "s" else array(_KIND[n]) for n in FIELDS]

    def append(self, row: StepRow) -> None:
        for col, v in zip(self._cols, _VALUES(row)):
            col.append(v)

    def __len__(self) -> int:
        return len(self._cols[0])

    @overload
    def __getitem__(self, i: int) -> StepRow: ...

    @overload
    def __getitem__(self, i: slice) -> list[StepRow]: ...

    def __getitem__(self, i: int | slice) -> StepRow | list[StepRow]:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        return StepRow(*(c[i] for c in self._cols))

    def __iter__(self) -> Iterator[StepRow]:
        for vals in zip(*self._cols):
            yield StepRow(*vals)

    def column(self, name: str) -> np.ndarray:
        """A copy of one field over every step (float64, int64, or object for text)."""
        c = self._cols[FIELDS.index(name)]
        if _KIND[name] == "s":
            return np.array(c, dtype=object)
        return np.array(c, dtype=np.float64 if _KIND[name] == "d" else np.int64)

    def columns(self) -> dict[str, Any]:
        """Every field's column as it is stored (typed arrays, a list for text): for the
        writers, without a copy."""
        return dict(zip(FIELDS, self._cols))
