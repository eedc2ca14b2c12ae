"""Turn a StepRecord into the tensors of one forward: the model runner's one job."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.backends.base import AttentionBatch, PrefillChunk
from harness.sched.step import ScheduledSeq, StepRecord


@dataclass(slots=True)
class ForwardInputs:
    """input_ids, positions: int64 (T,); logits_rows: int64 (S,) the batch row of the last
    token of every sequence that samples this step, in the order of ``samplers``."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    logits_rows: torch.Tensor
    samplers: list[ScheduledSeq]
    attn: AttentionBatch


def build_inputs(rec: StepRecord, block_size: int, device: torch.device) -> ForwardInputs:
    """Decodes first (one row each), then prefill chunks; see backends.base."""
    # Any one-token chunk is a "decode" for attention: one query over its context.
    decodes = [s for s in rec.seqs if s.num_tokens == 1]
    prefills = [s for s in rec.seqs if s.num_tokens != 1]
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    rows: list[int] = []
    samplers: list[ScheduledSeq] = []
    for s in decodes:
        if s.sample:
            rows.append(len(ids))
            samplers.append(s)
        ids.append(s.seq.token_ids[s.start])
        pos.append(s.start)
        slots += s.slots
    chunks: list[PrefillChunk] = []
    for s in prefills:
        row = len(ids)
        ids += s.seq.token_ids[s.start:s.start + s.num_tokens]
        pos += range(s.start, s.start + s.num_tokens)
        slots += s.slots
        # Evicted (-1) entries point at block 0: masked out by the window backends.
        table = torch.tensor(s.seq.block_table, dtype=torch.int64).clamp_(min=0).to(device)
        chunks.append(PrefillChunk(row, s.num_tokens, s.start, table, s))
        if s.sample:
            rows.append(row + s.num_tokens - 1)
            samplers.append(s)
    nd = len(decodes)
    if nd:
        width = max(len(s.seq.block_table) for s in decodes)
        tables = torch.zeros((nd, width), dtype=torch.int64)
        for i, s in enumerate(decodes):
            bt = s.seq.block_table
            # Evicted (-1) entries point at block 0: masked out by the window backends.
            tables[i, :len(bt)] = torch.tensor(bt, dtype=torch.int64).clamp_(min=0)
        lens = torch.tensor([s.start + 1 for s in decodes], dtype=torch.int64)
    else:
        tables = torch.zeros((0, 1), dtype=torch.int64)
        lens = torch.zeros(0, dtype=torch.int64)
    attn = AttentionBatch(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        positions=torch.tensor(pos, dtype=torch.int64, device=device),
        num_decode=nd,
        decode_tables=tables.to(device),
        decode_lens=lens.to(device),
        decode_seqs=decodes,
        prefills=chunks,
    )
    return ForwardInputs(
        input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
        positions=torch.tensor(pos, dtype=torch.int64, device=device),
        logits_rows=torch.tensor(rows, dtype=torch.int64, device=device),
        samplers=samplers,
        attn=attn,
    )
