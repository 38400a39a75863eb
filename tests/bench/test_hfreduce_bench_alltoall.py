"""`fireflyer bench alltoall`: its flags, the ranks' input and check, its rows, report, JSON and PNG.
Single-process and fast (the CLI tests start no ranks: they fail on the flags); no timing asserts."""

from __future__ import annotations

import io
import math
import subprocess
import sys

import pytest
import torch

from fireflyer.errors import UserError
from fireflyer.bench import allreduce as bench, exchange as bench_exchange, allreduce_worker as bench_worker
from fireflyer.bench import allreduce_report as report

MiB = 1 << 20


def test_defaults_and_quick() -> None:
    cfg = bench_exchange.build_config([])
    assert [s for s, _, _ in cfg.schedule] == [64 << 10, 4 * MiB, 64 * MiB]
    assert [(n, w) for _, n, w in cfg.schedule] == [(report.default_ops(s), report.default_warmup(s))
                                                    for s in bench_exchange.SIZES]
    assert [lay.name for lay in cfg.layouts] == ["1x4", "2x2"] and cfg.rounds == 2
    assert cfg.systems == ("candidate", "gloo") and cfg.peers == () and cfg.candidate == "hfreduce"
    assert cfg.json_path == "benchmarks/results/alltoall.json" and cfg.png_path == "benchmarks/results/alltoall.png"
    assert cfg.timeout_s > 0
    quick = bench_exchange.build_config(["--quick", "--layouts", "1x4", "--json", "/tmp/a.json"])
    assert [s for s, _, _ in quick.schedule] == list(bench_exchange.QUICK_SIZES)
    assert all(n == 5 and w == 1 for _, n, w in quick.schedule) and quick.rounds == 1
    assert quick.json_path == "/tmp/a.json"
    cfg = bench_exchange.build_config(["--sizes", "4M,64K,4M", "--iters", "3", "--warmup", "0", "--rounds", "4"])
    assert cfg.schedule == ((64 << 10, 3, 0), (4 * MiB, 3, 0)) and cfg.rounds == 4
    assert cfg.busy == 0
    busy = bench_exchange.build_config(["--busy", "2"])  # a busy run's default outputs sit beside the quiet ones
    assert busy.busy == 2 and busy.json_path == "benchmarks/results/alltoall-busy2.json"
    assert busy.png_path == "benchmarks/results/alltoall-busy2.png"
    named = bench_exchange.build_config(["--busy", "2", "--json", "/tmp/b.json"])
    assert named.json_path == "/tmp/b.json" and named.png_path == "benchmarks/results/alltoall-busy2.png"


@pytest.mark.parametrize("argv,needle", [
    (["--sizes", "lots"], "lots"),
    (["--sizes", "100"], "multiple of 16"),          # 25 floats do not split over 4 ranks
    (["--sizes", "8"], "multiple of 16"),
    (["--sizes", ","], "empty"),
    (["--layouts", "2by2"], "NODESxRANKS"),
    (["--layouts", "1x1"], "at least 2 ranks"),
    (["--layouts", ""], "empty"),
    (["--iters", "-1"], "--iters"),
    (["--iters", "0"], "--iters"),
    (["--warmup", "-2"], "--warmup"),
    (["--rounds", "0"], "--rounds"),
    (["--timeout", "0"], "--timeout"),
    (["--busy", "-1"], "--busy must be 0 to 64"),
    (["--busy", "65"], "--busy must be 0 to 64"),
    (["--busy", "two"], "--busy"),
    (["--bogus"], "--bogus"),
])
def test_bad_flags_are_user_errors(argv, needle) -> None:
    with pytest.raises(UserError, match=needle):
        bench_exchange.build_config(argv)


@pytest.mark.parametrize("args,needle", [
    (["--sizes", "64Q"], "64Q"),
    (["--layouts", "1x4,4"], "NODESxRANKS"),
    (["--iters", "-3"], "--iters"),
    (["--sizes", "6"], "multiple of"),
    (["--busy", "-2"], "--busy must be 0 to 64"),
])
def test_cli_bad_input_is_one_line_and_non_zero(args, needle) -> None:
    done = subprocess.run([sys.executable, "-m", "fireflyer.cli", "bench", "alltoall", *args],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, done.stderr
    assert needle in lines[0] and "Traceback" not in done.stderr


def test_the_part_is_registered() -> None:
    from fireflyer import cli

    assert cli.BENCHES["alltoall"] == "fireflyer.bench.exchange"


@pytest.mark.parametrize("world,numel", [(4, 16384), (4, 4 * MiB // 4), (2, 3 * bench_worker.PERIOD + 5)])
def test_exchange_input_checks_where_every_chunk_lands(world: int, numel: int) -> None:
    inputs = [bench_worker.exchange_input(r, world, numel, 1) for r in range(world)]
    c = numel // world

    def a2a(r: int, src=lambda s: s, chunk=lambda r: r) -> torch.Tensor:  # rank r's output, as the backend builds it
        return torch.cat([inputs[src(s)][0][chunk(r) * c:(chunk(r) + 1) * c] for s in range(world)])

    for r in range(world):
        expected = inputs[r][1]
        assert bench_worker.count_wrong(a2a(r), expected) == 0
        assert bench_worker.count_wrong(a2a(r, src=lambda s: (s + 1) % world), expected) > 0  # chunks out of order
        assert bench_worker.count_wrong(a2a(r, chunk=lambda r: (r + 1) % world), expected) > 0  # another rank's
        assert bench_worker.count_wrong(expected.repeat(numel // expected.numel() + 1)[:numel] + 100, expected) == numel
    with pytest.raises(ValueError):
        bench_worker.exchange_input(0, 3, 100, 0)


def test_exchange_round_checks_and_times(monkeypatch) -> None:
    """One rank's round on a stand-in group: a world of one, where all_to_all is a copy."""
    ex = bench_worker._Exchange(0, 1, {"candidate": "g"}, lambda: None)
    calls = []

    def fake_a2a(y, x, group):
        calls.append(group)
        y.copy_(x)

    monkeypatch.setattr(bench_worker.dist, "all_to_all_single", fake_a2a)
    out = ex.round({"system": "candidate", "bytes": 4096, "size_index": 0, "ops": 4, "warmup": 2})
    assert out["wrong"] == 0 and len(out["times"]) == 4 and calls == ["g"] * 6
    monkeypatch.setattr(bench_worker.dist, "all_to_all_single", lambda y, x, group: None)  # moves nothing
    assert ex.round({"system": "candidate", "bytes": 4096, "size_index": 0, "ops": 1, "warmup": 1})["wrong"] == 1024


def _rows() -> list[dict]:
    return [bench_exchange.build_row("1x4", 4, s, {"candidate": ([0.002, 0.001, 0.003], 0), "gloo": ([0.004] * 3, 0)})
            for s in (64 << 10, 4 * MiB)]


def test_build_row() -> None:
    row = _rows()[0]
    assert row["candidate"]["time_s"] == 0.002 and row["gloo"]["time_s"] == 0.004 and row["iters"] == 3
    assert row["speedup"]["gloo"] == pytest.approx(2.0)
    assert row["candidate"]["algbw"] == pytest.approx((64 << 10) / 0.002 / 1e9)
    assert row["candidate"]["busbw"] == pytest.approx(row["candidate"]["algbw"] * 0.75)  # (n-1)/n
    assert row["count"] == 16384 and row["dtype"] == "fp32"
    lone = bench_exchange.build_row("1x4", 4, 4096, {"gloo": ([1.0], 0)})
    assert math.isnan(lone["speedup"]["gloo"])


def _result() -> bench.LayoutResult:
    res = bench.LayoutResult("1x4", 1, 4, 4)
    res.rows = _rows()
    res.rows[1]["gloo"]["wrong"] = 3
    return res


def test_report_json_and_png(tmp_path) -> None:
    from rich.console import Console

    buf = io.StringIO()
    bench_exchange.print_layout(Console(file=buf, width=160), _result())
    out = buf.getvalue()
    assert "all_to_all_single fp32" in out and "hfreduce" in out and "x" in out and "gloo" in out
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("64K"))
    assert "2.00" in line and "4.00" in line and "2.00" in line.split()
    skipped = bench.LayoutResult("2x2-shaped", 2, 2, 4, skipped="needs root")
    buf = io.StringIO()
    bench_exchange.print_layout(Console(file=buf, width=160), skipped)
    assert "skipped: needs root" in buf.getvalue()

    cfg = bench_exchange.build_config(["--json", str(tmp_path / "a.json"), "--png", str(tmp_path / "a.png")])
    doc = bench_exchange.doc_fields(cfg, [_result(), skipped])
    assert doc["collective"] == "all_to_all_single" and doc["speedups"]["1x4"][str(64 << 10)] == pytest.approx(2.0)
    assert [lay["layout"] for lay in doc["layouts"]] == ["1x4", "2x2-shaped"] and len(doc["rows"]) == 2
    report.write_json(cfg.json_path, doc)
    bench_exchange.write_png(cfg.png_path, [_result(), skipped])
    assert (tmp_path / "a.json").read_text().startswith("{")
    assert (tmp_path / "a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
