"""adakv: the selection is kvpress's AdaKVPress.compress (transcribed, on random scores);
what each head keeps after a prompt equals a brute-force AdaKV over the window queries'
SnapKV scores, heads keeping different counts under one total per layer; decodes attend
to exactly each head's tokens; more sequences run than paged's at the same budget."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harness.config import run_config
from harness.errors import UserError
from harness.kv.headwise import HeadwiseKVManager
from harness.kv.policies.adakv import adakv_keep
from tests.backend_steps import Driver
from tests.backends.headwise_ref import (
    against_paged,
    against_paged_in_the_what_if,
    check_books,
    check_decode,
    prefill_recording,
    snapkv_scores,
)
from tests.compose import compose_cfg

BS = 8


def kvpress_adakv_pruned(scores: torch.Tensor, compression_ratio: float,
                         alpha_safeguard: float) -> torch.Tensor:
    """NVIDIA/kvpress, kvpress/presses/adakv_press.py, ``AdaKVPress.compress`` at commit
    8bb29b9c3078452a86d692f29123fa6c793e2b05, from the press's scores on, verbatim but
    for returning the (batch, head, position) indices it masks as a bool mask of what
    stays. scores: (bsz, num_key_value_heads, k_len)."""
    bsz, num_key_value_heads, k_len = scores.shape
    n_kept = int(k_len * (1 - compression_ratio))  # ScorerPress definition
    n_safe = int(n_kept * alpha_safeguard)
    top_indices = torch.topk(scores, n_safe, dim=-1).indices
    scores.scatter_(-1, top_indices, torch.finfo(scores.dtype).max)
    n_pruned = num_key_value_heads * (k_len - n_kept)
    indices = torch.topk(-scores.reshape(bsz, -1), n_pruned, dim=1).indices.flatten()
    batch_indices = torch.arange(bsz).repeat_interleave(n_pruned)
    head_indices = indices // k_len
    seq_indices = indices % k_len
    keep = torch.ones(bsz, num_key_value_heads, k_len, dtype=torch.bool)
    keep[batch_indices, head_indices, seq_indices] = False
    return keep


@pytest.mark.parametrize("kv,k_len,ratio,alpha", [(2, 64, 0.75, 0.2), (4, 100, 0.5, 0.2),
                                                  (8, 37, 0.9, 0.5), (3, 80, 0.25, 0.0),
                                                  (4, 50, 0.8, 1.0)])
def test_selection_is_kvpress_adakv(kv: int, k_len: int, ratio: float, alpha: float) -> None:
    gen = torch.Generator().manual_seed(kv * k_len)
    # Each head's scores on its own scale: flat heads lose more than peaked ones.
    scores = torch.rand(1, kv, k_len, generator=gen, dtype=torch.float64) \
        * torch.logspace(-2, 0, kv, dtype=torch.float64)[None, :, None]
    want = kvpress_adakv_pruned(scores.clone(), ratio, alpha)[0].numpy()
    got = adakv_keep(scores[0].numpy(), int(k_len * (1 - ratio)), alpha)
    assert (got == want).all()
    counts = got.sum(axis=1)
    assert counts.sum() == kv * int(k_len * (1 - ratio))
    if alpha < 1.0 and kv > 2:
        assert len(set(counts.tolist())) > 1  # adaptive: the heads' counts differ


def _brute_force_adakv(scores: np.ndarray, p: int, window: int, n_kept: int, alpha: float,
                       kv: int) -> list[set[int]]:
    """AdaKV spelled out per layer: the window at the layer's highest score + 1, each
    head's top int(n_kept * alpha) protected, then the layer's lowest kv * (p - n_kept)
    (head, position) pairs dropped, ties to the lower head and earlier position."""
    kept: list[set[int]] = []
    for layer in range(scores.shape[0] // kv):
        s = scores[layer * kv:(layer + 1) * kv]
        pad = s.max() + 1
        full = [[*s[h].tolist(), *[pad] * window] for h in range(kv)]
        safe = int(n_kept * alpha)
        for h in range(kv):
            top = sorted(range(p), key=lambda j, h=h: (-full[h][j], j))[:safe]
            for j in top:
                full[h][j] = float("inf")
        pairs = sorted((full[h][j], h, j) for h in range(kv) for j in range(p))
        gone = {(h, j) for _, h, j in pairs[:kv * (p - n_kept)]}
        kept += [{j for j in range(p) if (h, j) not in gone} for h in range(kv)]
    return kept


@pytest.mark.parametrize("chunks", [[100], [50, 45, 5]])
def test_each_head_keeps_a_brute_force_adakv(chunks: list[int]) -> None:
    p, window, kernel, n_kept, alpha = 100, 8, 5, 30, 0.2
    opts = {"budget": n_kept, "budget_ratio": 0.0, "window": window, "pool_width": kernel,
            "alpha_safeguard": alpha}
    d = Driver("adakv", block_size=BS, options=opts, seed=10 + len(chunks))
    kv = d.kv
    assert isinstance(kv, HeadwiseKVManager)
    s = d.add(p, max_tokens=8)
    q = prefill_recording(d, s, chunks)
    scores = snapkv_scores(d, s.seq_id, q, p, window, kernel)
    want = _brute_force_adakv(scores, p, window, n_kept, alpha, d.layout.num_kv_heads)
    held = kv.positions(s)
    for head in range(kv.heads):
        assert set(held[head].tolist()) == want[head], head
    counts = [len(h) for h in held]
    assert counts[0] + counts[1] == counts[2] + counts[3] == 2 * n_kept  # per layer
    assert len(set(counts)) > 1  # the heads' budgets differ
    check_books(kv, [s])
    for _ in range(3):
        check_decode(d, s, d.step([(s, 1)]))
    check_books(kv, [s])


def test_freed_pages_let_more_sequences_run_than_paged() -> None:
    paged, ada = against_paged("backend=adakv", "backend.window=16")
    assert ada["requests.finished"] == paged["requests.finished"] == 12
    assert ada["memory.max_running_seqs"] > paged["memory.max_running_seqs"]
    assert ada["cache.evicted_tokens"] > 0


def test_the_what_if_runs_it_and_frees_the_same() -> None:
    # executor=roofline: no scores (all equal: a stand-in), the same total per layer:
    # 8 KV heads x 200 of 1000 (20%), plus what each decode added.
    paged, ada = against_paged_in_the_what_if("adakv")
    assert ada["requests.finished"] == paged["requests.finished"] == 12
    assert ada["memory.max_running_seqs"] > paged["memory.max_running_seqs"]
    bps = paged["roofline.kv_bytes_per_token"]
    assert ada["attention.kv_read_bytes_per_token"] == pytest.approx(bps * (200 + 16))


@pytest.mark.parametrize("override,message", [
    ("backend.alpha_safeguard=1.5", "alpha_safeguard"),
    ("backend.prefill=streaming", "compresses a prompt once"),
    ("backend.kernel=triton", "has no Triton path yet"),
])
def test_bad_options_are_refused(override: str, message: str) -> None:
    with pytest.raises(UserError, match=message):
        run_config(compose_cfg(["backend=adakv", override]))
