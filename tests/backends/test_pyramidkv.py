"""pyramidkv: kvpress's pyramid of layer budgets to the bit; what each head keeps after a
prompt equals a brute-force PyramidKV over the window queries' scores (window spanning
prefill chunks); decodes attend to exactly each head's kept tokens; the dropped pages go
back to the pool, so more sequences run than paged's at the same budget."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from harness.backends.headwise import snapkv_head_scores
from harness.config import run_config
from harness.errors import UserError
from harness.kv.headwise import HeadwiseKVManager
from harness.kv.policies.pyramidkv import pyramid_budgets
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


def kvpress_layer_budget(layer_idx: int, num_hidden_layers: int, q_len: int,
                         compression_ratio: float, window_size: int, beta: int) -> int:
    """NVIDIA/kvpress, kvpress/presses/pyramidkv_press.py, ``PyramidKVPress.
    get_layer_budget`` at commit 8bb29b9c3078452a86d692f29123fa6c793e2b05, verbatim but
    for ``self.*`` and ``module.*`` passed as arguments."""
    assert beta >= 1, "Beta should >= 1"
    max_capacity_prompt = window_size + q_len * (1 - compression_ratio)
    min_num = (max_capacity_prompt - window_size) / beta
    max_num = (max_capacity_prompt - window_size) * 2 - min_num
    if max_num >= q_len - window_size:
        max_num = q_len - window_size
        min_num = (max_capacity_prompt - window_size) * 2 - max_num
    if not (q_len >= max_num >= min_num >= window_size):
        return round(q_len * (1 - compression_ratio))
    steps = (max_num - min_num) / (num_hidden_layers - 1)
    return round(max_num - layer_idx * steps)


def test_layer_budgets_are_kvpress_get_layer_budget() -> None:
    branches = set()
    for q_len in (100, 257, 1000, 4096, 8000):
        for cr in (0.1, 0.25, 0.5, 0.75, 0.8, 0.9):
            for window, beta, layers in ((64, 20, 30), (8, 2, 2), (32, 5, 24), (16, 1, 7)):
                want = [kvpress_layer_budget(i, layers, q_len, cr, window, beta)
                        for i in range(layers)]
                got = pyramid_budgets(q_len, q_len * (1 - cr), window, beta, layers)
                assert got == want, (q_len, cr, window, beta, layers)
                branches.add(len(set(got)) > 1)
    assert branches == {True, False}  # both the pyramid and kvpress's SnapKV fallback


def test_pyramid_keeps_more_in_lower_layers_with_the_mean_budget() -> None:
    b = pyramid_budgets(8000, 1600.0, 64, 20, 30)  # kept / beta = 80 >= the window
    assert b == sorted(b, reverse=True) and b[0] > b[-1]
    assert sum(b) / len(b) == pytest.approx(1600, abs=1)


@pytest.mark.parametrize("chunks", [[100], [50, 45, 5]])
def test_each_head_keeps_a_brute_force_pyramidkv(chunks: list[int]) -> None:
    # budget 40, window 8, beta 2 over 2 layers: layer 0 keeps 60, layer 1 keeps 20 (the
    # pyramid branch). [50, 45, 5]: the window [92, 100) spans the last two chunks.
    p, window, kernel = 100, 8, 5
    opts = {"budget": 40, "budget_ratio": 0.0, "window": window, "pool_width": kernel,
            "beta": 2}
    d = Driver("pyramidkv", block_size=BS, options=opts, seed=len(chunks))
    kv = d.kv
    assert isinstance(kv, HeadwiseKVManager)
    s = d.add(p, max_tokens=8)
    q = prefill_recording(d, s, chunks)
    budgets = pyramid_budgets(p, 40.0, window, 2, 2)
    assert budgets == [60, 20]
    scores = snapkv_scores(d, s.seq_id, q, p, window, kernel)
    held = kv.positions(s)
    for head in range(kv.heads):
        n = budgets[head // d.layout.num_kv_heads]
        ranked = sorted(range(p - window), key=lambda j: (-scores[head, j], j))
        want = set(ranked[:n - window]) | set(range(p - window, p))
        assert set(held[head].tolist()) == want, head
    # Each head's pages: ceil(kept / 8); the rest of the prompt's 13 per head went back.
    assert [len(pg) for pg in kv._seqs[s.seq_id].pages] == [8, 8, 3, 3]
    check_books(kv, [s])
    for _ in range(3):  # decodes read exactly each head's kept tokens and their own
        check_decode(d, s, d.step([(s, 1)]))
    check_books(kv, [s])
    assert d.reads[-1].decode_tokens == (60 + 60 + 20 + 20 + 4 * 3) // 4


def test_head_scores_are_kvpress_snapkv_scores_per_kv_head() -> None:
    # kvpress 0.5.5's own SnapKVPress.score, recorded per KV head on SmolLM2's layers 0-1
    # (tests/fixtures/kvpress_scores.pt, scripts/peer_kvpress.sh: window 32, kernel 7):
    # the per-head score pyramidkv and adakv rank by, to float32 rounding, no constant.
    fixture = torch.load(Path(__file__).parents[1] / "fixtures" / "kvpress_scores.pt")
    win, kern = int(fixture["meta"]["snapkv"]["window"]), int(fixture["meta"]["snapkv"]["kernel"])
    for layer in ("0", "1"):
        rec = fixture[layer]
        q, k = rec["q"].float(), rec["k"].float()  # (T, H, D), (T, KV, D) post-RoPE
        t, kv, d = k.shape
        qg = q[t - win:].view(win, kv, -1, d)
        logits = torch.einsum("nkgd,kld->kgnl", qg, k.transpose(0, 1)) * d ** -0.5
        causal = torch.arange(t)[None, :] <= torch.arange(t - win, t)[:, None]
        w = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)
        acc = w[..., :t - win].sum(dim=2).reshape(1, -1, t - win)  # (1 layer, H, T - W)
        ours = snapkv_head_scores(acc, win, kern, "avg", kv).double()
        ref = rec["scores"]["snapkv"][:, :t - win].double()  # (KV, T - W), window cut
        assert ours.shape == ref.shape
        assert float((ours - ref).abs().max() / ref.abs().max()) < 1e-5, layer


def test_scores_reach_the_policy_by_the_heads_own_slots() -> None:
    # The step's one transfer carries each head's score at that head's slot of the
    # position: the same numbers as the brute force, laid out by slot.
    p, window = 40, 8
    d = Driver("pyramidkv", block_size=BS, options={"budget": 12, "budget_ratio": 0.0,
                                                    "window": window, "beta": 2}, seed=3)
    kv = d.kv
    assert isinstance(kv, HeadwiseKVManager)
    s = d.add(p, max_tokens=4)
    q = prefill_recording(d, s, [p], observe=False)
    sent = d.last_scores
    assert sent is not None and len(sent.slots) == kv.heads * (p - window)
    want = snapkv_scores(d, s.seq_id, q, p, window, 5)
    st = kv._seqs[s.seq_id]
    for head in range(kv.heads):
        pages = np.asarray(st.pages[head])
        slots = pages[np.arange(p - window) // BS] * BS + np.arange(p - window) % BS
        got = dict(zip(sent.slots.tolist(), sent.values.tolist()))
        np.testing.assert_allclose([got[x] for x in slots.tolist()], want[head], rtol=1e-5)


def test_freed_pages_let_more_sequences_run_than_paged() -> None:
    paged, pyr = against_paged("backend=pyramidkv", "backend.window=16", "backend.beta=2")
    assert pyr["requests.finished"] == paged["requests.finished"] == 12
    assert pyr["memory.kv_budget_bytes"] == paged["memory.kv_budget_bytes"]
    assert pyr["memory.max_running_seqs"] > paged["memory.max_running_seqs"]
    assert pyr["cache.evicted_tokens"] > 0
    # Each decode reads what its heads kept: less than paged's whole contexts.
    assert pyr["attention.kv_read_bytes_per_token"] < \
        0.5 * paged["attention.kv_read_bytes_per_token"]


def test_the_what_if_runs_it_and_frees_the_same() -> None:
    # executor=roofline: no scores (each head keeps its first tokens by position, a
    # stand-in), the same counts: 200 of 1000 in every head (the mean budget; 200 / 20 is
    # under the window, so kvpress's uniform fallback), plus what each decode added.
    paged, pyr = against_paged_in_the_what_if("pyramidkv")
    assert pyr["requests.finished"] == paged["requests.finished"] == 12
    assert pyr["memory.max_running_seqs"] > paged["memory.max_running_seqs"]
    bps = paged["roofline.kv_bytes_per_token"]
    # Decodes 1..31 each hold 200 + i tokens in every head.
    assert pyr["attention.kv_read_bytes_per_token"] == pytest.approx(bps * (200 + 16))


@pytest.mark.parametrize("override,message", [
    ("backend.prefill=streaming", "compresses a prompt once"),
    ("backend.kernel=triton", "has no Triton path yet"),
    ("backend.pool_width=4", "must be odd"),
    ("backend.beta=0", "beta"),
])
def test_bad_options_are_refused(override: str, message: str) -> None:
    with pytest.raises(UserError, match=message):
        run_config(compose_cfg(["backend=pyramidkv", override]))


def test_runs_torch_under_auto() -> None:
    from harness.backends.pyramidkv import PyramidKVBackend
    from tests.backend_steps import LAYOUT

    assert PyramidKVBackend(LAYOUT, torch.device("cpu")).kernel == "torch"
