"""A method's costs are declared once (harness.backends.costs) and the declaration is the
truth the engine's metrics and the roofline read. Held here against two things nobody
declared: what every backend's attention actually touched (its masks, quest's chosen
blocks, kivi's residual, the fp8/int8 sink overlay, the held slots of h2o / tova / snapkv),
step by step, on the tiny model with forks, prefix hits and a forced preemption; and what
the roofline executor counts for the same steps."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from harness.backends import BACKENDS, get_backend
from harness.backends.base import KVLayout
from harness.backends.costs import KVCosts, QuestCosts, StepReads, WindowCosts
from harness.backends.paged_storage import PagedStorageBackend
from harness.engine import executor as executor_mod
from harness.errors import UserError
from harness.metrics.collector import StepRow
from harness.model.tiny import TINY_PRESETS
from harness.roofline.models import hf_config_of
from harness.runner import RunResult, run
from tests.compose import block_size, compose_cfg
from tests.flash_attn_standin import FlashAttnStandin

BS = 8
# Options that make each method act on these short prompts (as the backend matrix).
OPTIONS = {
    "contiguous": ["backend.reserve=exact"],
    "sliding_window": ["backend.window=24"],
    "streaming_llm": ["backend.window=24"],
    "h2o": ["backend.budget=32", "backend.budget_ratio=0"],
    "tova": ["backend.budget=32", "backend.budget_ratio=0"],
    "quest": ["backend.token_budget=16"],
    "snapkv": ["backend.window=8", "backend.budget=12", "backend.budget_ratio=0"],
    "pyramidkv": ["backend.window=8", "backend.budget=12", "backend.budget_ratio=0",
                  "backend.beta=1"],
    "adakv": ["backend.window=8", "backend.budget=12", "backend.budget_ratio=0"],
    "duo_attention": ["backend.sink_tokens=4", "backend.recent=8",
                      "backend.calibration_tokens=64"],
    "flash_attn": ["model.dtype=bfloat16"],  # the CPU stand-in of tests/flash_attn_standin
}
# Forks (n=3 samples share the prompt's blocks) under a budget of ~2 requests' tokens, so
# the third waits and later ones preempt; and one shared prompt (prefix hits).
FORKS = ["workload=parallel_sampling", "workload.num_requests=4", "workload.prompt_tokens=37",
         "workload.output_tokens=14", "workload.n=3"]
PREFIX = ["workload=shared_prefix", "workload.num_requests=4", "workload.prefix_tokens=40",
          "workload.suffix_tokens=5", "workload.output_tokens=9"]
# A compress-once method's cache holds whole compressed prompts (harness.kv.compressed): its
# prefix hits are a conversation's later turns (their prompts the earlier ones' tokens and
# answers, token for token: the roofline's synthetic answers hit as the model's do).
TURNS = ["workload=shared_context", "workload.contexts=2", "workload.turns=2",
         "workload.length=520", "workload.haystack=noise", "workload.answer_tokens=8",
         "workload.ignore_eos=true", "quality.generation_agreement=false"]
WORKLOADS = {"forks_preempted": FORKS, "prefix_hits": PREFIX}
TOKENS = {"forks_preempted": 200, "prefix_hits": 400}  # cache tokens each run gets


@pytest.fixture
def flash_standin(monkeypatch: pytest.MonkeyPatch) -> FlashAttnStandin:
    from harness.backends.flash_attn import FlashAttnBackend

    s = FlashAttnStandin()
    s.block_multiple = BS
    monkeypatch.setattr(FlashAttnBackend, "load_kernels", staticmethod(lambda: s.fns()))
    return s


def _budget(name: str, tokens: int, dtype: torch.dtype) -> int:
    """Bytes that give backend ``name`` ``tokens`` slots on the tiny model (its own bytes
    per slot and residual), so every backend runs the same schedule pressure."""
    c = TINY_PRESETS["tiny"]
    layout = KVLayout(c.num_layers, c.num_kv_heads, c.head_dim, dtype)
    be = get_backend(name)(layout, torch.device("cpu"), block_size=BS)
    return tokens * be.bytes_per_slot() + be.reserved_bytes()


def _compressed_prefixes(name: str) -> bool:
    if name == "flash_attn":  # (its kernels load at construction: the stand-in's test)
        return False
    c = TINY_PRESETS["tiny"]
    layout = KVLayout(c.num_layers, c.num_kv_heads, c.head_dim, torch.float32)
    return get_backend(name)(layout, torch.device("cpu"), block_size=BS).compressed_prefixes


def _overrides(name: str, workload: str) -> list[str]:
    dtype = torch.bfloat16 if name == "flash_attn" else torch.float32
    turns = workload == "prefix_hits" and _compressed_prefixes(name)
    load, tokens = (TURNS, 2000) if turns else (WORKLOADS[workload], TOKENS[workload])
    return ["model=tiny", f"backend={name}", *OPTIONS.get(name, []), *block_size(name, BS),
            *load, f"cache.kv_budget={_budget(name, tokens, dtype)}"]


def _recorded_run(name: str, workload: str,
                  monkeypatch: pytest.MonkeyPatch) -> tuple[RunResult, list[Any]]:
    """A model run whose every step's (declared, touched) pair is kept."""
    seen: list[Any] = []
    real = executor_mod.check_touched

    def record(rec: Any, declared: StepReads, backend: Any, kv: Any) -> None:
        seen.append((declared, backend.touched()))
        real(rec, declared, backend, kv)

    monkeypatch.setattr(executor_mod, "check_touched", record)
    return run(compose_cfg(_overrides(name, workload))), seen


CASES = [(name, w) for name in BACKENDS for w in WORKLOADS]


@pytest.mark.usefixtures("flash_standin")
@pytest.mark.parametrize("name,workload", CASES, ids=[f"{n}-{w}" for n, w in CASES])
def test_declared_reads_equal_what_the_attention_touched(
        name: str, workload: str, monkeypatch: pytest.MonkeyPatch) -> None:
    r, seen = _recorded_run(name, workload, monkeypatch)
    m = r.metrics
    assert m["requests.finished"] == len(r.requests) and m["requests.rejected"] == 0
    assert len(seen) == len(r.steps)  # every step was checked
    for step, (declared, (read, pairs)) in enumerate(seen):
        assert (read.tokens, read.bytes, pairs) == (
            declared.decode_tokens, declared.decode_bytes, declared.prefill_pairs), step
    assert sum(d.decode_queries for d, _ in seen) == sum(s.decode_tokens for s in r.steps)
    assert sum(d.decode_tokens for d, _ in seen) > 0 and sum(p for _, (_, p) in seen) > 0
    if workload == "forks_preempted":  # the scenario happened: forks and a preemption
        assert max(s.running for s in r.steps) >= 3
        if name != "contiguous":  # it reserves a request's whole range at admission
            assert m["sched.preemptions_recompute"] + m["sched.preemptions_swap"] > 0
    elif m["run.prefix_caching"]:
        assert m["cache.prefix_hit_rate"] > 0


def _tiny_config(tmp: Path) -> Path:
    path = tmp / "config.json"
    path.write_text(json.dumps(hf_config_of(TINY_PRESETS["tiny"])))
    return path


def _reads(steps: list[StepRow]) -> list[tuple[int, ...]]:
    return [(s.batch_tokens, s.decode_tokens, s.kv_read_tokens, s.kv_read_bytes,
             s.prefill_pairs) for s in steps]


def _memory(steps: list[StepRow]) -> list[tuple[int, ...]]:
    return [(s.used_bytes, s.reserved_bytes) for s in steps]


ROOFLINE = [n for n in BACKENDS if n != "flash_attn"]  # needs its kernels to be built at all
# h2o and tova give back the tokens their scores rank lowest, and the roofline's scores are
# stand-ins: which blocks empty (and which shared blocks a fork must copy) differs, so
# their held bytes may, and under memory pressure so may the schedule (they are compared
# where nothing preempts); the tokens they hold, and so what they read, may not. adakv
# shares each layer's total among its heads by the scores: its heads' pages may differ.
CHOSEN_BY_SCORES = {"h2o", "tova", "adakv"}


@pytest.mark.parametrize("workload", list(WORKLOADS))
@pytest.mark.parametrize("name", ROOFLINE)
def test_the_roofline_counts_the_same_reads_step_by_step(name: str, workload: str,
                                                         tmp_path: Path) -> None:
    ovr = _overrides(name, workload)
    if name in CHOSEN_BY_SCORES and workload == "forks_preempted":
        ovr.append(f"cache.kv_budget={_budget(name, 2000, torch.float32)}")
    model = run(compose_cfg(ovr))
    roof = run(compose_cfg([*ovr, "executor=roofline", f"roofline.model={_tiny_config(tmp_path)}",
                            "roofline.dtype=float32", "roofline.hardware=cpu"]))
    assert roof.metrics["run.executor"] == "roofline"
    assert _reads(roof.steps) == _reads(model.steps)
    if name not in CHOSEN_BY_SCORES:
        assert _memory(roof.steps) == _memory(model.steps)
    assert roof.metrics["attention.kv_read_bytes_per_token"] == pytest.approx(
        model.metrics["attention.kv_read_bytes_per_token"], rel=1e-12)


def test_a_backend_that_declares_nothing_fails_saying_what_to_declare() -> None:
    class Undeclared(PagedStorageBackend):
        name = "undeclared"

        def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor) -> torch.Tensor:
            return q

    layout = KVLayout(2, 2, 16, torch.float32)
    with pytest.raises(UserError, match=r"declares no costs: implement declare_costs\(\)"):
        Undeclared(layout, torch.device("cpu"))


# -- the declarations themselves, against brute force over positions ------------------------

def _brute_window(start: int, n: int, window: int, sinks: int) -> tuple[int, int]:
    pairs, seen = 0, set()
    for p in range(start, start + n):
        keys = {k for k in range(p + 1) if k > p - window or k < sinks}
        pairs += len(keys)
        seen |= keys
    return pairs, len(seen)


@pytest.mark.parametrize("window,sinks", [(1, 0), (5, 0), (8, 4), (16, 3), (3, 7)])
def test_window_costs_match_brute_force(window: int, sinks: int) -> None:
    c = WindowCosts(10, 4, window, sinks)
    for start in range(0, 30, 3):
        for n in (1, 2, 5, 17):
            pairs, distinct = _brute_window(start, n, window, sinks)
            assert c.prefill_pairs(start, n, start + n) == pairs, (start, n)
            assert c.prefill_read(start, n, start + n).tokens == distinct, (start, n)
        ctx = start + 1
        assert c.decode_read(ctx, ctx).tokens == _brute_window(start, 1, window, sinks)[0]


def test_dense_costs_read_what_is_held() -> None:
    c = KVCosts(10, 8)
    assert c.decode_read(100, 40).tokens == 40  # an eviction method holding 40 of 100
    # A chunk of 5 after 20 held tokens: each query sees the 20 and the chunk up to itself.
    assert c.prefill_pairs(50, 5, 25) == 5 * 20 + 15


def test_quest_costs_read_the_top_blocks_and_every_bound() -> None:
    c = QuestCosts(kv_bytes=100, meta_bytes=7, block_size=8, token_budget=24)  # 3 blocks
    assert c.decode_read(20, 20).tokens == 20  # 3 blocks: all of them
    r = c.decode_read(43, 43)  # 6 blocks (the last holds 3): 2 full + the last
    assert r.tokens == 2 * 8 + 3 and r.bytes == 19 * 100 + 6 * 7
