"""The sections of the GPU check, by name, and what each gets to run with.

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


def section_names(profile: Profile) -> list[str]:
    """The sections in the order they run."""
    engines = [f"engine-{s.name}" for s in profile.shapes]
    return ["env", "kernel-correctness", "kernel-bandwidth", *engines, "roofline-h200",
            "gpu-tests", "benchmarks", "flash-attn"]


def get_section(name: str, profile: Profile) -> SectionFn:
    """The function of section ``name`` (imported lazily: the driver imports no torch)."""
    if name == "env":
        from harness.gpucheck.env_check import env_section
        return env_section
    if name == "kernel-correctness":
        from harness.gpucheck.kernel_checks import correctness_section
        return correctness_section
    if name == "kernel-bandwidth":
        from harness.gpucheck.kernel_checks import bandwidth_section
        return bandwidth_section
    if name in ("gpu-tests", "benchmarks"):
        from harness.gpucheck.pytest_checks import benchmarks_section, gpu_tests_section
        return gpu_tests_section if name == "gpu-tests" else benchmarks_section
    if name == "roofline-h200":
        from harness.gpucheck.roofline_check import roofline_section
        return roofline_section
    if name == "flash-attn":
        from harness.gpucheck.fa4_check import flash_attn_section
        return flash_attn_section
    for shape in profile.shapes:
        if name == f"engine-{shape.name}":
            from harness.gpucheck.engine_checks import engine_section
            return lambda ctx, shape=shape: engine_section(ctx, shape)  # type: ignore[misc]
    raise ValueError(f"unknown section {name!r}; known: {section_names(profile)}")
