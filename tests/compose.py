"""Compose run configs the way `python -m harness` does, for tests."""

from __future__ import annotations

from pathlib import Path

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
