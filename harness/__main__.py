"""``python -m harness``: a thin Hydra entry point around :func:`harness.runner.run`.

A run that fails writes ``FAILED`` (the error) into its folder. With ``logger=wandb`` the
finished run is then logged to W&B; if that fails, the local results stay as they are and
``WANDB_FAILED`` (the error and how to retry) joins them. In a multirun sweep the sweep
goes on to the next job either way (exit status 0). A single run exits with:

- 0: the run finished (and was logged, if a logger was chosen);
- 1: the run crashed (a bug or an environment problem; the traceback is printed);
- 2: a configuration or capacity error (the message says what to change);
- 3: the run finished and its results are on disk, but logging to W&B failed.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, open_dict

from harness.config import register_configs

register_configs()


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from harness.results import write_failure
    from harness.runner import print_summary, run

    hc = HydraConfig.get()
    out = Path(hc.runtime.output_dir)
    with open_dict(cfg):
        cfg.out_dir = str(out)
    try:
        result = run(cfg)
    except Exception as e:  # recorded in the run's folder, then reported
        write_failure(out, e)
        user_error = isinstance(e, ValueError)
        if not user_error:
            traceback.print_exc()
        print(f"\nkvbench: run failed: {e}\n  (recorded in {out / 'FAILED'})", file=sys.stderr)
        if hc.mode == RunMode.MULTIRUN:
            return  # the sweep goes on
        sys.exit(2 if user_error else 1)
    print_summary(result.metrics, result.out_dir)
    if cfg.logger.name == "wandb":
        from harness.sinks import log_run_to_wandb, record_wandb_failure

        sweep = Path(hc.sweep.dir).name if hc.mode == RunMode.MULTIRUN else None
        try:
            log_run_to_wandb(cfg, result, cfg.logger, default_group=sweep)
        except Exception as e:  # local results are complete: report, record, exit 3
            print(f"\n{record_wandb_failure(out, e)}", file=sys.stderr)
            if hc.mode != RunMode.MULTIRUN:
                sys.exit(3)


if __name__ == "__main__":
    main()
