"""The run's requests.csv rows as columns: a typed array per number, a list per text, so a
run of a million requests holds ~200 bytes a request instead of a dict of ~22 objects
(~3.5 KB). It reads as a sequence of row dicts (made on access), so code that walks the
rows is unchanged; the summary and the writers take whole columns.

A row's place is reserved when its request arrives (rows stay in arrival order) and filled
when the request finishes or at the end (:meth:`fill`). Code that adds a column to every
row (goodput's ``meets_slo``, a task's scores, the reference agreement) calls
:meth:`add_column`: a row dict read from the log is a copy, and writing into it changes
nothing.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterator, Sequence
from typing import Any, overload

import numpy as np

# The columns every row has (harness.metrics.collector.request_row), in its key order:
# "q" an integer, "d" a real, "n" a real or None (NaN stands for None: these are
# differences of finite clock times, never NaN themselves), "s" text.
FIXED: dict[str, str] = {
    "request_id": "q", "status": "s", "rejected_reason": "s", "arrival_s": "d",
    "prompt_tokens": "q", "output_tokens": "q", "num_seqs": "q", "ttft_ms": "n",
    "tpot_ms": "n", "itl_ms_max": "n", "e2e_ms": "n", "prefix_hit_tokens": "q",
    "prefix_source": "s", "tier_hit_blocks_cpu": "q", "tier_hit_blocks_disk": "q",
    "preemptions_recompute": "q", "preemptions_swap": "q", "recomputed_tokens": "q",
    "swapped_out_bytes": "q", "finish_reason": "s",
}
OUTPUT_IDS = "output_ids"  # "s", only with records.output_ids


class NullableDoubles(Sequence[float | None]):
    """A column of reals where NaN is read as None (an empty CSV field, a Parquet null)."""

    typecode = "d"  # the writers type the column by it (harness.results)

    def __init__(self, values: array[float]) -> None:
        self.values = values

    @property
    def all_none(self) -> bool:
        """Every value is None (the writers type such a column null, as for a list)."""
        return bool(np.isnan(np.frombuffer(self.values, dtype=np.float64)).all())

    def __len__(self) -> int:
        return len(self.values)

    @overload
    def __getitem__(self, i: int) -> float | None: ...

    @overload
    def __getitem__(self, i: slice) -> list[float | None]: ...

    def __getitem__(self, i: int | slice) -> float | list[float | None] | None:
        if isinstance(i, slice):
            return [None if math.isnan(v) else v for v in self.values[i]]
        v = self.values[i]
        return None if math.isnan(v) else v


class RequestLog(Sequence[dict[str, Any]]):
    """Request rows as columns, in arrival order; ``outputs``: an output_ids column."""

    def __init__(self, outputs: bool = True) -> None:
        self.kinds = dict(FIXED) | ({OUTPUT_IDS: "s"} if outputs else {})
        self._cols: dict[str, Any] = {
            k: [] if kind == "s" else array("d" if kind in "dn" else kind)
            for k, kind in self.kinds.items()}
        # Columns added after the run (add_column): any values, None where a row has none;
        # the names of those every row has (its value may be None) as opposed to those
        # only the rows with a value have (a task's scores: not on a request never run).
        self._extra: dict[str, list[Any]] = {}
        self._every: set[str] = set()
        # Per column, in order: (name, column, its empty value, whether None is NaN), read
        # once per request as it arrives and as it finishes.
        self._slots = [(k, col, "" if self.kinds[k] == "s" else
                        math.nan if self.kinds[k] in "dn" else 0, self.kinds[k] in "dn")
                       for k, col in self._cols.items()]

    def reserve(self) -> int:
        """A place for the next arriving request's row (filled by :meth:`fill`)."""
        for _, col, empty, _ in self._slots:
            col.append(empty)
        for extra in self._extra.values():
            extra.append(None)
        return len(self) - 1

    def fill(self, i: int, row: dict[str, Any]) -> None:
        """Row ``i``'s values: a dict with exactly the fixed columns (None for a missing
        real or text)."""
        if row.keys() != self._cols.keys():  # a new field must be given a column here
            raise KeyError(f"a request row's keys {sorted(row.keys() ^ self._cols.keys())} "
                           "are not the RequestLog's columns")
        for k, col, _, nan in self._slots:
            v = row[k]
            col[i] = math.nan if v is None and nan else v

    def add_column(self, name: str, values: Sequence[Any], every_row: bool = True) -> None:
        """Add (or replace) a column: one value per row, in row order. ``every_row``:
        every row has the key, None or not; else only the rows whose value is not None
        (which decides where the column comes in the file, as it did for row dicts)."""
        if len(values) != len(self):
            raise ValueError(f"column {name}: {len(values)} values for {len(self)} rows")
        if name in self._cols:
            raise ValueError(f"column {name} is one of the fixed columns")
        self._extra.pop(name, None)
        self._extra[name] = list(values)
        if every_row:
            self._every.add(name)
        else:
            self._every.discard(name)

    def _has(self, name: str, i: int) -> bool:
        return name in self._every or self._extra[name][i] is not None

    def __len__(self) -> int:
        return len(self._cols["request_id"])

    def _value(self, k: str, i: int) -> Any:
        v = self._cols[k][i]
        return None if self.kinds[k] == "n" and math.isnan(v) else v

    def row(self, i: int) -> dict[str, Any]:
        """Row ``i`` as a dict (a copy), keys in column order; an added column's key on
        the rows that have it (every row, or those with a value: ``add_column``)."""
        r = {k: self._value(k, i) for k in self._cols}
        r.update({k: v[i] for k, v in self._extra.items() if self._has(k, i)})
        return r

    @overload
    def __getitem__(self, i: int) -> dict[str, Any]: ...

    @overload
    def __getitem__(self, i: slice) -> list[dict[str, Any]]: ...

    def __getitem__(self, i: int | slice) -> dict[str, Any] | list[dict[str, Any]]:
        if isinstance(i, slice):
            return [self.row(k) for k in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        return self.row(i % len(self))

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for i in range(len(self)):
            yield self.row(i)

    def __eq__(self, other: object) -> bool:
        """Equal to another log or a list holding the same rows, in the same order."""
        if isinstance(other, RequestLog | list):
            return len(self) == len(other) and all(
                a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable, compared by value

    def column(self, name: str) -> Any:
        """One column as stored: an array of numbers (NaN for none, in the nullable reals),
        a list of texts or of an added column's values."""
        return self._cols[name] if name in self._cols else self._extra[name]

    def matches(self, name: str, value: Any) -> np.ndarray:
        """bool (rows,): which rows hold ``value`` in column ``name`` (e.g. a status)."""
        return np.array(self.column(name), dtype=object) == value

    def values(self, name: str) -> np.ndarray:
        """A copy of a numeric fixed column as a numpy array (float64 or int64)."""
        kind = self.kinds[name]
        return np.array(self._cols[name], dtype=np.int64 if kind == "q" else np.float64)

    def columns(self) -> dict[str, Sequence[Any]]:
        """Every column for the writers (without a copy), in the order the keys first
        appear over the rows (as for a list of row dicts: harness.results.request_columns):
        the fixed ones, then each added column from the first row that has it, a column
        no row has left out. The nullable reals read None for NaN; an added column holds
        None where a row has no value. No rows: no columns."""
        if not len(self):
            return {}
        out: dict[str, Sequence[Any]] = {
            k: NullableDoubles(c) if self.kinds[k] == "n" else c for k, c in self._cols.items()}
        first = {}
        for pos, (k, v) in enumerate(self._extra.items()):
            at = 0 if k in self._every else next(
                (i for i, x in enumerate(v) if x is not None), None)
            if at is not None:
                first[k] = (at, pos)
        out.update((k, self._extra[k]) for k in sorted(first, key=first.__getitem__))
        return out
