"""Decode steps replayed from graphs captured per batch bucket (``engine.cuda_graphs``).

A decode step of B sequences is padded to the smallest bucket >= B (nano-vllm's buckets:
1, 2, 4, 8, then every 16 up to ``max_num_seqs``); each bucket's forward was captured once
at start-up over static buffers (ids, positions, slot mapping, lengths, block tables at
the fixed width ``cdiv(max_model_len, block_size)``), and a step copies its inputs into
them and replays. On CUDA the capture is a ``torch.cuda.CUDAGraph`` (one memory pool
shared by the buckets, the largest captured first, as vLLM does); on the CPU,
:class:`TraceCapture` stands in for it: ``make_fx`` traces the forward once per bucket,
baking every Python value into the trace and keeping every tensor by reference, as a CUDA
graph keeps addresses, so a replay whose only change is its refreshed buffers must give
the eager logits (tests/engine/test_graphs.py holds it, step after step).

Padded rows: token 0 at position 0, length 1, their K/V stored into the backend's pad
block (one block past the pool, never in a table) and their tables pointing at it; their
logits are dropped. Steps with prefill, a batch larger than the last bucket or a sampling
row missing run eagerly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import Tensor

from harness.backends.base import AttentionBatch, KVBackend
from harness.engine.batch import ForwardInputs
from harness.errors import UserError
from harness.model.llama import LlamaModel


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16, up to and including ``max_num_seqs``."""
    out = {b for b in (1, 2, 4, 8) if b <= max_num_seqs}
    out.update(range(16, max_num_seqs + 1, 16))
    out.add(max_num_seqs)
    return sorted(out)


class Capture(Protocol):
    """Records a forward once; returns what replays it (the same output tensor)."""

    def capture(self, fn: Callable[[], Tensor]) -> Callable[[], Tensor]: ...


class CudaCapture:
    """``torch.cuda.CUDAGraph`` per bucket, one memory pool for all of them."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool: Any = None  # the first graph's memory pool, shared by the others

    def capture(self, fn: Callable[[], Tensor]) -> Callable[[], Tensor]:
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # warm-up off the capture: lazy inits, autotune
            fn()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        if self.pool is None:
            self.pool = graph.pool()

        def replay() -> Tensor:
            graph.replay()
            return out
        return replay


class TraceCapture:
    """The CPU stand-in: ``make_fx`` traces the forward once; a replay runs the trace,
    whose Python values are those of the capture and whose tensors are the live ones."""

    def capture(self, fn: Callable[[], Tensor]) -> Callable[[], Tensor]:
        from torch.fx.experimental.proxy_tensor import make_fx

        traced = make_fx(fn)()
        return lambda: traced()


class DecodeGraphs:
    """A captured decode forward per batch bucket, over static inputs of its own."""

    def __init__(self, model: LlamaModel, backend: KVBackend, device: torch.device,
                 max_num_seqs: int, table_width: int, capture: Capture) -> None:
        self.model, self.backend, self.capture = model, backend, capture
        self.buckets = batch_buckets(max_num_seqs)
        self.width = table_width
        n = self.buckets[-1]

        def full(shape: tuple[int, ...], value: int) -> Tensor:
            return torch.full(shape, value, dtype=torch.int64, device=device)

        self.ids, self.positions = full((n,), 0), full((n,), 0)
        self.slots = full((n,), backend.pad_slot)
        self.lens, self.num_blocks = full((n,), 1), full((n,), 1)
        self.tables = full((n, table_width), _pad_block(backend))
        self.rows = torch.arange(n, dtype=torch.int64, device=device)
        self.batches: dict[int, AttentionBatch] = {}
        self.graphs: dict[int, Callable[[], Tensor]] = {}
        self.nbytes = 0  # device memory the capture reserved (setup_graphs measures it)

    def _batch(self, b: int) -> AttentionBatch:
        return AttentionBatch(slot_mapping=self.slots[:b], positions=self.positions[:b],
                              num_decode=b, decode_tables=self.tables[:b],
                              decode_lens=self.lens[:b], decode_num_blocks=self.num_blocks[:b])

    def capture_all(self) -> None:
        """Capture every bucket, the largest first, over all-padded inputs."""
        for b in reversed(self.buckets):
            batch = self.batches[b] = self._batch(b)
            self.backend.begin_step(batch)
            self.graphs[b] = self.capture.capture(self._forward_of(b))

    def _forward_of(self, b: int) -> Callable[[], Tensor]:
        """Bucket ``b``'s forward over the static buffers, as a function of nothing."""
        ids, pos, rows = self.ids[:b], self.positions[:b], self.rows[:b]

        def forward() -> Tensor:
            with torch.inference_mode():
                return self.model(ids, pos, self.backend.attend, rows)
        return forward

    def bucket(self, inputs: ForwardInputs) -> int | None:
        """The bucket a step replays in, or None: it runs eagerly (prefill, too large, a
        decode that does not sample)."""
        a = inputs.attn
        n = a.num_decode
        if a.prefills or n == 0 or n > self.buckets[-1] or len(inputs.samplers) != n \
                or inputs.input_ids.shape[0] != n:
            return None
        return next(b for b in self.buckets if b >= n)

    def run(self, inputs: ForwardInputs, b: int) -> Tensor:
        """Replay bucket ``b`` with ``inputs`` (a decode step of n <= b sequences) copied
        into the static buffers; float32 logits (n, vocab), a copy (the next replay
        rewrites the graph's own)."""
        a = inputs.attn
        n, w = a.num_decode, a.decode_tables.shape[1]
        assert w <= self.width, (w, self.width)
        self.ids[:n].copy_(inputs.input_ids, non_blocking=True)
        self.positions[:n].copy_(a.positions, non_blocking=True)
        self.slots[:n].copy_(a.slot_mapping, non_blocking=True)
        self.lens[:n].copy_(a.decode_lens, non_blocking=True)
        self.num_blocks[:n].copy_(a.decode_num_blocks, non_blocking=True)
        self.tables[:n, :w].copy_(a.decode_tables, non_blocking=True)
        self.tables[:n, w:] = _pad_block(self.backend)
        if n < b:  # rows a previous, larger step left: padding again
            self.ids[n:b] = 0
            self.positions[n:b] = 0
            self.slots[n:b] = self.backend.pad_slot
            self.lens[n:b] = 1
            self.num_blocks[n:b] = 1
            self.tables[n:b] = _pad_block(self.backend)
        self.backend.begin_step(self.batches[b])
        return self.graphs[b]()[:n].clone()


def _pad_block(backend: KVBackend) -> int:
    block = getattr(backend, "pad_block", None)
    assert block is not None, f"backend {backend.name} has no pad block"
    return int(block)


def graphs_unavailable(setting: str, device: torch.device, backend: KVBackend,
                       grouped: bool) -> str | None:
    """Why this run replays no decode graphs under ``engine.cuda_graphs=setting`` (None:
    it does). ``on`` where it cannot is a UserError saying what to change."""
    if setting == "off":
        return "engine.cuda_graphs=off"
    why = ("no CUDA device" if device.type != "cuda" else
           backend.graph_unsafe_reason() or
           ("KV cache groups (a hybrid model's per-group batches)" if grouped else None) or
           ("KVBENCH_CHECK counts what each step's attention touched"
            if backend.track_touches else None))
    if why is not None and setting == "on":
        raise UserError(f"engine.cuda_graphs=on, but {why}: use engine.cuda_graphs=auto "
                        "(graphs where they can run) or off")
    return why


def setup_graphs(setting: str, model: LlamaModel, backend: KVBackend, device: torch.device,
                 grouped: bool, max_num_seqs: int, max_model_len: int, block_size: int,
                 capture: Capture | None = None) -> tuple[DecodeGraphs | None, str]:
    """The run's decode graphs, captured (None when it has none), and what ``run.
    cuda_graphs`` records: "on: buckets ..." or "off: why". ``capture``: the CUDA one by
    default (the CPU stand-in for tests)."""
    why = graphs_unavailable(setting, device, backend, grouped) if capture is None else None
    if why is not None:
        return None, f"off: {why}"
    cuda = device.type == "cuda"
    before = torch.cuda.memory_reserved(device) if cuda else 0
    graphs = DecodeGraphs(model, backend, device, max_num_seqs,
                          -(-max_model_len // block_size), capture or CudaCapture(device))
    graphs.capture_all()
    # What the graphs hold beside the KV cache (their pool, static buffers): device
    # memory the KV budget did not count (the cache was allocated first).
    graphs.nbytes = torch.cuda.memory_reserved(device) - before if cuda else 0
    b = graphs.buckets
    return graphs, f"on: {len(b)} batch buckets, {b[0]}..{b[-1]}"
