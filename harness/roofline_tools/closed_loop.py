"""A published closed loop of ``c`` clients (``vllm bench serve --max-concurrency c``,
llm-benchmaq's concurrency), as the what-if's validation runs it: every request queued at
t=0 under ``scheduler.max_num_seqs=c`` (harness.roofline_tools.validate), so the schedule
does not depend on time and the fit stays affine in the engine's constants. A client
sends its next request when its last one finishes, so in that queue the (c + k)-th
request is sent at the k-th finish, by the client whose request that was.

A served engine's front end (HTTP, chat template, tokenization: ``EngineProfile.
frontend_s``) sits between a client and the engine: a request reaches the engine that
long after it was sent. The queue admits it at the finish that freed its slot, so here
the front end is added back: to each request's TTFT and end-to-end time (from when its
client sent it), and to each client's chain of requests (a closed loop's run is longer by
its front ends; the schedule is kept, a first-order account: exact for one client).
A closed loop runs without the API server's queue (``roofline.api_server=false``,
harness.metrics.api_server): its c clients keep at most c requests in it, where the
queue at t=0 would push every request through it at once.
"""

from __future__ import annotations

from collections.abc import Sequence


def closed_loop(finish: Sequence[float], clients: int) -> tuple[list[float], list[int]]:
    """For each request in the order sent (``finish``: when the engine finished each,
    the front end left out): when its client sent it (the first ``clients`` at 0, the
    (c + k)-th at the k-th finish, the one that freed its slot) and which client
    (0 .. clients - 1) sent it."""
    n = len(finish)
    by_finish = sorted(range(n), key=lambda i: finish[i])
    sent = [0.0] * n
    client = [min(i, clients - 1) for i in range(n)]
    for k in range(clients, n):
        j = by_finish[k - clients]  # j < k: it was sent before it could finish
        sent[k] = float(finish[j])
        client[k] = client[j]
    return sent, client


def front_end_extra(finish: Sequence[float], front: Sequence[float],
                    client: Sequence[int]) -> float:
    """Seconds a closed loop's run lasts past the engine's last finish once each request
    waits its front end (``front``, seconds) before the engine sees it: the latest of the
    clients' last finishes each pushed back by its own requests' front ends, less the
    latest finish (``client``: which client sent each, :func:`closed_loop`). 0 without a
    front end; exact for one client."""
    if not finish or not any(front):
        return 0.0
    last: dict[int, float] = {}
    paid: dict[int, float] = {}
    for f, fe, c in zip(finish, front, client):
        last[c] = max(last.get(c, 0.0), float(f))
        paid[c] = paid.get(c, 0.0) + float(fe)
    return max(last[c] + paid[c] for c in last) - max(float(f) for f in finish)
