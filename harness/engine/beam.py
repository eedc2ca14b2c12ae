"""Beam search over forked sequences: the selection rule, pure and shared with the tests'
brute-force reference, and its application to a sequence group.

Each step, every live beam proposes its ``2 * width`` best next tokens; the ``2 * width``
best candidates overall (by cumulative log-prob) are taken in order: an EOS candidate
becomes a finished hypothesis, any other continues as a beam, until ``width`` beams are
chosen. A parent chosen once keeps its sequence; chosen k times it is forked k - 1 times
(the forks share its blocks, and copy-on-write copies the last block when they diverge);
a parent never chosen is pruned and its blocks freed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.sched.scheduler import Scheduler
from harness.sched.sequence import Sequence, SequenceGroup


@dataclass(slots=True)
class BeamChoice:
    parent: int  # index into the beams given to beam_step
    token: int
    cum_logprob: float


def beam_score(cum_logprob: float, length: int, length_penalty: float) -> float:
    return cum_logprob / max(1, length) ** length_penalty


def beam_step(cum_logprobs: list[float], logprobs: torch.Tensor, width: int,
              eos_ids: frozenset[int]) -> tuple[list[BeamChoice], list[BeamChoice]]:
    """Choose the next beams. logprobs: (num_beams, vocab) float32.

    Returns (continuing beams, at most ``width``; finished candidates that ended in EOS).
    Ties break by (beam index, token id) order, deterministically.
    """
    k = min(2 * width, logprobs.shape[1])
    top_lp, top_tok = logprobs.topk(k, dim=-1)
    cands = []
    for b, cum in enumerate(cum_logprobs):
        for lp, tok in zip(top_lp[b].tolist(), top_tok[b].tolist()):
            cands.append((cum + lp, b, tok))
    cands.sort(key=lambda c: (-c[0], c[1], c[2]))
    keep: list[BeamChoice] = []
    done: list[BeamChoice] = []
    for cum, b, tok in cands[:k]:
        if tok in eos_ids:
            done.append(BeamChoice(b, tok, cum))
        else:
            keep.append(BeamChoice(b, tok, cum))
            if len(keep) == width:
                break
    return keep, done


def is_beam_done(finished: list[tuple[float, list[int]]], live_best: float | None,
                 width: int) -> bool:
    """Done when ``width`` hypotheses are finished and no live beam can still beat the
    worst of them (the heuristic of HF's early_stopping=False)."""
    fin = sorted(finished, key=lambda f: -f[0])[:width]
    if len(fin) < width:
        return False
    return live_best is None or live_best <= fin[-1][0]


def advance_beams(sched: Scheduler, group: SequenceGroup, beams: list[Sequence],
                  logits: torch.Tensor) -> list[tuple[Sequence, int]]:
    """Apply one beam step to ``group``: prune, fork, and return (sequence, token) pairs
    to append. logits: (len(beams), vocab) float32 of the live beams, in order."""
    p = group.params
    width = p.n
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    eos = frozenset(() if p.ignore_eos else sched.eos_token_ids) | frozenset(p.stop_token_ids)
    keep, done = beam_step([b.cum_logprob for b in beams], logprobs, width, eos)
    for c in done:
        toks = [*beams[c.parent].output_ids, c.token]
        group.beam_finished.append((beam_score(c.cum_logprob, len(toks), p.length_penalty),
                                    toks))
    # Fork before anything is appended: a child copies its parent's tokens as they are.
    uses: dict[int, int] = {}
    out: list[tuple[Sequence, int]] = []
    for c in keep:
        parent = beams[c.parent]
        seq = parent if uses.get(c.parent, 0) == 0 else sched.fork(parent)
        uses[c.parent] = uses.get(c.parent, 0) + 1
        out.append((seq, c.token))
    cums = {id(s): c.cum_logprob for (s, _), c in zip(out, keep)}
    for i, b in enumerate(beams):
        if i not in uses:
            sched.finish_seq(b, "pruned")
    for s, _ in out:
        s.cum_logprob = cums[id(s)]
    n_out = len(beams[0].output_ids) + 1
    limit = min(p.max_tokens, sched.cfg.max_model_len - beams[0].num_prompt_tokens)
    live_best = max((beam_score(c.cum_logprob, n_out, p.length_penalty) for c in keep),
                    default=None)
    if n_out >= limit or is_beam_done(group.beam_finished, live_best, width):
        for s, tok in out:
            group.beam_finished.append((beam_score(s.cum_logprob, n_out, p.length_penalty),
                                        [*s.output_ids, tok]))
        group.best_output = max(group.beam_finished, key=lambda f: f[0])[1]
        for s, _ in out:
            sched.finish_seq(s, "beam_done")
        return []
    return out
