"""A served engine's API server as a serial stage (issue #53): one process (vLLM's API
server, SGLang's tokenizer manager) does, one job at a time and first come first served,
each request's input (HTTP, chat template, tokenization: ``request_s``) and each engine
step's output (detokenizing and streaming a chunk per token: ``token_s`` a token). Under
a burst it is a queue: 1,000 requests sent at once reach the engine one ``request_s``
apart, and the tokens the engine makes meanwhile reach their clients only once the inputs
before them are through (GPUStack's vLLM runs of 1,000 x 128/4 on one H100: 44 requests a
second whatever the model, a first token after 18 s on average).

How the what-if runs it (a first-order account, exact for a burst sent before any output
and for an idle server):

- **inputs** retime the initial requests before the engine sees them
  (:meth:`ApiServer.retime`): a request reaches the engine when its input job is done;
  the wait and the job count in its TTFT and end-to-end time (the collector's front-end
  seconds). Inputs are not delayed by outputs (the retiming is done before the run).
- **outputs**: each step that made tokens queues one job of ``token_s`` per token behind
  the inputs sent before it and the outputs before it (:meth:`ApiServer.on_step`); a
  request's first and last tokens reach its client when their steps' jobs are done
  (:meth:`ApiServer.lag`), and the run lasts until the last is.

The light-load front end (``EngineProfile.request_s`` / ``prompt_token_s``, a delay fitted
to TTFT at light load) is apart: what a first token waits for beyond this server.
Follow-up requests (a conversation's next turn) pass straight in, and a cluster's
replicas run without it (their front end is the delay alone).
"""

from __future__ import annotations

import bisect
import dataclasses
from array import array
from collections.abc import Iterable, Iterator

from harness.workloads.base import Request


class ApiServer:
    """One serial API-server process: ``request_s`` a request's input, ``token_s`` a
    streamed token's output (seconds)."""

    def __init__(self, request_s: float, token_s: float) -> None:
        self.request_s, self.token_s = request_s, token_s
        self._free = 0.0  # when the input jobs queued so far are done
        self._sent = array("d")  # each input job's send time, in order
        self._done = array("d")  # ... and when it was done (nondecreasing)
        self._wait: dict[int, float] = {}  # request id -> seconds from send to engine
        self._step_t = array("d")  # each step that made tokens: its engine time
        self._step_vis = array("d")  # ... and when its output job was done

    def retime(self, requests: Iterable[Request]) -> Iterator[Request]:
        """The initial requests (in nondecreasing arrival order) as the engine gets them:
        each at the end of its input job, first come first served."""
        for r in requests:
            start = max(r.arrival_s, self._free)
            self._free = start + self.request_s
            self._sent.append(r.arrival_s)
            self._done.append(self._free)
            self._wait[r.request_id] = self._free - r.arrival_s
            yield dataclasses.replace(r, arrival_s=self._free)

    def wait_s(self, request_id: int) -> float:
        """Seconds request ``request_id`` spent in this server before the engine got it
        (0: it did not pass through: a follow-up)."""
        return self._wait.pop(request_id, 0.0)

    def on_step(self, now: float, tokens: int) -> None:
        """A step that made ``tokens`` tokens ended at engine time ``now``: its output job
        queues behind the inputs sent by then and the outputs before it."""
        k = bisect.bisect_right(self._sent, now)
        inputs = self._done[k - 1] if k else 0.0
        last = self._step_vis[-1] if self._step_vis else 0.0
        self._step_t.append(now)
        self._step_vis.append(max(now, last, inputs) + self.token_s * tokens)

    def lag(self, t: float) -> float:
        """Seconds between a token made at engine time ``t`` (a step's end) and its
        client getting it (0 before any step)."""
        k = bisect.bisect_right(self._step_t, t)
        return self._step_vis[k - 1] - self._step_t[k - 1] if k else 0.0

    def final_lag(self) -> float:
        """Seconds the last output reached its client after the engine's last step."""
        return self._step_vis[-1] - self._step_t[-1] if self._step_t else 0.0
