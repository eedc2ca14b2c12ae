"""Brute-force references for the per-head methods (pyramidkv, adakv, duo_attention),
written position by position and head by head, for the tests to hold the backends to."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from harness.kv.headwise import HeadwiseKVManager
from harness.sched.sequence import Sequence
from tests.backend_steps import NUM_HEADS, Driver, StepOut


def snapkv_scores(d: Driver, seq_id: int, q: dict[int, list[torch.Tensor]], p: int,
                  window: int, kernel: int) -> np.ndarray:
    """kvpress's SnapKVPress.score, one (layer, KV head) at a time: each window query's
    causal softmax over every key before it, the weights on the keys before the window
    averaged over the window's queries, average-pooled over ``kernel`` positions with
    zero padding counted, averaged over the KV head's query heads. ``q[t][layer]``: the
    (H, D) query at position t. -> float64 (layers * KV heads, p - window)."""
    lay = d.layout
    g = NUM_HEADS // lay.num_kv_heads
    lo, half = p - window, kernel // 2
    out = np.zeros((lay.num_layers * lay.num_kv_heads, lo))
    for layer in range(lay.num_layers):
        keys = d.k[seq_id][layer].double()
        for kv in range(lay.num_kv_heads):
            per_head = []
            for h in range(kv * g, (kv + 1) * g):
                s = torch.zeros(lo, dtype=torch.float64)
                for t in range(lo, p):
                    logits = keys[:t + 1, kv] @ q[t][layer][h].double() / lay.head_dim ** 0.5
                    s += torch.softmax(logits, 0)[:lo]
                s /= window
                pooled = [float(s[max(0, j - half):j + half + 1].sum()) / kernel
                          for j in range(lo)]
                per_head.append(pooled)
            out[layer * lay.num_kv_heads + kv] = np.mean(per_head, axis=0)
    return out


def prefill_recording(d: Driver, seq: Sequence, chunks: list[int],
                      observe: bool = True) -> dict[int, list[torch.Tensor]]:
    """Prefill ``seq`` in ``chunks``; each position's query per layer."""
    q: dict[int, list[torch.Tensor]] = {}
    for n in chunks:
        start = seq.num_computed
        out = d.step([(seq, n)], observe=observe)
        rows = out.rows[seq.seq_id]
        for i in range(n):
            q[start + i] = [ql[rows.start + i] for ql in out.q]
    return q


def check_decode(d: Driver, seq: Sequence, out: StepOut) -> None:
    """``out``'s rows of ``seq`` (a decode) equal each query head attending, in float64,
    to exactly the positions its KV head holds (the KV manager's view)."""
    kv = d.kv
    assert isinstance(kv, HeadwiseKVManager)
    lay = d.layout
    g = NUM_HEADS // lay.num_kv_heads
    pos = kv.positions(seq)
    row = out.rows[seq.seq_id].start
    for layer in range(lay.num_layers):
        got = out.out[layer][row]
        for h in range(NUM_HEADS):
            kvh = h // g
            held = torch.as_tensor(pos[layer * lay.num_kv_heads + kvh])
            k = d.k[seq.seq_id][layer, held, kvh].double()
            v = d.v[seq.seq_id][layer, held, kvh].double()
            w = torch.softmax(k @ out.q[layer][row, h].double() / lay.head_dim ** 0.5, 0)
            torch.testing.assert_close(got[h].double(), w @ v, atol=1e-5, rtol=1e-5)


def check_books(kv: HeadwiseKVManager, live: list[Sequence]) -> None:
    """The manager's books against a recount from its tables: each page's references
    are the tables holding it, its fill the tokens they put there, each block's pool fill
    the head-tokens of its pages over the heads (rounded down), a block held exactly
    while one of its pages is."""
    h, bs = kv.heads, kv.block_size
    ref = np.zeros_like(kv.ref)
    fill = np.zeros_like(kv.fill)
    for s in live:
        st = kv._seqs[s.seq_id]
        for i, pages in enumerate(st.pages):
            n = int(st.count[i])
            assert len(pages) == -(-n // bs)
            for j, p in enumerate(pages):
                ref[p] += 1
                fill[p] = min(bs, n - j * bs)
    assert (ref == kv.ref).all()
    assert (fill[ref > 0] == kv.fill[ref > 0]).all()
    held = ref.reshape(-1, h).any(axis=1)
    for b in range(kv.pool.num_blocks):
        assert (kv.pool.ref[b] > 0) == held[b], b
        if held[b]:
            assert kv.pool.fill[b] == int(fill[b * h:(b + 1) * h][ref[b * h:(b + 1) * h] > 0]
                                          .sum()) // h
    assert kv.pages_free() == kv.pool.num_blocks * h - int((ref > 0).sum())


# The "frees memory" comparisons every per-head method's tests make with paged: the same
# long prompts under one tight budget on the real engine, and the same batch in the
# what-if. Paged's side is run once per process (it does not depend on the method).
LONG_PROMPTS = ("model=tiny", "workload=random", "workload.num_requests=12",
                "workload.distribution=uniform", "workload.input_min=300",
                "workload.input_max=400", "workload.output_min=8", "workload.output_max=16",
                "workload.rate=0", "cache.kv_budget=512KiB", "backend.block_size=8")
WHATIF_PROMPT, WHATIF_OUTPUT = 1000, 32
WHATIF = ("executor=roofline", "roofline.model=Llama-3.1-8B", "roofline.hardware=h100-sxm",
          "workload=random", "workload.num_requests=12", "workload.distribution=uniform",
          f"workload.input_min={WHATIF_PROMPT}", f"workload.input_max={WHATIF_PROMPT}",
          f"workload.output_min={WHATIF_OUTPUT}", f"workload.output_max={WHATIF_OUTPUT}",
          "workload.rate=0", "cache.kv_budget=512MiB")


@functools.cache
def _metrics(overrides: tuple[str, ...]) -> dict[str, Any]:
    from harness.runner import run
    from tests.compose import compose_cfg

    return run(compose_cfg(list(overrides))).metrics


def against_paged(*method: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(paged's metrics, the method's) on :data:`LONG_PROMPTS` (``method``: its
    backend=... and options), paged without prefix caching as the method runs."""
    paged = _metrics(("backend=paged", "cache.enable_prefix_caching=false", *LONG_PROMPTS))
    return paged, _metrics((*method, *LONG_PROMPTS))


def against_paged_in_the_what_if(backend: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(paged's metrics, ``backend``'s) on :data:`WHATIF` (executor=roofline)."""
    return (_metrics((*WHATIF, "backend=paged")),
            _metrics((*WHATIF, f"backend={backend}")))

