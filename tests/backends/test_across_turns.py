"""Compression across turns through the real engine (issue #59, harness/kv/compressed.py):
a later turn that starts with an earlier turn's tokens hits that turn's compressed state
and gets the tokens a brute force gives (the model run densely in float32, attending to
what the method kept of the first prompt and everything after it); the same method
re-applied per turn (prefix caching off) gets the brute force of one compression of the
whole prompt; per head (duo_attention), a hit attends per head to what each head kept.
Hit rates per turn: above 0 on later turns for the compress-once methods, 0 for h2o and
tova (they re-score every step)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from harness.kv.evicting import EvictingKVManager
from harness.runner import run
from tests.compose import compose_cfg, model_stack

# Two turns about one 600-token context (noise haystack: the byte tokenizer's prompts).
TURNS = ["model=tiny", "workload=shared_context", "workload.contexts=1", "workload.turns=2",
         "workload.length=600", "workload.haystack=noise", "workload.answer_tokens=8",
         "cache.kv_budget=2MiB", "backend.block_size=16", "quality.generation_agreement=false"]


class DenseReference:
    """The model's forward with plain float32 attention over every position computed so
    far, but for the positions each (layer, KV head) dropped (``gone[layer][kv_head]``:
    what the method dropped there); keeps each layer's keys for the brute-force score."""

    def __init__(self, model: Any) -> None:
        self.model = model
        c = model.config
        self.k: list[torch.Tensor] = [torch.zeros(0, c.num_kv_heads, c.head_dim)
                                      for _ in range(c.num_layers)]
        self.v = [t.clone() for t in self.k]
        self.gone: list[list[set[int]]] = [[set() for _ in range(c.num_kv_heads)]
                                           for _ in range(c.num_layers)]

    def dropped(self, layer: int, kv_head: int) -> set[int]:
        return self.gone[layer][kv_head]

    @property
    def computed(self) -> int:
        return self.k[0].shape[0]

    def _attend(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> torch.Tensor:
        start = self.computed if layer == 0 else self.k[layer].shape[0]
        self.k[layer] = torch.cat([self.k[layer], k.float()])
        self.v[layer] = torch.cat([self.v[layer], v.float()])
        n, ctx = q.shape[0], self.k[layer].shape[0]
        kv_heads = self.k[layer].shape[1]
        kpos = torch.arange(ctx)
        seen = torch.ones(kv_heads, ctx, dtype=torch.bool)
        for h in range(kv_heads):
            seen[h, list(self.gone[layer][h])] = False
        causal = kpos[None, :] <= torch.arange(start, start + n)[:, None]  # (n, ctx)
        mask = (causal[None] & seen[:, None, :]).repeat_interleave(q.shape[1] // kv_heads, 0)
        out = F.scaled_dot_product_attention(
            q.float().transpose(0, 1)[None], self.k[layer].transpose(0, 1)[None],
            self.v[layer].transpose(0, 1)[None], attn_mask=mask[None], enable_gqa=True)
        return out[0].transpose(0, 1).to(q.dtype)

    def feed(self, tokens: list[int]) -> torch.Tensor:
        """Run ``tokens`` at the next positions; the last one's logits (vocab,)."""
        start = self.computed
        ids = torch.tensor(tokens, dtype=torch.int64)
        pos = torch.arange(start, start + len(tokens))
        return self.model.forward(ids, pos, self._attend)[-1]

    def knorm_drop(self, prompt_len: int, keep: int) -> None:
        """knorm's selection at the prompt's end, spelled out: each position's score is
        minus its key norm, averaged over KV heads and layers; the lowest go (ties: the
        earlier position, as the manager's stable order over slots in position order)."""
        score = sum(-self.k[layer][:prompt_len].norm(dim=-1).mean(dim=-1)
                    for layer in range(len(self.k))) / len(self.k)
        order = sorted(range(prompt_len), key=lambda j: (float(score[j]), j))
        for per_layer in self.gone:
            for gone in per_layer:
                gone |= set(order[:prompt_len - keep])

    def duo_drop(self, prompt_len: int, streaming: list[bool], sink: int,
                 recent: int) -> None:
        """DuoAttention's rule at the prompt's end: each streaming (layer, KV head), in
        layer-major order, drops the prompt's positions [sink, prompt_len - recent)."""
        kv_heads = self.k[0].shape[1]
        for i, s in enumerate(streaming):
            if s:
                self.gone[i // kv_heads][i % kv_heads] |= set(range(sink, prompt_len - recent))

    def check_greedy(self, first: torch.Tensor, answer: list[int]) -> None:
        """``answer`` is the greedy continuation from logits ``first`` (each token within
        float32 noise of the maximum), fed back token by token."""
        logits = first
        for i, t in enumerate(answer):
            assert float(logits[t]) >= float(logits.max()) - 1e-3, (i, t, int(logits.argmax()))
            if i + 1 < len(answer):
                logits = self.feed([t])


def _two_turns(caching: bool) -> tuple[Any, Any, Any]:
    target, wl, st = model_stack([*TURNS, "backend=knorm", "backend.budget_ratio=0.25",
                                  f"cache.enable_prefix_caching={str(caching).lower()}"])
    st.engine.run(wl)
    return target.loaded.model, wl, st


def _kept_positions(kv: EvictingKVManager, tokens: list[int], covered: int) -> set[int]:
    p = kv.index.lookup(tokens, covered, None)
    assert p is not None and p.covered == covered
    bs = kv.block_size
    slots = [b * bs + i for b in p.blocks for i in range(bs)]
    return {int(x) for x in kv._pos[slots] if x >= 0}


def test_a_hit_gives_the_tokens_of_the_recomputed_compressed_prefix() -> None:
    model, wl, st = _two_turns(caching=True)
    outs = st.collector.outputs()
    p1, p2, a1, a2 = wl._prompts[0], wl._prompts[1], outs[0], outs[1]
    covered = len(p1) + len(a1) - 1  # turn 1's computed tokens: its prompt, its answer's
    assert p2[:covered] == p1 + a1[:-1]
    kv = st.kv
    assert isinstance(kv, EvictingKVManager)
    # Turn 2 hit turn 1's state: every one of those tokens spared, none of turn 1's own.
    hits = dict(zip(st.collector.rows.column("request_id"),
                    st.collector.rows.column("prefix_hit_tokens")))
    assert hits == {0: 0, 1: covered}
    keep = st.backend.policy.keep(len(p1))
    ref = DenseReference(model)
    first = ref.feed(p1)
    ref.knorm_drop(len(p1), keep)
    # The state the engine kept is the brute force's: knorm's top `keep` of the prompt.
    kept = _kept_positions(kv, p2, covered)
    assert {j for j in kept if j < len(p1)} == set(range(len(p1))) - ref.dropped(0, 0)
    assert {j for j in kept if j >= len(p1)} == set(range(len(p1), covered))
    ref.check_greedy(first, a1)
    # Turn 2 from that state, its prompt not compressed again: the rest of it is fed
    # through the same mask (everything after the first prompt is kept).
    ref.check_greedy(ref.feed(p2[covered:]), a2)
    assert st.scheduler.recomputed_tokens == 0


def test_re_applied_per_turn_is_one_compression_of_the_whole_prompt() -> None:
    model, wl, st = _two_turns(caching=False)
    outs = st.collector.outputs()
    p2, a2 = wl._prompts[1], outs[1]
    assert list(st.collector.rows.column("prefix_hit_tokens")) == [0, 0]
    ref = DenseReference(model)
    first = ref.feed(p2)
    ref.knorm_drop(len(p2), st.backend.policy.keep(len(p2)))
    ref.check_greedy(first, a2)


DUO = ["backend=duo_attention", "backend.sink_tokens=8", "backend.recent=32",
       "backend.calibration_tokens=128"]


def test_a_per_head_hit_gives_the_tokens_of_the_recomputed_compressed_prefix() -> None:
    """duo_attention on the per-head tables (harness.kv.headwise): turn 2 copies each
    head's kept pages of turn 1 and attends per head to what that head kept."""
    target, wl, st = model_stack([*TURNS, *DUO, "cache.enable_prefix_caching=true"])
    st.engine.run(wl)
    outs = st.collector.outputs()
    p1, p2, a1, a2 = wl._prompts[0], wl._prompts[1], outs[0], outs[1]
    covered = len(p1) + len(a1) - 1
    hits = dict(zip(st.collector.rows.column("request_id"),
                    st.collector.rows.column("prefix_hit_tokens")))
    assert hits == {0: 0, 1: covered}
    streaming = st.backend.policy.streaming.tolist()
    assert any(streaming) and not all(streaming)
    ref = DenseReference(target.loaded.model)
    first = ref.feed(p1)
    ref.duo_drop(len(p1), streaming, 8, 32)
    # The kept prefix's heads hold the brute force's positions, each in index order.
    p = st.kv.index.lookup(p2, covered, None)
    assert p is not None and p.covered == covered
    kv_heads = ref.k[0].shape[1]
    for i, kept in enumerate(p.state.kept):
        want = sorted(set(range(len(p1))) - ref.dropped(i // kv_heads, i % kv_heads))
        assert kept.tolist() == want, i
        assert int(p.state.count[i]) == len(want) + covered - len(p1)
    ref.check_greedy(first, a1)
    ref.check_greedy(ref.feed(p2[covered:]), a2)


@pytest.mark.parametrize("backend,reused", [
    ("knorm", True), ("snapkv", True), ("keydiff", True), ("observed_attention", True),
    ("expected_attention", True), ("pyramidkv", True), ("adakv", True),
    ("duo_attention", True), ("h2o", False), ("tova", False)])
def test_later_turns_hit_the_compressed_context(backend: str, reused: bool) -> None:
    own = DUO[1:] if backend == "duo_attention" else \
        ["backend.window=16"] if backend in ("pyramidkv", "adakv") else []
    r = run(compose_cfg([*TURNS, "workload.turns=3", f"backend={backend}", *own,
                         "cache.enable_prefix_caching=true"]))
    m = r.metrics
    assert m["run.prefix_caching"] is reused
    assert m["cache.turn.0.hit_rate"] == 0.0  # one context: nothing to hit yet
    for k in (1, 2):
        rate = m[f"cache.turn.{k}.hit_rate"]
        # A later turn's prompt is the earlier turn's computed tokens + ~120 new ones.
        assert (rate > 0.75) if reused else rate == 0.0, (k, rate)
        assert 0.0 <= m[f"quality.turn.{k}.accuracy"] <= 1.0
    assert m["requests.finished"] == 3
