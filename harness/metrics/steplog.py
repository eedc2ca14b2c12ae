"""The run's step rows as columns: a typed array per :class:`StepRow` field, 8 bytes a
number per step instead of an object of ~40 (a run of a million requests takes millions of
steps). It reads as a sequence of :class:`StepRow` (made on access), so code that walks
the rows is unchanged; the summary and the writers take whole columns (:meth:`column`).

Past ``spill_rows`` steps held in memory, the numbers go to a file per column in a
temporary folder (``TMPDIR``; removed when the log is let go or the process exits) and
only the latest steps stay in memory: a run's memory does not grow with its step count
(the text column, "" unless the run has KV cache groups, stays: 8 bytes a step)."""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import fields
from operator import attrgetter
from pathlib import Path
from typing import IO, Any, overload

import numpy as np

from harness.metrics.rows import StepRow

FIELDS = tuple(f.name for f in fields(StepRow))
_VALUES = attrgetter(*FIELDS)  # a row's values in field order (astuple deep-copies: 48 us)
_KIND = {f.name: ("d" if f.type in ("float", float) else "q" if f.type in ("int", int)
                  else "s") for f in fields(StepRow)}
_DTYPE = {"d": np.float64, "q": np.int64}
SPILL_ROWS = 1 << 18  # steps held in memory before they go to disk (~65 MB of numbers)
# Rows appended are held as they come and moved into the columns this many at a time:
# a column's append per field was 5 us a step (an array checks each value's type), one
# extend per field of a batch's values a tenth of that.
_BATCH = 1 << 10
_READ = 1 << 16  # steps read back at a time


class SpilledColumn(Sequence[Any]):
    """One numeric column of a spilled log: its older steps on disk, the rest in memory.
    Slices (step 1) and items read as Python numbers, as the in-memory array gives them."""

    def __init__(self, path: Path, typecode: str, on_disk: int, tail: array[Any]) -> None:
        self.path, self.typecode, self.on_disk, self.tail = path, typecode, on_disk, tail

    def __len__(self) -> int:
        return self.on_disk + len(self.tail)

    def array(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Steps ``start:stop`` as a numpy array (a copy)."""
        stop = len(self) if stop is None else stop
        parts = []
        if start < self.on_disk:
            n = min(stop, self.on_disk) - start
            parts.append(np.fromfile(self.path, dtype=_DTYPE[self.typecode], count=n,
                                     offset=start * 8))
        if stop > self.on_disk:
            a = max(start, self.on_disk) - self.on_disk
            parts.append(np.array(self.tail[a:stop - self.on_disk],
                                  dtype=_DTYPE[self.typecode]))
        return np.concatenate(parts) if parts else np.zeros(0, _DTYPE[self.typecode])

    @overload
    def __getitem__(self, i: int) -> Any: ...

    @overload
    def __getitem__(self, i: slice) -> list[Any]: ...

    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if step != 1:
                raise ValueError("a spilled column reads contiguous slices only")
            return self.array(start, max(start, stop)).tolist()
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        return self.array(i, i + 1).tolist()[0]


class StepLog(Sequence[StepRow]):
    """Append-only columns of step rows (spilled to disk past ``spill_rows``)."""

    def __init__(self, spill_rows: int | None = None, batch: int = _BATCH) -> None:
        """``batch``: rows appended before they move into the columns (see _BATCH)."""
        self._cols: list[Any] = [[] if _KIND[n] == "s" else array(_KIND[n]) for n in FIELDS]
        # Appended, not yet in the columns (see _BATCH): each row's values in field order.
        self._new: list[tuple[Any, ...]] = []
        self.batch = batch
        self.spill_rows = SPILL_ROWS if spill_rows is None else spill_rows
        self._on_disk = 0  # steps whose numbers are in the files
        self._dir: Path | None = None
        self._files: list[IO[bytes] | None] = []

    def append(self, row: StepRow) -> None:
        self.append_values(_VALUES(row))

    def append_values(self, values: tuple[Any, ...]) -> None:
        """Append a row given as its values in :data:`FIELDS` order (what the collector
        makes each step: no StepRow object, 2.5 us a step)."""
        assert len(values) == len(FIELDS), len(values)
        new = self._new
        new.append(values)
        if len(new) >= self.batch:
            self._settle()

    def _settle(self) -> None:
        """Move the rows appended since into the columns (every read does this first),
        then spill if the columns hold enough."""
        if self._new:
            for col, vals in zip(self._cols, zip(*self._new)):
                col.extend(vals)
            self._new = []
        if len(self._cols[0]) >= self.spill_rows:
            self._spill()

    def _spill(self) -> None:
        """Move the numbers held in memory to the end of their files."""
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="kvbench-steps-"))
            self._files = [None if _KIND[n] == "s" else open(self._dir / n, "wb")  # noqa: SIM115
                           for n in FIELDS]
            # Closed and removed when the log is let go, or at exit (by this process only:
            # a forked child inherits the finalizer, not the folder).
            weakref.finalize(self, _remove, self._files, self._dir, os.getpid())
        n = len(self._cols[0])
        for col, f in zip(self._cols, self._files):
            if f is not None:
                col.tofile(f)
                f.flush()  # readers open the file by name
                del col[:]  # frees the array's buffer
        self._on_disk += n

    def _column(self, k: int) -> Any:
        """Column ``k`` as a sequence over every step (without a copy where in memory)."""
        self._settle()
        col = self._cols[k]
        if self._dir is None or _KIND[FIELDS[k]] == "s":
            return col
        return SpilledColumn(self._dir / FIELDS[k], _KIND[FIELDS[k]], self._on_disk, col)

    def __len__(self) -> int:
        # "step": a number, spilled with the rest
        return self._on_disk + len(self._cols[0]) + len(self._new)

    @overload
    def __getitem__(self, i: int) -> StepRow: ...

    @overload
    def __getitem__(self, i: slice) -> list[StepRow]: ...

    def __getitem__(self, i: int | slice) -> StepRow | list[StepRow]:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        return StepRow(*(self._column(k)[i] for k in range(len(FIELDS))))

    def __iter__(self) -> Iterator[StepRow]:
        cols = [self._column(k) for k in range(len(FIELDS))]
        for a in range(0, len(self), _READ):
            yield from (StepRow(*vals) for vals in zip(*(c[a:a + _READ] for c in cols)))

    def column(self, name: str) -> np.ndarray:
        """A copy of one field over every step (float64, int64, or object for text)."""
        c = self._column(FIELDS.index(name))
        if _KIND[name] == "s":
            return np.array(c, dtype=object)
        if isinstance(c, SpilledColumn):
            return c.array()
        return np.array(c, dtype=_DTYPE[_KIND[name]])

    def columns(self) -> dict[str, Any]:
        """Every field's column for the writers, without a copy: the typed arrays (or,
        spilled, a :class:`SpilledColumn` read a slice at a time), a list for text."""
        return {n: self._column(k) for k, n in enumerate(FIELDS)}


def _remove(files: list[IO[bytes] | None], folder: Path, owner: int) -> None:
    for f in files:
        if f is not None:
            f.close()
    if os.getpid() == owner:
        shutil.rmtree(folder, ignore_errors=True)
