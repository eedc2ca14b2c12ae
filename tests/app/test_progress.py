"""harness/progress.py: a bar on a terminal, periodic status lines elsewhere, and what an
interrupted run reports."""

from __future__ import annotations

import io

import pytest

from harness import progress as prog


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_terminal_bar_shows_requests_rate_elapsed_and_eta(
        monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(prog.time, "monotonic", lambda: now[0])
    out = FakeTTY()
    p = prog.Progress(True, stream=out)
    p(0, 10, 0.0)
    now[0] += 4.0
    p(2, 10, 50.0)  # 2 of 10 in 4 s: 16 s to go
    now[0] += 0.01
    p(3, 10, 51.0)  # within the redraw limit: not drawn
    last = out.getvalue().split("\r")[-1]
    assert "2/10 requests" in last and "50.0 tok/s" in last and " 20%|" in last
    assert "00:04 elapsed" in last and "ETA 00:16" in last
    p.close()
    assert out.getvalue().endswith("\n") and "3/10 requests" in out.getvalue().split("\r")[-1]


def test_status_lines_when_not_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [0.0]
    monkeypatch.setattr(prog.time, "monotonic", lambda: now[0])
    out = io.StringIO()
    p = prog.Progress(True, stream=out, label="3-fp8-random", interval_s=10.0)
    for step in range(100):  # one call per engine step, 0.25 s apart: 25 s
        now[0] += 0.25
        p(step // 10, 10, 12.5)
    p.close()
    lines = out.getvalue().splitlines()
    # The first step, then every 10 s (at 10.25 s and 20.25 s), then the end.
    assert len(lines) == 4, lines
    assert all(ln.startswith("kvbench [3-fp8-random]: ") for ln in lines)
    assert "0/10 requests" in lines[0] and "ETA ?" in lines[0]
    assert lines[-1].endswith("done: 9/10 requests in 25.0 s (12.5 tok/s)")


def test_disabled_draws_nothing_but_counts_for_the_marker() -> None:
    prog.configure("")
    assert prog.current() is None
    assert prog.describe(None).startswith("before the workload started")
    out = io.StringIO()
    p = prog.make_progress(False)
    p.stream = out
    for i in range(5):
        p(i, 8, 1.0)
    assert out.getvalue() == "" and prog.current() is p
    text = prog.describe(p.snapshot())
    assert text.startswith("5 engine steps, 4 of 8 requests done")
    p.close()
    assert "the workload had finished" in prog.describe(p.snapshot())


def test_clock() -> None:
    assert prog.clock(73.4) == "1:13" and prog.clock(3725) == "1:02:05"


def test_a_growing_total_counts_to_the_workloads_expected_requests(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue #54: a multi-turn run's known total grows by a turn per answer, so an ETA
    from it was too short; it counts to conversations x turns instead."""
    now = [0.0]
    monkeypatch.setattr(prog.time, "monotonic", lambda: now[0])
    out = io.StringIO()
    p = prog.Progress(True, stream=out, interval_s=0.0)
    p.expect(lambda: 12)  # 4 conversations x 3 turns; 4 first turns known at the start
    p(0, 4, 0.0)
    now[0] += 10.0
    p(3, 7, 5.0)  # 3 answers in 10 s, 3 next turns known: 9 of 12 to go -> 30 s
    assert out.getvalue().splitlines()[-1].endswith("3/12 requests 5.0 tok/s 0:10 elapsed "
                                                    "ETA 0:30")
    # Without the expected count, a total that grew gives no ETA.
    out = io.StringIO()
    q = prog.Progress(True, stream=out, interval_s=0.0)
    q(0, 4, 0.0)
    now[0] += 10.0
    q(3, 7, 5.0)
    assert out.getvalue().splitlines()[-1].endswith("3/7 requests 5.0 tok/s 0:10 elapsed "
                                                    "ETA n/a")
    tty = FakeTTY()
    r = prog.Progress(True, stream=tty)
    r(0, 4, 0.0)
    now[0] += 10.0
    r(3, 7, 5.0)
    assert "ETA n/a]" in tty.getvalue().split("\r")[-1]


def test_a_multiturn_run_counts_to_its_conversations_times_turns(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from harness.runner import run
    from tests.compose import tiny

    seen: list[int] = []
    real = prog.Progress.__call__

    def spy(self: prog.Progress, done: int, total: int, tps: float) -> None:
        real(self, done, total, tps)
        seen.append(self.shown_total)

    monkeypatch.setattr(prog.Progress, "__call__", spy)
    run(tiny("device=cpu"))  # 3 conversations x 2 turns
    assert seen and set(seen) == {6}


# -- a backlog beyond the deployment (issue #55) ---------------------------------------------
def test_a_growing_backlog_warns_once_with_its_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    """A look every BACKLOG_EVERY steps; a warning once the queue is past BACKLOG_WAITING
    and requests arrive faster than they are done; never again."""
    monkeypatch.setattr(prog, "BACKLOG_WAITING", 100)
    monkeypatch.setattr(prog, "BACKLOG_EVERY", 4)
    looks: list[int] = []
    queue = iter([(50, 60, 1.0), (150, 160, 2.0), (400, 410, 4.0), (900, 910, 8.0)])

    def probe() -> prog.Backlog:
        looks.append(1)
        return prog.Backlog(*next(queue))

    out = io.StringIO()
    p = prog.Progress(False, stream=out)
    p.watch_backlog(probe, "give a lower workload.rate", modelled=True)
    for step in range(1, 17):
        p(step // 4, 1000, 0.0)
    assert len(looks) == 2  # steps 4 and 8; none once it has warned
    text = out.getvalue()
    assert text.count("warning") == 1, text
    assert "150 requests wait after 2.0 s (modelled) of the workload; in the last 1.0 s " \
           "101 arrived (101.0/s) and 1 were done (1.0/s)" in text and text.rstrip().endswith(
               "; give a lower workload.rate")


def test_a_queue_that_keeps_up_or_is_small_says_nothing() -> None:
    out = io.StringIO()
    p = prog.Progress(False, stream=out)
    p.watch_backlog(lambda: prog.Backlog(5, 9, 10.0))  # few waiting
    for _ in range(3 * prog.BACKLOG_EVERY):
        p(1, 10, 0.0)
    # A queue past the threshold that drains: fewer arrive than are done between looks.
    draining = iter([(20000, 20000, 1.0), (15000, 15000, 2.0), (12000, 12000, 3.0)])
    q = prog.Progress(False, stream=out)
    q.watch_backlog(lambda: prog.Backlog(*next(draining)))
    q._last_look = (20000, 0, 0.5)  # it all arrived before the first look
    for step in range(1, 3 * prog.BACKLOG_EVERY + 1):
        q(step * 40, 10 ** 5, 0.0)
    assert out.getvalue() == "" and p.backlog_warned is None and q.backlog_warned is None


def test_an_offline_batch_that_only_drains_says_nothing() -> None:
    # workload.rate=0: 30,000 requests arrive at once, before the first look, and the
    # queue then only drains; the first look compared them with the start and warned
    # "30,000 arrived (417/s)" on every offline validation point.
    looks = iter([(29000, 30000, 72.0), (27000, 29000, 140.0), (25000, 28000, 210.0)])
    out = io.StringIO()
    p = prog.Progress(False, stream=out)
    p.watch_backlog(lambda: prog.Backlog(*next(looks)))
    for step in range(1, 3 * prog.BACKLOG_EVERY + 1):
        p(step * 3, 30000, 0.0)
    assert out.getvalue() == "" and p.backlog_warned is None


@pytest.mark.parametrize("replicas", [1, 3])
def test_a_what_if_far_beyond_its_capacity_warns_of_its_backlog(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        replicas: int) -> None:
    """Issue #55: a trace far beyond the deployment's capacity grew to 15.8 GB without a
    word. 3,000 requests arriving at 3,000/s on a 256 MiB cache (a queue of thousands):
    the warning names the queue and both rates, once; a cluster's is over its replicas."""
    from harness.runner import run
    from tests.compose import compose_cfg

    monkeypatch.setattr(prog, "BACKLOG_WAITING", 1000)  # the run stays small
    monkeypatch.setattr(prog, "BACKLOG_EVERY", 16)
    run(compose_cfg(["executor=roofline", "roofline.model=Llama-3.1-8B",
                     "roofline.hardware=h100-sxm", "workload=random",
                     "workload.num_requests=3000", "workload.rate=3000",
                     "cache.kv_budget=256MiB", f"cluster.replicas={replicas}"]))
    err = capsys.readouterr().err
    assert err.count("warning: a backlog beyond this deployment's capacity") == 1, err
    line = next(x for x in err.splitlines() if "backlog" in x)
    assert "requests wait after" in line and "s (modelled) of the workload" in line
    assert "arrived (" in line and "were done (" in line
    assert line.endswith("give a lower workload.rate, or more capacity (cache.kv_budget, "
                         "cluster.replicas)")
