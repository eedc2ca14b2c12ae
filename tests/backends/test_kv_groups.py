"""KV cache groups (harness.kv.groups, issue #29) in the what-if: the groups vLLM's rule
plans, the chunk policy and the grouped reads against brute forces, a grouped and a
uniform cache on the same requests (the same tokens, the grouped one holding and
admitting more), and what groups refuse."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from harness.backends.costs import GroupedCosts
from harness.errors import UserError
from harness.kv.groups import KVGroup, describe_groups, plan_groups
from harness.kv.policies.base import HeldBlocks
from harness.kv.policies.chunk import ChunkPolicy
from harness.layer_types import FULL, LayerAttention
from harness.roofline.models import GEMMA_3_27B, GPT_OSS_120B, LLAMA_4_SCOUT
from harness.runner import run
from tests.compose import compose_cfg
from tests.helpers import make_seq

S1024, C8192 = LayerAttention("sliding", 1024), LayerAttention("chunked", 8192)


def test_groups_as_vllm_plans_them() -> None:
    plan, size = plan_groups(GPT_OSS_120B.layer_attention)
    assert size == 18 and plan == [KVGroup(FULL, 18), KVGroup(LayerAttention("sliding", 128),
                                                                 18)]
    plan, size = plan_groups(GEMMA_3_27B.layer_attention)  # 10 full, 52 sliding
    assert size == 10 and plan == [KVGroup(FULL, 10)] + [KVGroup(S1024, 10)] * 5 + [
        KVGroup(S1024, 2)]
    assert describe_groups(plan, size) == "1 full + 6 sliding 1024 (10 layers a group; 8 padded)"
    plan, size = plan_groups(LLAMA_4_SCOUT.layer_attention)  # 12 full, 36 chunked
    assert size == 12 and plan == [KVGroup(FULL, 12)] + [KVGroup(C8192, 12)] * 3


def test_chunk_policy_against_brute_force() -> None:
    """Every block wholly before the next query's chunk goes, once; nothing else."""
    rng = random.Random(0)
    for _ in range(200):
        chunk, bs = rng.choice([4, 6, 8, 16]), rng.choice([2, 4, 8])
        pol = ChunkPolicy(chunk)
        seq = make_seq([1] * 2)
        table = list(range(100))
        cursor, gone = 0, set()
        for n in sorted(rng.sample(range(1, 80), 6)):
            seq.num_computed = n
            ev = pol.select(seq, HeldBlocks(table, cursor, bs), 0)
            gone |= set(ev.blocks)
            cursor = ev.considered if ev.considered is not None else cursor
            for b in ev.blocks:
                table[b] = -1
            start = n - n % chunk  # the next query's chunk
            assert gone == {i for i in range(100) if (i + 1) * bs <= start}, (chunk, bs, n)


def test_grouped_costs_against_brute_force() -> None:
    """Decode reads and prefill pairs, summed layer by layer from what each query sees."""
    kinds = ((2, "full", 0), (3, "sliding", 7), (1, "chunked", 5))
    c = GroupedCosts([(LayerAttention(k, s), n) for n, k, s in kinds], layer_bytes=10,
                     block_size=4, slot_bytes=30)

    def seen(kind: str, span: int, pos: int) -> int:  # keys the query at `pos` sees
        if kind == "sliding":
            return min(pos + 1, span)
        if kind == "chunked":
            return pos % span + 1
        return pos + 1

    for ctx in range(1, 40):
        layer_tokens = sum(n * seen(k, s, ctx - 1) for n, k, s in kinds)
        r = c.decode_read(ctx, ctx)
        assert r.bytes == layer_tokens * 10 and r.tokens == layer_tokens // 6
    for start in range(0, 30, 3):
        for n in (1, 2, 5, 11):
            pairs = sum(cnt * sum(seen(k, s, p) for p in range(start, start + n))
                        for cnt, k, s in kinds)
            assert c.prefill_pairs(start, n, start + n) == pairs // 6, (start, n)


CONFIG = {"model_type": "gpt_oss", "num_hidden_layers": 4, "hidden_size": 256,
          "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 64, "vocab_size": 1000, "max_position_embeddings": 4096,
          "sliding_window": 64,
          "layer_types": ["sliding_attention", "full_attention"] * 2}


def what_if(path: Path, *extra: str) -> Any:
    return run(compose_cfg([
        "executor=roofline", f"roofline.model={path}", "roofline.hardware=h100-sxm",
        "cache.kv_budget=16MiB", "workload=random", "workload.num_requests=40",
        "workload.input_mean=600", "workload.input_std=200", "workload.input_max=1000",
        "workload.output_mean=200", "workload.output_std=50", "workload.output_max=300",
        "scheduler.max_num_batched_tokens=512", *extra]))


def test_grouped_and_uniform_on_the_same_requests(tmp_path: Path) -> None:
    p = tmp_path / "config.json"
    p.write_text(json.dumps(CONFIG))
    grouped = what_if(p)
    uniform = what_if(p, "cache.kv_groups=uniform")
    g, u = grouped.metrics, uniform.metrics
    assert g["run.kv_groups"] == "1 full + 1 sliding 64 (2 layers a group)"
    assert u["run.kv_groups"].startswith("uniform: 2 full + 2 sliding 64")
    assert grouped.outputs == uniform.outputs  # synthetic ids: every request finished alike
    assert g["requests.finished"] == u["requests.finished"] == 40
    # The same reads (the sliding layers read their window either way) ...
    assert g["attention.kv_read_bytes_per_token"] == pytest.approx(
        u["attention.kv_read_bytes_per_token"], rel=0.05)
    # ... in half the bytes per slot, a sliding group giving back what its window left.
    assert g["roofline.kv_bytes_per_token"] * 2 == u["roofline.kv_bytes_per_token"]
    assert g["memory.kv_group_slots"] == 2 * g["memory.token_capacity"]
    # Per group: the full group holds every token, the sliding one at most its window,
    # one 512-token chunk and a block per running sequence.
    # The waste split per group adds up to the run's: reservation + internal = waste.
    for i in (0, 1):
        assert g[f"memory.kv_group.{i}.reservation_pct"] + g[
            f"memory.kv_group.{i}.internal_frag_pct"] == pytest.approx(
            g[f"memory.kv_group.{i}.waste_pct"])
    full, sliding = g["memory.kv_group.0.peak_held_bytes"], g["memory.kv_group.1.peak_held_bytes"]
    page = g["roofline.kv_bytes_per_token"] * 16
    assert sliding < full
    peak_seqs = max(s.running for s in grouped.steps)
    assert sliding <= peak_seqs * (-(-(64 + 512) // 16) + 1) * page
    assert g["cache.evicted_tokens"] > 0 and u["cache.evicted_tokens"] == 0
    # Under one budget the grouped cache runs more sequences at once, and sooner.
    assert g["memory.max_running_seqs"] > 1.5 * u["memory.max_running_seqs"]
    assert g["latency.e2e_ms.p50"] < u["latency.e2e_ms.p50"]


def test_what_groups_refuse(tmp_path: Path) -> None:
    p = tmp_path / "config.json"
    p.write_text(json.dumps(CONFIG))
    with pytest.raises(UserError, match="backend quest as configured is not one: use "):
        what_if(p, "backend=quest")
    # Swap is built (every group's blocks to one CPU pool; tests/engine/test_gemma3.py checks
    # the tokens): a what-if swaps too.
    m = what_if(p, "scheduler.preemption_mode=swap", "cache.swap_space=1GiB").metrics
    assert m["requests.finished"] == 40 and m["sched.preemptions_swap"] > 0


def test_prefix_hits_across_groups_in_a_multiturn_what_if(tmp_path: Path) -> None:
    """Conversations re-send their history: the grouped cache hits it in every group
    (the sliding group only the blocks its window sees), as often as the uniform one."""
    p = tmp_path / "config.json"
    p.write_text(json.dumps(CONFIG))
    common = ["executor=roofline", f"roofline.model={p}", "roofline.hardware=h100-sxm",
              "cache.kv_budget=64MiB", "workload=multiturn", "workload.conversations=6",
              "workload.turns=3", "workload.system_words=40", "workload.user_words=20"]
    grouped = run(compose_cfg(common))
    uniform = run(compose_cfg([*common, "cache.kv_groups=uniform"]))
    g, u = grouped.metrics, uniform.metrics
    assert g["cache.prefix_hit_rate"] > 0.3
    assert g["cache.prefix_hit_rate"] == pytest.approx(u["cache.prefix_hit_rate"])
    assert g["cache.prefill_tokens_computed"] == u["cache.prefill_tokens_computed"]
    assert grouped.outputs == uniform.outputs
