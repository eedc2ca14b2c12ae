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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.errors import UserError

FORMATS = ("auto", "mooncake", "azure", "kvbench")
# What each format's rows must hold (the auto-detection looks for these keys).
REQUIRED = {
    "mooncake": ("timestamp", "input_length", "output_length"),
    "azure": ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
    "kvbench": ("arrival_s", "prompt_tokens", "output_tokens"),
}
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
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                            for i in ids):
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


def _records(path: Path, kind: str, errors: list[str]) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, record) per data row of a CSV (header first) or JSONL file."""
    try:  # utf-8-sig: a byte-order mark (Excel's CSVs) is not part of the first column
        f = path.open(newline="", encoding="utf-8-sig")
    except OSError as e:
        raise UserError(f"workload.path={path}: cannot read it ({e.strerror or e})") from None
    with f:
        try:
            if kind == "csv":
                reader = csv.DictReader(f)
                try:
                    for rec in reader:
                        if None in rec:  # more fields than the header names
                            n = len(rec) - 1  # the header's fields (None holds the extra)
                            errors.append(f"{path}:{reader.line_num}: {n + len(rec[None])} "
                                          f"fields, the header has {n}")
                            continue
                        yield reader.line_num, rec
                except csv.Error as e:  # a field over csv's 128 KiB limit, a NUL byte
                    raise UserError(f"{path}:{reader.line_num + 1}: not a CSV row ({e}): a "
                                    "trace's fields are numbers and short ids") from None
                return
            for no, text in enumerate(f, 1):
                if not text.strip():
                    continue
                try:
                    rec = json.loads(text)
                except RecursionError:
                    errors.append(f"{path}:{no}: JSON nested too deeply to be a trace row")
                    continue
                except ValueError as e:
                    errors.append(f"{path}:{no}: not valid JSON ({e})")
                    continue
                if not isinstance(rec, dict):
                    errors.append(f"{path}:{no}: a JSON {type(rec).__name__}, not an object")
                    continue
                yield no, rec
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


def read_trace(path: Path, fmt: str = "auto") -> tuple[str, list[TraceRow], float]:
    """The trace's format, its rows in file order (arrivals from the earliest row) and the
    seconds subtracted to get there; a UserError lists malformed lines."""
    if fmt not in FORMATS:
        raise UserError(f"unknown workload.format {fmt!r}; known: {', '.join(FORMATS)}")
    if not path.is_file():
        raise UserError(f"workload.path={path} is not a file (example traces: traces/)")
    errors: list[str] = []
    rows: list[TraceRow] = []
    seen_turns: set[tuple[str, int]] = set()
    kind, why = sniff(path)
    for line, rec in _records(path, kind, errors):
        if fmt == "auto":
            fmt = detect(rec, path, why)
        try:
            row = PARSERS[fmt](rec, len(rows), line)
            if row.conversation is not None and row.turn is not None:
                key = (row.conversation, row.turn)
                if key in seen_turns:
                    raise _Bad(f"turn {row.turn} of conversation {row.conversation!r} "
                               "appears twice")
                seen_turns.add(key)
        except _Bad as e:
            errors.append(f"{path}:{line}: {e}")
            continue
        rows.append(row)
    if errors:
        more = len(errors) - _MAX_REPORTED
        raise UserError(f"{len(errors)} malformed line(s) in the {fmt} trace "
                        f"{path} ({why}):\n  " + "\n  ".join(errors[:_MAX_REPORTED])
                        + (f"\n  ... and {more} more" if more > 0 else ""))
    if not rows:
        raise UserError(f"workload.path={path} holds no requests")
    scale = 1e-6 if fmt == "azure" else 1.0  # azure: microseconds since the epoch
    if fmt == "azure":
        _one_time_zone(path, rows)
    t0 = min(r.arrival_s for r in rows)
    for r in rows:
        r.arrival_s = (r.arrival_s - t0) * scale
    return fmt, rows, t0 * scale


def _one_time_zone(path: Path, rows: list[TraceRow]) -> None:
    first: dict[str | None, TraceRow] = {}
    for r in rows:
        first.setdefault(r.tz, r)
    if len(first) > 1:
        seen = "; ".join(f"line {r.line}: {'no UTC offset' if tz == 'none' else tz or 'seconds'}"
                         for tz, r in first.items())
        raise UserError(f"workload.path={path}: its TIMESTAMPs mix time zones ({seen}); "
                        "arrivals between them would be off by the offsets (hours): write "
                        "every stamp with the same UTC offset, or none")
