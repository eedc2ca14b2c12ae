"""The ``+context=`` presets (conf/context/) run on their own under executor=roofline, as
their comments say (issue #54: they failed three ways before they ran, and their
"(+1024 generated)" held only inside +experiment=hybrid_at_scale)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from harness.errors import UserError
from harness.runner import run
from tests.compose import compose_cfg

CONTEXT = Path(__file__).resolve().parents[2] / "conf" / "context"


@pytest.mark.parametrize("name", ["8k", "32k", "128k"])
def test_a_context_preset_runs_alone_as_its_comment_says(name: str) -> None:
    text = (CONTEXT / f"{name}.yaml").read_text()
    m = re.search(r"# (\d+) prompts of (\d+) tokens, each answered with exactly 1,024", text)
    assert m is not None, text
    count, tokens = int(m.group(1)), int(m.group(2))
    assert f"+context={name} executor=roofline" in text
    cfg = compose_cfg([f"+context={name}", "executor=roofline"])
    assert cfg.workload.num_requests == count
    # Run with fewer of the same requests: each prompt its length, each answer 1,024.
    r = run(compose_cfg([f"+context={name}", "executor=roofline", "workload.num_requests=3"]))
    assert r.metrics["requests.finished"] == 3 and r.metrics["requests.rejected"] == 0
    assert {x["prompt_tokens"] for x in r.requests} == {tokens}
    assert {x["output_tokens"] for x in r.requests} == {1024}
    assert r.metrics["run.max_model_len"] >= tokens + 1024  # the model's context


def test_under_executor_model_a_context_preset_says_what_it_needs() -> None:
    with pytest.raises(UserError, match=r"cache\.kv_budget=auto .* needs executor=roofline"):
        run(compose_cfg(["+context=8k", "model=tiny"]))
