"""`expected_attention`: keep the tokens future queries are expected to attend to (kvpress's
ExpectedAttentionPress; Devoto et al., 2025, "Expected Attention: KV Cache Compression by
Estimating Attention from Future Queries Distribution").

The prompt's queries before RoPE (the post-RoPE queries the model hands the backend,
rotated back by their positions, which needs the model's RoPE speeds:
``KVLayout.rope_inv_freq``) give, per layer and query head, a mean ``mu`` and a covariance
``S`` (the first ``n_sink`` positions left out, as outliers); both are moved by the average
rotation ``R`` of the next ``n_future_positions`` positions (``mu R^T``, ``R S R^T``).
Attention ``exp(q.k / sqrt(d))`` of a Gaussian query then has the expectation
``exp(k.mu / sqrt(d) + k^T S k / (2 d))``: softmax over the held keys, averaged over the
query heads of each KV head, times each value's norm (``use_vnorm``), averaged over KV
heads and layers (one slot holds a token for all of them). The first ``n_sink`` tokens
rank above every other (kvpress pads them with the maximum score): they go only when the
budget is smaller than they are. Scored on the scorer seam
(backends/scored.py) with ``reads = "held"``: every held key at once, at the prompt's end
(``prefill=full``, kvpress's trigger; the kept tokens compacted, what is generated kept)
or after every chunk (``streaming``: the statistics of the queries so far).

The query statistics are per-sequence scratch beside the cache while a prompt is read
(layers x heads x head_dim^2 floats: 4.4 MiB for SmolLM2-135M), not charged to the budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from harness.backends.base import KVLayout, PrefillChunk
from harness.backends.scored import PressOptions, ScoredBackend
from harness.errors import UserError
from harness.kv.policies.budget import PressPolicy
from harness.model.rope import rotate_pairs

if TYPE_CHECKING:
    from harness.sched.sequence import Sequence


@dataclass
class ExpectedAttentionOptions(PressOptions):
    n_future_positions: int = 512  # the future queries' positions averaged over
    n_sink: int = 4  # first tokens: never evicted, and their queries left out
    use_covariance: bool = True  # the queries' covariance term (else the mean only)
    use_vnorm: bool = True  # scores times each value's L2 norm

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_future_positions < 1 or self.n_sink < 0:
            raise UserError(f"need backend.n_future_positions >= 1 and backend.n_sink >= 0, "
                            f"got {self.n_future_positions} and {self.n_sink}")


class ExpectedAttentionPolicy(PressPolicy):
    name = "expected_attention"

    def __init__(self, opts: Any) -> None:
        super().__init__(opts)
        self.n_sink = int(opts.n_sink)

    def rank(self, seq: Sequence, slots: np.ndarray, positions: np.ndarray) -> np.ndarray:
        # The sinks rank above every scored token (kvpress pads them with the maximum
        # score + 1), the earliest highest: they go only when the budget is below them.
        r = np.array(self.scores[slots], dtype=np.float64)
        sink = positions < self.n_sink
        if sink.any():
            top = float(r[~sink].max()) if (~sink).any() else 0.0
            r[sink] = top + 1.0 + (self.n_sink - positions[sink])
        return r


def rotate(x: torch.Tensor, inv_freq: torch.Tensor, positions: torch.Tensor,
           sign: float = 1.0) -> torch.Tensor:
    """x (T, H, D) rotated by each row's position (``sign=-1``: back), rotate-half RoPE
    (the model's own arithmetic, harness.model.rope.rotate_pairs)."""
    f = positions.to(x.device, torch.float64)[:, None] \
        * inv_freq[None, :].to(x.device, torch.float64)
    cos, sin = f.cos()[:, None, :].to(x.dtype), (sign * f.sin())[:, None, :].to(x.dtype)
    return rotate_pairs(x, cos, sin)


def average_rotation(inv_freq: torch.Tensor, start: int, n: int) -> torch.Tensor:
    """The mean over positions ``start .. start+n-1`` of RoPE's rotation matrix (D, D),
    float64: ``R q`` rotates q as ``rotate`` does."""
    half, dev = inv_freq.shape[0], inv_freq.device
    f = torch.arange(start, start + n, dtype=torch.float64, device=dev)[:, None] \
        * inv_freq[None, :].to(torch.float64)
    c, s = f.cos().mean(0), f.sin().mean(0)  # (half,)
    r = torch.zeros(2 * half, 2 * half, dtype=torch.float64, device=dev)
    idx = torch.arange(half, device=dev)
    r[idx, idx] = c
    r[idx + half, idx + half] = c
    r[idx, idx + half] = -s
    r[idx + half, idx] = s
    return r


class ExpectedAttentionBackend(ScoredBackend):
    name = "expected_attention"
    Options = ExpectedAttentionOptions
    Policy = ExpectedAttentionPolicy
    reads = "held"

    def __init__(self, layout: KVLayout, device: torch.device, **options: Any) -> None:
        super().__init__(layout, device, **options)
        o = self.opts
        assert isinstance(o, ExpectedAttentionOptions)
        self.n_future, self.n_sink = o.n_future_positions, o.n_sink
        self.use_cov, self.use_vnorm = o.use_covariance, o.use_vnorm
        # On the cache's device, as the statistics (the counts stay on the host).
        self.inv_freq = torch.tensor(layout.rope_inv_freq, dtype=torch.float64, device=device)
        # seq id -> [count, sum of q (layers, H, D), sum of q q^T (layers, H, D, D)], f64
        self._qstats: dict[int, list[Any]] = {}

    def after_chunk(self, layer: int, q: torch.Tensor, c: PrefillChunk,
                    slots: torch.Tensor) -> None:
        self.observe_queries(layer, q, c)  # before the held keys are scored with them
        super().after_chunk(layer, q, c, slots)

    def observe_queries(self, layer: int, q: torch.Tensor, c: PrefillChunk) -> None:
        """Add this chunk's prompt queries at positions >= n_sink, rotated back to before
        RoPE, to the sequence's sums (q: (n, H, D), post-RoPE)."""
        if not self.inv_freq.numel():
            raise UserError("backend=expected_attention needs the model's RoPE (its query "
                            "statistics are taken before rotation); this layout has none")
        seq = c.sched.seq
        p = seq.num_prompt_tokens
        lo, hi = max(c.start, self.n_sink), min(c.start + c.num_tokens, p)
        if layer == self.first_scored and c.start == 0:
            self._qstats.pop(seq.seq_id, None)  # a prompt (re)starts: fresh statistics
        if hi <= lo or not self.selects(seq):
            return  # no prompt query here, or a prompt within its budget: never scored
        pre = rotate(q[lo - c.start:hi - c.start].to(torch.float64), self.inv_freq,
                     torch.arange(lo, hi, device=q.device), sign=-1.0)  # (m, H, D)
        st = self._qstats.get(seq.seq_id)
        if st is None:
            lay, h, d = self.layout.num_layers, q.shape[1], q.shape[2]
            dev = self.device
            st = [torch.zeros(lay, dtype=torch.float64),
                  torch.zeros(lay, h, d, dtype=torch.float64, device=dev),
                  torch.zeros(lay, h, d, d, dtype=torch.float64, device=dev)]
            self._qstats[seq.seq_id] = st
        st[0][layer] += pre.shape[0]
        st[1][layer] += pre.sum(0)
        if self.use_cov:
            st[2][layer] += torch.einsum("mhi,mhj->hij", pre, pre)

    def held_scores(self, layer: int, c: PrefillChunk,
                    held: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seq = c.sched.seq
        cand = held[self.slot_pos[held] >= self.n_sink]  # the sinks rank first, unscored
        st = self._qstats.get(seq.seq_id)
        scores = torch.zeros(0, dtype=torch.float32, device=self.device)
        if st is not None and float(st[0][layer]) > 0 and cand.numel():
            k, v = self.gather(layer, cand, torch.float64)  # (T, KV, D)
            scores = self.expected(k, v, st, layer, c.start + c.num_tokens).float()
        else:
            cand = cand[:0]
        if layer == self.last_scored and c.start + c.num_tokens >= seq.num_prompt_tokens:
            self._qstats.pop(seq.seq_id, None)  # the prompt's statistics are spent
        return cand, scores

    def expected(self, k: torch.Tensor, v: torch.Tensor, st: list[Any], layer: int,
                 q_len: int) -> torch.Tensor:
        """k, v (T, KV, D) float64 held keys and values -> (T,) this layer's scores."""
        n = float(st[0][layer])
        mu = st[1][layer] / n  # (H, D)
        r = average_rotation(self.inv_freq, q_len, self.n_future)
        mu = mu @ r.T
        kv_heads, d = self.layout.num_kv_heads, self.layout.head_dim
        g = mu.shape[0] // kv_heads
        kh = k.repeat_interleave(g, dim=1)  # (T, H, D), query head h reads KV head h // g
        logits = torch.einsum("thd,hd->ht", kh, mu) / math.sqrt(d)
        if self.use_cov:
            cov = st[2][layer] / n - mu_outer(st[1][layer] / n)  # population covariance
            cov = r @ cov @ r.T
            logits = logits + torch.einsum("thi,hij,thj->ht", kh, cov, kh) / d / 2
        w = torch.softmax(logits, dim=-1).view(kv_heads, g, -1).mean(dim=1)  # (KV, T)
        if self.use_vnorm:
            w = w * v.norm(dim=-1).T
        return w.mean(dim=0) / self.layout.num_layers

    def score(self, w: torch.Tensor | None, k: torch.Tensor) -> torch.Tensor:
        raise AssertionError("expected_attention scores in score_held (it needs the "
                             "sequence's query statistics)")


def mu_outer(mu: torch.Tensor) -> torch.Tensor:
    """(H, D) -> (H, D, D): each head's mean times itself."""
    return torch.einsum("hi,hj->hij", mu, mu)
