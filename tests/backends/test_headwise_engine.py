"""The per-head methods on the real engine (issue #59's pyramidkv check): with several
requests in flight (prefill chunks beside decodes, compactions, pages crossed while
decoding), every decode's attention output equals, per query head, a float64 softmax over
exactly the positions its KV head holds (the KV manager's view) with the K/V the model
produced at those positions, recorded as the layers ran.

A compaction that put a token's K/V under another position, mixed two heads' pages or
lost a generated token would fail it; the Driver tests (test_pyramidkv.py, test_adakv.py,
test_duo_attention.py) check the same on random tensors, one sequence at a time."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch

from harness.backends.headwise import HeadwiseBackend
from harness.kv.headwise import HeadwiseKVManager
from harness.runner import run
from tests.compose import compose_cfg

# 6 prompts of 120-200 tokens at once, 96 tokens a step: chunks, mixed steps, decodes of
# several sequences together; blocks of 8 tokens, so decodes open pages.
TRAFFIC = ("model=tiny", "workload=random", "workload.num_requests=6",
           "workload.distribution=uniform", "workload.input_min=120",
           "workload.input_max=200", "workload.output_min=12", "workload.output_max=12",
           "workload.rate=0", "scheduler.max_num_batched_tokens=96", "backend.block_size=8",
           "cache.kv_budget=2MiB", "logger=none")


@dataclass
class Recorder:
    """Each sequence's K/V by layer and position, as the model handed them to the
    backend, and every decode's largest error against the brute force."""

    managers: list[HeadwiseKVManager] = field(default_factory=list)
    kv: dict[tuple[int, int], dict[int, tuple[torch.Tensor, torch.Tensor]]] = field(
        default_factory=dict)
    decodes: int = 0  # (sequence, layer) decode rows checked
    batched: int = 0  # steps with more than one decode
    worst: float = 0.0
    reordered: bool = False  # a head held positions out of order (tokens moved into holes)
    differ: bool = False  # two heads (layer, KV head) held different positions

    def record(self, be: HeadwiseBackend, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        b = be.batch
        assert b is not None
        for i, s in enumerate(b.decode_seqs):
            self.kv.setdefault((s.seq.seq_id, layer), {})[s.start] = (k[i], v[i])
        for c in b.prefills:
            got = self.kv.setdefault((c.sched.seq.seq_id, layer), {})
            for j in range(c.num_tokens):
                got[c.start + j] = (k[c.row + j], v[c.row + j])

    def check(self, be: HeadwiseBackend, layer: int, q: torch.Tensor,
              out: torch.Tensor) -> None:
        """q, out (T, H, D): the decode rows against the brute force."""
        b, kvm, lay = be.batch, self.managers[-1], be.layout
        assert b is not None
        g = q.shape[1] // lay.num_kv_heads
        self.batched += layer == 0 and b.num_decode > 1
        for i, s in enumerate(b.decode_seqs):
            every = kvm.positions(s.seq)
            pos = every[layer * lay.num_kv_heads:(layer + 1) * lay.num_kv_heads]
            assert all(int(p.max()) == s.start for p in pos)  # each head holds its own token
            self.reordered |= any(bool((np.diff(p) < 0).any()) for p in pos)
            self.differ |= any(not np.array_equal(every[0], p) for p in every[1:])
            rec = self.kv[(s.seq.seq_id, layer)]
            for h in range(q.shape[1]):
                kvh = h // g
                held = pos[kvh].tolist()
                k = torch.stack([rec[p][0][kvh] for p in held]).double()
                v = torch.stack([rec[p][1][kvh] for p in held]).double()
                w = torch.softmax(k @ q[i, h].double() / lay.head_dim ** 0.5, 0)
                self.worst = max(self.worst, float((out[i, h].double() - w @ v).abs().max()))
            self.decodes += 1


def run_recorded(monkeypatch: pytest.MonkeyPatch, *overrides: str) -> tuple[Recorder,
                                                                           dict[str, Any]]:
    """Run TRAFFIC with ``overrides``, every decode checked as it runs."""
    r = Recorder()
    init, attend = HeadwiseKVManager.__init__, HeadwiseBackend.attend

    def spy_init(self: HeadwiseKVManager, *a: Any, **k: Any) -> None:
        init(self, *a, **k)
        r.managers.append(self)

    def spy_attend(self: HeadwiseBackend, layer: int, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor) -> torch.Tensor:
        r.record(self, layer, k.clone(), v.clone())
        out = attend(self, layer, q, k, v)
        r.check(self, layer, q, out)
        return out

    monkeypatch.setattr(HeadwiseKVManager, "__init__", spy_init)
    monkeypatch.setattr(HeadwiseBackend, "attend", spy_attend)
    metrics = run(compose_cfg([*TRAFFIC, *overrides])).metrics
    return r, metrics


@pytest.mark.parametrize("method", [
    # window 8: kept / beta = 40 / 2 >= 8, the pyramid's branch (layer 0 keeps more)
    ("backend=pyramidkv", "backend.budget=40", "backend.budget_ratio=0", "backend.window=8",
     "backend.beta=2"),
    ("backend=pyramidkv", "backend.budget_ratio=0.5", "backend.window=8", "backend.beta=1"),
    ("backend=adakv", "backend.budget_ratio=0.3", "backend.window=8"),
    ("backend=duo_attention", "backend.sink_tokens=4", "backend.recent=32",
     "backend.calibration_tokens=256"),
], ids=["pyramid", "flat", "adakv", "duo"])
def test_decodes_attend_exactly_to_what_each_head_keeps(monkeypatch: pytest.MonkeyPatch,
                                                        method: tuple[str, ...]) -> None:
    r, m = run_recorded(monkeypatch, *method)
    assert m["requests.finished"] == 6
    assert m["cache.evicted_tokens"] > 0
    assert r.decodes == 6 * 11 * 2  # 11 decodes of each request, 2 layers
    assert r.batched > 0  # decodes of several sequences in one step
    assert r.differ  # the heads kept different tokens
    # The compaction moved kept tokens into dropped ones' slots, out of position order
    # (duo's streaming heads keep sinks and the latest tokens: moved, but in order).
    assert r.reordered == (method[0] != "backend=duo_attention")
    assert r.worst < 1e-5, r.worst
