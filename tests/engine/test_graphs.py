"""Decode steps replayed from per-bucket graphs (harness.engine.graphs), checked on the CPU
with the stand-in capture (make_fx: Python values baked in, tensors kept by reference,
as a CUDA graph keeps addresses): step after step, a replay whose only change is its
refreshed buffers gives the eager forward's logits, across buckets as the batch shrinks,
and the run's tokens equal an eager run's."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from harness.backends import get_backend
from harness.backends.base import KVLayout
from harness.config import compose_config, run_config
from harness.engine.executor import ModelExecutor
from harness.engine.graphs import (
    DecodeGraphs,
    TraceCapture,
    batch_buckets,
    graphs_unavailable,
    setup_graphs,
)
from harness.errors import UserError
from harness.gpucheck.profile import uniform_lengths
from harness.kv.groups import GroupedKVManager
from tests.compose import model_stack

CPU = torch.device("cpu")


def test_buckets_are_nano_vllms() -> None:
    assert batch_buckets(1) == [1]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]


def test_who_replays_and_why_not() -> None:
    lay = KVLayout(2, 2, 16, torch.float32)

    def be(name: str, **kw: Any) -> Any:
        return get_backend(name)(lay, CPU, **kw)

    for name in ("paged", "fp8", "int8", "sliding_window", "streaming_llm"):
        assert be(name, kernel="torch").graph_unsafe_reason() is None, name
    assert "sink" in (be("int8", kernel="torch", sink_tokens=4).graph_unsafe_reason() or "")
    for name in ("contiguous", "quest", "kivi", "h2o", "snapkv"):
        assert be(name).graph_unsafe_reason() is not None, name
    paged = be("paged", kernel="torch")
    paged.track_touches = False
    assert graphs_unavailable("auto", CPU, paged, False) == "no CUDA device"
    assert graphs_unavailable("off", CPU, paged, False) == "engine.cuda_graphs=off"
    with pytest.raises(UserError, match=r"engine\.cuda_graphs=on, but no CUDA device"):
        graphs_unavailable("on", CPU, paged, False)
    with pytest.raises(UserError, match=r"unknown engine\.cuda_graphs"):
        run_config(compose_config(["model=tiny", "engine.cuda_graphs=yes"]))


def _run(backend: str, kernel: str | None, graphs: bool,
         device: str = "cpu") -> tuple[dict[int, list[int]], list[float], set[int]]:
    """A run whose batch shrinks as requests finish (buckets 8, 4, 2, 1); with
    ``graphs``, every decode step is also run eagerly first and the logits compared
    (on the CPU the traced stand-in replays, on CUDA a CUDA graph)."""
    ov = ["model=tiny", f"device={device}", f"backend={backend}", "cache.kv_budget=8MiB",
          "scheduler.max_num_seqs=8", "scheduler.max_model_len=256",
          *uniform_lengths(6, (9, 40), (3, 14))]
    if kernel is not None:
        ov.append(f"backend.kernel={kernel}")
    target, wl, st = model_stack(ov)
    cuda = device == "cuda"
    assert target.cuda_graphs == ("off: KVBENCH_CHECK counts what each step's attention "
                                  "touched" if cuda else "off: no CUDA device")
    ex = st.engine.executor
    assert isinstance(ex, ModelExecutor)
    errors: list[float] = []
    used: set[int] = set()
    if graphs:
        st.backend.track_touches = False  # (KVBENCH_CHECK's touch counts: per step)
        g, label = setup_graphs("on", target.loaded.model, st.backend, torch.device(device),
                                isinstance(st.kv, GroupedKVManager), 8, 256,
                                st.sizing.block_size, capture=None if cuda else TraceCapture())
        assert g is not None and label.startswith("on: 4 batch buckets")
        ex.graphs = g
        replay = DecodeGraphs.run

        def run(self: DecodeGraphs, inputs: Any, b: int) -> torch.Tensor:
            self.backend.begin_step(inputs.attn)
            with torch.inference_mode():
                eager = self.model(inputs.input_ids, inputs.positions, self.backend.attend,
                                   inputs.logits_rows)
            got = replay(self, inputs, b)
            errors.append(float((got - eager).abs().max()))
            used.add(b)
            return got

        g.run = run.__get__(g)  # type: ignore[method-assign]
    st.engine.run(wl)
    return st.collector.outputs(), errors, used


@pytest.mark.parametrize("backend,kernel", [
    ("paged", "torch"), ("fp8", "torch"), ("sliding_window", "torch"),
    # The Triton path under the interpreter: ~20 s a case; int8 covers the quantizing
    # store's pad slot too, paged runs with the slow tests.
    pytest.param("paged", "triton", marks=pytest.mark.slow), ("int8", "triton")])
def test_a_replayed_decode_step_gives_the_eager_logits(backend: str, kernel: str) -> None:
    if kernel == "triton":
        pytest.importorskip("triton")
    eager_out, _, _ = _run(backend, kernel, graphs=False)
    out, errors, used = _run(backend, kernel, graphs=True)
    assert used == {1, 2, 4, 8}, used  # every bucket, padded and not
    assert len(errors) >= 12 and max(errors) < 1e-4, errors
    assert out == eager_out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend,kernel", [("paged", "triton"), ("fp8", "triton"),
                                            ("paged", "torch")])
def test_cuda_graph_replays_give_the_eager_logits(backend: str, kernel: str) -> None:
    """The same check with real CUDA graphs (compiled kernels, one memory pool)."""
    eager_out, _, _ = _run(backend, kernel, graphs=False, device="cuda")
    out, errors, used = _run(backend, kernel, graphs=True, device="cuda")
    assert used == {1, 2, 4, 8}, used
    assert max(errors) < 1e-3, errors
    assert out == eager_out
