"""The sweeper of ``python -m harness -m``: Hydra's basic sweeper, with each configuration's
``repeats`` interleaved across the sweep (harness/repeats.py). It lives here because Hydra
instantiates plugins only from the ``hydra_plugins`` namespace.

The jobs are the basic sweeper's (the cartesian product of the sweep overrides, in order);
when any job's composed config has ``repeats`` > 1, every job is run as repeat 0, then
every one as repeat 1, and so on (a configuration with fewer repeats drops out), each with
``repeat=k repeat_of=<c>`` added to its overrides. Any launcher (the basic one, joblib,
Slurm, Ray) runs the expanded list as it would any sweep.

Its end and its resumption (issue #54; harness/app/supervisor.py): once every job ran, one
summary block says how many finished, failed and never started (the failed ones' folders),
and the CLI exits 1 if any did not finish. Rerun into the folder of an earlier attempt of
the same sweep (the sweep folder's claim taken over by harness.results.claim_sweep), the
jobs that finished are kept and not launched; the others are set aside and launched under
their own job numbers (so their folders are the same), in runs of consecutive jobs.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.core.utils import JobReturn
from omegaconf import OmegaConf, open_dict

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

    def sweep(self, arguments: list[str]) -> Any:
        """BasicSweeper.sweep, resuming an earlier attempt found in the sweep folder, and
        summarizing the jobs' ends (module docstring)."""
        from harness.app.supervisor import job_folders, resume_plan, summarize_sweep

        assert self.config is not None and self.launcher is not None
        assert self.hydra_context is not None
        params = [*self._parse_config(), *arguments]
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        self.overrides = self.split_arguments(parser.parse_overrides(params),
                                              self.max_batch_size)
        jobs = [list(job) for batch in self.overrides for job in batch]
        sweep = Path(str(self.config.hydra.sweep.dir))
        sweep.mkdir(parents=True, exist_ok=True)
        kept: dict[int, Path] = {}
        if job_folders(sweep):  # an earlier attempt's (claim_sweep let it be resumed)
            try:
                kept = resume_plan(sweep, [(job, self._job_folder(i, job))
                                           for i, job in enumerate(jobs)]).kept
            except UserError as e:
                print(f"kvbench: {e}", file=sys.stderr)
                sys.exit(2)
        OmegaConf.save(self.config, sweep / "multirun.yaml")
        folders: list[Path | None] = [kept.get(i) for i in range(len(jobs))]
        returns: list[Sequence[JobReturn]] = []
        for first, batch in _runs([i for i in range(len(jobs)) if i not in kept],
                                  self.max_batch_size):
            overrides = [jobs[i] for i in batch]
            self.validate_batch_is_legal(overrides)
            results = self.launcher.launch(overrides, initial_job_idx=first)
            for i, r in zip(batch, results, strict=False):
                _ = r.return_value  # a job that raised raises here, as in the basic sweeper
                out = OmegaConf.select(r.hydra_cfg, "hydra.runtime.output_dir") \
                    if r.hydra_cfg is not None else None
                folders[i] = Path(str(out)) if out else None
            returns.append(results)
        summarize_sweep(sweep, folders, kept=len(kept))
        return returns

    def _job_folder(self, num: int, job: list[str]) -> Path:
        """The folder job ``num`` (``job``: its overrides) runs in, as the launcher will
        name it: hydra.sweep.dir / hydra.sweep.subdir resolved for that job."""
        assert self.hydra_context is not None and self.config is not None
        cfg = self.hydra_context.config_loader.load_sweep_config(self.config, job)
        with open_dict(cfg):
            cfg.hydra.job.id = num
            cfg.hydra.job.num = num
        hc = HydraConfig.instance()
        before = hc.cfg
        hc.set_config(cfg)
        try:
            return Path(str(self.config.hydra.sweep.dir)) / str(cfg.hydra.sweep.subdir)
        finally:
            if before is not None:
                hc.cfg = before


def _runs(todo: list[int], max_batch: int | None) -> Iterator[tuple[int, list[int]]]:
    """``todo`` (ascending job numbers) as batches of consecutive numbers, each at most
    ``max_batch`` long: (its first number, its numbers)."""
    batch: list[int] = []
    for i in todo:
        if batch and (i != batch[-1] + 1 or (max_batch and len(batch) >= max_batch)):
            yield batch[0], batch
            batch = []
        batch.append(i)
    if batch:
        yield batch[0], batch
