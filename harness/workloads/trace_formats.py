"""Reading request traces: one :class:`TraceRow` per request, from three formats.

- ``mooncake`` (JSONL, the Mooncake / FAST'25 traces): ``timestamp`` (ms from the trace's
  start), ``input_length``, ``output_length``, ``hash_ids`` (one id per block of
  ``hash_block_tokens`` prompt tokens, 512 in the published traces; equal ids are equal
  blocks, and an id names its whole prefix, so shared leading ids are shared prefixes);
- ``azure`` (CSV, the Azure LLM inference traces 2023/2024): ``TIMESTAMP`` (a date-time
  such as ``2023-11-16 18:15:46.6805900``, or seconds), ``ContextTokens``,
  ``GeneratedTokens``;
- ``kvbench`` (CSV or JSONL, ours): ``arrival_s``, ``prompt_tokens``, ``output_tokens``,
  and optionally ``conversation_id`` with ``turn`` (a conversation's later turn re-sends
  its history) and ``priority`` (lower runs first under ``scheduler.policy=priority``).

Arrival times are rebased to the earliest row whatever the format (a trace of epoch
timestamps would otherwise wait decades for its first request): ``read_trace`` returns
the seconds it subtracted, and the workload records them (``trace.rebased_s``). An Azure
file mixing time zones (stamps with different UTC offsets, or some with and some
without one) is refused: which offset a naive stamp means cannot be known.

Every malformed line is reported as ``<file>:<line>: <what is wrong>`` in one UserError
(the first few, and how many more), never skipped: a replay that silently drops rows
replays another trace.
"""

from __future__ import annotations

import csv
import datetime as dt
import json
import math
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from harness.errors import UserError

FORMATS = ("auto", "mooncake", "azure", "kvbench")
# What each format's rows must hold (the auto-detection looks for these keys).
REQUIRED = {
    "mooncake": ("timestamp", "input_length", "output_length"),
    "azure": ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
    "kvbench": ("arrival_s", "prompt_tokens", "output_tokens"),
}
BOM = b"\xef\xbb\xbf"  # utf-8-sig's byte-order mark
_MAX_REPORTED = 8  # malformed lines listed in the error; the rest are counted
# Most tokens a row's length may say: far past any model's context (a row of 1e12 tokens
# is a broken file, not a request to cut down silently).
MAX_ROW_TOKENS = 10_000_000


@dataclass(slots=True)
class TraceRow:
    """One request of a trace, as the file gives it (before any window or speed-up)."""

    index: int  # the row's place among the file's data rows: the request id
    line: int  # 1-based line number in the file (for messages)
    arrival_s: float  # seconds from the trace's first timestamp
    prompt_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] | None = None  # mooncake only
    conversation: str | None = None  # kvbench only
    turn: int | None = None
    priority: int = 0
    tz: str | None = None  # azure only: the stamp's UTC offset ("none": a naive stamp)


class _Bad(Exception):
    """A row's field is missing or wrong; the message says which (no file or line)."""


def _number(rec: dict[str, Any], key: str) -> tuple[Any, float]:
    """The field's raw value and its float (NaN for a bool); _Bad if missing or not a
    number."""
    v = rec.get(key)
    if v is None or v == "":
        raise _Bad(f"missing {key!r}")
    try:
        return v, float(v) if not isinstance(v, bool) else math.nan
    except (TypeError, ValueError):
        raise _Bad(f"{key}={v!r} is not a number") from None


def _int(rec: dict[str, Any], key: str, minimum: int,
         maximum: int = MAX_ROW_TOKENS) -> int:
    v = rec.get(key)
    if type(v) is int and minimum <= v <= maximum:  # the common case, first (1M rows)
        return v
    if isinstance(v, int | str) and not isinstance(v, bool) and len(str(v)) > 20:
        raise _Bad(f"{key} has {len(str(v).strip().lstrip('+-'))} digits: must be in "
                   f"[{minimum}, {maximum:,}]")
    v, f = _number(rec, key)
    if not math.isfinite(f) or f != int(f):
        raise _Bad(f"{key}={v!r} is not a whole number")
    if not minimum <= int(f) <= maximum:
        raise _Bad(f"{key}={v!r} must be in [{minimum}, {maximum:,}]")
    return int(f)


def _seconds(rec: dict[str, Any], key: str, scale: float) -> float:
    v = rec.get(key)
    if (type(v) is int or type(v) is float) and 0 <= v < math.inf:  # the common case
        return v * scale
    v, f = _number(rec, key)
    if not math.isfinite(f) or f < 0:
        raise _Bad(f"{key}={v!r} must be a finite number >= 0")
    return f * scale


_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


def _azure_time(v: Any) -> tuple[float, str | None]:
    """Microseconds since the epoch of an Azure TIMESTAMP (a date-time, or seconds), as a
    whole number (differences of such stamps are then exact to the microsecond), and its
    UTC offset (``none`` for a naive date-time, None for seconds)."""
    if v is None or v == "":
        raise _Bad("missing 'TIMESTAMP'")
    try:
        f = float(v)
        if not math.isfinite(f):
            raise _Bad(f"TIMESTAMP={v!r} is not a finite number")
        return float(round(f * 1e6)), None
    except (TypeError, ValueError):
        pass
    try:
        t = dt.datetime.fromisoformat(str(v).strip())
    except ValueError:
        raise _Bad(f"TIMESTAMP={v!r} is neither a date-time (2023-11-16 18:15:46.68) "
                   "nor seconds") from None
    tz = "none" if t.tzinfo is None else f"UTC{t.strftime('%z')}"
    if t.tzinfo is None:
        t = t.replace(tzinfo=dt.UTC)
    return float((t - _EPOCH) // dt.timedelta(microseconds=1)), tz


def _mooncake(rec: dict[str, Any], index: int, line: int) -> TraceRow:
    ids = rec.get("hash_ids", [])
    # type() is int: no bool, no float (a set of the types: C speed over a million rows)
    if not isinstance(ids, list) or not set(map(type, ids)) <= {int}:
        raise _Bad(f"hash_ids={ids!r} is not a list of integers")
    return TraceRow(index, line, _seconds(rec, "timestamp", 1e-3),
                    _int(rec, "input_length", 1), _int(rec, "output_length", 0),
                    hash_ids=tuple(ids))


def _azure(rec: dict[str, Any], index: int, line: int) -> TraceRow:
    # Microseconds: made seconds from the first timestamp once every row is read.
    us, tz = _azure_time(rec.get("TIMESTAMP"))
    return TraceRow(index, line, us, _int(rec, "ContextTokens", 1),
                    _int(rec, "GeneratedTokens", 0), tz=tz)


def _kvbench(rec: dict[str, Any], index: int, line: int) -> TraceRow:
    conv = rec.get("conversation_id")
    conv = None if conv is None or conv == "" else str(conv)
    turn = _int(rec, "turn", 0, 2**31 - 1) if rec.get("turn") not in (None, "") else None
    if turn is not None and conv is None:
        raise _Bad("a turn without a conversation_id")
    prio = _int(rec, "priority", -(2**31), 2**31 - 1) \
        if rec.get("priority") not in (None, "") else 0
    return TraceRow(index, line, _seconds(rec, "arrival_s", 1.0),
                    _int(rec, "prompt_tokens", 1), _int(rec, "output_tokens", 0),
                    conversation=conv, turn=turn, priority=prio)


PARSERS = {"mooncake": _mooncake, "azure": _azure, "kvbench": _kvbench}


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's pairs as a dict; ValueError when a key appears twice."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"key {k!r} appears twice")
        out[k] = v
    return out


def sniff(path: Path) -> tuple[str, str]:
    """How the file's rows are written, from its content (its first non-blank line), not
    its name: ``("jsonl" | "csv", why)``; ``why`` says from what, for messages."""
    try:
        with path.open(encoding="utf-8-sig", errors="replace") as f:
            first = next((ln for ln in f if ln.strip()), "")
    except OSError as e:
        raise UserError(f"workload.path={path}: cannot read it ({e.strerror or e})") from None
    kind = "jsonl" if first.lstrip().startswith("{") else "csv"
    why = ("read as JSONL: its first line starts with '{'" if kind == "jsonl" else
           "read as CSV with a header: its first line does not start with '{'")
    if (kind == "csv") != (path.suffix.lower() == ".csv"):
        why += f" (whatever its {path.suffix or 'missing'} suffix says)"
    return kind, why


def _records(path: Path, kind: str, errors: _Errors
             ) -> Iterator[tuple[int, dict[str, Any], int]]:
    """(line number, record, byte offset of its line) per data row of a CSV (header
    first) or JSONL file, read as a stream. A JSONL row's offset lets
    :meth:`TraceIndex.hash_ids` read it again; a CSV row's is -1 (its columns are all a
    replay needs). JSONL lines end at ``\n`` (or ``\r\n``); a bare ``\r`` does not end
    one."""
    if kind == "csv":
        yield from _csv_records(path, errors)
        return
    try:
        f = path.open("rb")
    except OSError as e:
        raise UserError(f"workload.path={path}: cannot read it ({e.strerror or e})") from None
    with f:
        offset = 0
        for no, raw in enumerate(f, 1):
            at, offset = offset, offset + len(raw)
            if no == 1 and raw.startswith(BOM):  # not part of the first key
                raw, at = raw[len(BOM):], at + len(BOM)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise UserError(f"workload.path={path} is not UTF-8 text ({e.reason} at byte "
                                f"{at + e.start})") from None
            if not text.strip():
                continue
            try:
                rec = json.loads(text)
                # A key given twice: json keeps the last, silently (issue #55). Parsed again
                # with a check only when the row may hold one (more ':' than keys).
                if isinstance(rec, dict) and text.count(":") > len(rec):
                    json.loads(text, object_pairs_hook=_unique_keys)
            except RecursionError:
                errors.append(f"{path}:{no}: JSON nested too deeply to be a trace row")
                continue
            except ValueError as e:
                errors.append(f"{path}:{no}: not valid JSON ({e})")
                continue
            if not isinstance(rec, dict):
                errors.append(f"{path}:{no}: a JSON {type(rec).__name__}, not an object")
                continue
            yield no, rec, at


def _csv_records(path: Path, errors: _Errors) -> Iterator[tuple[int, dict[str, Any], int]]:
    try:  # utf-8-sig: a byte-order mark (Excel's CSVs) is not part of the first column
        f = path.open(newline="", encoding="utf-8-sig")
    except OSError as e:
        raise UserError(f"workload.path={path}: cannot read it ({e.strerror or e})") from None
    with f:
        try:
            reader = csv.DictReader(f)
            try:
                for rec in reader:
                    if None in rec:  # more fields than the header names
                        n = len(rec) - 1  # the header's fields (None holds the extra)
                        errors.append(f"{path}:{reader.line_num}: {n + len(rec[None])} "
                                      f"fields, the header has {n}")
                        continue
                    yield reader.line_num, rec, -1
            except csv.Error as e:  # a field over csv's 128 KiB limit, a NUL byte
                raise UserError(f"{path}:{reader.line_num + 1}: not a CSV row ({e}): a "
                                "trace's fields are numbers and short ids") from None
        except UnicodeDecodeError as e:
            raise UserError(f"workload.path={path} is not UTF-8 text ({e.reason} at byte "
                            f"{e.start})") from None


def detect(rec: dict[str, Any], path: Path, why: str = "") -> str:
    """The format whose required keys the first record holds."""
    for fmt, keys in REQUIRED.items():
        if all(k in rec for k in keys):
            return fmt
    wanted = "; ".join(f"{fmt}: {', '.join(keys)}" for fmt, keys in REQUIRED.items())
    got = ", ".join(str(k)[:40] for k in list(rec)[:8]) + (", ..." if len(rec) > 8 else "")
    raise UserError(f"workload.path={path}: cannot tell the trace format from its first "
                    f"row's keys ({got}{'; ' + why if why else ''}); expected one of "
                    f"{wanted} (or set workload.format)")


class _Errors:
    """Malformed lines: the first few as messages, the rest counted (a file of the wrong
    format would otherwise hold a message per line)."""

    def __init__(self) -> None:
        self.first: list[str] = []
        self.count = 0

    def append(self, msg: str) -> None:
        self.count += 1
        if len(self.first) < _MAX_REPORTED:
            self.first.append(msg)


@dataclass
class TraceIndex:
    """A trace after one streaming pass over its file: every row validated (what
    :func:`read_trace` promises), and kept as columns of numbers, one entry per data row
    in file order, instead of one object per row: a million rows take tens of MB. What a
    row's columns do not hold (a Mooncake row's ``hash_ids``) is read again from the file
    when its request is built (:meth:`hash_ids`), by the byte offset of its line."""

    path: Path
    format: str
    rebased_s: float  # seconds subtracted so that arrivals count from the earliest row
    arrival_s: np.ndarray  # float64 (n,): seconds from the earliest row
    prompt_tokens: np.ndarray  # int64 (n,)
    output_tokens: np.ndarray  # int64 (n,)
    line: np.ndarray  # int64 (n,): 1-based line in the file
    offset: np.ndarray  # int64 (n,): byte offset of a JSONL row's line; -1 in a CSV
    num_hash_ids: np.ndarray  # int64 (n,): len(hash_ids); -1 where the row has none
    priority: np.ndarray  # int64 (n,)
    turn: np.ndarray  # int64 (n,): -1 where the row has none
    conversation: np.ndarray  # int64 (n,): index into ``conversations``, -1: none
    conversations: list[str]
    _file: BinaryIO | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.arrival_s)

    def hash_ids(self, i: int) -> tuple[int, ...] | None:
        """Row ``i``'s Mooncake hash ids, read again from its line (validated by the
        scan: a changed file is an error, not a different replay)."""
        if self.num_hash_ids[i] < 0:
            return None
        if self.num_hash_ids[i] == 0 or self.offset[i] < 0:  # e.g. a Mooncake CSV: no ids
            return ()
        if self._file is None:
            self._file = self.path.open("rb")
        self._file.seek(int(self.offset[i]))
        raw = self._file.readline()
        try:
            ids = tuple(json.loads(raw.decode("utf-8")).get("hash_ids", []))
        except (ValueError, AttributeError):
            ids = ()
        if len(ids) != self.num_hash_ids[i]:
            raise UserError(f"{self.path}:{self.line[i]}: the trace changed while it was "
                            "replayed (its line no longer holds the row read at the start)")
        return ids

    def row(self, i: int) -> TraceRow:
        """Row ``i`` as a :class:`TraceRow` (arrival rebased)."""
        conv, turn = int(self.conversation[i]), int(self.turn[i])
        return TraceRow(i, int(self.line[i]), float(self.arrival_s[i]),
                        int(self.prompt_tokens[i]), int(self.output_tokens[i]),
                        hash_ids=self.hash_ids(i),
                        conversation=self.conversations[conv] if conv >= 0 else None,
                        turn=turn if turn >= 0 else None, priority=int(self.priority[i]))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def scan_trace(path: Path, fmt: str = "auto") -> TraceIndex:
    """One streaming pass over the trace: every row parsed and validated as
    :func:`read_trace` does (the same messages), kept as :class:`TraceIndex` columns.
    Memory grows by ~70 bytes per row whatever the row holds."""
    if fmt not in FORMATS:
        raise UserError(f"unknown workload.format {fmt!r}; known: {', '.join(FORMATS)}")
    if not path.is_file():
        raise UserError(f"workload.path={path} is not a file (example traces: traces/)")
    errors = _Errors()
    cols = {k: array("q") for k in ("prompt", "output", "line", "offset", "nhash", "prio",
                                     "turn", "conv")}
    arrival = array("d")
    convs: dict[str, int] = {}
    seen_turns: set[tuple[str, int]] = set()
    conv_kinds: dict[str, tuple[str, Any]] = {}  # id -> (its JSON type, its first value)
    first_tz: dict[str | None, int] = {}  # azure: each UTC offset's first line
    kind, why = sniff(path)
    n = 0
    for line, rec, offset in _records(path, kind, errors):
        if fmt == "auto":
            fmt = detect(rec, path, why)
        try:
            row = PARSERS[fmt](rec, n, line)
            if row.conversation is not None:
                # 1 and "1" read as one id (issue #55: their turns were merged).
                raw = rec.get("conversation_id")
                first = conv_kinds.setdefault(row.conversation, (type(raw).__name__, raw))
                if first[0] != type(raw).__name__:
                    raise _Bad(f"conversation_id {raw!r} and {first[1]!r} (line before) read "
                               "as one id: give every conversation_id as text, or every "
                               "one as a number")
            if row.conversation is not None and row.turn is not None:
                key = (row.conversation, row.turn)
                if key in seen_turns:
                    raise _Bad(f"turn {row.turn} of conversation {row.conversation!r} "
                               "appears twice")
                seen_turns.add(key)
        except _Bad as e:
            errors.append(f"{path}:{line}: {e}")
            continue
        if fmt == "azure":
            first_tz.setdefault(row.tz, line)
        arrival.append(row.arrival_s)
        cols["prompt"].append(row.prompt_tokens)
        cols["output"].append(row.output_tokens)
        cols["line"].append(line)
        cols["offset"].append(offset)
        cols["nhash"].append(-1 if row.hash_ids is None else len(row.hash_ids))
        cols["prio"].append(row.priority)
        cols["turn"].append(-1 if row.turn is None else row.turn)
        cols["conv"].append(-1 if row.conversation is None
                            else convs.setdefault(row.conversation, len(convs)))
        n += 1
    if errors.count:
        more = errors.count - _MAX_REPORTED
        raise UserError(f"{errors.count} malformed line(s) in the {fmt} trace "
                        f"{path} ({why}):\n  " + "\n  ".join(errors.first)
                        + (f"\n  ... and {more} more" if more > 0 else ""))
    if not n:
        raise UserError(f"workload.path={path} holds no requests")
    # Stamps that each carry a UTC offset are exact instants, whatever the offsets (a
    # trace crossing a daylight-saving change: issue #55 refused it); what cannot be told
    # apart is a stamp without an offset, or seconds, beside stamps of another kind.
    kinds = {"seconds" if tz is None else "naive" if tz == "none" else "offset"
             for tz in first_tz}
    if len(kinds) > 1:
        seen = "; ".join(f"line {ln}: {'no UTC offset' if tz == 'none' else tz or 'seconds'}"
                         for tz, ln in first_tz.items())
        raise UserError(f"workload.path={path}: its TIMESTAMPs mix time zones ({seen}); "
                        "arrivals between them would be off by the offsets (hours): give "
                        "every stamp a UTC offset, or none")
    t = np.frombuffer(arrival, dtype=np.float64).copy()
    scale = 1e-6 if fmt == "azure" else 1.0  # azure: microseconds since the epoch
    t0 = float(t.min())
    t = (t - t0) * scale
    c = {k: np.frombuffer(v, dtype=np.int64).copy() for k, v in cols.items()}
    return TraceIndex(path, fmt, t0 * scale, t, c["prompt"], c["output"], c["line"],
                      c["offset"], c["nhash"], c["prio"], c["turn"], c["conv"], list(convs))


def read_trace(path: Path, fmt: str = "auto") -> tuple[str, list[TraceRow], float]:
    """The trace's format, its rows in file order (arrivals from the earliest row) and the
    seconds subtracted to get there; a UserError lists malformed lines. One object per
    row: for small traces (the replay itself reads :func:`scan_trace`'s columns)."""
    idx = scan_trace(path, fmt)
    try:
        return idx.format, [idx.row(i) for i in range(len(idx))], idx.rebased_s
    finally:
        idx.close()
