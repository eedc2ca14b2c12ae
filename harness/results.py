"""The results folder of one run: its files, its markers, and who owns it.

A finished run holds config.yaml, steps.csv, requests.csv and metrics.json (written last:
its presence means done). A run that did not finish holds a marker instead: ``FAILED``
(the error) or ``INTERRUPTED`` (the signal and what was done). ``.kvbench-run`` says which
process owns the folder; a run never writes into a folder owned by another run or holding
another run's results (:func:`claim_folder` refuses, atomically). docs/errors.md lists
what each file means.

Every file is written to a fresh temporary name in the same folder and renamed into place,
so a crash or a full disk never leaves a half-written file under a real name, two writers
never share a temporary file, and a failed write leaves no temporary file behind.
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import numbers
import os
import secrets
import socket
import tempfile
import time
from array import array
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import numpy as np

from harness.errors import UserError

if TYPE_CHECKING:
    from harness.metrics.collector import StepRow

METRICS, FAILED, INTERRUPTED = "metrics.json", "FAILED", "INTERRUPTED"
OUTCOMES = (METRICS, FAILED, INTERRUPTED)  # a folder with one of these holds a run's end
CLAIM = ".kvbench-run"  # JSON: the owning process (token, pid, host, start time)
SWEEP_CLAIM = ".kvbench-sweep"  # the same for a sweep folder

# Who "we" are. A forked job process draws a new token (new_owner_token), so a job never
# mistakes its parent's claim for its own.
_token = secrets.token_hex(8)


def new_owner_token() -> None:
    """Start a new identity for claims (called in a freshly forked job process)."""
    global _token
    _token = secrets.token_hex(8)


def _file_mode() -> int:
    # mkstemp creates 0600 files; results are shared (a cluster's results folder), so give
    # them the mode a plain open() would: 0666 minus the umask.
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


_MODE = _file_mode()


class ResultsWriteError(Exception):
    """A results file could not be written. The run itself finished: ``metrics`` holds its
    summary (for the terminal), ``path`` the file that failed, ``written`` the files that
    were complete before it."""

    def __init__(self, path: Path, cause: OSError, metrics: dict[str, Any] | None,
                 written: list[str]) -> None:
        super().__init__(f"could not write {path}: {cause.strerror or cause}")
        self.path, self.cause, self.metrics, self.written = path, cause, metrics, written


class FolderTaken(UserError):
    """The results folder belongs to another run: kvbench refuses to write into it."""


def atomic_write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` via a unique temporary file in the same folder, then
    rename. On any failure the temporary file is removed and the error re-raised."""
    _atomic_stream(path, lambda f: f.write(text))


# --- ownership ---------------------------------------------------------------------------

def read_claim(folder: Path, name: str = CLAIM) -> dict[str, Any] | None:
    """The claim in ``folder`` (None if none; ``{}`` if unreadable)."""
    try:
        d = json.loads((folder / name).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}
    return d if isinstance(d, dict) else {}


def _describe(owner: dict[str, Any]) -> str:
    who = ", ".join(f"{k} {owner[k]}" for k in ("pid", "host", "started_at") if k in owner)
    return f" ({who})" if who else ""


def _outcomes(folder: Path) -> list[str]:
    return [n for n in OUTCOMES if (folder / n).exists()]


def check_not_taken(folder: Path) -> None:
    """Raise :class:`FolderTaken` if ``folder`` holds another run (a claim that is not ours,
    or a finished or marked run)."""
    owner = read_claim(folder)
    if owner is not None and owner.get("token") == _token:
        return
    if owner is not None or (found := _outcomes(folder)):
        what = (f"is owned by another run{_describe(owner)}" if owner is not None
                else f"already holds another run's results ({', '.join(found)})")
        raise FolderTaken(
            f"results folder {folder} {what}; kvbench never writes into another run's "
            "folder: choose a new one (hydra.run.dir=..., or leave it to the default, which "
            "is unique per run) or remove that folder")


def _create_claim(folder: Path, name: str, kind: str) -> None:
    owner = {"token": _token, "pid": os.getpid(), "host": socket.gethostname(),
             "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    try:  # O_EXCL: of two processes creating it, exactly one succeeds
        fd = os.open(folder / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, _MODE)
    except FileExistsError:
        current = read_claim(folder, name) or {}
        if current.get("token") == _token:
            return
        raise FolderTaken(
            f"folder {folder} is owned by another {kind}{_describe(current)}; kvbench never "
            f"writes into another {kind}'s folder: choose a new one or remove it") from None
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(owner) + "\n")


def claim_folder(folder: Path, empty: bool = False) -> None:
    """Make ``folder`` this run's: create it and, atomically, its claim file.

    Idempotent within one process; raises :class:`FolderTaken` when another run owns or
    used the folder, so of two runs racing for one folder exactly one goes on. ``empty``
    (a single run's folder, claimed before Hydra writes into it): a folder that already
    holds anything is refused too, whatever it holds (a user's own files, a sweep), unless
    this process claimed it already.
    """
    folder.mkdir(parents=True, exist_ok=True)
    check_not_taken(folder)
    mine = (read_claim(folder) or {}).get("token") == _token
    if empty and not mine and (held := sorted(p.name for p in folder.iterdir())):
        runs = [n for n in held if (folder / n).is_dir()
                and ((folder / n / CLAIM).exists() or _outcomes(folder / n))]
        what = "a sweep" if SWEEP_CLAIM in held or runs else "files"
        raise FolderTaken(
            f"results folder {folder} is not empty: it holds {what} ({', '.join(held[:5])}"
            f"{', ...' if len(held) > 5 else ''}); kvbench writes a run only into a new "
            "or empty folder: choose another hydra.run.dir (or leave it to the default, "
            "which is unique per run)")
    _create_claim(folder, CLAIM, "run")
    if folder not in _claimed:
        _claimed.append(folder)


# Run folders claimed in this process (claim_folder), for unmarked_claims.
_claimed: list[Path] = []


def unmarked_claims() -> list[Path]:
    """Run folders this process claimed (its own owner token) that hold neither results
    nor a marker: a stop signal that ends the process now leaves them to be marked
    (issue #55: one between the claim and the run's start left a folder that read as
    killed without a word)."""
    return [f for f in _claimed
            if (read_claim(f) or {}).get("token") == _token and outcome(f) is None]


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host runs (an exited child not yet reaped, a zombie,
    does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


ALIVE, DEAD, UNKNOWN = "alive", "dead", "unknown"


def owner_state(owner: dict[str, Any]) -> str:
    """Whether the process of a claim runs: ``alive``, ``dead`` (this host, no such
    process), or ``unknown`` (another host's, or an unreadable claim)."""
    pid = owner.get("pid")
    if not isinstance(pid, int) or owner.get("host") != socket.gethostname():
        return UNKNOWN
    return ALIVE if pid_alive(pid) else DEAD


def claim_sweep(folder: Path, earlier: Callable[[Path], str | None] | None = None) -> bool:
    """Make ``folder`` this sweep's; True when it resumes an earlier kvbench sweep there.

    A folder that holds runs but no sweep claim (not a kvbench sweep, or from before claims
    existed) is refused: a reused folder would mix stale jobs into this sweep's. One whose
    sweep claim names a process that is gone (this host, no such pid) is taken over when
    ``earlier(folder)`` finds nothing against it (None; else the reason, refused: another
    sweep's jobs), and the sweep resumes (harness/app/supervisor.py: ``resume_plan``). A
    live owner, or one this host cannot check (another host's), is refused."""
    folder.mkdir(parents=True, exist_ok=True)
    owner = read_claim(folder, SWEEP_CLAIM)
    if owner is not None and owner.get("token") == _token:
        return False
    if owner is None:
        if runs := sorted({f.parent for n in (*OUTCOMES, CLAIM) for f in folder.rglob(n)}):
            raise FolderTaken(
                f"sweep folder {folder} already holds {len(runs)} run(s) (e.g. {runs[0]}) and "
                "is not a kvbench sweep's (no .kvbench-sweep); kvbench never writes into "
                "another run's folder: choose a new hydra.sweep.dir (the default is unique "
                "per sweep) or remove that folder")
        _create_claim(folder, SWEEP_CLAIM, "sweep")
        return False
    state = owner_state(owner)
    if state != DEAD:
        how = ("still running" if state == ALIVE else
               "on another host, or unreadable: kvbench cannot tell whether it still runs "
               f"(if it does not, remove {folder / SWEEP_CLAIM} to resume it)")
        raise FolderTaken(
            f"sweep folder {folder} is owned by another sweep{_describe(owner)}, {how}; "
            "kvbench never writes into another run's folder: choose a new hydra.sweep.dir "
            "(the default is unique per sweep)")
    if earlier is not None and (why := earlier(folder)) is not None:
        raise FolderTaken(
            f"sweep folder {folder} holds an earlier sweep (its process{_describe(owner)} is "
            f"gone) {why}; only the same sweep resumes there: rerun it as it was, or choose "
            "a new hydra.sweep.dir")
    # Taken over by a rename, which exactly one of two resuming processes wins.
    try:
        os.rename(folder / SWEEP_CLAIM, folder / f"{SWEEP_CLAIM}.{_token}.old")
    except FileNotFoundError:
        raise FolderTaken(f"sweep folder {folder} is being resumed by another process; "
                          "kvbench never writes into another run's folder") from None
    _create_claim(folder, SWEEP_CLAIM, "sweep")
    with contextlib.suppress(OSError):
        os.unlink(folder / f"{SWEEP_CLAIM}.{_token}.old")
    return True


ATTEMPTS = ".kvbench-attempts"  # a resumed sweep's earlier attempts of the jobs it reruns


def set_aside(folder: Path, sweep: Path) -> Path:
    """Move a job folder of ``sweep`` that is to be rerun (failed, interrupted, killed) to
    ``<sweep>/.kvbench-attempts/<stamp>/<its path>``, out of the report's sight, and return
    where it went."""
    dest = sweep / ATTEMPTS / time.strftime("%Y%m%d-%H%M%S") / folder.relative_to(sweep)
    dest.parent.mkdir(parents=True, exist_ok=True)
    n = 1
    while dest.exists():
        n += 1
        dest = dest.with_name(f"{folder.name}.{n}")
    os.rename(folder, dest)
    return dest


# --- writing a run's files -----------------------------------------------------------------

def json_null_nonfinite(v: Any) -> Any:
    """``v`` with every NaN or infinite float (in dicts and lists) as None: what standard
    JSON can say of a figure that has no value (``json.dumps`` would write ``NaN`` and
    ``Infinity``, which JSON readers other than Python's refuse)."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: json_null_nonfinite(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [json_null_nonfinite(x) for x in v]
    return v


def json_text(metrics: dict[str, Any]) -> str:
    """metrics.json's text: sorted keys, standard JSON (null, never NaN or Infinity)."""
    return json.dumps(json_null_nonfinite(metrics), indent=2, sort_keys=True,
                      allow_nan=False) + "\n"


def write_results(out: Path, config_yaml: str, metrics: dict[str, Any],
                  steps: Sequence[StepRow], requests: Sequence[dict[str, Any]],
                  fmt: str = "csv", step_extra: dict[str, Sequence[Any]] | None = None
                  ) -> None:
    """Write the four result files, metrics.json last: config.yaml, the step and request
    records as ``fmt`` (csv: steps.csv, requests.csv; parquet: steps.parquet,
    requests.parquet), metrics.json. The records are written a chunk at a time.
    ``step_extra``: more step columns, after the rows' own (a cluster's ``replica``).

    Raises :class:`FolderTaken` if the folder holds another run, and
    :class:`ResultsWriteError` (carrying ``metrics``) if a file cannot be written.
    """
    out.mkdir(parents=True, exist_ok=True)
    check_not_taken(out)
    written: list[str] = []
    ext = RECORD_SUFFIX[fmt]
    files: list[tuple[str, Callable[[Path], None]]] = [
        ("config.yaml", lambda p: atomic_write(p, config_yaml)),
        (f"steps{ext}", lambda p: _write_records(
            p, step_columns(steps) | (step_extra or {}), fmt)),
        (f"requests{ext}", lambda p: _write_records(p, request_columns(requests), fmt)),
        (METRICS, lambda p: atomic_write(p, json_text(metrics)))]
    for name, write in files:
        try:
            write(out / name)
        except OSError as e:
            raise ResultsWriteError(out / name, e, metrics, written) from e
        written.append(name)


RECORD_SUFFIX = {"csv": ".csv", "parquet": ".parquet"}
_CHUNK = 65_536  # rows per write (a Parquet row group)


def step_columns(steps: Sequence[StepRow]) -> dict[str, Sequence[Any]]:
    """The step rows as columns (a StepLog's own, without a copy)."""
    from harness.metrics.steplog import FIELDS, StepLog

    if isinstance(steps, StepLog):
        return steps.columns()
    return {f: [getattr(s, f) for s in steps] for f in FIELDS} if steps else {}


def request_columns(rows: Sequence[dict[str, Any]]) -> dict[str, Sequence[Any]]:
    """The request rows as columns (a RequestLog's own, without a copy): every key any
    row has, in the order they first appear (a task workload's score columns only on the
    requests that ran); a row without one holds None there (an empty CSV field, a
    Parquet null)."""
    from harness.metrics.requestlog import RequestLog

    if isinstance(rows, RequestLog):
        return rows.columns()
    keys = dict.fromkeys(k for r in rows for k in r)
    return {k: [r.get(k) for r in rows] for k in keys}


def _write_records(path: Path, cols: dict[str, Sequence[Any]], fmt: str) -> None:
    """``cols`` (equal lengths) to ``path`` as CSV (a header, then rows, as csv writes
    them: the format steps.csv always had) or Parquet, through a temporary file renamed
    at the end; an empty table is an empty CSV file or a Parquet file with no columns."""
    n = len(next(iter(cols.values()))) if cols else 0

    def chunks() -> Iterator[tuple[int, int]]:
        for a in range(0, n, _CHUNK):
            yield a, min(n, a + _CHUNK)

    if fmt == "parquet":
        pq, pa = _pyarrow()

        def write(f: IO[Any]) -> None:
            schema = pa.schema([(k, _arrow_type(pa, v)) for k, v in cols.items()])
            with pq.ParquetWriter(f, schema) as w:
                for a, b in chunks():
                    w.write_table(pa.table(
                        {k: _arrow_values(pa, v[a:b], schema.field(k).type)
                         for k, v in cols.items()}, schema=schema))
        _atomic_stream(path, write, binary=True)
        return

    def write_csv(f: IO[Any]) -> None:
        if not n:
            return
        w = csv.writer(f)
        w.writerow(list(cols))
        for a, b in chunks():
            w.writerows(zip(*(v[a:b] for v in cols.values())))
    _atomic_stream(path, write_csv, newline="")  # csv writes its own line ends


def _arrow_type(pa: Any, col: Sequence[Any]) -> Any:
    """A column's Parquet type from every value it holds (its first could be None: a
    rejected request has no TTFT): bool where all are bools, int where all are integers,
    float where all are real numbers (numpy's scalars included), else text; null where
    all are None. :func:`_arrow_values` makes the values fit it."""
    code = getattr(col, "typecode", None)  # an array, or a column that says its type
    if code is not None:
        if getattr(col, "all_none", False):  # NullableDoubles: None throughout
            return pa.null()
        return pa.float64() if code == "d" else pa.int64()
    kinds = set(map(type, col)) - {type(None)}
    if not kinds:
        return pa.null()
    if kinds <= {bool, np.bool_}:
        return pa.bool_()
    if all(issubclass(k, numbers.Integral) for k in kinds):
        return pa.int64()
    if all(issubclass(k, numbers.Real) for k in kinds):
        return pa.float64()
    return pa.string()


def _arrow_values(pa: Any, col: Sequence[Any], kind: Any) -> Any:
    """``col`` as values of ``kind`` (a bool in an int column as 0/1, a number in a text
    column as its text)."""
    if isinstance(col, array):
        return col
    if kind == pa.int64():
        return [None if v is None else int(v) for v in col]
    if kind == pa.float64():
        return [None if v is None else float(v) for v in col]
    if kind == pa.string():
        return [None if v is None else str(v) for v in col]
    return list(col)


def _pyarrow() -> tuple[Any, Any]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError("records.format=parquet needs pyarrow: pip install -e '.[parquet]' "
                        "(or use records.format=csv)") from None
    return pq, pa


def _atomic_stream(path: Path, write: Callable[[IO[Any]], Any], binary: bool = False,
                   newline: str | None = None) -> None:
    """:func:`atomic_write` for a writer that streams into the open file (binary, or
    UTF-8 text with ``newline`` as open() takes it)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with (os.fdopen(fd, "wb") if binary else
              os.fdopen(fd, "w", encoding="utf-8", newline=newline)) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())  # the rename must not publish a file still in the cache
        os.chmod(tmp, _MODE)
        os.replace(tmp, path)
    except BaseException:  # disk full, Ctrl-C mid-write: never leave the temp behind
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_config(out: Path, config_yaml: str) -> None:
    """config.yaml at the start of a run, so a run that never finishes still says what it
    was (Hydra's .hydra/ copy is Hydra's, and the report should not depend on it)."""
    atomic_write(out / "config.yaml", config_yaml)


def write_failure(out: Path, error: BaseException | str) -> Path:
    """Mark a run folder as failed (a sweep goes on past it); returns the marker's path.
    Raises OSError when even the marker cannot be written."""
    out.mkdir(parents=True, exist_ok=True)
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    atomic_write(out / FAILED, text.rstrip("\n") + "\n")
    return out / FAILED


def write_interrupted(out: Path, text: str) -> Path:
    """Mark a run folder as interrupted (``text``: the signal and what was done)."""
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / INTERRUPTED, text.rstrip("\n") + "\n")
    return out / INTERRUPTED


def record_interrupted(out: Path, text: str) -> str:
    """:func:`write_interrupted`, said for the terminal: where the marker is, or why even
    it could not be written (a run stopped on a full or read-only disk says so)."""
    try:
        return f"recorded in {write_interrupted(out, text)}"
    except OSError as e:
        return f"even the INTERRUPTED marker could not be written: {e.strerror or e}"


def outcome(folder: Path) -> str | None:
    """The newest of metrics.json, FAILED and INTERRUPTED in ``folder`` (None: none).
    Folders from before claims existed could be rerun into: the newest file tells."""
    found = {n: (folder / n).stat().st_mtime for n in OUTCOMES if (folder / n).is_file()}
    return max(found, key=lambda n: found[n]) if found else None
