"""`trace`: replay a request trace (Mooncake JSONL, Azure CSV, or our own CSV/JSONL).

Each row becomes one request with the row's arrival time, prompt length and output length
(formats: harness.workloads.trace_formats). The text is synthesized from our local corpus
(harness.workloads.text) at exactly the given lengths:

- Mooncake's ``hash_ids``: every id is one block of ``hash_block_tokens`` tokens drawn
  once per id, so equal ids are equal token blocks and the trace's prefix sharing shows up
  as prefix-cache hits (the prompt is BOS, then the blocks in order, cut to its length);
- a later turn of a conversation (our format) re-sends the previous turn's prompt and the
  answer the model actually gave, then new text up to its own length, and arrives at its
  trace time or when that answer is done, whichever is later;
- any other row gets text of its own, seeded by its row, so a request's text never
  depends on which other rows a window or a limit kept.

Selection, in this order: the time window [``start_s``, ``start_s + duration_s``) of the
trace's clock (times then count from ``start_s``), the first ``max_requests`` rows by
time, then ``speedup`` divides every time (2 = twice the request rate). A row whose prompt
and output do not fit ``max_model_len`` is truncated (prompt cut from its end, so a
shared prefix stays shared; output capped at half the length if it alone is too long) or
rejected with its reason, and counted either way (``trace.*`` metrics). Request ids are
the rows' places in the file, never their scheduling order.
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass
from pathlib import Path

import harness
from harness.errors import UserError
from harness.model.tokenizer import Tokenizer
from harness.sched.sequence import SamplingParams, SequenceGroup
from harness.validate import one_of
from harness.workloads.base import Request, WorkloadOptions
from harness.workloads.common import token_prompt
from harness.workloads.trace_formats import TraceRow, read_trace

OVER_LENGTH = ("truncate", "reject")
REPO = Path(harness.__file__).resolve().parents[1]


@dataclass
class TraceConfig(WorkloadOptions):
    path: str = "traces/mooncake_example.jsonl"  # relative: to the cwd, else to the repo
    format: str = "auto"  # auto | mooncake | azure | kvbench
    speedup: float = 1.0  # times are divided by it: 2 = twice the request rate
    max_requests: int = 0  # 0: every row (after the window)
    start_s: float = 0.0  # the window on the trace's clock, seconds from its first row
    duration_s: float = 0.0  # 0: to the trace's end
    hash_block_tokens: int = 512  # tokens per Mooncake hash id (512 in the published traces)
    over_length: str = "truncate"  # truncate | reject: prompt + output > max_model_len
    max_model_len: int | None = None  # None: the run's scheduler.max_model_len
    max_tokens: int = 0  # 0: each row's output length; else every request asks this many
    # and stops at its row's length (as at an EOS): what a server reserves without knowing
    temperature: float = 0.0

    def __post_init__(self) -> None:
        one_of(self, "workload", "over_length", OVER_LENGTH)
        if not self.speedup > 0:
            raise UserError(f"workload.speedup must be > 0, got {self.speedup}")
        for key in ("max_requests", "start_s", "duration_s", "max_tokens", "temperature"):
            if getattr(self, key) < 0:
                raise UserError(f"workload.{key} must be >= 0, got {getattr(self, key)}")
        if self.hash_block_tokens < 1:
            raise UserError(f"workload.hash_block_tokens must be >= 1, got "
                            f"{self.hash_block_tokens}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise UserError(f"workload.max_model_len must be >= 2, got {self.max_model_len}")

    def resolved_path(self) -> Path:
        p = Path(self.path).expanduser()
        if not p.is_absolute() and not p.exists() and (REPO / p).exists():
            return REPO / p
        return p


@dataclass(slots=True)
class _Plan:
    """What one kept row will be sent as."""

    row: TraceRow
    arrival_s: float  # after window and speed-up
    prompt_len: int
    output_len: int
    follows: int | None = None  # request id of the conversation's previous kept turn
    rejected: str | None = None


def fit(prompt: int, output: int, limit: int) -> tuple[int, int]:
    """Lengths cut to ``prompt + output <= limit`` with at least one prompt token: the
    prompt loses its end (a shared prefix stays shared); an output that alone needs the
    whole length is capped at half of it."""
    if output >= limit:
        output = limit // 2
    return min(prompt, limit - output), output


class TraceWorkload:
    name = "trace"

    def __init__(self, cfg: TraceConfig, tok: Tokenizer) -> None:
        self.cfg, self.tok = cfg, tok
        path = cfg.resolved_path()
        self.format, rows, self.rebased_s = read_trace(path, cfg.format)
        self.num_rows = len(rows)
        self.truncated = self.rejected = self.raised_outputs = 0
        self._blocks: dict[int, list[int]] = {}
        self.plans = self._plan(rows)
        self._next: dict[int, _Plan] = {p.follows: p for p in self.plans
                                        if p.follows is not None}
        self._initial = [self._request(p, self._fresh_prompt(p)) for p in self.plans
                         if p.follows is None]

    # -- which rows, when, how long --------------------------------------------------
    def _plan(self, rows: list[TraceRow]) -> list[_Plan]:
        c = self.cfg
        end = c.start_s + c.duration_s if c.duration_s > 0 else float("inf")
        kept = sorted((r for r in rows if c.start_s <= r.arrival_s < end),
                      key=lambda r: (r.arrival_s, r.index))
        if c.max_requests:
            kept = kept[:c.max_requests]
        if not kept:
            raise UserError(f"no trace row arrives in the window [{c.start_s}, {end}) s of "
                            f"{c.path} (its {len(rows)} rows span 0 to "
                            f"{max(r.arrival_s for r in rows):.3f} s): widen "
                            "workload.start_s / workload.duration_s")
        limit = c.max_model_len
        plans: list[_Plan] = []
        last_turn: dict[str, _Plan] = {}
        for r in kept:
            prompt, output = r.prompt_tokens, r.output_tokens
            if output < 1:  # the engine's smallest request generates one token
                output, self.raised_outputs = 1, self.raised_outputs + 1
            p = _Plan(r, (r.arrival_s - c.start_s) / c.speedup, prompt, output)
            if limit is not None and prompt + output > limit:
                if c.over_length == "reject":
                    self.rejected += 1
                    p.rejected = (f"trace row at {r.line}: prompt {prompt} + output {output}"
                                  f" tokens exceed max_model_len={limit} "
                                  "(workload.over_length=reject)")
                else:
                    self.truncated += 1
                    p.prompt_len, p.output_len = fit(prompt, output, limit)
            if r.conversation is not None:
                # A turn follows the conversation's previous kept turn, unless either was
                # rejected or the turns arrive out of order: then it starts afresh.
                prev = last_turn.get(r.conversation)
                if (prev is not None and prev.rejected is None and p.rejected is None
                        and (r.turn is None or prev.row.turn is None
                             or r.turn > prev.row.turn)):
                    p.follows = prev.row.index
                last_turn[r.conversation] = p
            plans.append(p)
        if plans and all(p.rejected is not None for p in plans):
            raise UserError(f"every one of the {len(plans)} trace rows in the window is longer "
                            f"than max_model_len={limit} (workload.over_length=reject): "
                            "nothing would run; raise scheduler.max_model_len or use "
                            "workload.over_length=truncate")
        self.hash_mismatch = self._check_hash_ids(kept)
        return plans

    def _check_hash_ids(self, rows: list[TraceRow]) -> int:
        """Rows whose hash ids do not cover their prompt as ``hash_block_tokens`` says
        (ceil(input_length / hash_block_tokens) ids): warned about with the count, as a
        wrong block size makes every shared prefix the wrong length."""
        bt = self.cfg.hash_block_tokens
        bad = [r for r in rows if r.hash_ids
               and len(r.hash_ids) != -(-r.prompt_tokens // bt)]
        if bad:
            r = bad[0]
            print(f"kvbench: warning: {len(bad)} of {len(rows)} trace rows have hash_ids that "
                  f"do not match their input_length at workload.hash_block_tokens={bt} "
                  f"(e.g. line {r.line}: {len(r.hash_ids or ())} ids for {r.prompt_tokens} "
                  f"tokens, {-(-r.prompt_tokens // bt)} expected): is hash_block_tokens "
                  "the trace's block size?", file=sys.stderr)
        return len(bad)

    # -- prompts -----------------------------------------------------------------------
    def _rng(self, *key: object) -> random.Random:
        # A string seed goes through SHA-512: the same row or id gives the same text on
        # every run and platform, whatever else the trace holds.
        return random.Random("/".join(map(str, (self.cfg.seed_value, *key))))

    def _block(self, hash_id: int) -> list[int]:
        if hash_id not in self._blocks:
            self._blocks[hash_id] = token_prompt(self.tok, self._rng("block", hash_id),
                                                 self.cfg.hash_block_tokens, add_bos=False)
        return self._blocks[hash_id]

    def _fresh_prompt(self, p: _Plan) -> list[int]:
        n, ids = p.prompt_len, p.row.hash_ids
        if not ids:
            return token_prompt(self.tok, self._rng("row", p.row.index), n)
        out = [self.tok.bos_id] if self.tok.bos_id is not None else []
        for h in ids:
            if len(out) >= n:
                break
            out += self._block(h)
        if len(out) < n:  # fewer ids than the length needs: the rest is the row's own
            out += token_prompt(self.tok, self._rng("row", p.row.index), n - len(out),
                                add_bos=False)
        return out[:n]

    def _request(self, p: _Plan, prompt: list[int], earliest: float | None = None) -> Request:
        c = self.cfg
        max_tokens = max(c.max_tokens, p.output_len) if c.max_tokens else p.output_len
        params = SamplingParams(max_tokens=max_tokens, temperature=c.temperature,
                                ignore_eos=True, seed=c.seed_value,
                                stop_after=p.output_len if c.max_tokens else None)
        meta = {"line": p.row.line, "conversation": p.row.conversation, "turn": p.row.turn}
        return Request(p.row.index, prompt, params,
                       arrival_s=0.0 if earliest is not None else p.arrival_s,
                       priority=p.row.priority, meta=meta, earliest_s=earliest,
                       rejected_reason=p.rejected)

    def initial_requests(self) -> list[Request]:
        return list(self._initial)

    def on_finished(self, group: SequenceGroup) -> list[Request]:
        nxt = self._next.pop(group.request_id, None)
        if nxt is None:
            return []
        history = list(group.prompt_ids) + list(group.output_ids)
        n = nxt.prompt_len
        if len(history) < n:
            history += token_prompt(self.tok, self._rng("row", nxt.row.index),
                                    n - len(history), add_bos=False)
        return [self._request(nxt, history[:n], earliest=nxt.arrival_s)]

    def on_rejected(self, group: SequenceGroup) -> list[Request]:
        """A rejected turn's next turn still arrives when the trace says (the trace is
        the offered load), on the history it had, without an answer."""
        return self.on_finished(group)

    def workload_metrics(self) -> dict[str, float]:
        arrivals = [p.arrival_s for p in self.plans]
        span = max(arrivals) - min(arrivals)
        return {
            "trace.rows": float(self.num_rows),
            # Seconds subtracted from the file's times: arrivals count from its first row.
            "trace.rebased_s": self.rebased_s,
            "trace.requests": float(len(self.plans)),
            "trace.span_s": span,
            "trace.offered_rps": (len(self.plans) - 1) / span if span > 0 else 0.0,
            "trace.truncated": float(self.truncated),
            "trace.rejected_too_long": float(self.rejected),
            "trace.outputs_raised_to_1": float(self.raised_outputs),
            "trace.hash_ids_mismatched": float(self.hash_mismatch),
        }
