"""The ``scheduler`` group's Hydra schema (issue #54): :class:`SchedulerConfig` whose three
sizes may be left unset, so that a run can tell a user's value from kvbench's default.

``executor=model`` takes kvbench's own (:data:`SCHEDULER_SIZES`, harness.config's
RunConfig); ``executor=roofline`` takes the modelled engine's (harness.roofline.sizes).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from harness.sched.scheduler import SchedulerConfig

# kvbench's own batch sizes: every executor=model run's, and a what-if's where the engine
# it models (roofline.engine, harness.roofline.engines) gives none.
SCHEDULER_SIZES: dict[str, int] = {"max_num_seqs": 32, "max_num_batched_tokens": 1024,
                                   "max_model_len": 2048}


@dataclass
class SchedulerSpec(SchedulerConfig):
    """The ``scheduler`` group's Hydra schema: :class:`SchedulerConfig` whose three sizes
    may be left unset (None, their default), so that a run can tell a user's value from
    kvbench's. ``executor=model`` takes :data:`SCHEDULER_SIZES` for them (RunConfig);
    ``executor=roofline`` takes the modelled engine's (harness.roofline.sizes, when the
    stack is built). Everything else is SchedulerConfig's, checked the same way."""

    max_num_seqs: int | None = None  # type: ignore[assignment]
    max_num_batched_tokens: int | None = None  # type: ignore[assignment]
    max_model_len: int | None = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        self.resolved()  # SchedulerConfig's checks, on the values given

    def unset(self) -> tuple[str, ...]:
        """The sizes the user left to the run."""
        return tuple(k for k in SCHEDULER_SIZES if getattr(self, k) is None)

    def resolved(self, **sizes: int) -> SchedulerConfig:
        """A plain SchedulerConfig: each unset size from ``sizes``, else kvbench's."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(SchedulerConfig)}
        for k in self.unset():
            values[k] = sizes.get(k, SCHEDULER_SIZES[k])
        return SchedulerConfig(**values)


def scheduler_unset(sched: SchedulerConfig) -> tuple[str, ...]:
    """The sizes of ``sched`` still to be resolved (none for a plain SchedulerConfig)."""
    return sched.unset() if isinstance(sched, SchedulerSpec) else ()
