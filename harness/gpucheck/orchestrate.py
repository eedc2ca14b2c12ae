"""The driver: run every section in its own process within the check's total budget.

``python -m harness.gpucheck [--dry-run] [--out DIR] [--only a,b] [--skip a,b]
[--total-s S]`` runs the sections in order; each gets ``min(its budget, what is left)``
seconds and is killed (its whole process group) a few seconds after that. A section that
fails or is killed is recorded in ``status.json`` and the next one runs. ``summary.md``
is written at the end, and also after each section, so that a kill of the whole check
leaves the tables of what finished.

``python -m harness.gpucheck section NAME --profile P --out DIR --budget-s S`` is one
section (what the driver starts).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from harness.gpucheck.context import SectionContext, error_text, write_json
from harness.gpucheck.profile import PROFILES, Profile
from harness.gpucheck.sections import get_section, section_names
from harness.gpucheck.summary import write_summary
from harness.gpucheck.verdict import nothing_ran, problems

GRACE_S = 5.0  # after a section's budget, before its process group is killed
EMPTY_RC = 3  # a section's exit status when it ran but checked nothing (verdict.nothing_ran)
SUMMARY_RESERVE_S = 3.0
ROOT = Path(__file__).resolve().parents[2]


def child_env(profile: Profile) -> dict[str, str]:
    return {**os.environ, "TRITON_INTERPRET": "1" if profile.triton_interpret else "0",
            "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1"}


def section_command(profile: Profile, name: str, out: Path, root: Path,
                    budget: float) -> list[str]:
    return [sys.executable, "-m", "harness.gpucheck", "section", name, "--profile",
            profile.name, "--out", str(out), "--root", str(root), "--budget-s", f"{budget:.1f}"]


def run_child(profile: Profile, name: str, out: Path, root: Path,
              budget: float) -> dict[str, Any]:
    """One section in its own process group; its status record."""
    cmd = section_command(profile, name, out, root, budget)
    t0 = time.monotonic()
    rec: dict[str, Any] = {"budget_s": round(budget, 1)}
    with (out / f"{name}.log").open("w") as log:
        proc = subprocess.Popen(cmd, cwd=root, env=child_env(profile), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=budget + GRACE_S)
            rec.update(status={0: "ok", EMPTY_RC: "empty"}.get(rc, "failed"), returncode=rc)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rec.update(status="timeout", returncode=None,
                       error=f"killed after {budget + GRACE_S:.0f} s (budget {budget:.0f} s)")
    rec["seconds"] = round(time.monotonic() - t0, 1)
    if rec["status"] in ("failed", "empty"):
        lines = (out / f"{name}.log").read_text(errors="replace").strip().splitlines()
        rec["error"] = lines[-1][:500] if lines else f"exit status {rec['returncode']}"
    return rec


def run_all(profile: Profile, out: Path, root: Path, names: list[str],
            total_s: float) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + total_s
    status: dict[str, Any] = {"profile": profile.name, "total_s": total_s, "sections": {}}
    for name in names:
        left = deadline - time.monotonic() - SUMMARY_RESERVE_S
        budget = min(profile.budget(name), left - GRACE_S)
        if budget < 2:
            rec: dict[str, Any] = {"status": "skipped", "error": "skipped: the check's total "
                                   f"budget ({total_s:.0f} s) is spent"}
        else:
            rec = run_child(profile, name, out, root, budget)
        status["sections"][name] = rec
        print(f"gpu check: {name:<20} {rec['status']:<8} {rec.get('seconds', 0):6.1f} s"
              f"  {rec.get('error', '')}", flush=True)
        write_json(out / "status.json", status)
        write_summary(out, status)
    return status


def run_one(name: str, profile: Profile, out: Path, root: Path, budget: float) -> int:
    """One section in this process: its result saved as <name>.json; exit 0 only if it ran
    and nothing in its result failed (``verdict.problems``)."""
    t0 = time.monotonic()
    ctx = SectionContext(name, profile, out, t0 + max(1.0, budget - 1.0), root)
    try:
        result = get_section(name, profile)(ctx)
    except Exception as e:  # recorded beside what the section saved so far
        traceback.print_exc()
        prior = out / f"{name}.json"
        partial = json.loads(prior.read_text()) if prior.is_file() else {}
        ctx.save({**partial, "error": error_text(e), "seconds": time.monotonic() - t0})
        return 1
    bad = problems(result)
    empty = None if bad else nothing_ran(result)
    ctx.save({**result, "seconds": round(time.monotonic() - t0, 2),
              **({"problems": bad} if bad else {}), **({"empty": empty} if empty else {})})
    if bad:  # the last line of the log is the status's error
        for line in bad:
            print(f"problem: {line}", file=sys.stderr)
        print(f"{len(bad)} problem(s); the first: {bad[0]}", file=sys.stderr, flush=True)
        return 1
    if empty:
        print(empty, file=sys.stderr, flush=True)
        return EMPTY_RC
    return 0


def _names(arg: str | None) -> list[str]:
    return [n for n in (arg or "").split(",") if n]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["section"]:
        ap = argparse.ArgumentParser(prog="python -m harness.gpucheck section")
        ap.add_argument("name")
        ap.add_argument("--profile", choices=sorted(PROFILES), required=True)
        ap.add_argument("--out", type=Path, required=True)
        ap.add_argument("--root", type=Path, default=ROOT)
        ap.add_argument("--budget-s", type=float, required=True)
        a = ap.parse_args(argv[1:])
        return run_one(a.name, PROFILES[a.profile], a.out, a.root, a.budget_s)
    ap = argparse.ArgumentParser(prog="python -m harness.gpucheck",
                                 description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes (the test)")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu_check"))
    ap.add_argument("--root", type=Path, default=ROOT)
    ap.add_argument("--only", help="comma-separated sections to run (default: all)")
    ap.add_argument("--skip", help="comma-separated sections to leave out")
    ap.add_argument("--total-s", type=float, default=None,
                    help="the whole check's budget in seconds (default: the profile's)")
    ap.add_argument("--budget", action="append", default=[], metavar="NAME=S",
                    help="a section's budget in seconds (repeatable)")
    a = ap.parse_args(argv)
    profile = PROFILES["dry" if a.dry_run else "gpu"]
    try:
        budgets = {k: float(v) for k, v in (b.split("=", 1) for b in a.budget)}
    except ValueError:
        ap.error(f"--budget takes NAME=SECONDS, got {a.budget}")
    # A budget of 0, a negative or a non-finite one skipped every section (issue #55).
    for key, v in [("--total-s", a.total_s), *((f"--budget {k}", x) for k, x in budgets.items())]:
        if v is not None and not (math.isfinite(v) and v > 0):
            ap.error(f"{key}={v}: give a positive number of seconds")
    profile = dataclasses.replace(profile, budgets={**profile.budgets, **budgets})
    known = section_names(profile, profile.on_request)
    unknown = set(_names(a.only)) | set(_names(a.skip)) | set(budgets)
    if unknown - set(known):
        ap.error(f"unknown sections {sorted(unknown - set(known))}; known: {known}")
    # On-request sections (the GPU profile's compression) only when --only names them.
    names = [n for n in section_names(profile, _names(a.only))
             if (not a.only or n in _names(a.only)) and n not in _names(a.skip)]
    status = run_all(profile, a.out, a.root, names,
                     a.total_s if a.total_s is not None else profile.total_s)
    print(f"gpu check: summary in {a.out / 'summary.md'}")
    # "empty" (ran, checked nothing) fails a real check; on the dry run's CPU the gpu
    # tests cannot run, and say so.
    ok = ("ok", "empty") if profile.device == "cpu" else ("ok",)
    bad = [n for n, r in status["sections"].items() if r["status"] not in ok]
    return 1 if bad else 0
