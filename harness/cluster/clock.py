"""A replica's clock under ``executor=model``: the wall time of its own steps only.

Replicas stepped in turn in one process would otherwise see each other's steps on the
wall clock (16 replicas: every step 16 times as long). :class:`ReplicaClock` runs only
while the cluster driver steps its replica (:meth:`resume` .. :meth:`pause`), and an idle
replica's wait for an arrival moves it without taking wall time, as the roofline's
virtual clock does."""

from __future__ import annotations

import time


class ReplicaClock:
    """Seconds this replica has spent working or waiting, measured while it works."""

    def __init__(self) -> None:
        self._t = 0.0
        self._since: float | None = None  # perf_counter() when resumed; None: paused

    def now(self) -> float:
        if self._since is None:
            return self._t
        return self._t + (time.perf_counter() - self._since)

    def sleep(self, seconds: float) -> None:
        """Idle until ``seconds`` later: the clock moves, no wall time is spent."""
        self._t += max(0.0, seconds)

    def resume(self) -> None:
        assert self._since is None, "resumed twice"
        self._since = time.perf_counter()

    def pause(self) -> None:
        assert self._since is not None, "paused while not running"
        self._t += time.perf_counter() - self._since
        self._since = None
