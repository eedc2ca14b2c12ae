"""A disaggregated cluster on the real engine (executor=model, the tiny model on the
CPU): a prefill replica and a decode replica in this one process, each request's blocks
copied from one to the other, give the tokens one replica gives; without the copy they
do not; a backend whose blocks cannot move is refused."""

from __future__ import annotations

from typing import Any

import pytest

from harness.cluster import disagg
from harness.errors import UserError
from harness.runner import run
from tests.compose import tiny

DIS = ["cluster.mode=disaggregated", "logger=none"]


def _outputs(*overrides: str) -> tuple[dict[int, list[int]], dict[str, Any]]:
    res = run(tiny("logger=none", *overrides))
    assert res.metrics["requests.finished"] == len(res.requests) == 6
    return res.outputs, res.metrics


@pytest.mark.parametrize("backend", [
    ["backend=paged"], ["backend=fp8"], ["backend=int8"], ["backend=quest"],
    ["backend=kivi", "cache.kv_budget=1MiB"],
], ids=lambda b: b[0].split("=")[1])
def test_prefill_and_decode_replicas_give_one_replicas_tokens(backend: list[str]) -> None:
    one, _ = _outputs(*backend)
    two, m = _outputs(*backend, *DIS)
    assert two == one
    # Blocks were copied, and the decode side's cache served the shared system prompt.
    assert m["cluster.transfer_blocks"] > 0 and m["cluster.transfer_skipped_blocks"] > 0
    assert m["run.transfer"].startswith("copied")


def test_pools_of_two_behind_their_routers_give_the_same_tokens() -> None:
    one, _ = _outputs()
    four, m = _outputs(*DIS, "cluster.prefill_replicas=2", "cluster.decode_replicas=2",
                       "cluster.prefill.router=least_loaded",
                       "cluster.decode.router=prefix_aware")
    assert four == one
    assert m["replica.2.requests_routed"] + m["replica.3.requests_routed"] == 6


def test_without_the_copy_the_tokens_differ(monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode side reads the blocks the copy wrote: skip it and what it reads is not
    the prompt's K/V (the test above would catch a copy that moved nothing)."""
    one, _ = _outputs()
    monkeypatch.setattr(disagg, "copy_blocks", lambda *a: 0.0)
    broken, _ = _outputs(*DIS)
    assert broken != one


def test_a_backend_whose_blocks_cannot_move_is_refused() -> None:
    with pytest.raises(UserError, match=r"backend h2o runs without prefix caching"):
        run(tiny(*DIS, "backend=h2o"))
    with pytest.raises(UserError, match=r"cluster\.link=eth: what-if options"):
        run(tiny(*DIS, "cluster.link=eth"))
