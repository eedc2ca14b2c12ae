"""Through the whole engine (chunked prefill, then decodes, paged backend, two requests in
one batch), the default model's logits match transformers' own implementation."""

from __future__ import annotations

import pytest
import torch

import harness.model as hm
from harness.backends.base import KVLayout
from harness.backends.paged import PagedBackend
from harness.engine.engine import Engine
from harness.engine.sampler import Sampler
from harness.metrics.collector import MetricsCollector
from harness.sched.scheduler import Scheduler, SchedulerConfig
from harness.sched.sequence import SamplingParams, Sequence, SequenceGroup
from harness.sizing import size_cache
from harness.workloads.base import Request

CPU = torch.device("cpu")


class RecordingSampler(Sampler):
    """Greedy, and keeps every logits row it was given, per sequence."""

    def __init__(self) -> None:
        super().__init__(0)
        self.rows: dict[int, list[torch.Tensor]] = {}

    def sample(self, logits: torch.Tensor, seqs: list[Sequence],
               samples: list[int | None] | None = None) -> list[int]:
        for row, seq in zip(logits, seqs):
            self.rows.setdefault(seq.group.request_id, []).append(row.clone())
        return super().sample(logits, seqs, samples)


class FixedRequests:
    name = "fixed"

    def __init__(self, reqs: list[Request]) -> None:
        self.reqs = reqs

    def initial_requests(self) -> list[Request]:
        return self.reqs

    def on_finished(self, group: SequenceGroup) -> list[Request]:
        return []


@pytest.mark.slow
def test_engine_logits_match_transformers(smollm2: hm.LoadedModel,
                                          smollm2_transformers: torch.nn.Module) -> None:
    lm = smollm2
    c = lm.config
    backend = PagedBackend(KVLayout(c.num_layers, c.num_kv_heads, c.head_dim, torch.float32),
                           CPU, kernel="torch")
    sizing = size_cache(backend, "8MiB", 0)
    kv = backend.make_manager(sizing, enable_prefix_caching=True, watermark=0.0)
    backend.allocate(sizing)
    # A 16-token budget splits each ~20-token prompt into chunks that run beside decodes.
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16), kv, ())
    prompts = [lm.tokenizer.encode("The key-value cache stores, for every past token, the keys"),
               lm.tokenizer.encode("Paged attention splits the cache into fixed-size blocks so")]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    sampler = RecordingSampler()
    engine = Engine(lm.model, backend, sched, sampler, MetricsCollector(kv, sched, 1), CPU)
    engine.run(FixedRequests([Request(i, p, params) for i, p in enumerate(prompts)]))

    assert any(s.decode_tokens and s.prefill_tokens for s in engine.metrics.steps), \
        "the test must mix a prefill chunk and decodes in one step"
    for rid, prompt in enumerate(prompts):
        full = prompt + engine.metrics.outputs()[rid]
        with torch.no_grad():
            ref = smollm2_transformers(torch.tensor([full[:-1]])).logits[0].float()
        ours = torch.stack(sampler.rows[rid])
        assert ours.shape[0] == params.max_tokens
        theirs = ref[len(prompt) - 1:]
        assert (ours - theirs).abs().max().item() <= 1e-4
