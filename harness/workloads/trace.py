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

import math
import random
import sys
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import harness
from harness.errors import UserError
from harness.model.tokenizer import Tokenizer
from harness.sched.sequence import SamplingParams, SequenceGroup
from harness.validate import one_of
from harness.workloads.base import Request, WorkloadOptions
from harness.workloads.common import token_prompt
from harness.workloads.trace_formats import TraceRow, scan_trace

OVER_LENGTH = ("truncate", "reject")
REPO = Path(harness.__file__).resolve().parents[1]


MAX_SPAN_S = 1e9  # the longest trace a run takes, in seconds after the speedup


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
    """What one kept row will be sent as (:attr:`TraceWorkload.plans`, built on demand)."""

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


# Mooncake blocks kept drawn (an id's tokens are drawn again, the same, when it was
# dropped): a million-row trace names millions of ids, ~20 KB each as lists of ints.
BLOCK_CACHE = 4096


class TraceWorkload:
    """The kept rows are columns (``kept``: row indices in arrival order, with their
    lengths, arrivals and links), and requests are built as the engine reaches them
    (:meth:`stream_requests`), so memory does not grow with the trace's length."""

    name = "trace"

    def __init__(self, cfg: TraceConfig, tok: Tokenizer) -> None:
        self.cfg, self.tok = cfg, tok
        self.index = scan_trace(cfg.resolved_path(), cfg.format)
        self.format, self.rebased_s = self.index.format, self.index.rebased_s
        self.num_rows = len(self.index)
        self.truncated = self.rejected = self.raised_outputs = 0
        self._blocks: OrderedDict[int, list[int]] = OrderedDict()
        self._plan()

    # -- which rows, when, how long --------------------------------------------------
    def _plan(self) -> None:
        """The kept rows, as arrays in arrival order (ties: file order): ``kept`` (row
        index = request id), ``arrival`` (after window and speed-up), ``prompt_len``,
        ``output_len``, ``follows`` (the row index of the conversation's previous kept
        turn, -1: none) and ``rejected`` (too long, over_length=reject)."""
        c, ix = self.cfg, self.index
        end = c.start_s + c.duration_s if c.duration_s > 0 else float("inf")
        t = ix.arrival_s
        rows = np.flatnonzero((t >= c.start_s) & (t < end))
        rows = rows[np.lexsort((rows, t[rows]))]
        if c.max_requests:
            rows = rows[:c.max_requests]
        if not len(rows):
            raise UserError(f"no trace row arrives in the window [{c.start_s}, {end}) s of "
                            f"{c.path} (its {len(t)} rows span 0 to "
                            f"{float(t.max()):.3f} s): widen "
                            "workload.start_s / workload.duration_s")
        prompt = ix.prompt_tokens[rows].copy()
        output = ix.output_tokens[rows].copy()
        low = output < 1  # the engine's smallest request generates one token
        self.raised_outputs = int(low.sum())
        output[low] = 1
        rejected = np.zeros(len(rows), dtype=bool)
        limit = c.max_model_len
        if limit is not None:
            over = prompt + output > limit
            if c.over_length == "reject":
                rejected = over
                self.rejected = int(over.sum())
            else:
                self.truncated = int(over.sum())
                out_cut = np.where(output >= limit, limit // 2, output)
                prompt = np.where(over, np.minimum(prompt, limit - out_cut), prompt)
                output = np.where(over, out_cut, output)
        if rejected.all():
            raise UserError(f"every one of the {len(rows)} trace rows in the window is longer "
                            f"than max_model_len={limit} (workload.over_length=reject): "
                            "nothing would run; raise scheduler.max_model_len or use "
                            "workload.over_length=truncate")
        follows = np.full(len(rows), -1, dtype=np.int64)
        conv = ix.conversation[rows]
        if (conv >= 0).any():
            turn = ix.turn[rows]
            last: dict[int, int] = {}  # conversation -> position of its last kept turn
            for k in np.flatnonzero(conv >= 0).tolist():
                # A turn follows the conversation's previous kept turn, unless either was
                # rejected or the turns arrive out of order: then it starts afresh.
                prev = last.get(int(conv[k]))
                if (prev is not None and not rejected[prev] and not rejected[k]
                        and (turn[k] < 0 or turn[prev] < 0 or turn[k] > turn[prev])):
                    follows[k] = rows[prev]
                last[int(conv[k])] = k
        self.kept, self.prompt_len, self.output_len = rows, prompt, output
        self.longest_prompt = int(prompt.max()) if len(prompt) else 1
        self.arrival = (t[rows] - c.start_s) / c.speedup
        span = float(self.arrival.max()) if len(self.arrival) else 0.0
        if not (math.isfinite(span) and span <= MAX_SPAN_S):
            # (issue #55: workload.speedup=1e-300 was taken, a trace of 10^300 seconds)
            raise UserError(
                f"workload.speedup={c.speedup} stretches the trace's arrivals over {span:.3g} "
                f"s (more than {MAX_SPAN_S:.0e} s, ~32 years): give a larger speedup")
        self.follows, self.rejected_rows = follows, rejected
        self._next = {int(f): k for k, f in enumerate(follows.tolist()) if f >= 0}
        self.num_initial = int((follows < 0).sum())
        self.hash_mismatch = self._check_hash_ids(rows)

    def _check_hash_ids(self, rows: np.ndarray) -> int:
        """Rows whose hash ids do not cover their prompt as ``hash_block_tokens`` says
        (ceil(input_length / hash_block_tokens) ids): warned about with the count, as a
        wrong block size makes every shared prefix the wrong length."""
        bt, ix = self.cfg.hash_block_tokens, self.index
        n = ix.num_hash_ids[rows]
        want = -(-ix.prompt_tokens[rows] // bt)
        bad = np.flatnonzero((n > 0) & (n != want))
        if len(bad):
            r = int(rows[bad[0]])
            print(f"kvbench: warning: {len(bad)} of {len(rows)} trace rows have hash_ids that "
                  f"do not match their input_length at workload.hash_block_tokens={bt} "
                  f"(e.g. line {ix.line[r]}: {ix.num_hash_ids[r]} ids for "
                  f"{ix.prompt_tokens[r]} tokens, {want[bad[0]]} expected): is "
                  "hash_block_tokens the trace's block size?", file=sys.stderr)
        return len(bad)

    def _reason(self, k: int) -> str | None:
        if not self.rejected_rows[k]:
            return None
        r, ix = int(self.kept[k]), self.index
        return (f"trace row at {ix.line[r]}: prompt {ix.prompt_tokens[r]} + output "
                f"{max(1, int(ix.output_tokens[r]))} tokens exceed max_model_len="
                f"{self.cfg.max_model_len} (workload.over_length=reject)")

    @property
    def plans(self) -> list[_Plan]:
        """Every kept row as a :class:`_Plan`, in arrival order. Builds one object per row
        (and reads every row's hash ids again): for small traces and tests."""
        return [_Plan(self.index.row(int(r)), float(self.arrival[k]), int(self.prompt_len[k]),
                      int(self.output_len[k]),
                      int(self.follows[k]) if self.follows[k] >= 0 else None, self._reason(k))
                for k, r in enumerate(self.kept.tolist())]

    # -- prompts -----------------------------------------------------------------------
    def _rng(self, *key: object) -> random.Random:
        # A string seed goes through SHA-512: the same row or id gives the same text on
        # every run and platform, whatever else the trace holds.
        return random.Random("/".join(map(str, (self.cfg.seed_value, *key))))

    def _block(self, hash_id: int) -> list[int]:
        got = self._blocks.get(hash_id)
        if got is None:
            # No prompt reads past the trace's longest (kept, cut to max_model_len): a
            # block longer than that is drawn only that long (workload.hash_block_tokens
            # =1e9 drew a billion tokens per id, issue #55).
            n = min(self.cfg.hash_block_tokens, self.longest_prompt)
            got = token_prompt(self.tok, self._rng("block", hash_id), n, add_bos=False)
            self._blocks[hash_id] = got
            if len(self._blocks) > BLOCK_CACHE:
                self._blocks.popitem(last=False)
        else:
            self._blocks.move_to_end(hash_id)
        return got

    def _fresh_prompt(self, k: int) -> list[int]:
        row = int(self.kept[k])
        n, ids = int(self.prompt_len[k]), self.index.hash_ids(row)
        if not ids:
            return token_prompt(self.tok, self._rng("row", row), n)
        out = [self.tok.bos_id] if self.tok.bos_id is not None else []
        for h in ids:
            if len(out) >= n:
                break
            out += self._block(h)
        if len(out) < n:  # fewer ids than the length needs: the rest is the row's own
            out += token_prompt(self.tok, self._rng("row", row), n - len(out),
                                add_bos=False)
        return out[:n]

    def _max_tokens(self, output_len: int) -> int:
        """What a request asks for: its row's length, or workload.max_tokens when set
        (never less than the row's length)."""
        c = self.cfg
        return max(c.max_tokens, output_len) if c.max_tokens else output_len

    def _params(self, k: int) -> SamplingParams:
        c, out = self.cfg, int(self.output_len[k])
        return SamplingParams(max_tokens=self._max_tokens(out), temperature=c.temperature,
                              ignore_eos=True, seed=c.seed_value,
                              stop_after=out if c.max_tokens else None)

    def _request(self, k: int, prompt: list[int], earliest: float | None = None) -> Request:
        row, ix = int(self.kept[k]), self.index
        conv, turn = int(ix.conversation[row]), int(ix.turn[row])
        meta = {"line": int(ix.line[row]),
                "conversation": ix.conversations[conv] if conv >= 0 else None,
                "turn": turn if turn >= 0 else None}
        return Request(row, prompt, self._params(k),
                       arrival_s=0.0 if earliest is not None else float(self.arrival[k]),
                       priority=int(ix.priority[row]), meta=meta, earliest_s=earliest,
                       rejected_reason=self._reason(k))

    def stream_requests(self) -> Iterator[Request]:
        """The requests known at the start (every kept row that follows no earlier turn),
        built one at a time in arrival order (ties: request id), as the engine reaches
        them."""
        for k in np.flatnonzero(self.follows < 0).tolist():
            yield self._request(k, self._placeholder(k) if self.rejected_rows[k]
                                else self._fresh_prompt(k))

    def _placeholder(self, k: int) -> list[int]:
        """A rejected row's prompt: never run, never re-sent (a later turn starts afresh),
        only its length counts; no text is drawn for it (it may be millions of tokens)."""
        bos = self.tok.bos_id if self.tok.bos_id is not None else 0
        return [bos] * int(self.prompt_len[k])

    def initial_shapes(self) -> Iterator[tuple[int, int, int]]:
        """(prompt tokens, max_tokens, n) of every request known at the start, without
        building them (the stack's budget check)."""
        first = self.follows < 0
        for p, o in zip(self.prompt_len[first].tolist(), self.output_len[first].tolist()):
            yield p, self._max_tokens(o), 1

    def initial_requests(self) -> list[Request]:
        return list(self.stream_requests())

    @property
    def expected_requests(self) -> int:
        """Every kept row, the later turns of a session included (they become known only
        as the turn before them ends): the progress bar's total and ETA count to it."""
        return len(self.kept)

    def on_finished(self, group: SequenceGroup) -> list[Request]:
        k = self._next.pop(group.request_id, None)
        if k is None:
            return []
        history = list(group.prompt_ids) + list(group.output_ids)
        n, row = int(self.prompt_len[k]), int(self.kept[k])
        if len(history) < n:
            history += token_prompt(self.tok, self._rng("row", row), n - len(history),
                                    add_bos=False)
        return [self._request(k, history[:n], earliest=float(self.arrival[k]))]

    def on_rejected(self, group: SequenceGroup) -> list[Request]:
        """A rejected turn's next turn still arrives when the trace says (the trace is
        the offered load), on the history it had, without an answer."""
        return self.on_finished(group)

    def workload_metrics(self) -> dict[str, float]:
        n = len(self.kept)
        span = float(self.arrival.max() - self.arrival.min())
        return {
            "trace.rows": float(self.num_rows),
            # Seconds subtracted from the file's times: arrivals count from its first row.
            "trace.rebased_s": self.rebased_s,
            "trace.requests": float(n),
            "trace.span_s": span,
            "trace.offered_rps": (n - 1) / span if span > 0 else 0.0,
            "trace.truncated": float(self.truncated),
            "trace.rejected_too_long": float(self.rejected),
            "trace.outputs_raised_to_1": float(self.raised_outputs),
            "trace.hash_ids_mismatched": float(self.hash_mismatch),
        }
