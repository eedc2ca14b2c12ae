"""The GPU check's pure-Python parts, on CPU: the size list, byte counts, rows, table, JSON,
and its behaviour without a GPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from harness.kernels import bench


def test_sizes_span_1x4k_to_64x32k_smallest_first() -> None:
    sizes = bench.decode_sizes()
    assert sizes[0] == (1, 4096) and sizes[-1] == (64, 32768)
    assert len(sizes) == len(set(sizes)) == len(bench.BATCHES) * len(bench.CONTEXTS)
    work = [b * c for b, c in sizes]
    assert work == sorted(work)


def test_bytes_read_counts_k_v_and_q_once() -> None:
    # 1 sequence x 4096 tokens x 8 KV heads x 128 dims x 2 bytes, for K and for V; plus
    # Q: 32 heads x 128 dims x 2 bytes.
    assert bench.bytes_read(1, 4096) == 2 * 4096 * 8 * 128 * 2 + 32 * 128 * 2
    assert bench.bytes_read(64, 32768) == 64 * bench.bytes_read(1, 32768)


def test_row_bandwidth_and_percent_of_copy() -> None:
    r = bench.make_row("triton", 1, 4096, ms=0.01, copy_gbps=4000.0)
    gbps = bench.bytes_read(1, 4096) / 1e-5 / 1e9
    assert r.gbps == pytest.approx(gbps) and r.pct_of_copy == pytest.approx(gbps / 40)
    failed = bench.make_row("flash-attn", 1, 4096, None, 4000.0, error="ImportError: x")
    assert failed.ms is None and failed.gbps is None and failed.error == "ImportError: x"


def test_table_has_a_line_per_row_and_shows_errors() -> None:
    rows = [bench.make_row("triton", 4, 8192, 0.123456, 4300.0),
            bench.make_row("flash-attn", 4, 8192, None, 4300.0,
                           error="RuntimeError: block size must be divisible by 256\nmore")]
    text = bench.format_table(rows, 4300.0)
    lines = text.splitlines()
    assert "4,300 GB/s" in lines[0] and len(lines) == 3 + len(rows)
    assert "4 x 8k" in lines[3] and "0.123" in lines[3] and "%" in lines[3]
    assert "divisible by 256" in lines[4] and "more" not in lines[4]


def test_report_round_trips_as_json(tmp_path: Path) -> None:
    rows = [bench.make_row("torch-sdpa", 1, 4096, 0.05, 4300.0)]
    path = tmp_path / "sub" / "gpu_check.json"
    bench.write_report(path, bench.report_dict(rows, 4300.0, device="H200"))
    data = json.loads(path.read_text())
    assert data["device"] == "H200" and data["copy_gbps"] == 4300.0
    assert data["geometry"]["num_kv_heads"] == 8 and data["geometry"]["dtype"] == "bfloat16"
    assert data["decode"][0]["provider"] == "torch-sdpa" and data["decode"][0]["ms"] == 0.05


def test_default_out_follows_the_out_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUT", "/tmp/somewhere")
    assert bench.default_out() == Path("/tmp/somewhere/gpu_check.json")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_main_without_cuda_writes_an_error_report(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    assert bench.main(["--out", str(out)]) == 2
    assert json.loads(out.read_text())["error"] == "no CUDA device"
