"""The seam between the run pipeline (harness.runner.run) and an executor: what each
executor contributes to one run. ``ModelTarget`` (harness.model_target) runs the real
model; ``RooflineTarget`` (harness.roofline.run) models each step's time. The pipeline
(workload, engine loop, summary, SLO metrics, results, rejections) is the same code for
both; these three hooks are all that differs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from harness.metrics.requestlog import RequestLog
    from harness.model.tokenizer import Tokenizer
    from harness.stack import Stack
    from harness.workloads.base import Workload


@dataclass
class ExecutorRecord:
    """An executor's own keys of a run's record: ``run`` (without the ``run.`` prefix:
    ``executor``, ``model``, ``kernel``, ``device``, ``dtype``, ...) and ``metrics``
    (full keys: ``roofline.*``, ``engine.sim_wall_s``)."""

    run: dict[str, Any]
    metrics: dict[str, Any] = field(default_factory=dict)


class RunTarget(Protocol):
    """What runs the steps of one run, built from its :class:`~harness.config.RunConfig`."""

    @property
    def tokenizer(self) -> Tokenizer:
        """Encodes the workload's prompts (the model's, or bytes for the roofline)."""
        ...

    @property
    def max_position(self) -> int:
        """The longest sequence the model takes (``max_position_embeddings``)."""
        ...

    def build(self, workload: Workload, quiet: bool = False) -> Stack:
        """The serving stack for ``workload`` (fails early on a budget nothing fits);
        ``quiet``: no warnings (a cluster's second and later replicas: the same stack)."""
        ...

    def record(self, st: Stack, sim_wall_s: float, sim_cpu_s: float) -> ExecutorRecord:
        """After the run: the executor's keys. ``sim_wall_s``: this machine's seconds in
        the engine loop (the wall clock whatever clock the engine ran on); ``sim_cpu_s``:
        the process's CPU seconds there (on a shared machine, what the loop itself cost:
        time spent waiting for a core is not in it)."""
        ...

    def score(self, st: Stack, workload: Workload, outputs: dict[int, list[int]],
              metrics: dict[str, Any], rows: RequestLog) -> None:
        """Quality: task scores and ``quality.*`` into ``metrics`` (and columns into
        ``rows``) where the outputs are a model's; nothing where they are synthetic."""
        ...
