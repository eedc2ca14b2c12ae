"""Turn a StepRecord into the tensors of one forward: the model runner's one job."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Protocol

import torch

from harness.backends.base import AttentionBatch, PrefillChunk
from harness.backends.staging import Staging
from harness.sched.sequence import Sequence
from harness.sched.step import ScheduledSeq, StepRecord


class TableSource(Protocol):
    """Where the tables come from: the KV manager (``KVManager.tables``)."""

    def tables(self, seqs: list[Sequence]) -> list[list[int]]: ...


@dataclass(slots=True)
class ForwardInputs:
    """input_ids, positions: int64 (T,); logits_rows: int64 (S,) the batch row of the last
    token of every sequence that samples this step, in the order of ``samplers``.
    ``groups``: under KV cache groups, each group's batch (its tables and slot mapping;
    ``attn`` is the first group's, as the step record's slots are); else empty."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    logits_rows: torch.Tensor
    samplers: list[ScheduledSeq]
    attn: AttentionBatch
    groups: list[AttentionBatch]


def group_batch(base: AttentionBatch, source: TableSource, block_size: int,
                device: torch.device, staging: Staging | None = None,
                field: str = "group") -> AttentionBatch:
    """``base`` (the step's batch) through another KV cache group's tables: the same
    tokens, positions and lengths; that group's decode tables, chunk tables, and its
    slot mapping, each new token's slot read from its table (tables are positional:
    entry i holds positions [i x block_size, (i + 1) x block_size)). ``staging``: the
    persistent buffers to build into (fields named after ``field``); None: fresh ones."""
    st = staging if staging is not None else Staging(device)
    bs, nd = block_size, base.num_decode
    dseqs = [s.seq for s in base.decode_seqs]
    dtables = source.tables(dseqs)
    width = max((len(t) for t in dtables), default=1)
    tables = st.put2d(f"{field}.tables", dtables, width)
    num_blocks = st.put(f"{field}.num_blocks", [len(t) for t in dtables], len(dtables))
    slots: list[torch.Tensor] = []
    if nd:
        pos = base.positions[:nd]
        rows = torch.arange(nd, device=device)
        slots.append(tables[rows, pos // bs] * bs + pos % bs)
    chunks = []
    for i, (c, table) in enumerate(zip(base.prefills,
                                       source.tables([c.sched.seq for c in base.prefills]))):
        t = st.put(f"{field}.chunk{i}", table, len(table))
        pos = torch.arange(c.start, c.start + c.num_tokens, device=device)
        slots.append(t[pos // bs] * bs + pos % bs)
        chunks.append(PrefillChunk(c.row, c.num_tokens, c.start, t, c.sched))
    return AttentionBatch(
        slot_mapping=torch.cat(slots) if slots else base.slot_mapping[:0],
        positions=base.positions, num_decode=nd, decode_tables=tables,
        decode_lens=base.decode_lens, decode_num_blocks=num_blocks,
        decode_seqs=base.decode_seqs, prefills=chunks)


class InputBuilder:
    """Builds each step's :class:`ForwardInputs` into persistent buffers
    (:class:`~harness.backends.staging.Staging`): on the CPU, tensors over buffers that live
    for the run; on CUDA, device buffers filled from pinned host ones without a blocking
    copy. No tensor is built from a Python list and nothing is read back."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.staging = Staging(device)

    def build(self, rec: StepRecord, kv: TableSource, groups: Seq[TableSource] = (),
              block_size: int = 0) -> ForwardInputs:
        """Decodes first (one row each), then prefill chunks; see backends.base.
        ``groups``: each KV cache group's tables (their manager), ``block_size`` their
        blocks' tokens. The tensors are valid until the next :meth:`build`.

        Every table comes from the KV manager already in the form attention reads it, and
        each field is written once for the step (not per sequence: a per-sequence copy
        cost 4.2 us of the 6.8 us per sequence a step's bookkeeping took)."""
        st = self.staging
        st.begin()
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
        for i, (s, table) in enumerate(zip(prefills, kv.tables([s.seq for s in prefills]))):
            row = len(ids)
            ids += s.seq.token_ids[s.start:s.start + s.num_tokens]
            pos += range(s.start, s.start + s.num_tokens)
            slots += s.slots
            chunks.append(PrefillChunk(row, s.num_tokens, s.start,
                                       st.put(f"chunk{i}", table, len(table)), s))
            if s.sample:
                rows.append(row + s.num_tokens - 1)
                samplers.append(s)
        nd = len(decodes)
        dtables = kv.tables(dseqs) if nd else []
        width = max((len(t) for t in dtables), default=1)
        positions = st.put("positions", pos, len(pos))
        attn = AttentionBatch(
            slot_mapping=st.put("slots", slots, len(slots)),
            positions=positions,
            num_decode=nd,
            decode_tables=st.put2d("tables", dtables, width),
            decode_lens=st.put("lens", [p + 1 for p in pos[:nd]], nd),
            decode_num_blocks=st.put("num_blocks", [len(t) for t in dtables], nd),
            decode_seqs=decodes,
            prefills=chunks,
        )
        inputs = ForwardInputs(
            input_ids=st.put("ids", ids, len(ids)),
            positions=positions,
            logits_rows=st.put("rows", rows, len(rows)),
            samplers=samplers,
            attn=attn,
            # The first group's batch is the record's (its slots need not be positional: a
            # token-choosing full group reuses slots); the others' are read from their
            # tables.
            groups=[attn, *(group_batch(attn, g, block_size, self.device, st, f"group{j}")
                            for j, g in enumerate(groups[1:], start=1))] if groups else [],
        )
        st.end()
        return inputs


def build_inputs(rec: StepRecord, kv: TableSource, device: torch.device,
                 groups: Seq[TableSource] = (), block_size: int = 0) -> ForwardInputs:
    """:meth:`InputBuilder.build` into buffers of its own (tests, one-off steps)."""
    return InputBuilder(device).build(rec, kv, groups, block_size)
