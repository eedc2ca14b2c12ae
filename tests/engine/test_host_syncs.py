"""A decode step reads nothing back from the device but its sampled tokens (issue #50):
counted on the CPU, where the same calls that would sync on CUDA are visible, for every
backend on both kernel paths; and the pieces that made that so, each against the way it
was done before (RoPE tables, persistent step buffers, the quantized store, the scored
methods' one transfer)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness.backends.quantized import store_kv_quant_torch
from harness.backends.staging import Staging
from harness.engine.host_syncs import HostSyncCounter
from harness.kernels.reference import store_kv_quant_ref
from harness.model.rope import RotaryEmbedding

ROOT = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")

# Syncs a decode step may take: the sampled tokens; the scored methods also send their
# scores to the KV manager's policy (one transfer).
ONE = ("paged", "contiguous", "fp8", "int8", "sliding_window", "streaming_llm", "quest",
       "kivi")
TWO = ("h2o", "tova", "snapkv", "knorm", "keydiff", "observed_attention",
       "expected_attention")
# The paged family on Triton: paged and int8 (a quantizing store) in the default run; the
# others (the same decode kernel) counted with the slow run's methods (the time limit).
TRITON = ("paged", "int8")
TRITON_SLOW = ("fp8", "sliding_window", "streaming_llm")
# The per-head presses (issue #59): they score a prompt once, at its end (pyramidkv, adakv)
# or not at all (duo_attention), and decode over per-head tables unpacked on the device.
HEADWISE = ("pyramidkv", "adakv", "duo_attention")
# Token-evicting methods counted on Triton: a weights score (its weights launch) and a
# window score (snapkv: nothing more a decode).
SCORED_TRITON = ("h2o", "snapkv")


def test_the_counter_sees_each_kind_of_sync() -> None:
    x = torch.arange(6.0)
    with HostSyncCounter() as c:
        int(x.max())
        x[x > 2]  # a boolean mask: its size is read back
        x.nonzero()
        x.tolist()
        x.cpu().numpy()  # one transfer
        x.view(2, 3).t()  # views launch nothing
        y = x * 2
    assert c.num_syncs == 5, c.syncs
    assert c.syncs["Tensor.cpu"] == 1 and "Tensor.numpy" not in c.syncs
    assert c.ops["mul"] == 1 and "view" not in c.ops and "t" not in c.ops
    with HostSyncCounter() as c, torch.inference_mode():
        y.max().item()
        float(y.sum())
    assert c.num_syncs == 2, c.syncs


def _bench(out: Path, kernels: str, backends: tuple[str, ...] = ()) -> dict:
    """One run of the benchmark script (its own process: KVBENCH_CHECK off, as a user's
    run, so only the measured path counts): its rows by (backend, kernel)."""
    env = {**os.environ, "KVBENCH_CHECK": "0"}
    pick = ["--backends", ",".join(backends)] if backends else []
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_host_step.py"),
                           "--model", "tiny", "--batch", "4", "--prompt", "40", "--output",
                           "8", "--no-time", "--kernels", kernels, *pick, "--out", str(out)],
                          env=env, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return {(r["backend"], r["kernel"]): r for r in json.loads(out.read_text())}


@pytest.fixture(scope="module")
def method_counts(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], dict]:
    """The compression methods' counts on Triton (interpreted, ~8 s each: the slow run's;
    the default run keeps the paged family's below)."""
    out = tmp_path_factory.mktemp("syncs") / "methods.json"
    return _bench(out, "triton", ("quest", "kivi", *SCORED_TRITON, *TRITON_SLOW))


@pytest.fixture(scope="module")
def counts(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], dict]:
    """Every backend's counts on torch, and the paged family's on Triton."""
    out = tmp_path_factory.mktemp("syncs") / "rows.json"
    env = {**os.environ, "KVBENCH_CHECK": "0"}
    rows = {**_bench(out, "torch"), **_bench(out, "triton", TRITON)}
    # The per-layer count at SmolLM2's depth (30 layers: per-step constants amortized).
    deep = out.with_name("deep.json")
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_host_step.py"),
                           "--model", "tiny-deep", "--backends", "paged", "--kernels",
                           "triton", "--batch", "2", "--prompt", "8", "--output", "3",
                           "--out", str(deep)], env=env, cwd=ROOT, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    rows[("paged", "triton-deep")] = json.loads(deep.read_text())[0]
    return rows


@pytest.mark.parametrize("backend", ONE + TWO)
def test_a_decode_step_syncs_once_or_twice(counts: dict, backend: str) -> None:
    row = counts[(backend, "torch")]
    budget = 1 if backend in ONE else 2
    assert row["decode_steps"] >= 5
    # Per layer would be 2 more a step at least (model=tiny has 2 layers).
    assert row["max_syncs_decode_step"] <= budget, row
    if backend in ONE:  # a prefill step too: its first token is the one read
        assert row["syncs_per_step"] <= 1, row


@pytest.mark.parametrize("backend", HEADWISE)
def test_a_per_head_decode_step_syncs_once(counts: dict, backend: str) -> None:
    """A decode step over compressed per-head tables reads back its sampled tokens only;
    the run's one other transfer is the prompts' window scores (one step ends every
    prompt here), none for duo_attention, whose heads keep by rule."""
    row = counts[(backend, "torch")]
    assert row["decode_steps"] >= 5
    assert row["max_syncs_decode_step"] == 1, row
    transfers = row["sync_causes"].get("Tensor.cpu", 0)
    assert transfers == (0 if backend == "duo_attention" else 1), row
    assert set(row["sync_causes"]) <= {"Tensor.tolist", "Tensor.cpu"}, row


@pytest.mark.parametrize("backend", [*TRITON, *(pytest.param(b, marks=pytest.mark.slow)
                                                 for b in TRITON_SLOW)])
def test_the_triton_path_syncs_once_a_step(request: pytest.FixtureRequest,
                                           backend: str) -> None:
    counts = request.getfixturevalue("method_counts" if backend in TRITON_SLOW else "counts")
    row = counts[(backend, "triton")]
    assert row["max_syncs_decode_step"] <= 1 and row["syncs_per_step"] <= 1, row
    # A layer: its two norms (the first without a residual), RoPE, the store, the
    # decode, SiLU x mul (harness.kernels.layers): 6 launches.
    assert row["launches_per_decode_step"] == 2 * 6


@pytest.mark.slow
@pytest.mark.parametrize("backend,per_layer", [("quest", 7), ("kivi", 5)])
def test_quest_and_kivi_on_triton_sync_once_a_step(method_counts: dict, backend: str,
                                                   per_layer: int) -> None:
    """Issue #56: their Triton paths keep the step's one sync. A layer: paged's 6 with
    quest's block selection beside its decode (7); kivi's decode in place of paged's and
    its store in torch (5)."""
    row = method_counts[(backend, "triton")]
    assert row["max_syncs_decode_step"] <= 1 and row["syncs_per_step"] <= 1, row
    assert row["launches_per_decode_step"] == 2 * per_layer, row


@pytest.mark.slow
@pytest.mark.parametrize("backend,per_layer", [("h2o", 7), ("snapkv", 6)])
def test_evicting_methods_on_triton_keep_their_syncs(method_counts: dict, backend: str,
                                                     per_layer: int) -> None:
    """Issue #56's second stage: on Triton a token-evicting method's decode step syncs as
    on torch (the sampled ids, and h2o's scores: one transfer) and launches paged's 6 a
    layer, its decode the slot-list form, plus h2o's weights kernel (7)."""
    row = method_counts[(backend, "triton")]
    assert row["max_syncs_decode_step"] <= (2 if backend == "h2o" else 1), row
    assert row["launches_per_decode_step"] == 2 * per_layer, row


def test_a_triton_layer_launches_at_most_20_kernels(counts: dict) -> None:
    """Non-view ATen ops + Triton launches per layer of a decode step, at 30 layers (the
    torch path's ~41 before the fused kernels): 4 matmuls, the output buffer, 6 launches."""
    row = counts[("paged", "triton-deep")]
    per_layer = (row["ops_per_decode_step"] + row["launches_per_decode_step"]) / 30
    assert per_layer <= 20, row
    assert row["launches_per_decode_step"] == 30 * 6


def test_reserved_rope_tables_rotate_as_grown_ones_without_a_sync() -> None:
    grown, reserved = RotaryEmbedding(16, 10000.0), RotaryEmbedding(16, 10000.0)
    reserved.reserve(3000)
    assert reserved.capacity >= 3000
    positions = torch.tensor([0, 5, 2999, 1023, 1024])
    q, k = torch.randn(5, 4, 16), torch.randn(5, 2, 16)
    want = grown.apply(q, k, positions)  # grows its tables: reads the largest position
    with HostSyncCounter() as c:
        got = reserved.apply(q, k, positions)
    assert c.num_syncs == 0, c.syncs
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    with pytest.raises(IndexError):  # past what was reserved: an error, not a wrong angle
        reserved.at(torch.tensor([reserved.capacity]), torch.float32)


def test_staged_fields_live_until_written_again() -> None:
    st = Staging(CPU, capacity=4)
    st.begin()
    a = st.put("pos", [1, 2, 3], 3)
    t = st.put2d("tables", [[7], [8, 9, 10]], 3)
    assert a.tolist() == [1, 2, 3]
    assert t.tolist() == [[7, 0, 0], [8, 9, 10]] and t.is_contiguous()
    st.end()
    st.begin()
    b = st.put("pos", list(range(10)), 10)  # grows: a new buffer, the old view is intact
    assert b.tolist() == list(range(10)) and a.tolist() == [1, 2, 3]
    c = st.put("pos", [5], 1)  # the same buffer again: the last step's view sees it
    assert c.data_ptr() == b.data_ptr() and b[0].item() == 5
    assert st.put2d("tables", [], 3).shape == (0, 3)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8])
def test_the_quantized_store_without_masks_equals_the_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    nb, bs, kv, d, t = 6, 8, 2, 16, 13
    k = torch.randn(t, kv, d, generator=gen) * 3
    v = torch.randn(t, kv, d, generator=gen)
    k[4] = 0.0  # an all-zero vector: scale 0
    slots = torch.randperm(nb * bs, generator=gen)[:t]
    ours = [torch.zeros(nb, bs, kv, d, dtype=dtype) for _ in range(2)] + \
        [torch.zeros(nb, bs, kv) for _ in range(2)]
    ref = [x.clone() for x in ours]
    with HostSyncCounter() as c:
        store_kv_quant_torch(k, v, *ours, slots)
    store_kv_quant_ref(k, v, *ref, slots)
    assert c.num_syncs == 0, c.syncs
    for a, b in zip(ours, ref, strict=True):
        assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                           b.view(torch.uint8) if b.element_size() == 1 else b)


@pytest.mark.parametrize("name", ["h2o", "tova"])
def test_scored_transfers_each_touched_slot_once(name: str) -> None:
    """What the policy receives: every slot the step's attention scored, once, sorted,
    with its summed score, as ``torch.unique`` over the valid slots gave it before."""
    from tests.backend_steps import Driver

    drv = Driver(name, options={"budget": 12, "budget_ratio": 0.0, "prefill": "streaming"})
    be = drv.be
    real = be.take_scores
    seen: list[int] = []

    def take() -> object:
        parts = list(be._chunk_slots)
        if be.batch is not None and be.batch.num_decode:
            parts.append(be._decode_slots[be._decode_valid])
        want = torch.unique(torch.cat(parts)) if parts else None
        values = None if want is None else be._received[want].double().clone()
        got = real()
        if want is None:
            assert got is None
            return got
        assert got is not None
        assert got.slots.tolist() == want.tolist()
        assert torch.equal(torch.from_numpy(got.values), values)
        assert float(be._received.abs().sum()) == 0.0  # cleared for the next step
        seen.append(len(want))
        return got

    be.take_scores = take  # type: ignore[method-assign]
    a, b = drv.add(20, max_tokens=10), drv.add(9, max_tokens=10)
    drv.step([(a, 20), (b, 9)])
    for _ in range(8):
        drv.step([(a, 1), (b, 1)])
    assert len(seen) == 9 and max(seen) > 12  # decodes over a held budget, with padding
