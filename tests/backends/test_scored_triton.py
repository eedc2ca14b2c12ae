"""The token-evicting methods on their Triton path (issue #56, second stage), under the
interpreter, step by step against their torch path: the same attention outputs, the same
scores handed to the policy every step (so the same tokens evicted and compacted), and
the same declared reads (which the step driver holds to what the attention touched), for
both triggers; the per-head methods still refuse ``backend.kernel=triton``."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch

from harness.backends import BACKENDS
from harness.backends.base import KVLayout
from harness.backends.scored import ScoredBackend
from harness.errors import UserError
from harness.kv.evicting import EvictingKVManager
from harness.model.rope import inverse_frequencies
from tests.backend_steps import LAYOUT, Driver

pytest.importorskip("triton")

# Every scored method with a Triton path, from the registry (a new one is tested here).
METHODS = sorted(n for n, cls in BACKENDS.items()
                 if issubclass(cls, ScoredBackend) and cls.Options.triton_built)
# expected_attention rotates its queries back: it needs the RoPE speeds.
ROPE = KVLayout(LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim, LAYOUT.dtype,
                rope_inv_freq=tuple(inverse_frequencies(LAYOUT.head_dim, 10000.0).tolist()))


def _drive(name: str, kernel: str, prefill: str) -> dict[str, Any]:
    """Three sequences (prompts over, at and under the 16-token budget): chunks of at most
    16 tokens (or the policy's streaming chunk), so decodes run beside chunks, then two
    decode steps; what each step gave and held."""
    opts: dict[str, Any] = {"kernel": kernel, "budget": 16, "budget_ratio": 0,
                            "prefill": prefill}
    if "window" in {f.name for f in dataclasses.fields(BACKENDS[name].Options)}:
        opts["window"] = 4  # snapkv's observation window, within the prompts
    d = Driver(name, block_size=8, options=opts, seed=3, layout=ROPE)
    assert isinstance(d.be, ScoredBackend) and d.be.kernel == kernel
    seqs = [d.add(n, max_tokens=16) for n in (36, 17, 7)]
    outs, scores, held = [], [], []
    decodes = 0
    while decodes < 2:
        step = []
        for s in seqs:
            left = s.num_prompt_tokens - s.num_computed
            cap = d.kv.max_chunk(s) or (16 if s is seqs[0] else left)
            step.append((s, min(left, cap) if left > 0 else 1))
        decodes += all(n == 1 and s.num_computed >= s.num_prompt_tokens for s, n in step)
        out = d.step(step)
        outs.append(out.out)
        sc = d.last_scores
        scores.append(None if sc is None else (sc.slots.copy(), sc.values.copy()))
        held.append([d.held(s) for s in seqs])
    kv = d.kv
    assert isinstance(kv, EvictingKVManager)
    return {"outs": outs, "scores": scores, "held": held, "reads": d.reads,
            "evicted": kv.stats.evicted_tokens}


# Every method at its full trigger (the first prompt in chunks of 16: tova's last rows of
# each chunk score too); streaming where the kernels score differently: every chunk
# evicts after h2o's weights, and snapkv's window is each chunk's own.
# ~1.5 s each interpreted: the default run keeps one of each way the kernels score (every
# row, the last rows, a window, a window per chunk); the rest run under -m slow (knorm is
# also in the default engine test).
DEFAULT = {("h2o", "full"), ("tova", "full"), ("snapkv", "full"), ("snapkv", "streaming")}
CASES = [c if c in DEFAULT else pytest.param(*c, marks=pytest.mark.slow) for c in
         [(m, "full") for m in METHODS] + [(m, "streaming") for m in ("h2o", "snapkv")]]


@pytest.mark.parametrize(("name", "prefill"), CASES)
def test_the_triton_path_gives_the_torch_paths_outputs_scores_and_choices(
        name: str, prefill: str) -> None:
    ref, tri = _drive(name, "torch", prefill), _drive(name, "triton", prefill)
    assert ref["evicted"] > 0 and tri["evicted"] == ref["evicted"]
    for a, b in zip(ref["outs"], tri["outs"], strict=True):
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(y, x, atol=1e-4, rtol=1e-4)
    for a, b in zip(ref["scores"], tri["scores"], strict=True):
        assert (a is None) == (b is None)
        if a is not None and b is not None:
            assert np.array_equal(a[0], b[0])
            np.testing.assert_allclose(b[1], a[1], rtol=1e-4, atol=1e-7)
    assert tri["held"] == ref["held"]  # the same tokens kept, in the same slots
    assert tri["reads"] == ref["reads"]


@pytest.mark.parametrize("name", ["pyramidkv", "adakv"])
def test_the_per_head_presses_refuse_triton(name: str) -> None:
    with pytest.raises(UserError, match=rf"backend={name} has no Triton path yet"):
        BACKENDS[name](LAYOUT, torch.device("cpu"), kernel="triton")


def test_triton_needs_blocks_of_eight() -> None:
    with pytest.raises(UserError, match=r"backend.block_size >= 8, got 4"):
        BACKENDS["h2o"](LAYOUT, torch.device("cpu"), kernel="triton", block_size=4)
    assert BACKENDS["h2o"](LAYOUT, torch.device("cpu"), kernel="auto",
                           block_size=4).kernel == "torch"


@pytest.mark.slow  # ~7 s interpreted (six layers)
def test_a_hybrid_models_sliding_layers_run_the_paged_kernels_with_their_window() -> None:
    """model=tiny_gemma3 (KV cache groups): h2o chooses the full layers' tokens through the
    slot-list kernels, the sliding layers keep their window through the paged kernels;
    the torch path's greedy tokens and evictions."""
    from harness.runner import run
    from tests.compose import compose_cfg

    over = ["model=tiny_gemma3", "workload=long_prompt", "workload.num_short=0",
            "workload.long_prompt_tokens=40", "workload.num_long=1", "workload.long_start_s=0",
            "workload.long_output_tokens=4", "cache.kv_budget=1MiB", "backend.block_size=8",
            "backend=h2o", "scheduler.max_num_batched_tokens=16"]
    ref, tri = (run(compose_cfg([*over, f"backend.kernel={k}"])) for k in ("torch", "triton"))
    assert tri.metrics["run.kernel"] == "triton"
    assert tri.metrics["run.kv_groups"].startswith("1 full + 2 sliding 24")
    assert tri.outputs == ref.outputs
    assert tri.metrics["cache.evicted_tokens"] == ref.metrics["cache.evicted_tokens"] > 0
