"""Compose run configs the way `python -m harness` does, for tests."""

from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, open_dict

from harness.config import register_configs

CONF = str(Path(__file__).resolve().parents[1] / "conf")


def compose_cfg(overrides: list[str], out_dir: Path | None = None) -> DictConfig:
    register_configs()
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
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
