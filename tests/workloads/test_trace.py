"""Trace replay: parsing each format (malformed lines by file and line), selection,
over-length rows, and a replay that reproduces the trace's arrivals, lengths and sharing."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import pytest

from harness.errors import UserError
from harness.model import ByteTokenizer
from harness.runner import run
from harness.sched.sequence import Sequence, SequenceGroup
from harness.workloads import make_workload
from harness.workloads.trace import TraceWorkload, fit
from harness.workloads.trace_examples import FOLDER, example_files
from harness.workloads.trace_formats import read_trace
from tests.compose import compose_cfg

TOK = ByteTokenizer()
MOONCAKE = FOLDER / "mooncake_example.jsonl"


def trace(path: Path | str, **opts: Any) -> TraceWorkload:
    wl = make_workload({"name": "trace", "path": str(path), **opts}, TOK)
    assert isinstance(wl, TraceWorkload)
    return wl


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_the_example_traces_are_ours_and_regenerate_identically() -> None:
    for name, text in example_files().items():
        assert (FOLDER / name).read_text() == text, \
            f"{name} differs from its generator: rerun python -m harness.workloads.trace_examples"


def test_each_format_is_detected_and_read() -> None:
    fmt, rows, shift = read_trace(MOONCAKE)
    first = json.loads(MOONCAKE.read_text().splitlines()[0])
    assert fmt == "mooncake" and len(rows) == 24
    assert (rows[0].arrival_s + shift, rows[0].prompt_tokens, rows[0].output_tokens,
            rows[0].hash_ids) == (first["timestamp"] / 1e3, first["input_length"],
                                  first["output_length"], tuple(first["hash_ids"]))
    fmt, rows, _ = read_trace(FOLDER / "azure_example.csv")
    assert fmt == "azure" and rows[0].arrival_s == 0.0
    # The second stamp is 18:15:47.4064190, the first 18:15:47.1963380: 0.210081 s later.
    assert rows[1].arrival_s == pytest.approx(0.210081, abs=1e-9)
    fmt, csv_rows, _ = read_trace(FOLDER / "kvbench_example.csv")
    _, jsonl_rows, _ = read_trace(FOLDER / "kvbench_example.jsonl")
    assert fmt == "kvbench" and [r.line for r in csv_rows][:2] == [2, 3]  # after the header
    assert [replace(r, line=0) for r in csv_rows] == [replace(r, line=0) for r in jsonl_rows]
    assert {r.conversation for r in csv_rows} == {None, "c0", "c1", "c2", "c3"}
    assert {r.priority for r in csv_rows} == {0, 1}


@pytest.mark.parametrize(("name", "text", "where", "what"), [
    ("a.jsonl", '{"timestamp": 0, "input_length": 8, "output_length": 2}\n'
                '{"timestamp": 5, "input_length": 8\n', ":2:", "not valid JSON"),
    ("a.jsonl", '{"timestamp": 0, "input_length": 8, "output_length": 2}\n\n'
                '{"timestamp": 5, "input_length": 0, "output_length": 2}\n', ":3:",
     "input_length=0 must be in [1, 10,000,000]"),
    ("a.jsonl", '{"timestamp": 0, "input_length": 8, "output_length": 2, "hash_ids": [1]}\n'
                '{"timestamp": 1, "input_length": 8, "output_length": 2, "hash_ids": "x"}\n',
     ":2:", "not a list of integers"),
    ("a.jsonl", '{"timestamp": 0, "input_length": 8, "output_length": 2}\n[1, 2]\n', ":2:",
     "not an object"),
    # Issue #55: a key given twice (JSON keeps the last, silently).
    ("a.jsonl", '{"timestamp": 0, "input_length": 8, "output_length": 2}\n'
                '{"timestamp": 1, "input_length": 8, "input_length": 900, "output_length": 2}\n',
     ":2:", "key 'input_length' appears twice"),
    ("b.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,10,2\n"
              "yesterday,10,2\n", ":3:", "neither a date-time"),
    ("b.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,10,2,9\n",
     ":2:", "4 fields, the header has 3"),
    ("c.csv", "arrival_s,prompt_tokens,output_tokens\n0.5,12.5,3\n", ":2:",
     "prompt_tokens='12.5' is not a whole number"),
    ("c.csv", "arrival_s,prompt_tokens,output_tokens\n-1,12,3\n", ":2:",
     "arrival_s='-1' must be a finite number >= 0"),
    ("c.csv", "arrival_s,prompt_tokens,output_tokens,conversation_id,turn\n"
              "0,12,3,a,0\n1,20,3,a,0\n", ":3:", "turn 0 of conversation 'a' appears twice"),
    ("c.csv", "arrival_s,prompt_tokens,output_tokens\n0,12,\n", ":2:",
     "missing 'output_tokens'"),
    # Issue 27: hostile rows, each once silent or a traceback.
    ("d.csv", "arrival_s,prompt_tokens,output_tokens\n0,1000000000000,3\n", ":2:",
     "prompt_tokens='1000000000000' must be in [1, 10,000,000]"),
    ("d.csv", "arrival_s,prompt_tokens,output_tokens\n0," + "9" * 400 + ",3\n", ":2:",
     "prompt_tokens has 400 digits: must be in [1, 10,000,000]"),
    ("d.jsonl", '{"timestamp": 0, "input_length": ' + "9" * 400 + ', "output_length": 2}\n',
     ":1:", "input_length has 400 digits"),
    ("e.jsonl", '{"timestamp": 0, "input_length": 8, "output_length": 2}\n'
                + "[" * 100_000 + "\n", ":2:", "JSON nested too deeply to be a trace row"),
    ("f.txt", "arrival_s,prompt_tokens,output_tokens\n0,12,x\n", ":2:",
     "(read as CSV with a header: its first line does not start with '{' (whatever its .txt "
     "suffix says))"),
    ("g.csv", '{"timestamp": 0, "input_length": 8, "output_length": 2}\n{"timestamp": 1}\n',
     ":2:", "(read as JSONL: its first line starts with '{' (whatever its .csv suffix says))"),
])
def test_malformed_lines_are_reported_with_file_and_line(tmp_path: Path, name: str,
                                                         text: str, where: str,
                                                         what: str) -> None:
    p = write(tmp_path, name, text)
    with pytest.raises(UserError, match="malformed") as e:
        trace(p)
    assert f"{p}{where}" in str(e.value) and what in str(e.value)


def test_a_bom_is_stripped_and_a_huge_csv_field_is_named_by_line(tmp_path: Path) -> None:
    # Issue 27: Excel's byte-order mark made the first column "\ufeffarrival_s" (format
    # unknown); a field over csv's 128 KiB limit was a traceback.
    p = tmp_path / "bom.csv"
    p.write_bytes(b"\xef\xbb\xbfarrival_s,prompt_tokens,output_tokens\n0,12,3\n1,9,2\n")
    assert [r.prompt_tokens for r in read_trace(p)[1]] == [12, 9]
    q = write(tmp_path, "huge.csv", "arrival_s,prompt_tokens,output_tokens,note\n0,12,3,x\n"
              f"1,9,2,{'y' * 200_000}\n")
    with pytest.raises(UserError, match=rf"{q}:3: not a CSV row \(field larger than field "
                                        r"limit"):
        read_trace(q)


def test_hash_ids_that_do_not_match_the_length_are_warned_and_counted(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = write(tmp_path, "m.jsonl", '{"timestamp": 0, "input_length": 1024, "output_length": 2,'
              ' "hash_ids": [1, 2]}\n{"timestamp": 5, "input_length": 1024, '
              '"output_length": 2, "hash_ids": [1, 2, 3, 4, 5, 6, 7, 8]}\n')
    wl = trace(p)  # 512 tokens per id: the second row's 8 ids say 4096 tokens
    assert wl.workload_metrics()["trace.hash_ids_mismatched"] == 1.0
    err = capsys.readouterr().err
    assert "1 of 2 trace rows have hash_ids that do not match their input_length at " \
           "workload.hash_block_tokens=512 (e.g. line 2: 8 ids for 1024 tokens, 2 expected)" \
           in err
    assert trace(p, hash_block_tokens=128).workload_metrics()[
        "trace.hash_ids_mismatched"] == 1.0  # now the first row is the odd one
    assert "(e.g. line 1: 2 ids for 1024 tokens, 8 expected)" in capsys.readouterr().err


def test_a_trace_whose_every_row_is_too_long_is_refused_at_start(tmp_path: Path) -> None:
    p = write(tmp_path, "long.csv", "arrival_s,prompt_tokens,output_tokens\n"
              "0,5000,3\n86400,6000,2\n")  # a day apart: replaying the span took a day
    with pytest.raises(UserError, match=r"every one of the 2 trace rows in the window is "
                                        r"longer than max_model_len=2048"):
        trace(p, over_length="reject", max_model_len=2048)


def test_every_malformed_line_is_counted_and_unknown_formats_name_the_columns(
        tmp_path: Path) -> None:
    p = write(tmp_path, "many.csv", "arrival_s,prompt_tokens,output_tokens\n"
              + "".join(f"{i},x,1\n" for i in range(12)))
    with pytest.raises(UserError, match=r"12 malformed line\(s\)[\s\S]*and 4 more"):
        trace(p)
    q = write(tmp_path, "odd.csv", "time,len\n1,2\n")
    with pytest.raises(UserError, match="expected one of mooncake: timestamp"):
        trace(q)
    with pytest.raises(UserError, match="is not a file"):
        trace(tmp_path / "missing.jsonl")


def test_window_limit_and_speedup_select_and_scale(tmp_path: Path) -> None:
    p = write(tmp_path, "t.csv", "arrival_s,prompt_tokens,output_tokens\n"
              + "".join(f"{t},{10 + i},2\n" for i, t in enumerate([0, 3, 1, 4, 2, 5, 6])))
    wl = trace(p, start_s=1, duration_s=4, max_requests=3, speedup=2)
    reqs = sorted(wl.initial_requests(), key=lambda r: r.arrival_s)
    # Rows 2, 4, 1 arrive at 1, 2, 3 s (row 3 at 4 s is the fourth): times count from
    # start_s and are halved; request ids are the rows' places in the file.
    assert [(r.request_id, r.arrival_s, len(r.prompt_ids)) for r in reqs] == [
        (2, 0.0, 12), (4, 0.5, 14), (1, 1.0, 11)]
    with pytest.raises(UserError, match="no trace row arrives in the window"):
        trace(p, start_s=100)


def test_rows_over_max_model_len_are_truncated_or_rejected_and_counted(
        tmp_path: Path) -> None:
    p = write(tmp_path, "t.csv", "arrival_s,prompt_tokens,output_tokens\n"
              "0,50,10\n0.1,95,10\n0.2,20,200\n")
    cut = trace(p, max_model_len=100)
    assert [(len(r.prompt_ids), r.params.max_tokens) for r in cut.initial_requests()] == [
        (50, 10), (90, 10), (20, 50)]
    assert cut.workload_metrics()["trace.truncated"] == 2
    rej = trace(p, max_model_len=100, over_length="reject")
    assert [r.rejected_reason is not None for r in rej.initial_requests()] == [
        False, True, True]
    assert rej.workload_metrics()["trace.rejected_too_long"] == 2
    assert fit(95, 10, 100) == (90, 10) and fit(20, 200, 100) == (20, 50)


def test_rejected_rows_are_counted_in_a_run(tmp_path: Path) -> None:
    p = write(tmp_path, "t.csv", "arrival_s,prompt_tokens,output_tokens\n"
              "0,50,4\n0,300,4\n")
    r = run(compose_cfg(["model=tiny", "workload=trace", f"workload.path={p}",
                         "workload.over_length=reject", "scheduler.max_model_len=128",
                         "cache.kv_budget=512KiB"]))
    rows = {x["request_id"]: x for x in r.requests}
    assert rows[0]["status"] == "finished" and rows[1]["status"] == "rejected"
    assert "max_model_len=128" in rows[1]["rejected_reason"]
    assert r.metrics["requests.rejected"] == r.metrics["trace.rejected_too_long"] == 1


def test_equal_hash_ids_become_equal_token_blocks() -> None:
    wl = trace(MOONCAKE, max_model_len=4096)
    reqs = {r.request_id: r.prompt_ids for r in wl.initial_requests()}
    rows = {p.row.index: p.row for p in wl.plans}
    checked = 0
    for a in rows.values():
        for b in rows.values():
            assert a.hash_ids is not None and b.hash_ids is not None
            k = 0  # leading ids the two rows share
            while k < min(len(a.hash_ids), len(b.hash_ids)) and \
                    a.hash_ids[k] == b.hash_ids[k]:
                k += 1
            n = min(1 + 512 * k, a.prompt_tokens, b.prompt_tokens)  # BOS, then blocks
            assert reqs[a.index][:n] == reqs[b.index][:n]
            if k < min(len(a.hash_ids), len(b.hash_ids)):  # the next blocks differ
                assert reqs[a.index][n:n + 512] != reqs[b.index][n:n + 512]
                checked += 1
    assert checked > 0
    assert all(len(reqs[i]) == rows[i].prompt_tokens for i in rows)


def expected_hits(rows: list[dict[str, Any]], plans: dict[int, Any], block: int,
                  done_only: bool) -> dict[int, int]:
    """Prefix-cache hits each request should get from the trace's hash ids: blocks of the
    cache (``block`` tokens) inside the prefix it shares with an earlier request (whose
    prefill is done by its arrival when ``done_only``), never its last token."""
    out = {}
    for b in rows:
        best = 0
        for a in rows:
            ready = (a["arrival_s"] + a["ttft_ms"] / 1e3 <= b["arrival_s"]) if done_only \
                else (a["arrival_s"], a["request_id"]) < (b["arrival_s"], b["request_id"])
            if a is b or not ready:
                continue
            ia, ib = plans[a["request_id"]].row.hash_ids, plans[b["request_id"]].row.hash_ids
            k = 0
            while k < min(len(ia), len(ib)) and ia[k] == ib[k]:
                k += 1
            shared = min(1 + 512 * k, a["prompt_tokens"]) if k else 0
            best = max(best, min(shared // block, (b["prompt_tokens"] - 1) // block) * block)
        out[b["request_id"]] = best
    return out


def test_a_block_longer_than_every_prompt_is_drawn_only_as_long_as_the_longest() -> None:
    """Issue #55: workload.hash_block_tokens=1e9 drew a billion tokens per hash id (the
    run never started). No prompt reads past the trace's longest: a block is drawn that
    long, and prompts sharing ids still share their tokens."""
    wl = trace(MOONCAKE, max_model_len=4096, hash_block_tokens=10**9)
    longest = max(int(n) for n in wl.prompt_len)
    assert wl.longest_prompt == longest
    reqs = {r.request_id: r.prompt_ids for r in wl.initial_requests()}
    assert all(len(blk) == longest for blk in wl._blocks.values())
    rows = {p.row.index: p.row for p in wl.plans}
    assert all(len(reqs[i]) == rows[i].prompt_tokens for i in rows)
    by_first: dict[int, list[int]] = {}
    for i, r in rows.items():  # equal first ids: equal prompts up to the shorter
        assert r.hash_ids
        by_first.setdefault(r.hash_ids[0], []).append(i)
    shared = [ids for ids in by_first.values() if len(ids) > 1]
    assert shared
    for ids in shared:
        a, b = reqs[ids[0]], reqs[ids[1]]
        n = min(len(a), len(b))
        assert a[:n] == b[:n]


def test_a_replay_reproduces_the_traces_arrivals_lengths_and_sharing(tmp_path: Path) -> None:
    r = run(compose_cfg(["model=tiny", "workload=trace", f"workload.path={MOONCAKE}",
                         "workload.speedup=2", "cache.kv_budget=16MiB"], tmp_path))
    wl = trace(MOONCAKE, max_model_len=2048, speedup=2)
    plans = {p.row.index: p for p in wl.plans}
    rows = sorted(r.requests, key=lambda x: x["request_id"])
    assert [x["request_id"] for x in rows] == list(range(24))
    for x in rows:
        p = plans[x["request_id"]]
        assert x["arrival_s"] == pytest.approx(p.row.arrival_s / 2, abs=1e-12)
        assert x["output_tokens"] == p.row.output_tokens and x["status"] == "finished"
        if p.row.prompt_tokens + p.row.output_tokens <= 2048:
            assert x["prompt_tokens"] == p.row.prompt_tokens
        else:  # the long row: cut to fit, counted
            assert x["prompt_tokens"] == 2048 - p.row.output_tokens
    assert r.metrics["trace.truncated"] == 1
    # Sharing: every request hits at least the blocks an earlier request had finished
    # computing when it arrived, and at most what any earlier request shares with it.
    lo = expected_hits(rows, plans, 16, done_only=True)
    hi = expected_hits(rows, plans, 16, done_only=False)
    for x in rows:
        assert lo[x["request_id"]] <= x["prefix_hit_tokens"] <= hi[x["request_id"]]
    assert sum(lo.values()) > 0.4 * sum(x["prompt_tokens"] for x in rows)
    assert r.metrics["cache.prefix_hit_rate"] > 0.4


def test_a_conversations_later_turn_resends_the_real_history() -> None:
    wl = trace(FOLDER / "kvbench_example.csv")
    first = next(p for p in wl.plans if p.row.conversation == "c0" and p.row.turn == 0)
    second = next(p for p in wl.plans if p.row.conversation == "c0" and p.row.turn == 1)
    assert second.follows == first.row.index
    assert second.row.index not in {r.request_id for r in wl.initial_requests()}
    req = next(r for r in wl.initial_requests() if r.request_id == first.row.index)
    g = SequenceGroup(req.request_id, req.prompt_ids, req.params)
    answer = [7] * first.output_len
    g.seqs.append(Sequence(1, g, req.prompt_ids + answer))
    g.seqs[0].num_prompt_tokens = len(req.prompt_ids)
    (nxt,) = wl.on_finished(g)
    assert nxt.request_id == second.row.index and len(nxt.prompt_ids) == second.prompt_len
    assert nxt.prompt_ids[:len(req.prompt_ids) + len(answer)] == req.prompt_ids + answer
    assert nxt.earliest_s == second.arrival_s and nxt.arrival_s == 0.0


def test_a_conversation_trace_hits_its_history_in_a_run() -> None:
    r = run(compose_cfg(["model=tiny", "workload=trace",
                         f"workload.path={FOLDER / 'kvbench_example.csv'}",
                         "workload.speedup=10", "cache.kv_budget=4MiB"]))
    wl = trace(FOLDER / "kvbench_example.csv", speedup=10)
    plans = {p.row.index: p for p in wl.plans}
    rows = {x["request_id"]: x for x in r.requests}
    assert len(rows) == 18 and all(x["status"] == "finished" for x in rows.values())
    for rid, x in rows.items():
        p = plans[rid]
        assert x["prompt_tokens"] == p.row.prompt_tokens
        assert x["arrival_s"] >= p.arrival_s - 1e-12  # never before its trace time
        if p.follows is not None:
            prev = rows[p.follows]
            assert x["arrival_s"] >= prev["arrival_s"] + prev["e2e_ms"] / 1e3 - 1e-9
            # The previous prompt and answer, less the last block and the unwritten token.
            assert x["prefix_hit_tokens"] >= (prev["prompt_tokens"] // 16 - 1) * 16


def test_max_tokens_asks_a_servers_limit_and_stops_at_the_rows_length(
        tmp_path: Path) -> None:
    p = write(tmp_path, "t.csv", "arrival_s,prompt_tokens,output_tokens\n0,10,5\n0,10,300\n")
    exact = [r.params for r in trace(p).initial_requests()]
    assert [(x.max_tokens, x.stop_after) for x in exact] == [(5, None), (300, None)]
    capped = [r.params for r in trace(p, max_tokens=256).initial_requests()]
    # The row's length ends the request (as an EOS would); max_tokens is what is reserved,
    # never less than the row needs.
    assert [(x.max_tokens, x.stop_after) for x in capped] == [(256, 5), (300, 300)]


def test_a_rejected_turns_next_turn_still_arrives_when_the_trace_says(tmp_path: Path) -> None:
    # The trace is the offered load: conversation a's first turn needs more than the whole
    # KV pool (64 tokens) and is rejected when it arrives; its second still arrives at its
    # time (it was never sent before run-time rejections were followed up); b runs.
    p = write(tmp_path, "c.csv", "arrival_s,prompt_tokens,output_tokens,conversation_id,turn\n"
              "0,100,4,a,0\n0.5,120,4,a,1\n0,20,4,b,0\n0.2,40,4,b,1\n")
    r = run(compose_cfg(["model=tiny", "workload=trace", f"workload.path={p}",
                         "cache.kv_budget=32KiB", "cache.watermark=0"]))
    rows = {x["request_id"]: x for x in r.requests}
    assert {i: x["status"] for i, x in rows.items()} == {
        0: "rejected", 1: "rejected", 2: "finished", 3: "finished"}
    assert rows[1]["arrival_s"] >= 0.5 - 1e-9
    assert r.metrics["requests.rejected"] == 2


@pytest.mark.parametrize(("name", "text", "first"), [
    ("epoch.jsonl", '{"timestamp": 1733000000000, "input_length": 8, "output_length": 2}\n'
                    '{"timestamp": 1733000000250, "input_length": 8, "output_length": 2}\n',
     1733000000.0),
    ("epoch.csv", "arrival_s,prompt_tokens,output_tokens\n1733000000.5,8,2\n1733000000.75,8,2\n",
     1733000000.5),
])
def test_epoch_times_are_rebased_to_the_first_row_and_recorded(tmp_path: Path, name: str,
                                                               text: str, first: float) -> None:
    # Issue 27: mooncake and kvbench times were not rebased (Azure's were): epoch times
    # made a run wait decades for its first request.
    p = tmp_path / name
    p.write_text(text)
    _, rows, shift = read_trace(p)
    assert [r.arrival_s for r in rows] == [0.0, 0.25] and shift == pytest.approx(first)
    w = trace(p)
    assert [r.arrival_s for r in w.initial_requests()] == [0.0, 0.25]
    assert w.workload_metrics()["trace.rebased_s"] == pytest.approx(first)


def test_an_azure_trace_mixing_time_zones_is_refused(tmp_path: Path) -> None:
    p = tmp_path / "mixed.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                 "2023-11-16 18:15:46.680+00:00,8,2\n2023-11-16 13:15:47.000-05:00,8,2\n"
                 "2023-11-16 18:15:48.000,8,2\n")
    with pytest.raises(UserError, match=r"its TIMESTAMPs mix time zones \(line 2: "
                                        r"UTC\+0000; line 3: UTC-0500; line 4: no UTC "
                                        r"offset\)"):
        read_trace(p)


@pytest.mark.parametrize("path", ["mooncake_example.jsonl", "kvbench_example.csv"])
def test_a_streamed_replay_equals_one_from_every_request_at_once(
        path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The engine takes a trace's requests one at a time from its stream, merged with the
    # follow-up turns; the same run with every request pushed at the start (the way every
    # other workload runs) must be the same run, request for request.
    import harness.engine.engine as engine

    cfg = ["executor=roofline", "roofline.model=Llama-3.1-8B", "roofline.hardware=a100-80gb",
           "workload=trace", f"workload.path={FOLDER / path}", "workload.speedup=40",
           "cache.kv_budget=1GiB", "scheduler.max_num_seqs=4", "scheduler.max_model_len=4096"]
    streamed = run(compose_cfg(cfg))

    class Never(Protocol):  # no workload has this: the engine takes initial_requests()
        def never_implemented_(self) -> None: ...

    monkeypatch.setattr(engine, "StreamsRequests", runtime_checkable(Never))
    whole = run(compose_cfg(cfg))
    assert streamed.requests == whole.requests
    assert len(streamed.requests) >= 18
    assert max(r["ttft_ms"] for r in streamed.requests) > 10 * min(
        r["ttft_ms"] for r in streamed.requests)  # requests queued: arrivals interleave
    keys = [k for k in whole.metrics if k.startswith(("latency.", "throughput.", "memory."))]
    assert {k: streamed.metrics[k] for k in keys} == {k: whole.metrics[k] for k in keys}


def test_a_trace_is_scanned_into_columns_and_built_as_reached(tmp_path: Path) -> None:
    from harness.workloads.trace_synth import write_mooncake_like

    p = tmp_path / "big.jsonl"
    write_mooncake_like(p, 3000, rate=50.0, seed=1)
    wl = trace(p, max_requests=100)
    assert wl.num_rows == 3000 and wl.num_initial == 100
    built: list[int] = []
    real = wl._fresh_prompt
    wl._fresh_prompt = lambda k: built.append(k) or real(k)  # type: ignore[method-assign]
    stream = wl.stream_requests()
    first = next(stream)
    assert built == [0] and first.request_id == int(wl.kept[0])  # one built, not 100
    rest = list(stream)
    times = [(r.arrival_s, r.request_id) for r in [first, *rest]]
    assert times == sorted(times) and len(times) == 100
    # The same requests as the per-row reader gives (hash ids read again by offset).
    _, rows, _ = read_trace(p)
    for r in [first, *rest]:
        row = rows[r.request_id]
        assert len(r.prompt_ids) == min(row.prompt_tokens, wl.cfg.max_model_len or 10**9)
    shapes = list(wl.initial_shapes())
    assert shapes == [(len(r.prompt_ids), r.params.max_tokens, 1) for r in [first, *rest]]


def test_the_synthetic_traces_lengths_and_blocks_follow_their_options(tmp_path: Path) -> None:
    import json
    import statistics

    from harness.workloads.trace_synth import main

    p = tmp_path / "s.jsonl"
    main([str(p), "--rows", "4000", "--rate", "20", "--input-median", "250",
          "--output-median", "150", "--block", "64"])
    rows = [json.loads(line) for line in p.read_text().splitlines()]
    assert len(rows) == 4000
    # Lognormal medians within 10% on 4,000 draws (sigma 1.0 and 0.9: ~2% standard error).
    assert abs(statistics.median(r["input_length"] for r in rows) / 250 - 1) < 0.1
    assert abs(statistics.median(r["output_length"] for r in rows) / 150 - 1) < 0.1
    assert all(len(r["hash_ids"]) == -(-r["input_length"] // 64) for r in rows)
    assert abs(rows[-1]["timestamp"] / 1e3 / 4000 - 1 / 20) < 0.005  # 20 per second
    with pytest.raises(SystemExit):
        main([str(p), "--block", "0"])


def test_a_mooncake_csv_without_hash_ids_replays(tmp_path: Path) -> None:
    # A CSV with Mooncake's columns has no hash ids to read again (its rows' offsets are
    # -1): each prompt is its row's own text, as before the columns.
    p = write(tmp_path, "m.csv", "timestamp,input_length,output_length\n0,40,3\n250,30,2\n")
    wl = trace(p)
    assert wl.format == "mooncake" and [len(r.prompt_ids) for r in wl.initial_requests()] \
        == [40, 30]
    assert [r.hash_ids for r in read_trace(p)[1]] == [(), ()]


def test_a_rejected_rows_prompt_is_not_drawn(tmp_path: Path) -> None:
    p = write(tmp_path, "t.csv", "arrival_s,prompt_tokens,output_tokens\n0,5000000,3\n1,40,2\n")
    wl = trace(p, over_length="reject", max_model_len=2048)
    reqs = wl.initial_requests()
    assert reqs[0].rejected_reason is not None and len(reqs[0].prompt_ids) == 5_000_000
    assert len(set(reqs[0].prompt_ids)) == 1  # a placeholder of its length, no text drawn
    assert reqs[1].rejected_reason is None and len(set(reqs[1].prompt_ids)) > 5


def test_a_speedup_that_stretches_the_trace_past_any_run_is_refused(tmp_path: Path) -> None:
    """Issue #55: workload.speedup=1e-300 was taken (arrivals 10^300 seconds apart)."""
    p = write(tmp_path, "t.csv", "arrival_s,prompt_tokens,output_tokens\n0,12,3\n2,12,3\n")
    assert trace(p, speedup=1e-6).arrival.max() == pytest.approx(2e6)
    with pytest.raises(UserError, match=r"workload\.speedup=1e-300 stretches the trace"):
        trace(p, speedup=1e-300)


def test_conversation_ids_that_read_as_one_are_refused(tmp_path: Path) -> None:
    """Issue #55: conversation ids 1 and "1" were merged into one conversation."""
    p = write(tmp_path, "c.jsonl",
              '{"arrival_s": 0, "prompt_tokens": 8, "output_tokens": 2, '
              '"conversation_id": 1, "turn": 0}\n'
              '{"arrival_s": 1, "prompt_tokens": 9, "output_tokens": 2, '
              '"conversation_id": "1", "turn": 1}\n')
    with pytest.raises(UserError, match=r"c\.jsonl:2: conversation_id '1' and 1 .* read as "
                                        "one id"):
        trace(p)
    ok = write(tmp_path, "d.jsonl", p.read_text().replace('"conversation_id": "1"',
                                                            '"conversation_id": 1'))
    assert trace(ok).num_initial == 1  # one conversation: its turn 1 follows turn 0


def test_an_azure_trace_across_a_daylight_saving_change_is_exact(tmp_path: Path) -> None:
    """Issue #55: explicit UTC offsets that change mid-trace (EDT -> EST) were refused as
    mixed time zones, though every stamp is an exact instant."""
    p = tmp_path / "dst.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                 "2023-11-05 01:59:59.500-04:00,8,2\n"   # EDT, 05:59:59.5 UTC
                 "2023-11-05 01:00:00.250-05:00,8,2\n")  # EST, 06:00:00.25 UTC
    _, rows, _ = read_trace(p)
    assert [r.arrival_s for r in rows] == [0.0, 0.75]
