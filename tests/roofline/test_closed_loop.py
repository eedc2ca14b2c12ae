"""The closed-loop account of validate's queue (harness.roofline_tools.closed_loop) against
a brute-force event simulation of c clients, each sending its next request when its last
one finishes."""

from __future__ import annotations

import heapq
import random

import pytest

from harness.roofline_tools.closed_loop import closed_loop, front_end_extra


def _simulate(work: list[float], front: list[float], clients: int
              ) -> tuple[list[float], list[int], float]:
    """Each request takes ``front`` then ``work`` seconds whatever else runs (no batching
    interaction): when each was sent, by which client, and when the last one finished."""
    sent, owner = [0.0] * len(work), [0] * len(work)
    heap: list[tuple[float, int, int]] = []  # (finish, request, client)
    nxt = 0
    for c in range(min(clients, len(work))):
        owner[nxt] = c
        heapq.heappush(heap, (front[nxt] + work[nxt], nxt, c))
        nxt += 1
    end = 0.0
    while heap:
        t, _, c = heapq.heappop(heap)
        end = max(end, t)
        if nxt < len(work):
            sent[nxt], owner[nxt] = t, c
            heapq.heappush(heap, (t + front[nxt] + work[nxt], nxt, c))
            nxt += 1
    return sent, owner, end


@pytest.mark.parametrize("seed", range(20))
def test_sends_and_clients_match_an_event_simulation(seed: int) -> None:
    rng = random.Random(seed)
    n, c = rng.randint(1, 30), rng.randint(1, 6)
    work = [rng.choice([0.5, 1.0, 1.5]) * rng.randint(1, 4) for _ in range(n)]  # ties too
    sent, owner, end = _simulate(work, [0.0] * n, c)
    fin = [s + w for s, w in zip(sent, work)]
    got_sent, got_owner = closed_loop(fin, c)
    assert got_sent == pytest.approx(sent)
    assert got_owner == owner
    assert front_end_extra(fin, [0.0] * n, got_owner) == 0.0
    assert max(fin) == pytest.approx(end)


@pytest.mark.parametrize("seed", range(10))
def test_one_client_pays_every_front_end(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, 20)
    work = [rng.uniform(0.1, 2.0) for _ in range(n)]
    front = [rng.uniform(0.0, 0.1) for _ in range(n)]
    fin = [s + w for s, w in zip(_simulate(work, [0.0] * n, 1)[0], work)]
    _, _, end = _simulate(work, front, 1)
    assert max(fin) + front_end_extra(fin, front, closed_loop(fin, 1)[1]) == \
        pytest.approx(end)


def test_equal_chains_pay_their_own_front_ends() -> None:
    # Two clients of three equal requests each: every chain is 3 x (front + work) long.
    work, front = [1.0] * 6, [0.05] * 6
    fin = [s + w for s, w in zip(_simulate(work, [0.0] * 6, 2)[0], work)]
    _, owner, end = _simulate(work, front, 2)
    client = closed_loop(fin, 2)[1]
    assert client == owner
    assert max(fin) + front_end_extra(fin, front, client) == pytest.approx(end) == 3.15
