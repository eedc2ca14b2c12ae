"""Drive one backend and its KV manager through engine steps without a model: random
queries, keys and values per layer, so a test can hold the outputs, scores and cache
against a brute-force implementation of the method."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from harness.backends import get_backend
from harness.backends.base import CacheSizing, KVBackend, KVLayout
from harness.backends.costs import StepReads, step_reads
from harness.engine.batch import build_inputs
from harness.kv.base import Demand, KVManager
from harness.kv.evicting import EvictingKVManager
from harness.sched.sequence import SamplingParams, SeqStatus, Sequence, SequenceGroup
from harness.sched.step import ScheduledSeq, StepRecord

CPU = torch.device("cpu")
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.float32)
NUM_HEADS = 4


@dataclass
class StepOut:
    """One step: per layer, the queries (rows in batch order) and the attention output."""

    q: list[torch.Tensor]
    out: list[torch.Tensor]
    rows: dict[int, slice]  # seq id -> its rows in the batch


@dataclass
class Driver:
    """A backend and its manager, fed as the engine feeds them. ``k[seq_id]``,
    ``v[seq_id]``: (layers, positions, KV, D), the K/V every position of a sequence will
    store (drawn when it is added)."""

    name: str
    num_blocks: int = 64
    block_size: int = 8
    layout: KVLayout = LAYOUT
    options: dict[str, Any] = field(default_factory=dict)
    prefix_caching: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        self.gen = torch.Generator().manual_seed(self.seed)
        self.be: KVBackend = get_backend(self.name)(self.layout, CPU,
                                                    block_size=self.block_size,
                                                    **self.options)
        self.be.track_touches = True
        self.reads: list[StepReads] = []  # each step's declared reads
        sizing = CacheSizing(kv_budget_bytes=0, bytes_per_slot=self.be.bytes_per_slot(),
                             num_slots=self.num_blocks * self.block_size,
                             block_size=self.block_size, num_blocks=self.num_blocks,
                             num_cpu_blocks=0)
        self.kv: KVManager = self.be.make_manager(
            sizing, enable_prefix_caching=self.prefix_caching, watermark=0.0)
        self.be.allocate(sizing)
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self._next = 0

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen)

    def add(self, prompt_len: int, max_tokens: int = 16,
            tokens: list[int] | None = None) -> Sequence:
        lay = self.layout
        self._next += 1
        toks = tokens if tokens is not None else [1 + (self._next * 7 + i) % 50
                                                  for i in range(prompt_len)]
        g = SequenceGroup(self._next, list(toks), SamplingParams(max_tokens=max_tokens))
        s = Sequence(self._next, g, list(toks))
        s.status = SeqStatus.RUNNING
        g.seqs.append(s)
        n = prompt_len + max_tokens + 1
        self.k[s.seq_id] = self.randn(lay.num_layers, n, lay.num_kv_heads, lay.head_dim)
        self.v[s.seq_id] = self.randn(lay.num_layers, n, lay.num_kv_heads, lay.head_dim)
        return s

    def step(self, chunks: list[tuple[Sequence, int]], observe: bool = True) -> StepOut:
        """One step: ``(seq, n)`` adds ``n`` tokens to ``seq`` (1 = a decode once its
        prompt is in). A sequence whose chunk reaches its last token samples one."""
        rec = StepRecord(0)
        for s, n in chunks:
            slots = self.kv.allocate_group([Demand(s, n)])[0]
            start = s.num_computed
            s.num_computed += n
            rec.seqs.append(ScheduledSeq(s, start, n, slots, s.num_computed == s.num_tokens))
        ops = self.kv.take_cache_ops()
        rec.copies, rec.invalidated = ops.copies, ops.invalidated
        self.be.apply_cache_ops(rec)
        inputs = build_inputs(rec, self.kv, CPU)
        attn = inputs.attn
        self.be.begin_step(attn)
        order = [*attn.decode_seqs, *(c.sched for c in attn.prefills)]
        rows, r = {}, 0
        for sc in order:
            rows[sc.seq.seq_id] = slice(r, r + sc.num_tokens)
            r += sc.num_tokens
        lay = self.layout
        qs, outs = [], []
        for layer in range(lay.num_layers):
            q = self.randn(r, NUM_HEADS, lay.head_dim)
            k = torch.cat([self.k[sc.seq.seq_id][layer, sc.start:sc.start + sc.num_tokens]
                           for sc in order])
            v = torch.cat([self.v[sc.seq.seq_id][layer, sc.start:sc.start + sc.num_tokens]
                           for sc in order])
            qs.append(q)
            outs.append(self.be.attend(layer, q, k, v))
        # The declaration against the tensors, every step: what the attention touched.
        declared = step_reads(rec, self.kv, self.be.costs())
        read, pairs = self.be.touched()
        assert (read.tokens, read.bytes, pairs) == (
            declared.decode_tokens, declared.decode_bytes, declared.prefill_pairs), \
            (self.name, (read, pairs), declared)
        self.reads.append(declared)
        scores = self.be.take_scores()
        for s, _ in chunks:
            if s.num_computed == s.num_tokens:
                s.token_ids.append(1)
        self.kv.end_forward()
        if observe:
            self.kv.observe([s for s, _ in chunks], scores)
        self.last_scores = scores
        return StepOut(qs, outs, rows)

    def read_bytes_per_token(self) -> float:
        """Declared cache bytes per decode query over the steps so far."""
        q = sum(r.decode_queries for r in self.reads)
        assert q, "no decode ran"
        return sum(r.decode_bytes for r in self.reads) / q

    def held(self, seq: Sequence) -> tuple[list[int], list[int]]:
        """(slots, positions) of the tokens ``seq`` holds, in position order, as the
        evicting manager says (its view is current; the backend's follows next step)."""
        kv = self.kv
        assert isinstance(kv, EvictingKVManager)
        slots, pos = kv.live_slots(seq)
        order = pos.argsort()
        return slots[order].tolist(), pos[order].tolist()

    def prefill(self, seq: Sequence, chunks: list[int]) -> dict[int, list[torch.Tensor]]:
        """Prefill ``seq`` in ``chunks`` (a full trigger: nothing may go before the prompt's
        end, checked); returns each prompt position's query, (H, D) per layer."""
        qs: dict[int, list[torch.Tensor]] = {}
        for n in chunks:
            first = seq.num_computed
            out = self.step([(seq, n)])
            rows = out.rows[seq.seq_id]
            for j in range(n):
                qs[first + j] = [out.q[layer][rows.start + j]
                                 for layer in range(self.layout.num_layers)]
            if seq.num_computed < seq.num_prompt_tokens:
                assert len(self.held(seq)[1]) == seq.num_computed
        return qs

    def check_compressed_once(self, seq: Sequence, keep: int, decodes: int = 5) -> None:
        """After a press's one selection: the kept prompt compacted into whole blocks, and
        every token decoded afterwards kept beside it (no decode budget)."""
        kv = self.kv
        assert isinstance(kv, EvictingKVManager)
        _, pos = self.held(seq)
        assert len(pos) == keep
        assert len(kv.table_of(seq)) == -(-keep // self.block_size)  # whole blocks back
        for _ in range(decodes):
            self.step([(seq, 1)])
        _, after = self.held(seq)
        assert after[:keep] == pos and len(after) == keep + decodes
