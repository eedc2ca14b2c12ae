"""duo_attention: the streaming heads are kvpress's choice (its rule transcribed) of the
heads that attend least to distant tokens, measured on the model at start-up (the
criterion against a brute force, and on heads built to look far or near); a streaming
head keeps the prompt's sinks and last tokens, a retrieval head all of it, decodes
attend to exactly that; more sequences run than paged's at the same budget."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harness.backends.duo_attention import DuoAttentionBackend
from harness.backends.duo_heads import calibration_ids, distant_mass, measure_heads
from harness.config import run_config
from harness.errors import UserError
from harness.kv.headwise import HeadwiseKVManager
from harness.kv.policies.duo import DuoPolicy, choose_streaming
from tests.backend_steps import Driver
from tests.backends.headwise_ref import (
    against_paged,
    against_paged_in_the_what_if,
    check_books,
    check_decode,
    prefill_recording,
)
from tests.compose import compose_cfg, model_stack

BS = 8


def kvpress_streaming_mask(head_scores: np.ndarray, head_compression_ratio: float) -> np.ndarray:
    """NVIDIA/kvpress, kvpress/presses/duo_attention_press.py, ``DuoAttentionPress.
    post_init_from_model`` at commit 8bb29b9c3078452a86d692f29123fa6c793e2b05, from the
    head scores on, verbatim but for a numpy mask in place of the torch one."""
    n_pruned = round(head_scores.size * head_compression_ratio)
    streaming_mask = np.zeros(head_scores.shape, dtype=bool)
    if n_pruned > 0:
        indices = np.argsort(head_scores, axis=None)[:n_pruned]
        streaming_mask[np.unravel_index(indices, head_scores.shape)] = True
    return streaming_mask


@pytest.mark.parametrize("shape,ratio", [((30, 3), 0.5), ((2, 2), 0.25), ((32, 8), 0.75),
                                         ((4, 1), 0.0), ((3, 5), 1.0), ((7, 2), 0.3)])
def test_streaming_heads_are_kvpress_choice(shape: tuple[int, int], ratio: float) -> None:
    scores = np.random.default_rng(shape[0] * shape[1]).random(shape)
    want = kvpress_streaming_mask(scores, ratio)
    assert (choose_streaming(scores, ratio) == want).all()
    assert want.sum() == round(scores.size * ratio)


def _brute_distant(q: torch.Tensor, k: torch.Tensor, sink: int, recent: int) -> list[float]:
    n, h, d = q.shape
    kv = k.shape[1]
    g = h // kv
    out = []
    for kvh in range(kv):
        total, count = 0.0, 0
        for head in range(kvh * g, (kvh + 1) * g):
            for p in range(sink + recent, n):
                logits = k[:p + 1, kvh].double() @ q[p, head].double() / d ** 0.5
                w = torch.softmax(logits, 0)
                total += float(w[sink:p - recent + 1].sum())
                count += 1
        out.append(total / count)
    return out


def test_distant_mass_is_a_brute_force() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(40, 6, 8, generator=gen), torch.randn(40, 3, 8, generator=gen)
    got = distant_mass(q, k, 4, 10)
    torch.testing.assert_close(got.double(), torch.tensor(_brute_distant(q, k, 4, 10),
                                                          dtype=torch.float64))


def test_a_head_that_looks_far_is_kept_and_one_that_looks_near_streams() -> None:
    # KV head 0's queries match the key at position 5 (distant for every measured query
    # but the first, at 20); KV head 1's match each query's own key (always recent).
    n, d, sink, recent = 64, 16, 4, 16
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(n, 2, d, generator=gen)
    q = torch.zeros(n, 2, d)
    q[:, 0] = 8 * k[5, 0]
    q[:, 1] = 8 * k[:, 1]
    mass = distant_mass(q, k, sink, recent)
    assert mass[0] > 0.9 and mass[1] < 0.1
    assert choose_streaming(mass.numpy(), 0.5).tolist() == [False, True]


def test_start_up_measures_the_model_and_streams_its_least_distant_heads() -> None:
    ovr = ["model=tiny", "backend=duo_attention", "backend.sink_tokens=4",
           "backend.recent=32", "backend.calibration_tokens=200", "backend.head_ratio=0.5",
           "workload=random", "workload.num_requests=1"]
    target, _, st = model_stack(ovr)
    be = st.backend
    assert isinstance(be, DuoAttentionBackend) and be.calibration is not None
    # Recomputed apart: the model's q and k recorded per layer, brute-forced in float64.
    ids = calibration_ids(target.loaded.tokenizer, 200)
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def record(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        seen[layer] = (q.clone(), k.clone())
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            is_causal=True, enable_gqa=True)
        return o[0].transpose(0, 1)

    model = target.loaded.model
    model(torch.tensor(ids), torch.arange(len(ids)), record, torch.tensor([len(ids) - 1]))
    want = np.array([_brute_distant(*seen[layer], 4, 32) for layer in sorted(seen)])
    np.testing.assert_allclose(be.calibration, want, rtol=1e-4, atol=1e-6)
    policy = be.policy
    assert isinstance(policy, DuoPolicy)
    assert policy.streaming.tolist() == choose_streaming(want, 0.5).reshape(-1).tolist()
    assert np.allclose(measure_heads(model, ids, 4, 32), be.calibration)  # deterministic


def test_a_second_stack_on_the_same_model_measures_nothing_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import harness.backends.duo_attention as duo

    calls: list[tuple[int, int]] = []
    real = duo.measure_heads

    def counted(model: object, ids: list[int], sink: int, recent: int) -> np.ndarray:
        calls.append((sink, recent))
        return real(model, ids, sink, recent)

    monkeypatch.setattr(duo, "measure_heads", counted)
    ovr = ["model=tiny", "backend=duo_attention", "backend.sink_tokens=4",
           "backend.recent=32", "backend.calibration_tokens=180", "workload=random",
           "workload.num_requests=1"]
    target, wl, first = model_stack(ovr)
    again = target.build(wl, quiet=True)  # the quality evaluation's way: the same model
    assert calls == [(4, 32)]
    assert np.array_equal(again.backend.calibration, first.backend.calibration)
    # Other settings on the same model are measured for themselves.
    be = again.backend
    be.opts.recent = 40
    be.calibrate(target.loaded.model, target.loaded.tokenizer)
    assert calls == [(4, 32), (4, 40)]


@pytest.mark.parametrize("chunks", [[100], [60, 40]])
def test_streaming_heads_keep_sinks_and_recent_tokens_retrieval_heads_all(
        chunks: list[int]) -> None:
    p, sink, recent = 100, 4, 16
    d = Driver("duo_attention", block_size=BS, options={
        "sink_tokens": sink, "recent": recent, "calibration_tokens": 64}, seed=20)
    kv = d.kv
    assert isinstance(kv, HeadwiseKVManager)
    policy = d.be.policy
    assert isinstance(policy, DuoPolicy)
    policy.use_streaming(np.array([False, True, True, False]))  # as a measurement would
    s = d.add(p, max_tokens=8)
    prefill_recording(d, s, chunks)
    short = set(range(sink)) | set(range(p - recent, p))
    held = kv.positions(s)
    assert [set(h.tolist()) for h in held] == [set(range(p)), short, short, set(range(p))]
    # A streaming head's 20 tokens fill 3 pages; the other 10 of its 13 went back.
    assert [len(pg) for pg in kv._seqs[s.seq_id].pages] == [13, 3, 3, 13]
    check_books(kv, [s])
    for _ in range(3):
        check_decode(d, s, d.step([(s, 1)]))
    check_books(kv, [s])


def test_freed_pages_let_more_sequences_run_than_paged() -> None:
    paged, duo = against_paged("backend=duo_attention", "backend.sink_tokens=4",
                               "backend.recent=32", "backend.calibration_tokens=256")
    assert duo["requests.finished"] == paged["requests.finished"] == 12
    assert duo["memory.max_running_seqs"] > paged["memory.max_running_seqs"]
    assert duo["cache.evicted_tokens"] > 0


def test_the_what_if_runs_it_and_frees_the_same() -> None:
    # No model to measure: the first half of the 256 (layer, KV head)s stream (the count
    # is the method's): each holds 128 sinks + 256 recent of 1000, the others all of it.
    paged, duo = against_paged_in_the_what_if("duo_attention")
    assert duo["requests.finished"] == paged["requests.finished"] == 12
    assert duo["memory.max_running_seqs"] > paged["memory.max_running_seqs"]
    bps = paged["roofline.kv_bytes_per_token"]
    assert duo["attention.kv_read_bytes_per_token"] == pytest.approx(
        bps * ((1000 + 384) / 2 + 16))


@pytest.mark.parametrize("override,message", [
    ("backend.head_ratio=1.5", "head_ratio"),
    ("backend.recent=0", "backend.recent >= 1"),
    ("backend.calibration_tokens=300", "must exceed"),
    ("backend.kernel=triton", "has no Triton path yet"),
])
def test_bad_options_are_refused(override: str, message: str) -> None:
    with pytest.raises(UserError, match=message):
        run_config(compose_cfg(["backend=duo_attention", override]))
