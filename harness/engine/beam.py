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

from harness.sched.sequence import Sequence, SequenceGroup
from harness.sched.step import NewToken, StepOutcome


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


def advance_beams(group: SequenceGroup, beams: list[Sequence], logits: torch.Tensor,
                  eos_token_ids: frozenset[int], max_model_len: int,
                  out: StepOutcome) -> None:
    """Decide one beam step of ``group`` and add it to ``out`` (the step's outcome, which
    ``Scheduler.update`` applies): forks, prunes, finished hypotheses and the tokens to
    append. Changes nothing itself. logits: (len(beams), vocab) float32 of the live beams,
    in order."""
    p = group.params
    width = p.n
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    eos = frozenset(() if p.ignore_eos else eos_token_ids) | frozenset(p.stop_token_ids)
    keep, done = beam_step([b.cum_logprob for b in beams], logprobs, width, eos)
    hyps: list[tuple[float, list[int]]] = []
    for c in done:
        toks = [*beams[c.parent].output_ids, c.token]
        hyps.append((beam_score(c.cum_logprob, len(toks), p.length_penalty), toks))
    chosen = list(dict.fromkeys(c.parent for c in keep))  # parents in order of choice
    n_out = len(beams[0].output_ids) + 1
    limit = min(p.max_tokens, max_model_len - beams[0].num_prompt_tokens)
    live_best = max((beam_score(c.cum_logprob, n_out, p.length_penalty) for c in keep),
                    default=None)
    ended = n_out >= limit or is_beam_done(group.beam_finished + hyps, live_best, width)
    if ended:  # the kept candidates become hypotheses too; nothing is appended
        hyps += [(beam_score(c.cum_logprob, n_out, p.length_penalty),
                  [*beams[c.parent].output_ids, c.token]) for c in keep]
    out.hypotheses += [(group, score, toks) for score, toks in hyps]
    out.stops += [(b, "pruned") for i, b in enumerate(beams) if i not in chosen]
    if ended:
        out.beams_done.append(group)
        out.stops += [(beams[i], "beam_done") for i in chosen]
        return
    # A parent chosen once keeps its sequence; chosen k times it is forked k - 1 times.
    used: set[int] = set()
    for c in keep:
        out.tokens.append(NewToken(beams[c.parent], c.token, fork=c.parent in used,
                                   cum_logprob=c.cum_logprob))
        used.add(c.parent)
