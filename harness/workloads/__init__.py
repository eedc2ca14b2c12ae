"""Workloads, registered by hand: name -> factory(cfg, tokenizer)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from harness.model.tokenizer import Tokenizer
from harness.workloads.base import Request, Workload
from harness.workloads.multiturn import MultiturnConfig, MultiturnWorkload


def _fields(cls: type, cfg: dict[str, Any]) -> dict[str, Any]:
    names = set(cls.__dataclass_fields__)  # type: ignore[attr-defined]
    return {k: v for k, v in cfg.items() if k in names}


def _multiturn(cfg: dict[str, Any], tok: Tokenizer) -> Workload:
    return MultiturnWorkload(MultiturnConfig(**_fields(MultiturnConfig, cfg)), tok)


WORKLOADS: dict[str, Callable[[dict[str, Any], Tokenizer], Workload]] = {
    "multiturn": _multiturn,
}


def make_workload(cfg: dict[str, Any], tok: Tokenizer) -> Workload:
    name = cfg.get("name", "")
    if name not in WORKLOADS:
        raise ValueError(f"workload {name!r} is not registered; known: {', '.join(WORKLOADS)}")
    return WORKLOADS[name](cfg, tok)


__all__ = ["WORKLOADS", "Request", "Workload", "make_workload"]
