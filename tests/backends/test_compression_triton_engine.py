"""The compression methods on their Triton paths through the engine (issue #56): on the
tiny model and a long-prompt workload they give the torch path's greedy tokens on every
request, and with every Triton launch counted each decode step launches the method's own
kernel per layer while no torch op reads the K/V cache (the store, a write path, aside):
quest and kivi (first stage), and the token-evicting methods (second stage: the paged
decode over their slot lists, plus the weights kernel for those scoring by attention)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from harness.backends.kivi import KIVIBackend
from harness.backends.paged_storage import PagedStorageBackend
from harness.backends.quest import QuestBackend
from harness.backends.scored import ScoredBackend
from harness.backends.slotted import SlottedBackend
from harness.engine.executor import ModelExecutor
from harness.engine.host_syncs import HostSyncCounter, count_launches
from harness.runner import run
from tests.compose import compose_cfg

pytest.importorskip("triton")

LAYERS = 2  # model=tiny
# A long prompt (120 tokens: 15 blocks of 8) beside two short chats, so quest's budget of
# 4 blocks leaves most of it unread and kivi seals blocks while others fill.
LONG_PROMPT = ["model=tiny", "workload=long_prompt", "workload.num_short=2",
               "workload.short_output_tokens=6", "workload.long_prompt_tokens=120",
               "workload.num_long=1", "workload.long_start_s=0",
               "workload.long_output_tokens=12", "cache.kv_budget=512KiB",
               "backend.block_size=8"]
METHODS = {"quest": ["backend=quest", "backend.token_budget=32"],
           "kivi": ["backend=kivi", "backend.bits=2"]}
OWN = {"quest": ("_quest_select_kernel", "_decode_kernel"), "kivi": ("_kivi_decode_kernel",)}
# The token-evicting methods at their defaults (budget 20% of the request or prompt: the
# long prompt keeps 24-27 of its 120 tokens, the chats 7-8 of 32; each trigger is met). The
# decode over their slot lists is the paged decode's slot-list form; those scoring by
# attention weights add one weights launch a layer.
EVICTING = ["h2o", "tova", "observed_attention", "snapkv", "knorm", "keydiff",
            "expected_attention"]
WEIGHTS = {"h2o", "tova", "observed_attention"}
# Each ~5 s interpreted (the model's fused layers run there too): the default run keeps one
# method per kind of score that a kernel gives (weights, window), the rest (knorm's keys
# scored in torch among them) run with -m slow: the suite's time limit.
DEFAULT = {"h2o", "snapkv"}
EVICTING_CASES = [m if m in DEFAULT else pytest.param(m, marks=pytest.mark.slow)
                  for m in EVICTING]
# quest and kivi each ~8 s a run interpreted: the default run checks kivi's tokens and
# quest's launches, -m slow the other two.
TOKEN_CASES = ["kivi", pytest.param("quest", marks=pytest.mark.slow)]
LAUNCH_CASES = ["quest", pytest.param("kivi", marks=pytest.mark.slow)]


def _run(method: str, kernel: str) -> Any:
    over = METHODS.get(method, [f"backend={method}"])
    return run(compose_cfg([*LONG_PROMPT, *over, f"backend.kernel={kernel}"]))


@pytest.mark.parametrize("method", TOKEN_CASES)
def test_triton_gives_the_torch_paths_greedy_tokens(method: str) -> None:
    ref, tri = _run(method, "torch"), _run(method, "triton")
    assert ref.metrics["run.kernel"] == "torch" and tri.metrics["run.kernel"] == "triton"
    assert set(tri.outputs) == set(ref.outputs) == {0, 1, 2}
    for rid, ids in ref.outputs.items():
        assert tri.outputs[rid] == ids, rid
    assert [len(ref.outputs[i]) for i in range(3)] == [6, 6, 12]
    assert tri.metrics["attention.kv_read_bytes_per_token"] == \
        ref.metrics["attention.kv_read_bytes_per_token"]


def _cache_tensors(be: PagedStorageBackend) -> list[torch.Tensor]:
    """Every tensor holding the cache's K/V: codes, scales and zeros and the residual
    (kivi), the blocks (quest's K/V; its key bounds are not K/V)."""
    if isinstance(be, KIVIBackend):
        r = be.residual
        return [*be.k_q, *be.v_q, *be.k_scale, *be.k_zero, *be.v_scale, *be.v_zero, *r.k,
                *r.v]
    return [*be.k_cache, *be.v_cache]  # paged's layout: quest's and the slot lists'



class KVReads(TorchDispatchMode):
    """Counts, by op, the torch ops that take one of the backend's K/V tensors as an
    argument (views aside: they read nothing) while attention runs; the kvbench custom ops
    (the Triton launches) are not torch reads."""

    def __init__(self, be: PagedStorageBackend) -> None:
        super().__init__()
        self.be = be
        self.reads: Counter[str] = Counter()
        self.quiet = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if not self.quiet and not func.is_view and func.namespace != "kvbench":
            ptrs = {t.untyped_storage().data_ptr() for t in _cache_tensors(self.be)}
            flat, _ = tree_flatten((args, kwargs))
            if any(isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in ptrs
                   for t in flat):
                self.reads[func.overloadpacket.__name__] += 1
        return func(*args, **kwargs)


def _quiet_store(orig: Any, modes: list[KVReads]) -> Any:
    """A scored method's store (its own override: knorm scores the new keys there) with
    the watch quiet, as the storage's."""
    def store(self: PagedStorageBackend, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if modes:
            modes[-1].quiet += 1
        try:
            orig(self, layer, k, v)
        finally:
            if modes:
                modes[-1].quiet -= 1
    return store


@pytest.fixture
def watched(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[bool, Counter, Counter]]]:
    """Each forward: (decode only, its Triton launches by kernel, torch reads of K/V by op
    inside the backend's attention, its store excepted)."""
    counter = HostSyncCounter()
    rows: list[tuple[bool, Counter, Counter]] = []
    modes: list[KVReads] = []

    def forward(self: ModelExecutor, rec: Any) -> Any:
        before = Counter(counter.launches)
        modes.clear()
        out = orig_forward(self, rec)
        reads = sum((m.reads for m in modes), Counter())
        rows.append((all(s.is_decode for s in rec.seqs), Counter(counter.launches) - before,
                     reads))
        return out

    def wrap_attend(cls: type[PagedStorageBackend]) -> None:
        orig = cls.attend

        def attend(self: PagedStorageBackend, layer: int, q: torch.Tensor,
                   k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            mode = KVReads(self)
            modes.append(mode)
            with mode:
                return orig(self, layer, q, k, v)
        monkeypatch.setattr(cls, "attend", attend)
        orig_store = cls.store

        def store(self: PagedStorageBackend, layer: int, k: torch.Tensor,
                  v: torch.Tensor) -> None:
            if modes:
                modes[-1].quiet += 1
            try:
                orig_store(self, layer, k, v)
            finally:
                if modes:
                    modes[-1].quiet -= 1
        monkeypatch.setattr(cls, "store", store)

    orig_forward = ModelExecutor.forward
    monkeypatch.setattr(ModelExecutor, "forward", forward)
    wrap_attend(QuestBackend)
    wrap_attend(KIVIBackend)
    wrap_attend(SlottedBackend)
    monkeypatch.setattr(ScoredBackend, "store", _quiet_store(ScoredBackend.store, modes))
    with count_launches(counter):
        yield rows


@pytest.mark.parametrize("method", LAUNCH_CASES)
def test_decode_launches_its_own_kernel_and_gathers_no_kv_in_torch(
        method: str, watched: list[tuple[bool, Counter, Counter]]) -> None:
    _run(method, "triton")
    decodes = [(n, r) for only, n, r in watched if only]
    assert len(decodes) >= 5
    for launches, reads in decodes:
        for name in OWN[method]:
            assert launches[name] == LAYERS, (name, launches)
        if method == "kivi":  # dequantized in its own kernel, not the paged decode's
            assert launches["_decode_kernel"] == 0, launches
        assert not reads, reads  # no torch op read K/V
    if method == "quest":  # its prefill is a kernel too: no torch read of K/V at all
        assert all(not r for _, _, r in watched), [r for _, _, r in watched if r]


@pytest.mark.parametrize("method", list(METHODS))
def test_the_torch_path_is_seen_reading_kv(method: str,
                                           watched: list[tuple[bool, Counter, Counter]]) -> None:
    """The watch can fail: on the torch path each decode step reads K/V in torch."""
    _run(method, "torch")
    decodes = [r for only, _, r in watched if only]
    assert decodes and all(r for r in decodes), decodes


@pytest.mark.parametrize("method", EVICTING_CASES)
def test_evicting_methods_on_triton_give_the_torch_paths_tokens_from_their_own_kernels(
        method: str, watched: list[tuple[bool, Counter, Counter]]) -> None:
    """Second stage: the same greedy tokens on every request (scores within rounding, ties
    broken as on the torch path: the policy is the same code on both), the same tokens
    evicted and bytes read; and every decode step launches the slot-list decode (and the
    weights kernel where the score is attention) once per layer, with no torch op reading
    K/V inside attention, decode or prefill alike for the attention-weight scores."""
    ref = _run(method, "torch")
    watched.clear()
    tri = _run(method, "triton")
    assert ref.metrics["run.kernel"] == "torch" and tri.metrics["run.kernel"] == "triton"
    assert set(tri.outputs) == set(ref.outputs) == {0, 1, 2}
    for rid, ids in ref.outputs.items():
        assert tri.outputs[rid] == ids, rid
    for key in ("cache.evicted_tokens", "attention.kv_read_bytes_per_token",
                "memory.peak_used_bytes"):
        assert tri.metrics[key] == ref.metrics[key], key
    assert ref.metrics["cache.evicted_tokens"] > 0
    decodes = [(n, r) for only, n, r in watched if only]
    assert len(decodes) >= 5
    for launches, reads in decodes:
        assert launches["_decode_kernel"] == LAYERS, launches
        assert launches["_decode_weights_kernel"] == (LAYERS if method in WEIGHTS else 0)
        assert not reads, reads  # no torch op read K/V
    if method in WEIGHTS:  # scored in the kernels while prefilling too
        assert all(not r for _, _, r in watched), [r for _, _, r in watched if r]


def test_the_torch_path_of_an_evicting_method_is_seen_reading_kv(
        watched: list[tuple[bool, Counter, Counter]]) -> None:
    _run("h2o", "torch")
    decodes = [r for only, _, r in watched if only]
    assert decodes and all(r for r in decodes), decodes
