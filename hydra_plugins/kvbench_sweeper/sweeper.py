"""The sweeper of ``python -m harness -m``: Hydra's basic sweeper, with each configuration's
``repeats`` interleaved across the sweep (harness/repeats.py). It lives here because Hydra
instantiates plugins only from the ``hydra_plugins`` namespace.

The jobs are the basic sweeper's (the cartesian product of the sweep overrides, in order);
when any job's composed config has ``repeats`` > 1, every job is run as repeat 0, then
every one as repeat 1, and so on (a configuration with fewer repeats drops out), each with
``repeat=k repeat_of=<c>`` added to its overrides. Any launcher (the basic one, joblib,
Slurm, Ray) runs the expanded list as it would any sweep.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.types import Override

from harness.errors import UserError
from harness.repeats import REPEAT_KEYS, expand_repeats


class RepeatSweeper(BasicSweeper):
    """``hydra.sweeper._target_`` of conf/config.yaml."""

    def split_arguments(  # type: ignore[override]
            self, overrides: list[Override], max_batch_size: int | None) -> list[list[list[str]]]:
        jobs = [job for batch in BasicSweeper.split_arguments(overrides, None) for job in batch]
        for o in overrides:
            if o.get_key_element().lstrip("+~") in REPEAT_KEYS:
                raise UserError(f"{o.input_line}: repeat and repeat_of are set by kvbench; "
                                "give repeats=N")
        expanded = expand_repeats(jobs, [self._repeats(job) for job in jobs])
        return list(self.split_overrides_to_chunks(expanded, max_batch_size))

    def _repeats(self, job: Sequence[str]) -> int:
        """The ``repeats`` of one job's composed config (an experiment may set it)."""
        assert self.hydra_context is not None and self.config is not None
        cfg: Any = self.hydra_context.config_loader.load_sweep_config(self.config, list(job))
        n = cfg.get("repeats", 1)
        return n if isinstance(n, int) and n > 1 else 1
