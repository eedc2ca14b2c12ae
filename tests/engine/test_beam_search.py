"""Beam search through the engine equals a brute-force beam search over the model's
log-probs (no cache at all), and copy-on-write copies happen exactly where beams diverge
inside a shared, partially filled block."""

from __future__ import annotations

import pytest
import torch

from harness.backends.attention_ref import attend_chunk
from harness.engine.beam import beam_score, beam_step, is_beam_done
from harness.model import load_model
from harness.runner import run
from tests.compose import compose_cfg

WIDTH, PROMPT, OUT, BS = 3, 21, 10, 8


def dense_logprobs(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    def attn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attend_chunk(q, k, v, 0)

    n = len(tokens)
    logits = model(torch.tensor(tokens), torch.arange(n), attn, torch.tensor([n - 1]))
    return torch.log_softmax(logits[0].float(), dim=-1)


def reference_beam_search(model: torch.nn.Module, prompt: list[int], width: int,
                          max_tokens: int) -> tuple[list[int], list[list[int]]]:
    """Returns the best output and, per step, the parent index of every kept beam."""
    beams: list[tuple[list[int], float]] = [([], 0.0)]
    finished: list[tuple[float, list[int]]] = []
    lineage: list[list[int]] = []
    for step in range(max_tokens):
        lp = torch.stack([dense_logprobs(model, prompt + out) for out, _ in beams])
        keep, done = beam_step([c for _, c in beams], lp, width, frozenset())
        assert not done  # no EOS (ignore_eos)
        lineage.append([c.parent for c in keep])
        beams = [([*beams[c.parent][0], c.token], c.cum_logprob) for c in keep]
        n_out = step + 1
        live_best = max(beam_score(c, n_out, 1.0) for _, c in beams)
        if n_out >= max_tokens or is_beam_done(finished, live_best, width):
            finished += [(beam_score(c, n_out, 1.0), out) for out, c in beams]
            break
    return max(finished, key=lambda f: f[0])[1], lineage


def expected_cow_copies(lineage: list[list[int]], prompt_len: int, bs: int) -> int:
    """Simulate block sharing from the beam lineage alone: beams forked from one parent
    share its last block; writing into a shared, partially filled block copies it for
    every writer but the last."""
    owner = [0]  # identity of each live beam's last block (the prompt's, at first)
    next_id, copies = 1, 0
    pos = prompt_len - 1  # the prompt's last token is written by the prefill itself
    for parents in lineage[:-1]:  # the last step's tokens are never written
        owner = [owner[p] for p in parents]  # forks share, pruned beams drop out
        pos += 1  # each beam writes its newest token at this position
        if pos % bs:
            for ident in set(owner):
                copies += owner.count(ident) - 1
        new = []
        for _ in owner:
            new.append(next_id)
            next_id += 1
        owner = new
    return copies


@pytest.fixture(scope="module")
def engine_run():  # type: ignore[no-untyped-def]
    cfg = compose_cfg(["model=tiny", "workload=beam_search", f"workload.n={WIDTH}",
                       f"workload.prompt_tokens={PROMPT}", f"workload.output_tokens={OUT}",
                       "workload.num_requests=3", f"backend.block_size={BS}",
                       "cache.kv_budget=1MiB"])
    return run(cfg)


def test_engine_beam_search_equals_brute_force(engine_run) -> None:  # type: ignore[no-untyped-def]
    from harness.workloads.sampling import BeamSearchWorkload, SamplingWorkloadConfig

    tiny = load_model("tiny", None, "float32", torch.device("cpu"))
    wl = BeamSearchWorkload(SamplingWorkloadConfig(num_requests=3, prompt_tokens=PROMPT,
                                                   output_tokens=OUT, n=WIDTH), tiny.tokenizer)
    expected_copies = 0
    with torch.no_grad():
        for req in wl.initial_requests():
            best, lineage = reference_beam_search(tiny.model, req.prompt_ids, WIDTH, OUT)
            assert engine_run.outputs[req.request_id] == best
            expected_copies += expected_cow_copies(lineage, PROMPT, BS)
    assert expected_copies > 0, "the test needs beams that diverge mid-block"
    assert engine_run.metrics["cache.cow_copies"] == expected_copies


def test_beams_share_blocks(engine_run) -> None:  # type: ignore[no-untyped-def]
    m = engine_run.metrics
    assert m["cache.blocks_saved_by_sharing_peak"] > 0
    assert m["cache.sharing_saved_pct"] > 20


BEAM = ["model=tiny", "workload=beam_search", "workload.n=3", "workload.prompt_tokens=40",
        "workload.output_tokens=24", "workload.num_requests=4", "backend.block_size=8"]


def test_preempted_beams_give_the_same_best_beams() -> None:
    roomy = run(compose_cfg([*BEAM, "cache.kv_budget=2MiB"]))
    # Recompute, with chunks so small that the beams' prefills end in different steps.
    recompute = run(compose_cfg([*BEAM, "cache.kv_budget=128KiB",
                                 "scheduler.max_num_batched_tokens=16"]))
    swap = run(compose_cfg([*BEAM, "cache.kv_budget=64KiB", "scheduler.preemption_mode=swap",
                            "cache.swap_space=1MiB"]))
    assert recompute.metrics["sched.preemptions_recompute"] > 0
    assert swap.metrics["sched.preemptions_swap"] > 0
    assert recompute.outputs == roomy.outputs == swap.outputs


def test_group_too_big_to_recompute_is_rejected_and_the_run_goes_on() -> None:
    r = run(compose_cfg([*BEAM, "cache.kv_budget=64KiB"]))
    rejected = [x for x in r.requests if x["status"] == "rejected"]
    assert rejected and r.metrics["requests.finished"] == 4 - len(rejected)
    assert all("preemption_mode=swap" in x["rejected_reason"] for x in rejected)
