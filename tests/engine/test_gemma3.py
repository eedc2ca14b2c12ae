"""Gemma 3 (a hybrid-attention model) through the whole engine against transformers'
``Gemma3ForCausalLM``: the tiny preset here (seeded weights, a 24-token window on 4 of 6
layers), the real 270M in tests/engine/test_gemma3_270m.py. Prompts longer than the window,
prefill chunks straddling its edge, decodes past it; with KV cache groups (a sliding
group gives blocks back) and without (every layer holds every token, the sliding layers
masked), on the torch path and the Triton kernels (interpreted on CPU)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from harness.backends.base import BackendOptions
from harness.backends.paged import PagedOptions
from harness.config import CacheSpec
from harness.kv.groups import GroupedKVManager
from harness.metrics.groups import group_peaks
from harness.model import LoadedModel, load_model
from harness.model.config import ModelConfig
from harness.runner import run
from harness.sched.scheduler import SchedulerConfig
from harness.sched.sequence import SamplingParams
from harness.stack import Stack, build_stack
from harness.workloads.base import Request
from tests.compose import compose_cfg
from tests.engine.test_engine_transformers import FixedRequests, RecordingSampler
from tests.workloads.test_workloads import DESIGN_KEYS, SMALL

CPU = torch.device("cpu")


def hf_gemma3(loaded: LoadedModel) -> torch.nn.Module:
    """transformers' Gemma 3 with our config and weights (eager attention: its own
    sliding-window mask)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    c: ModelConfig = loaded.config
    kinds = ["sliding_attention" if a.kind == "sliding" else "full_attention"
             for a in c.layer_attention]
    window = next(a.span for a in c.layer_attention if a.kind == "sliding")
    cfg = Gemma3TextConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, sliding_window=window,
        layer_types=kinds, query_pre_attn_scalar=int(c.query_pre_attn_scalar or c.head_dim),
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": c.rope_theta},
                         "sliding_attention": {"rope_type": "default",
                                               "rope_theta": c.rope_local_theta}},
        max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=True,
        attn_implementation="eager", pad_token_id=0)
    model = Gemma3ForCausalLM(cfg).eval()
    missing, unexpected = model.load_state_dict(loaded.model.hf_state_dict(), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return model


def engine_run(loaded: LoadedModel, prompts: list[list[int]], max_tokens: int,
               kv_groups: str = "grouped", budget: str = "256KiB", chunk: int = 16,
               backend: BackendOptions | None = None) -> tuple[Stack, RecordingSampler]:
    sampler = RecordingSampler()
    st = build_stack(loaded, CPU, backend or PagedOptions(name="paged", kernel="torch"),
                     CacheSpec(kv_budget=budget, kv_groups=kv_groups),
                     SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=chunk), sampler)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    st.engine.run(FixedRequests([Request(i, p, params) for i, p in enumerate(prompts)]))
    return st, sampler


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny-gemma3")


@pytest.fixture(scope="module")
def reference(tiny: LoadedModel) -> torch.nn.Module:
    return hf_gemma3(tiny)


def prompts(loaded: LoadedModel) -> list[list[int]]:
    tok = loaded.tokenizer
    return [tok.encode("Sliding windows forget: each of these layers sees 24 tokens back, "
                       "never more"),
            tok.encode("while the global layers keep every token of the prompt")]


def assert_matches(loaded: LoadedModel, ref: torch.nn.Module, st: Stack,
                   sampler: RecordingSampler, ps: list[list[int]], max_tokens: int,
                   tol: float = 1e-4) -> None:
    for rid, prompt in enumerate(ps):
        out = st.engine.metrics.outputs()[rid]
        with torch.no_grad():
            theirs = ref(torch.tensor([prompt + out[:-1]])).logits[0, len(prompt) - 1:]
        ours = torch.stack(sampler.rows[rid])
        assert ours.shape[0] == max_tokens
        assert (ours - theirs.float()).abs().max().item() <= tol


@pytest.mark.parametrize("kernel", ["torch", "triton"])
@pytest.mark.parametrize("kv_groups", ["grouped", "uniform"])
def test_engine_logits_match_transformers(tiny: LoadedModel, reference: torch.nn.Module,
                                          kv_groups: str, kernel: str) -> None:
    ps = prompts(tiny)
    assert min(len(p) for p in ps) > 2 * 24, "prompts longer than the window"
    st, sampler = engine_run(tiny, ps, 12, kv_groups,
                             backend=PagedOptions(name="paged", kernel=kernel))
    steps = st.engine.metrics.steps
    # 16-token chunks: a chunk runs across position 24 (the window's edge) beside decodes
    assert any(s.decode_tokens and s.prefill_tokens for s in steps)
    assert isinstance(st.kv, GroupedKVManager) == (kv_groups == "grouped")
    assert st.backend.kernel == kernel
    assert_matches(tiny, reference, st, sampler, ps, 12)


def test_groups_give_blocks_back_with_identical_tokens(tiny: LoadedModel) -> None:
    """The same run with and without groups: the same tokens, and the sliding groups hold
    at most their window while the uniform cache holds every token of every layer."""
    ps = prompts(tiny)
    runs = {m: engine_run(tiny, ps, 60, m, budget="1MiB") for m in ("grouped", "uniform")}
    g = runs["grouped"][0]
    outs = {m: sorted(st.engine.metrics.outputs().items()) for m, (st, _) in runs.items()}
    assert outs["grouped"] == outs["uniform"] and len(outs["grouped"]) == len(ps)
    assert isinstance(g.kv, GroupedKVManager)
    assert g.kv.stats.evicted_tokens > 0  # the sliding groups gave blocks back
    # Bytes held at the peak: a pool block holds 2 layers (grouped), 6 (uniform).
    peak = {m: max(s.reserved_bytes for s in st.engine.metrics.steps)
            for m, (st, _) in runs.items()}
    assert peak["grouped"] < 0.6 * peak["uniform"], peak
    # A sliding group's tables keep at most its window + a step's tokens + a block per
    # sequence (24 + 16 + 16 tokens: 4 blocks of 16, two sequences); the full group more.
    peaks = group_peaks(g.engine.metrics.steps)
    kinds = [grp.attention.kind for grp in g.kv.plan]
    assert kinds == ["full", "sliding", "sliding"]
    assert max(peaks[1:]) <= 2 * 4 < peaks[0], peaks


def test_fp8_runs_groups_and_other_backends_refuse(tiny: LoadedModel) -> None:
    from harness.backends.quantized import QuantizedOptions
    from harness.errors import UserError

    ps = prompts(tiny)
    fp8 = QuantizedOptions(name="fp8", kernel="torch")
    st, _ = engine_run(tiny, ps, 30, backend=fp8, budget="1MiB")
    uni, _ = engine_run(tiny, ps, 30, "uniform", backend=fp8, budget="1MiB")
    assert isinstance(st.kv, GroupedKVManager)
    # Per-token scales: the same bytes whichever storage tensor and block hold a token,
    # so a layer reading another group's or layer's blocks would change the tokens.
    assert st.engine.metrics.outputs() == uni.engine.metrics.outputs()
    from harness.backends.kivi import KIVIOptions

    with pytest.raises(UserError, match=r"backend kivi cannot attend per layer.*"
                       r"paged, .*sliding_window"):
        engine_run(tiny, ps, 2, backend=KIVIOptions(name="kivi"))



@pytest.mark.parametrize("name", sorted(SMALL))
def test_every_workload_runs_grouped_with_the_uniform_cache_tokens(name: str,
                                                                    tmp_path: Path) -> None:
    """Every workload on the hybrid model with KV cache groups (forks, beams, prefix hits
    across groups, chunked long prompts, RULER): every design key, the per-group keys,
    and the same tokens as the uniform cache (exact attention either way)."""
    ovr = ["model=tiny_gemma3", f"workload={name}", "cache.kv_budget=1MiB", *SMALL[name]]
    grouped = run(compose_cfg(ovr, tmp_path / "g"))
    uniform = run(compose_cfg([*ovr, "cache.kv_groups=uniform"], tmp_path / "u"))
    m = json.loads((tmp_path / "g" / "metrics.json").read_text())
    assert [k for k in DESIGN_KEYS if k not in m] == []
    assert m["requests.finished"] == len(grouped.requests) and m["requests.rejected"] == 0
    assert m["run.kv_groups"] == "1 full + 2 sliding 24 (2 layers a group)"
    assert m["memory.kv_group.0.peak_held_bytes"] > 0
    assert uniform.metrics["run.kv_groups"].startswith("uniform: 2 full + 4 sliding 24")
    assert grouped.outputs == uniform.outputs
    # A scored method choosing the full group's tokens runs every workload too (forks,
    # beams, chunked prompts; its reads held to the attention's under KVBENCH_CHECK).
    chosen = run(compose_cfg([*ovr, "backend=snapkv", "backend.budget=40",
                              "backend.budget_ratio=0"])).metrics
    assert chosen["requests.finished"] == len(grouped.requests)
    assert chosen["requests.rejected"] == 0


def masked_reference(loaded: LoadedModel, ids: list[int],
                     masks: list[tuple[int, int]]) -> torch.Tensor:
    """Brute force: the whole sequence in one forward, layer i's query at p seeing keys
    j <= p with j > p - window or j < sinks (``masks[i]`` = (window, sinks); 0 = all)."""
    import torch.nn.functional as F

    n = len(ids)
    i = torch.arange(n)
    causal = i[None, :] <= i[:, None]

    def attn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        w, s = masks[layer]
        mask = causal & ((i[None, :] > i[:, None] - w) | (i[None, :] < s)) if w else causal
        qs, ks, vs = (x.transpose(0, 1) for x in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True)
        return o.transpose(0, 1)

    return loaded.model(torch.tensor(ids), i, attn)


def test_a_window_backend_compresses_the_full_layers_only(tiny: LoadedModel) -> None:
    """streaming_llm on a hybrid model: its window and sinks on the full layers (their
    groups give blocks back), the model's own window on the sliding ones: the logits are
    the brute-force forward with exactly those masks."""
    from harness.backends.sliding_window import SlidingWindowOptions
    from harness.errors import UserError

    ps = prompts(tiny)
    opts = SlidingWindowOptions(name="streaming_llm", window=12, sink_tokens=4,
                                kernel="torch")
    st, sampler = engine_run(tiny, ps, 20, backend=opts, budget="1MiB")
    assert isinstance(st.kv, GroupedKVManager)
    masks = [(24, 0) if a.kind == "sliding" else (12, 4) for a in tiny.config.layer_attention]
    for rid, prompt in enumerate(ps):
        out = st.engine.metrics.outputs()[rid]
        ref = masked_reference(tiny, prompt + out[:-1], masks)[len(prompt) - 1:]
        assert (torch.stack(sampler.rows[rid]) - ref).abs().max().item() <= 1e-4
    # The full group holds sinks + window + a step + a block per sequence, not every token.
    peaks = group_peaks(st.engine.metrics.steps)
    assert peaks[0] <= 2 * 3 + 2, peaks  # 4 sinks (1 block) + 12 + 16 tokens: <= 4 blocks
    with pytest.raises(UserError, match=r"use cache\.kv_groups=grouped"):
        engine_run(tiny, ps, 2, "uniform", backend=opts)


def test_groups_swap_and_come_back_with_the_same_tokens(tmp_path: Path) -> None:
    """A budget too small for every sequence: swap preemption moves every group's blocks
    of a sequence group to the shared CPU pool and back; the tokens are the roomy run's."""
    ovr = ["model=tiny_gemma3", "workload=random", "workload.num_requests=8",
           "workload.input_min=40", "workload.input_max=90", "workload.output_min=30",
           "workload.output_max=60", "scheduler.max_num_batched_tokens=32"]
    roomy = run(compose_cfg([*ovr, "cache.kv_budget=2MiB"]))
    swapped = run(compose_cfg([*ovr, "cache.kv_budget=160KiB", "cache.swap_space=1MiB",
                               "scheduler.preemption_mode=swap"], tmp_path))
    m = swapped.metrics
    assert m["sched.preemptions_swap"] > 0 and roomy.metrics["sched.preemptions_swap"] == 0
    assert m["requests.finished"] == 8 and m["run.kv_groups"].startswith("1 full + 2 sliding")
    assert m["sched.swapped_bytes"] > 0  # every group's swapped blocks counted
    assert swapped.outputs == roomy.outputs


def test_the_record_and_the_quality_reference_of_a_hybrid_model() -> None:
    """run.kv_groups names a window backend on the full groups; the quality evaluation's
    exact reference attends per layer too (paged: contiguous cannot), so exact paged
    scores as the reference does."""
    base = ["model=tiny_gemma3", "workload=random", "workload.num_requests=3",
            "workload.input_max=60", "workload.output_max=20", "cache.kv_budget=1MiB"]
    m = run(compose_cfg([*base, "backend=streaming_llm", "backend.window=12"])).metrics
    assert m["run.kv_groups"] == ("1 full + 2 sliding 24 (2 layers a group); the full groups "
                                  "windowed by the backend (12 tokens + 4 sinks), the sliding "
                                  "ones keeping their own")
    q = run(compose_cfg([*base, "quality.enabled=true", "quality.text_tokens=80",
                         "quality.prefill_tokens=16", "quality.num_texts=2",
                         "quality.generation_agreement=true"])).metrics
    assert abs(q["quality.ppl_delta_pct"]) < 1e-3 and q["quality.top1_agreement"] == 1.0
    # generation agreement reruns the workload on the reference: every token the same
    assert q["quality.gen_exact_match_rate"] == 1.0


def test_groups_take_the_prefix_cache_tiers_with_the_same_tokens(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Multi-turn histories leave a small device pool and come back from the CPU and disk
    tiers, every group's pages under its own names (the sliding groups' given-back blocks
    go down too): the same tokens as without tiers (KVBENCH_CHECK fills every loaded
    block with garbage first, so a load that reads nothing fails), and fewer prefill
    tokens computed. Hits are counted once (the first group's), loads in every group."""
    from tests.compose import tiny as tiny_cfg

    common = ("model=tiny_gemma3", "cache.kv_budget=600KiB",
              "scheduler.max_num_batched_tokens=64", "workload.conversations=8",
              "workload.turns=3", "workload.system_words=60", "workload.user_words=12",
              "workload.answer_tokens=12")
    off = run(tiny_cfg(*common))
    on = run(tiny_cfg(*common, "cache.tiers.cpu=160KiB", "cache.tiers.disk=4MiB"))
    assert dict(on.outputs) == dict(off.outputs)
    m = on.metrics
    assert m["run.kv_groups"].startswith("1 full + 2 sliding 24")
    assert m["cache.hit_rate.disk"] > 0.1
    shares = [m[f"cache.hit_rate.{k}"] for k in ("gpu", "cpu", "disk", "miss")]
    assert sum(shares) == pytest.approx(1.0) and min(shares) >= 0
    assert m["cache.prefill_tokens_computed"] < 0.5 * off.metrics["cache.prefill_tokens_computed"]
    # Every group loads its own pages; a request's tier hits are its first group's.
    up = m["cache.tier.cpu.blocks_up"] + m["cache.tier.disk.blocks_up"]
    hits = sum(r["tier_hit_blocks_cpu"] + r["tier_hit_blocks_disk"] for r in on.requests)
    assert 0 < hits < up
    # The control: loads that read nothing (the target keeps a huge value) change tokens.
    from tests.backends.test_tiers_engine import break_loads

    break_loads(monkeypatch)
    broken = run(tiny_cfg(*common, "cache.tiers.cpu=160KiB", "cache.tiers.disk=4MiB"))
    assert dict(broken.outputs) != dict(off.outputs)


@pytest.mark.parametrize("method", ["snapkv", "h2o"])
def test_a_scoring_method_chooses_the_full_layers_tokens_only(tiny: LoadedModel,
                                                              method: str) -> None:
    """A scored method on a hybrid model: its policy chooses which tokens the full layers
    keep (their KV cache group), the sliding layers keep their own window. Brute force:
    one forward over the whole sequence in which each query row sees what the engine's
    attention saw when that token ran (full layers: every earlier token while the prompt
    is read, then the tokens the full group held at that step; sliding layers: their
    window), and every logits row the engine sampled from equals it."""
    from harness.backends.h2o import H2OOptions
    from harness.backends.snapkv import SnapKVOptions

    opts: BackendOptions = (SnapKVOptions(name="snapkv", budget=16, budget_ratio=0,
                                          window=8) if method == "snapkv" else
                            H2OOptions(name="h2o", budget=40, budget_ratio=0))
    prompt = prompts(tiny)[0]
    sampler = RecordingSampler()
    st = build_stack(tiny, CPU, opts, CacheSpec(kv_budget="1MiB"),
                     SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32), sampler)
    kv = st.kv
    assert isinstance(kv, GroupedKVManager) and kv.chooses
    full = kv.members[0]
    from harness.kv.evicting import EvictingKVManager

    assert isinstance(full, EvictingKVManager)
    # Each query position -> the positions the full group held when it ran (a query sees
    # those at or before it).
    seen: dict[int, list[int]] = {}
    real = st.backend.begin_groups

    def spy(batches: list[Any]) -> None:
        b = batches[0]
        for s in [*b.decode_seqs, *(c.sched for c in b.prefills)]:
            held = sorted(int(p) for p in full.live_slots(s.seq)[1])
            for pos in range(s.start, s.start + s.num_tokens):
                seen[pos] = held
        real(batches)

    st.backend.begin_groups = spy  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    st.engine.run(FixedRequests([Request(0, prompt, params)]))
    out = st.engine.metrics.outputs()[0]
    ids, p = prompt + out[:-1], len(prompt)
    assert full.stats.evicted_tokens > 0  # the policy chose (and its slots were reused)
    assert all(m.stats.evicted_tokens > 0 for m in kv.members[1:])  # windows gave back
    assert any(len([j for j in v if j <= k]) < k + 1 for k, v in seen.items()), \
        "the full group chose tokens"
    n = len(ids)
    i = torch.arange(n)
    causal = i[None, :] <= i[:, None]
    full_mask = torch.zeros(n, n, dtype=torch.bool)
    for pos, keep in seen.items():
        full_mask[pos, keep] = True
    full_mask &= causal
    masks = [(i[None, :] > i[:, None] - a.span) & causal if a.kind == "sliding" else full_mask
             for a in tiny.config.layer_attention]

    import torch.nn.functional as F

    def attn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        qs, ks, vs = (x.transpose(0, 1) for x in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=masks[layer], enable_gqa=True)
        return o.transpose(0, 1)

    ref = tiny.model(torch.tensor(ids), i, attn)[p - 1:]
    ours = torch.stack(sampler.rows[0])
    assert (ours - ref).abs().max().item() <= 1e-4
