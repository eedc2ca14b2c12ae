"""The decode forward is one graph to dynamo (issue #50): no graph break for the backends
CUDA graph capture is meant for, on the torch path and (the launches as torch custom ops,
harness.kernels.ops) the Triton path, checked with ``torch._dynamo.explain`` on real decode
steps of an engine run."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import harness.engine.executor as ex
from harness.gpucheck.profile import fixed_lengths
from tests.compose import model_stack

GRAPH_SAFE = ["paged", "contiguous", "fp8", "int8", "sliding_window", "streaming_llm",
              "h2o", "tova", "snapkv", "knorm", "quest", "kivi"]
TRITON = ["paged", "fp8", "int8", "sliding_window"]
# The default run keeps one backend of each seam (paged's, the contiguous one, a scorer's,
# a selector's) and paged's Triton path; the others share those seams' code and run with
# -m slow (2-6 s each: the suite's time limit).
DEFAULT = {("paged", None), ("contiguous", None), ("h2o", None), ("quest", None),
           ("paged", "triton")}
CASES = [c if c in DEFAULT else pytest.param(*c, marks=pytest.mark.slow)
         for c in [*((b, None) for b in GRAPH_SAFE), *((b, "triton") for b in TRITON)]]


def explain_decode_steps(backend: str, kernel: str | None, steps: int = 2) -> list[Any]:
    """``torch._dynamo.explain`` of the model's forward on the first ``steps`` decode
    steps of a small run (the inputs and backend state as the engine made them)."""
    ov = ["model=tiny", "device=cpu", f"backend={backend}", "cache.kv_budget=8MiB",
          *fixed_lengths(3, 20, 6)]
    if kernel is not None:
        ov.append(f"backend.kernel={kernel}")
    _, wl, st = model_stack(ov)
    # What KVBENCH_CHECK adds (counting what the attention touched) is not the measured
    # path: off, as in a user's run.
    st.backend.track_touches = False
    found: list[Any] = []
    orig = ex.ModelExecutor.forward

    def forward(self: ex.ModelExecutor, rec: Any) -> Any:
        if all(s.is_decode for s in rec.seqs) and len(found) < steps:
            assert self.kv is not None
            inputs = self.inputs.build(rec, self.kv)
            self.backend.begin_step(inputs.attn)
            torch._dynamo.reset()
            found.append(torch._dynamo.explain(self.model.forward)(
                inputs.input_ids, inputs.positions, self.backend.attend,
                inputs.logits_rows))
        return orig(self, rec)

    ex.ModelExecutor.forward = forward  # type: ignore[method-assign]
    try:
        st.engine.run(wl)
    finally:
        ex.ModelExecutor.forward = orig  # type: ignore[method-assign]
    return found


@pytest.mark.parametrize("backend,kernel", CASES)
def test_a_decode_forward_is_one_graph(backend: str, kernel: str | None) -> None:
    if kernel is None and backend in ("paged", "fp8", "int8", "sliding_window",
                                      "streaming_llm", "quest", "kivi"):
        kernel = "torch"
    found = explain_decode_steps(backend, kernel)
    assert len(found) == 2
    for e in found:
        reasons = [str(b.reason)[:300] for b in e.break_reasons]
        assert e.graph_count == 1 and e.graph_break_count == 0, reasons
