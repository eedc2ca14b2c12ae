"""Compose run configs the way `python -m harness` does, for tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, open_dict

from harness.config import compose_config


def compose_cfg(overrides: list[str], out_dir: Path | None = None) -> DictConfig:
    cfg = compose_config(overrides)
    with open_dict(cfg):
        cfg.out_dir = str(out_dir) if out_dir is not None else None
        cfg.progress = False
    return cfg


def tiny(*overrides: str, out_dir: Path | None = None) -> DictConfig:
    """A tiny-model run small enough for CI."""
    base = ["model=tiny", "workload.conversations=3", "workload.turns=2",
            "workload.system_words=20", "workload.user_words=6", "workload.answer_tokens=8",
            "cache.kv_budget=256KiB"]
    return compose_cfg([*base, *overrides], out_dir)


def model_stack(overrides: list[str]) -> tuple[Any, Any, Any]:
    """(the model target, the workload, the built stack) of a composed run, without
    running it: for tests that drive or watch the engine themselves."""
    from harness.config import run_config
    from harness.model_target import ModelTarget
    from harness.workloads import make_workload

    rc = run_config(compose_config(overrides))
    rc.workload.seed = rc.seed
    target = ModelTarget(rc)
    wl = make_workload(rc.workload, target.tokenizer)
    return target, wl, target.build(wl, quiet=True)


def block_size(backend: str, size: int) -> list[str]:
    """``backend.block_size=<size>`` for a backend that reads it; none for one that
    declares it ignores it (contiguous: a run refuses it there, issue #54)."""
    from harness.backends import BACKENDS

    ignored = getattr(BACKENDS.get(backend), "ignored_options", {})
    return [] if "block_size" in ignored else [f"backend.block_size={size}"]
