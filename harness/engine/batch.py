"""Turn a StepRecord into the tensors of one forward: the model runner's one job."""

from __future__ import annotations

import array
from dataclasses import dataclass
from typing import Protocol

import torch

from harness.backends.base import AttentionBatch, PrefillChunk
from harness.sched.sequence import Sequence
from harness.sched.step import ScheduledSeq, StepRecord


class TableSource(Protocol):
    """Where the tables come from: the KV manager (``KVManager.tables``)."""

    def tables(self, seqs: list[Sequence]) -> list[list[int]]: ...


@dataclass(slots=True)
class ForwardInputs:
    """input_ids, positions: int64 (T,); logits_rows: int64 (S,) the batch row of the last
    token of every sequence that samples this step, in the order of ``samplers``."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    logits_rows: torch.Tensor
    samplers: list[ScheduledSeq]
    attn: AttentionBatch


def i64(xs: list[int], device: torch.device) -> torch.Tensor:
    """An int64 tensor of ``xs`` on ``device``. Through an ``array`` buffer: 3.5x faster
    than ``torch.tensor(list)`` (8.5 vs 30 us for 768 ints here), and this runs for every
    field of every step."""
    if not xs:
        return torch.zeros(0, dtype=torch.int64, device=device)
    t = torch.frombuffer(array.array("q", xs), dtype=torch.int64)  # shares, keeps it alive
    return t if device.type == "cpu" else t.to(device)


def build_inputs(rec: StepRecord, kv: TableSource, device: torch.device) -> ForwardInputs:
    """Decodes first (one row each), then prefill chunks; see backends.base.

    Every table comes from the KV manager already in the form attention reads it, and each
    tensor is built once for the step (one ``torch.tensor`` per field, not per sequence:
    a per-sequence copy cost 4.2 us of the 6.8 us per sequence a step's bookkeeping took).
    """
    # Decode or prefill: ScheduledSeq.is_decode (a prompt's last token is prefill).
    decodes = [s for s in rec.seqs if s.is_decode]
    prefills = [s for s in rec.seqs if not s.is_decode]
    # Comprehensions, not appends in one loop: this runs for every sequence every step.
    dseqs = [s.seq for s in decodes]
    pos = [s.start for s in decodes]
    ids = [q.token_ids[p] for q, p in zip(dseqs, pos)]
    slots = [s.slots[0] for s in decodes]
    rows = [i for i, s in enumerate(decodes) if s.sample]
    samplers = [decodes[i] for i in rows] if len(rows) < len(decodes) else list(decodes)
    chunks: list[PrefillChunk] = []
    for s, table in zip(prefills, kv.tables([s.seq for s in prefills])):
        row = len(ids)
        ids += s.seq.token_ids[s.start:s.start + s.num_tokens]
        pos += range(s.start, s.start + s.num_tokens)
        slots += s.slots
        chunks.append(PrefillChunk(row, s.num_tokens, s.start, i64(table, device), s))
        if s.sample:
            rows.append(row + s.num_tokens - 1)
            samplers.append(s)
    nd = len(decodes)
    if nd:
        tables = kv.tables(dseqs)
        nblocks = [len(t) for t in tables]
        width = max(nblocks)
        # One flat list, one tensor: a nested list converts row by row, several times slower.
        pad = [0] * width
        flat = [b for t, n in zip(tables, nblocks) for b in (t + pad[n:] if n < width else t)]
        decode_tables = i64(flat, device).view(nd, width)
        lens = i64([p + 1 for p in pos[:nd]], device)
        num_blocks = i64(nblocks, device)
    else:
        decode_tables = torch.zeros((0, 1), dtype=torch.int64, device=device)
        lens = torch.zeros(0, dtype=torch.int64, device=device)
        num_blocks = torch.zeros(0, dtype=torch.int64, device=device)
    positions = i64(pos, device)
    attn = AttentionBatch(
        slot_mapping=i64(slots, device),
        positions=positions,
        num_decode=nd,
        decode_tables=decode_tables,
        decode_lens=lens,
        decode_num_blocks=num_blocks,
        decode_seqs=decodes,
        prefills=chunks,
    )
    return ForwardInputs(
        input_ids=i64(ids, device),
        positions=positions,
        logits_rows=i64(rows, device),
        samplers=samplers,
        attn=attn,
    )
