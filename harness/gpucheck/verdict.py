"""Whether a section's result holds a failure, whatever the section measured.

A section process that returns is not a section that passed: on the first H200 run
(2026-12-04) every Triton check raised ``ModuleNotFoundError`` inside its row and pytest
stopped at collection, and those sections still read ``ok``. ``problems`` reads the
result the section saved: a row (in any list of rows) with ``ok`` False or an error, a
pytest that did not exit 0, failed tests, or a section-level error. A row skipped for
want of time (its error starts with ``skipped``) is reported in the tables, not failed.
"""

from __future__ import annotations

from typing import Any

ROW_LISTS = ("rows", "kernels", "timings", "engine")


def _row_name(row: dict[str, Any]) -> str:
    keys = ("kernel", "backend", "provider", "shape", "batch", "context", "page")
    return " ".join(f"{row[k]}" for k in keys if row.get(k) is not None) or "row"


def problems(result: dict[str, Any]) -> list[str]:
    """What failed in one section's result, one line each (empty: the section passed)."""
    out: list[str] = []
    if result.get("error"):
        out.append(str(result["error"]))
    for key in ROW_LISTS:
        rows = result.get(key)
        if not isinstance(rows, list):
            continue
        for row in rows:
            if not isinstance(row, dict):
                continue
            err = str(row.get("error") or "")
            if err.startswith("skipped"):
                continue
            if err:
                out.append(f"{key}: {_row_name(row)}: {err}")
            elif row.get("ok") is False:
                out.append(f"{key}: {_row_name(row)}: not equal to its reference")
    rc = result.get("returncode", 0)
    if "command" in result and rc != 0 and not result.get("error"):
        tail = [t for t in result.get("tail", []) if t.strip()]
        out.append(f"pytest exit status {rc}: {tail[-1] if tail else 'no output'}")
    if result.get("failed"):
        out.append(f"{result['failed']} tests failed: {result.get('failures', [])[:3]}")
    return out


def nothing_ran(result: dict[str, Any]) -> str | None:
    """Why a section ran without failing yet checked nothing (None: it checked something):
    a pytest section whose tests all skipped (issue #55: the dry run called such a section
    ``ok``). Its status is ``empty``, which only the dry run accepts (its gpu tests need
    CUDA)."""
    if "skip_reasons" in result and not result.get("passed") and not result.get("failed"):
        reasons = "; ".join(f"{n} x {why}" for why, n in result["skip_reasons"].items())
        return f"nothing ran: {result.get('skipped', 0)} skipped ({reasons or 'no test'})"
    return None
