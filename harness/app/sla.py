"""``python -m harness.sla``: the highest request rate that still meets the SLOs, per backend.

    python -m harness.sla --backends paged,contiguous -- +experiment=rate_sweep
    python -m harness.sla --lo 1 --hi 64 --steps 5 --attainment 0.99 --out results/sla/x \\
        -- model=tiny workload=random slo.ttft_ms=500 slo.tpot_ms=20

Everything after ``--`` is the run's Hydra overrides, and must set at least one ``slo.*``
target. Each probe is a normal run, ``python -m harness <overrides> backend=<b>
<key>=<rate>``, into ``<out>/<backend>/<key>_<rate>/`` (config.yaml, metrics.json, ...),
so ``python -m harness.report <out>`` reads them like any sweep. A probe *passes* when its
``latency.slo_attainment`` (the share of requests meeting every target) is at least
``--attainment``: 0.9 is DistServe's 90% attainment; 0.99 reads "p99 TTFT <= X".

The search, per backend (rates spanning orders of magnitude, so midpoints are geometric):
probe ``--hi``; if it passes, the answer is "at least hi". Else probe ``--lo``; if it fails,
"below lo". Else ``--steps`` bisections between the highest passing and the lowest failing
rate (each narrows the bracket to its square root: 4 steps from 0.25-4 leave 19%). It
assumes latency grows with the rate; on a busy machine a probe near the knee can pass or
fail by chance, so the bracket is reported with the answer. Rerunning with the same
``--out`` reuses the probes already there (more ``--steps`` refines a finished search); a
probe there without results (it failed, was interrupted, or its process is gone) is moved
to ``<out>/.kvbench-attempts/`` and run again.

Defaults are sized for a 2-core CPU with ``+experiment=rate_sweep`` (0.25-4 req/s, 4
steps: 6 probes of 20-100 s per backend, the bracket then within 19%); on a GPU give a
wider range (``--hi 64``) and more requests.

Writes ``sla.json``, ``sla.md`` and ``latency_vs_rate.png`` into ``--out``. Exit status: 0;
1 when a probe run failed (its folder, how it ended and the end of its output are
printed); 2 for a wrong option or configuration (the message says what to change: a
``--key`` that takes no fractional value, ``repeats``, no SLO target); 130 on Ctrl-C (the
probe running is stopped and marked; the message says how to reuse the others).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import math
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from harness.app.supervisor import STOP_WAIT_S, signal_name
from harness.errors import UserError
from harness.results import (
    DEAD,
    INTERRUPTED,
    METRICS,
    outcome,
    owner_state,
    read_claim,
    set_aside,
)


@dataclass(slots=True)
class Probe:
    rate: float
    folder: str
    passed: bool
    attainment: float
    metrics: dict[str, Any] = field(repr=False)


@dataclass(slots=True)
class SlaResult:
    """One backend's answer: ``best`` is the highest passing rate (None: even ``lo``
    failed), ``first_fail`` the lowest failing one (None: even ``hi`` passed)."""

    backend: str
    best: float | None
    first_fail: float | None
    probes: list[Probe] = field(default_factory=list)


class ProbeFailed(Exception):
    """A probe's run did not finish; the message names its folder and says why."""


def bisect_rate(passes: Callable[[float], bool], lo: float, hi: float,
                steps: int) -> tuple[float | None, float | None]:
    """(highest passing rate, lowest failing rate) found by geometric bisection."""
    if passes(hi):
        return hi, None
    if not passes(lo):
        return None, lo
    good, bad = lo, hi
    for _ in range(steps):
        mid = math.sqrt(good * bad)
        if passes(mid):
            good = mid
        else:
            bad = mid
    return good, bad


def fmt_rate(rate: float) -> str:
    return f"{rate:.4g}"


def exit_text(code: int) -> str:
    """How a probe run ended, in words (``python -m harness``'s exit codes: harness/app/
    cli.py): never a bare "exited 0" for a run that left no results."""
    if code < 0:
        return f"was killed by {signal_name(-code)}"
    return {0: "exited 0 but wrote no metrics.json there",
            1: "crashed (exit 1)",
            2: "was refused (exit 2: a configuration or capacity error)",
            3: "exited 3 (logging to W&B failed)",
            4: "could not write its results (exit 4)",
            130: "was interrupted by SIGINT (exit 130)",
            143: "was interrupted by SIGTERM (exit 143)"}.get(code, f"exited {code}")


class Searcher:
    """Runs (or reuses) the probes of one search into ``out``."""

    def __init__(self, out: Path, overrides: list[str], key: str, attainment: float,
                 python: str = sys.executable) -> None:
        self.out, self.overrides, self.key = out, overrides, key
        self.attainment, self.python = attainment, python
        self.running: Path | None = None  # the probe folder being run now

    def folder(self, backend: str, rate: float) -> Path:
        return self.out / backend / f"{self.key.rsplit('.', 1)[-1]}_{fmt_rate(rate)}"

    def overrides_of(self, backend: str, rate: float) -> list[str]:
        """The overrides of the probe run at ``rate``."""
        return [*self.overrides, f"backend={backend}", f"{self.key}={rate!r}"]

    def planned(self, backend: str, rate: float) -> dict[str, Any]:
        """The config the probe at ``rate`` runs, resolved (as its config.yaml holds it)."""
        from omegaconf import OmegaConf

        from harness.config import as_recorded, compose_config

        c = OmegaConf.to_container(compose_config(self.overrides_of(backend, rate)),
                                   resolve=True)
        assert isinstance(c, dict)
        return as_recorded({str(k): v for k, v in c.items()})

    def _set_aside(self, folder: Path, end: str | None) -> None:
        """A probe of an earlier attempt without results (it failed, was interrupted, or
        its process is gone) is moved to ``<out>/.kvbench-attempts/`` and run again, as a
        resumed sweep does (issue #55: after a Ctrl-C "the same command reuses them" met
        the interrupted probe and stopped); one whose process still runs is refused."""
        owner = read_claim(folder)
        if end is None and owner is not None and owner_state(owner) != DEAD:
            raise ProbeFailed(f"{folder} holds a probe with no outcome whose process "
                              f"(pid {owner.get('pid')}, host {owner.get('host')}) may still "
                              "run it: wait for it, or remove the folder to probe this rate "
                              "again")
        why = f"ended {end}" if end is not None else "no outcome: its process is gone"
        dest = set_aside(folder, self.out)
        print(f"  rerun: {folder} ({why}; the earlier attempt is in {dest})", flush=True)

    def check_reuse(self, backend: str, rate: float, folder: Path) -> None:
        """Refuse a finished probe whose config is not what this search would run (another
        SLO, model, workload: its pass or fail is not this search's)."""
        import yaml

        from harness.config import RESOLVED_AT_RUN
        from harness.reporting.runs import comparable, flatten

        def flat(d: Any) -> dict[str, str]:  # compared as the gate compares configs
            return {k: v for k, v in comparable(flatten(d if isinstance(d, dict) else {})).items()
                    if not k.startswith("hydra.")}

        try:
            had = flat(yaml.safe_load((folder / "config.yaml").read_text()))
        except (OSError, yaml.YAMLError) as e:
            raise ProbeFailed(f"{folder} holds a finished probe whose config.yaml cannot be "
                              f"read ({e}): remove it, or use another --out") from None
        want = flat(self.planned(backend, rate))
        # A what-if's unset sizes are the engine's, a function of the rest of the config.
        diff = [f"{k}: {had.get(k, '(unset)')} here, {want.get(k, '(unset)')} now"
                for k in sorted(set(had) | set(want)) if had.get(k) != want.get(k)
                and not (k in RESOLVED_AT_RUN and want.get(k) == "null")]
        if diff:
            raise UserError(f"{folder} holds a probe of another config ("
                            + "; ".join(diff[:4]) + (f"; {len(diff) - 4} more" if len(diff) > 4
                                                     else "")
                            + "): its pass or fail is not this search's. Use another --out "
                            "(the default is new per search) or remove that folder")

    def probe(self, backend: str, rate: float) -> Probe:
        rate = float(fmt_rate(rate))  # the rate the folder is named by is the one run
        folder = self.folder(backend, rate)
        end = outcome(folder) if folder.is_dir() else None
        if end != METRICS and folder.is_dir() and any(folder.iterdir()):
            self._set_aside(folder, end)
            end = None
        if end is None:
            self._run(backend, rate, folder)
        else:
            self.check_reuse(backend, rate, folder)
        m = json.loads((folder / METRICS).read_text())
        att = m.get("latency.slo_attainment")
        if att is None:
            raise UserError(f"{folder / METRICS} has no latency.slo_attainment: set at least "
                            "one slo.* target in the overrides (slo.ttft_ms=..., slo.tpot_ms=...)")
        p = Probe(rate, str(folder), att >= self.attainment, float(att), m)
        print(f"  {backend:<14} {self.key}={fmt_rate(rate):<8} attainment {att:.3f} "
              f"{'pass' if p.passed else 'FAIL'}  (TTFT p99 {_ms(m, 'latency.ttft_ms.p99')}, "
              f"TPOT p99 {_ms(m, 'latency.tpot_ms.p99')}; {folder})", flush=True)
        return p

    def _run(self, backend: str, rate: float, folder: Path) -> None:
        cmd = [self.python, "-m", "harness", *self.overrides_of(backend, rate),
               f"hydra.run.dir={folder}", "progress=false"]
        self.running = folder
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) as child:
            try:
                log, _ = child.communicate()
            except KeyboardInterrupt:
                # The probe may not have had the signal (a kill of this process alone; a
                # terminal's Ctrl-C reaches both, and the probe ignores the second while
                # it writes its marker): pass it on, and wait for the INTERRUPTED marker
                # instead of killing it before it is written (issue #55).
                with contextlib.suppress(OSError):
                    child.send_signal(signal.SIGINT)
                try:
                    child.wait(timeout=STOP_WAIT_S)
                except (subprocess.TimeoutExpired, KeyboardInterrupt):
                    child.kill()  # no marker then: a rerun sees its process gone
                raise
        self.running = None
        if folder.is_dir():
            (folder / "probe.log").write_text(log)
        if child.returncode != 0 or not (folder / METRICS).is_file():
            tail = "\n    ".join(log.strip().splitlines()[-8:])
            where = (f"into {folder}" if folder.is_dir() else
                     f"for {self.key}={fmt_rate(rate)} (its folder {folder} was never made)")
            raise ProbeFailed(f"the probe run {where} {exit_text(child.returncode)}:\n    "
                              f"{tail}")

    def search(self, backend: str, lo: float, hi: float, steps: int) -> SlaResult:
        probes: list[Probe] = []

        def passes(rate: float) -> bool:
            probes.append(self.probe(backend, rate))
            return probes[-1].passed

        best, fail = bisect_rate(passes, lo, hi, steps)
        return SlaResult(backend, _as_probed(best), _as_probed(fail),
                         sorted(probes, key=lambda p: p.rate))


def _as_probed(rate: float | None) -> float | None:
    return None if rate is None else float(fmt_rate(rate))  # the rate a probe ran at


def _ms(m: dict[str, Any], key: str) -> str:
    v = m.get(key)
    return "-" if v is None else f"{v:.0f} ms"


def check_overrides(overrides: list[str], backends: list[str], key: str,
                    fractional: float = 0.5) -> None:
    """The overrides compose into a valid run for every backend (typos fail here, before
    any probe runs), ``key`` takes a real number such as ``fractional`` (bisection's
    midpoints), and they set at least one SLO target."""
    from harness.config import compose_config, run_config
    from harness.reporting.runs import one_line

    for o in overrides:
        if o.split("=", 1)[0].lstrip("+~") in ("backend", key):
            raise UserError(f"override {o!r}: the search sets backend= and {key}= itself "
                            "(give backends with --backends, rates with --lo/--hi)")
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    for b in backends:
        try:
            cfg = compose_config([*overrides, f"backend={b}"])
        except (HydraException, OmegaConfBaseException) as e:
            raise UserError(f"the overrides do not compose with backend={b}: {e}") from None
        try:  # the searched key itself (issue #55: a typo failed only after a probe ran)
            compose_config([*overrides, f"backend={b}", f"{key}=1"])
        except (HydraException, OmegaConfBaseException) as e:
            raise UserError(f"--key {key}: not an option these runs have ({e}); the "
                            "search varies an existing numeric option, e.g. "
                            "workload.rate") from None
        try:  # ... and takes the real-valued rates bisection probes (issue #55: an integer
            # option failed the first probe, exit 1, naming a folder never made)
            compose_config([*overrides, f"backend={b}", f"{key}={fractional!r}"])
        except (HydraException, OmegaConfBaseException) as e:
            cause = one_line(str(e.__cause__ or e))
            raise UserError(f"--key {key} does not take a real number such as "
                            f"{fractional!r} ({cause}); the search probes rates between "
                            "--lo and --hi by geometric midpoints: search a real-valued "
                            "option (workload.rate, or workload.speedup for a trace)") from None
        rc = run_config(cfg)
        if rc.repeats > 1:
            raise UserError(f"repeats={rc.repeats}: the search runs one probe per rate and "
                            "reads its metrics.json, which a group of repeats does not "
                            "have; drop repeats (near the knee, more --steps narrow the "
                            "bracket)")
        if not rc.slo.any:
            raise UserError("no SLO target: add slo.ttft_ms=..., slo.tpot_ms=... or "
                            "slo.e2e_ms=... after -- (or use +experiment=rate_sweep)")


def to_markdown(results: list[SlaResult], key: str, attainment: float,
                overrides: list[str]) -> str:
    lines = [f"# Highest {key} meeting the SLOs (attainment >= {attainment})", "",
             f"Overrides: `{' '.join(overrides)}`", "",
             "| backend | max rate meeting SLOs | first failing | attainment there | "
             "goodput req/s | TTFT p99 | TPOT p99 | probes |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        at = next((p for p in r.probes if p.rate == r.best), None)
        best = ("below " + fmt_rate(r.first_fail or 0) if r.best is None else
                fmt_rate(r.best) + (" (never failed: raise --hi)" if r.first_fail is None
                                    else ""))
        cells = [r.backend, best, "-" if r.first_fail is None else fmt_rate(r.first_fail)]
        if at is None:
            cells += ["-"] * 4
        else:
            m = at.metrics
            cells += [f"{at.attainment:.3f}", f"{m.get('latency.goodput_rps', 0):.2f}",
                      _ms(m, "latency.ttft_ms.p99"), _ms(m, "latency.tpot_ms.p99")]
        cells.append(", ".join(f"{fmt_rate(p.rate)} {'ok' if p.passed else 'x'}"
                               for p in r.probes))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_outputs(out: Path, results: list[SlaResult], key: str, attainment: float,
                  overrides: list[str]) -> None:
    from harness.reporting.rate import latency_vs_rate
    from harness.reporting.runs import find_runs

    (out / "sla.json").write_text(json.dumps({
        "key": key, "attainment": attainment, "overrides": overrides,
        "backends": {r.backend: {"best": r.best, "first_fail": r.first_fail,
                                 "probes": [{k: v for k, v in asdict(p).items()
                                             if k != "metrics"} for p in r.probes]}
                     for r in results}}, indent=2) + "\n")
    (out / "sla.md").write_text(to_markdown(results, key, attainment, overrides))
    latency_vs_rate(find_runs([out]), out / "latency_vs_rate.png")


def check_earlier_search(out: Path, key: str, attainment: float, overrides: list[str]) -> None:
    """``--out`` naming a file, or the folder of an earlier search with other settings (its
    summary would be overwritten by this one's): a UserError saying what differs."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file: give a folder (the default is "
                        "results/sla/<time>)")
    summary = out / "sla.json"
    if not summary.is_file():
        return
    try:
        was = json.loads(summary.read_text())
        diff = [f"{name}: {was[name]!r} there, {now!r} now"
                for name, now in (("key", key), ("attainment", attainment),
                                  ("overrides", overrides)) if was[name] != now]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"--out {out} holds an sla.json that cannot be read ({e}): use "
                        "another --out") from None
    if diff:
        raise UserError(f"--out {out} holds an earlier search with other settings ("
                        + "; ".join(diff) + "): use another --out (the default is new per "
                        "search); the same settings reuse its probes")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    head, overrides = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) \
        if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(prog="python -m harness.sla", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="python -m harness.sla [options] -- <run overrides, with slo.* targets>")
    ap.add_argument("--backends", default="paged", help="comma-separated (default: paged)")
    ap.add_argument("--key", default="workload.rate",
                    help="the rate knob (default workload.rate; a trace: workload.speedup)")
    ap.add_argument("--lo", type=float, default=0.25, help="lowest rate probed (0.25)")
    ap.add_argument("--hi", type=float, default=4.0, help="highest rate probed (4)")
    ap.add_argument("--steps", type=int, default=4, help="bisection steps after lo/hi (4)")
    ap.add_argument("--attainment", type=float, default=0.9,
                    help="share of requests that must meet every SLO (0.9)")
    ap.add_argument("--out", type=Path, default=None,
                    help="parent folder of the probes (default results/sla/<time>)")
    args = ap.parse_args(head)
    backends = [b for b in args.backends.split(",") if b]
    out = args.out or Path("results/sla") / dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    s: Searcher | None = None
    try:
        if not 0 < args.lo < args.hi or args.steps < 0 or not 0 < args.attainment <= 1:
            raise UserError("need 0 < --lo < --hi, --steps >= 0 and 0 < --attainment <= 1")
        if not backends:
            raise UserError("--backends names no backend")
        check_overrides(overrides, backends, args.key, float(fmt_rate(
            math.sqrt(args.lo * args.hi))))  # bisection's first midpoint
        check_earlier_search(out, args.key, args.attainment, overrides)
        out.mkdir(parents=True, exist_ok=True)
        print(f"kvbench sla: {args.key} in [{fmt_rate(args.lo)}, {fmt_rate(args.hi)}], "
              f"attainment >= {args.attainment}, into {out}/", flush=True)
        s = Searcher(out, overrides, args.key, args.attainment)
        results = [s.search(b, args.lo, args.hi, args.steps) for b in backends]
    except (UserError, ValueError) as e:  # ValueError: Hydra's and OmegaConf's own
        print(f"kvbench sla: {e}", file=sys.stderr)
        return 2
    except ProbeFailed as e:
        print(f"kvbench sla: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # the probe running was stopped, and marks its folder
        running = s.running if s is not None else None
        where = "" if running is None else f" during the probe into {running} (" + (
            "marked INTERRUPTED" if outcome(running) == INTERRUPTED else "it left no marker"
        ) + ": the search probes it again)"
        again = ("the same command reuses them" if args.out is not None else
                 f"the same command with --out {out} reuses them (without --out a search "
                 "starts a new folder)")
        print(f"\nkvbench sla: stopped by SIGINT (Ctrl-C){where}; the probes that finished "
              f"are in {out}/ and {again}", file=sys.stderr)
        return 130
    write_outputs(out, results, args.key, args.attainment, overrides)
    print("\n" + to_markdown(results, args.key, args.attainment, overrides))
    print(f"written to {out}/: sla.md, sla.json, latency_vs_rate.png")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # during start-up (imports, composing the overrides)
        print("\nkvbench sla: stopped by SIGINT (Ctrl-C) while starting; nothing was run",
              file=sys.stderr)
        sys.exit(130)
