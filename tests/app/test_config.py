"""Every config group option composes; unknown names and keys fail at compose time."""

from __future__ import annotations

import pytest
from hydra.errors import ConfigCompositionException

from harness.config import CONF_DIR
from tests.compose import compose_cfg

GROUPS = ["backend", "workload", "model", "scheduler", "cache", "logger"]


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)])
def test_every_option_composes(group: str, option: str) -> None:
    extra = ["model.path=/x"] if group == "model" and option in ("gguf", "hf") else []
    cfg = compose_cfg([f"{group}={option}", *extra])
    assert cfg[group] is not None


def test_unknown_backend_lists_known_ones() -> None:
    with pytest.raises(ConfigCompositionException) as e:
        compose_cfg(["backend=nope"])
    msg = str(e.value) + str(e.value.__cause__)
    assert "paged" in msg and "contiguous" in msg


def test_unknown_key_fails_at_compose() -> None:
    with pytest.raises(ConfigCompositionException):
        compose_cfg(["backend.blok_size=8"])


def test_wrong_type_fails_at_compose() -> None:
    with pytest.raises(ConfigCompositionException):
        compose_cfg(["scheduler.max_num_seqs=many"])
