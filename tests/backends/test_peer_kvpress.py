"""kvbench's scores against NVIDIA kvpress's on the same layer inputs: a fixture recorded
by scripts/peer_kvpress.sh (kvpress 0.5.5 in its own venv, SmolLM2-135M, layers 0-1 of a
64-token RULER prompt: post-RoPE queries, keys and values, and each press's
scores). Each kvbench method recomputes its score from those tensors through its own code;
after the documented constant (kvbench keeps one score per token: kvpress's averaged over
KV heads; snapkv sums over its window's queries and the query heads where kvpress
averages) they agree to 1e-5. pyramidkv and adakv (issue #59) rank per KV head by the same
window's score as kvpress's PyramidKVPress and AdaKVPress(SnapKVPress): the fixture's
snapkv scores, head by head, with no constant."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "kvpress_scores.pt"
sys.path.insert(0, str(ROOT / "scripts" / "peer"))
from score_check import check_scores  # noqa: E402

METHODS = {"knorm", "keydiff", "tova", "observed_attention", "snapkv", "expected_attention",
           "pyramidkv", "adakv"}


@pytest.fixture(scope="module")
def fixture() -> dict[str, object]:
    return torch.load(FIXTURE)  # committed: the CI check needs no kvpress install


def test_every_method_scores_as_kvpress_does(fixture: dict[str, object]) -> None:
    checks = check_scores(fixture)  # type: ignore[arg-type]
    assert {c.method for c in checks} == METHODS
    meta = fixture["meta"]
    heads = fixture["0"]["q"].shape[1]  # type: ignore[index]
    window = meta["snapkv"]["window"]  # type: ignore[index]
    for c in checks:
        assert c.rel_error <= 1e-5, c
        want = window * heads if c.method == "snapkv" else 1.0  # (per head: the mean)
        assert c.constant == pytest.approx(want, rel=1e-5), c


def test_the_check_can_fail(fixture: dict[str, object]) -> None:
    # Perturb one press's recorded scores: its check must see it.
    import copy

    bad = copy.deepcopy(fixture)
    s = bad["0"]["scores"]["keydiff"]  # type: ignore[index]
    s[:, 5] += 0.5 * s.abs().max()
    worst = max(c.rel_error for c in check_scores(bad) if c.method == "keydiff")  # type: ignore[arg-type]
    assert worst > 1e-3
