"""What a section of the GPU check gets to run with: its context, a time limit, atomic
JSON writes. Section modules import this; the list of sections (harness.gpucheck.sections)
imports them, never the other way round.

A section is a function ``(ctx) -> dict``: it measures, calls ``ctx.save(result)`` as
results come (a later kill keeps what was saved), and returns the final result, which
is saved as ``<name>.json``. It must watch ``ctx.left()`` and stop starting new work when
its budget runs low; the driver kills it a few seconds after the budget regardless.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.gpucheck.profile import Profile


@dataclass(slots=True)
class SectionContext:
    """name: the section's; out: the check's folder; deadline: time.monotonic() by which
    the section should return; root: the repository (tests/, conf/)."""

    name: str
    profile: Profile
    out: Path
    deadline: float
    root: Path

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def save(self, result: dict[str, Any]) -> None:
        write_json(self.out / f"{self.name}.json", result)


class SectionTimeout(Exception):
    """A part of a section ran past the time it was given (see :func:`time_limit`)."""


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise :class:`SectionTimeout` in this (main) thread after ``seconds``.

    Interrupts Python code (the engine's loop, torch.compile's tracing); a single long
    C call finishes first. The driver's kill is the backstop.
    """
    if seconds <= 0:
        raise SectionTimeout("no time left")

    def fire(signum: int, frame: object) -> None:
        raise SectionTimeout(f"ran past its {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write through a temporary name and rename: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    tmp.replace(path)


def error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".strip()[:2000]


SectionFn = Callable[[SectionContext], dict[str, Any]]
