"""DuoAttention's retrieval heads, measured on the model itself at start-up.

The criterion: how much of its attention a head pays to *distant* tokens, those a
streaming head would no longer hold. Over a calibration prompt (the first
``calibration_tokens`` of Python's help texts, pydoc_data.topics, the same offline corpus
as harness.workloads.text: no download, the same on every machine), each query at
position p >= sink + recent has distant keys, positions ``[sink, p - recent]`` (a
streaming head keeps the first ``sink`` and the last ``recent``, p's own included); a
head's score is its causal softmax weight on them, averaged over those queries and over
the KV head's query heads. The heads with the lowest scores lose least by streaming and
stream (harness.kv.policies.duo.choose_streaming: kvpress's rule); the others keep every
token. kvpress's own on-the-fly scoring (``duo_attention_on_the_fly``, mean queries and
keys over BookSum samples) needs a data set; DuoAttention's trained gates, downloaded
patterns.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from harness.errors import UserError

if TYPE_CHECKING:
    from harness.model.llama import LlamaModel
    from harness.model.tokenizer import Tokenizer


def calibration_ids(tokenizer: Tokenizer, n: int) -> list[int]:
    """The first ``n`` tokens (BOS first) of Python's help texts."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    ids = tokenizer.encode(text[:8 * n], add_bos=True)  # >= 1 token per 8 characters
    if len(ids) < n:
        ids = tokenizer.encode(text, add_bos=True)
    if len(ids) < n:
        raise UserError(f"backend.calibration_tokens={n}: the calibration text has "
                        f"{len(ids)} tokens")
    return ids[:n]


def distant_mass(q: torch.Tensor, k: torch.Tensor, sink: int, recent: int) -> torch.Tensor:
    """Each KV head's attention on distant keys (module docstring): q (n, H, D) rotated
    queries and k (n, KV, D) keys of one layer over one prompt -> float32 (KV,)."""
    n, h, d = q.shape
    kv = k.shape[1]
    first = sink + recent
    assert n > first, (n, first)
    qq = q[first:].float().reshape(n - first, kv, h // kv, d)
    logits = torch.einsum("mkgd,nkd->kgmn", qq, k.float()) * d ** -0.5
    qpos = torch.arange(first, n, device=q.device)[:, None]
    kpos = torch.arange(n, device=q.device)[None, :]
    w = torch.softmax(logits.masked_fill(kpos > qpos, float("-inf")), dim=-1)
    distant = (kpos >= sink) & (kpos <= qpos - recent)  # (queries, keys)
    return (w * distant).sum(dim=-1).mean(dim=(1, 2))


def measure_heads(model: LlamaModel, ids: list[int], sink: int,
                  recent: int) -> np.ndarray:
    """Every (layer, KV head)'s distant mass over one forward of ``ids`` with full causal
    attention: float64 (layers, KV heads)."""
    dev = model.device
    out: dict[int, torch.Tensor] = {}

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        out[layer] = distant_mass(q, k, sink, recent)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0), is_causal=True, enable_gqa=True)
        return o[0].transpose(0, 1)

    n = len(ids)
    model(torch.tensor(ids, device=dev), torch.arange(n, device=dev), attend,
          torch.tensor([n - 1], device=dev))
    return torch.stack([out[i] for i in range(len(out))]).double().cpu().numpy()
