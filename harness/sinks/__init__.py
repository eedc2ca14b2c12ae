"""Where a finished run goes besides its local results folder (harness/results.py)."""

from harness.sinks.wandb_sink import (
    FAILED_FILE,
    WandbLogError,
    log_report_to_wandb,
    log_run_to_wandb,
    record_wandb_failure,
)

__all__ = ["FAILED_FILE", "WandbLogError", "log_report_to_wandb", "log_run_to_wandb",
           "record_wandb_failure"]
