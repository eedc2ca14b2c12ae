"""kvbench's per-position scores against kvpress's on the same layer inputs.

The inputs are a fixture recorded by scripts/peer/kvpress_side.py (``--fixture``): for two
layers of a short prompt, the post-RoPE queries (T, H, D), keys and values (T, KV, D) and
attention weights (H, T, T) that kvpress's presses scored, and each press's scores (KV, T).
Each kvbench method is run on the same tensors through its own code (the backend's
``score``, ``weights``, ``pool``, ``expected``), and compared after the documented
constant: kvbench keeps one score per token (a slot holds a token for every layer and head),
so kvpress's (KV, T) is averaged over KV heads; kvbench divides by the layer count where it
sums over layers (undone here); snapkv sums over the window's queries and the query heads
where kvpress averages (a constant factor, fitted and reported). Positions kvpress pads
(snapkv's window, tova's last token, expected attention's sinks) are left out.

pyramidkv and adakv rank each KV head by SnapKV's score (kvpress's PyramidKVPress is a
SnapKVPress, AdaKVPress wraps one): the fixture's snapkv scores, per KV head as kvpress
gives them (not averaged), against backends/headwise.py's ``snapkv_head_scores`` of the
same window's weights (both average over the window's queries: constant 1).
duo_attention has no score to compare: its heads are measured by kvbench's own criterion
(backends/duo_heads.py; kvpress loads published patterns), and scripts/peer_kvpress.sh
gives kvpress's press kvbench's heads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from harness.backends.base import KVLayout
from harness.backends.expected_attention import ExpectedAttentionBackend, rotate
from harness.backends.headwise import snapkv_head_scores
from harness.backends.keydiff import KeyDiffBackend
from harness.backends.knorm import KnormBackend
from harness.backends.observed_attention import ObservedAttentionBackend
from harness.backends.snapkv import SnapKVBackend
from harness.backends.tova import TOVABackend

CPU = torch.device("cpu")


@dataclass
class ScoreCheck:
    method: str
    layer: int
    rel_error: float  # max |kvbench - c * kvpress| / max |kvbench|
    constant: float  # c: kvbench / kvpress (1 where nothing differs but the mean)
    positions: int


def _compare(method: str, layer: int, ours: torch.Tensor, ref: torch.Tensor) -> ScoreCheck:
    ours, ref = ours.double().flatten(), ref.double().flatten()
    c = float((ours @ ref) / (ref @ ref))  # least squares: ours ~ c * ref
    err = float((ours - c * ref).abs().max() / ours.abs().max())
    return ScoreCheck(method, layer, err, c, ours.numel())


def check_scores(fixture: dict[str, Any]) -> list[ScoreCheck]:
    """One :class:`ScoreCheck` per (method, recorded layer)."""
    meta = fixture["meta"]
    num_layers = int(meta["num_layers"])
    out: list[ScoreCheck] = []
    for key, rec in fixture.items():
        if key == "meta":
            continue
        layer = int(key)
        q, k, v = rec["q"].float(), rec["k"].float(), rec["v"].float()
        t, kv_heads, d = k.shape
        layout = KVLayout(num_layers, kv_heads, d, torch.float32,
                          tuple(meta["inv_freq"].tolist()))
        ref = {m: s.double().mean(dim=0) for m, s in rec["scores"].items()}  # (T,)
        # Query-agnostic scores: the keys alone.
        for name, cls in (("knorm", KnormBackend), ("keydiff", KeyDiffBackend)):
            be = cls(layout, CPU, budget=8, budget_ratio=0.0)
            out.append(_compare(name, layer, be.score(None, k) * num_layers, ref[name]))
        # The attention weights, as kvbench computes them (float32 softmax, causal).
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        tova = TOVABackend(layout, CPU, budget=8, budget_ratio=0.0)
        w = tova.weights(q[None], k[None], causal[None])  # (1, KV, G, T, T)
        ours = tova.score(w, k[None])[0] * num_layers
        out.append(_compare("tova", layer, ours[:-1], ref["tova"][:-1]))
        obs = ObservedAttentionBackend(layout, CPU, budget=8, budget_ratio=0.0)
        seen = torch.arange(t, 0, -1, dtype=torch.float64)  # queries that saw each key
        ours = obs.score(w, k[None])[0].double() * num_layers / seen
        out.append(_compare("observed_attention", layer, ours, ref["observed_attention"]))
        # snapkv: the window's queries over the keys before it, pooled (avg, as kvpress).
        win, kern = int(meta["snapkv"]["window"]), int(meta["snapkv"]["kernel"])
        snap = SnapKVBackend(layout, CPU, budget=8, budget_ratio=0.0, window=win,
                             pool_width=kern, pooling="avg")
        ww = w[0][:, :, t - win:, :t - win]  # (KV, G, W, T - W)
        acc = snap.score(ww, k[:t - win])[None]  # (1, H, T - W)
        out.append(_compare("snapkv", layer, snap.pool(acc), ref["snapkv"][:t - win]))
        # pyramidkv, adakv: the same window's score, per KV head.
        per_head = snapkv_head_scores(acc, win, kern, "avg", kv_heads)  # (KV, T - W)
        theirs = rec["scores"]["snapkv"].double()[:, :t - win]
        for name in ("pyramidkv", "adakv"):
            out.append(_compare(name, layer, per_head, theirs))
        # expected attention: the statistics of the pre-RoPE queries past the sinks.
        ea = meta["expected_attention"]
        sink, future = int(ea["n_sink"]), int(ea["n_future_positions"])
        exp = ExpectedAttentionBackend(layout, CPU, budget=8, budget_ratio=0.0, n_sink=sink,
                                       n_future_positions=future)
        inv = torch.tensor(layout.rope_inv_freq, dtype=torch.float64)
        pre = rotate(q[sink:].double(), inv, torch.arange(sink, t), sign=-1.0)  # (m, H, D)
        st = [torch.full((num_layers,), float(pre.shape[0]), dtype=torch.float64),
              pre.sum(0).expand(num_layers, -1, -1).clone(),
              torch.einsum("mhi,mhj->hij", pre, pre).expand(num_layers, -1, -1, -1).clone()]
        ours = exp.expected(k[sink:].double(), v[sink:].double(), st, 0, t) * num_layers
        out.append(_compare("expected_attention", layer, ours, ref["expected_attention"][sink:]))
    return out
