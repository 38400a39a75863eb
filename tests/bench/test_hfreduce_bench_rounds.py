"""How `fireflyer bench allreduce` turns rounds into figures: the slowest rank per op, medians, the
memory and dispatch floors, speedups, the report and the PNG, and the control protocol the
ranks speak. Single-process and fast; no timing asserts."""

from __future__ import annotations

import io
import math
import socket
import threading

import pytest
import torch

from fireflyer.bench import allreduce as bench, allreduce_worker as bench_worker
from fireflyer.bench import allreduce_report as report

MiB = 1 << 20


def test_memory_floor_arithmetic() -> None:
    # 1 node x 4 ranks: each input read once, each output written once = 8x the tensor
    assert report.memory_floor_bytes(64 * MiB, 4) == 8 * 64 * MiB
    # 2 emulated nodes of 2 share this host: 2 * 2 * 2 = 8x as well
    assert report.memory_floor_bytes(64 * MiB, 2, 2) == 8 * 64 * MiB
    assert report.memory_floor_seconds(1000, 4, 1, 8e3) == 1.0
    assert math.isnan(report.memory_floor_seconds(1000, 4, 1, None))


def test_median_and_slowest_rank() -> None:
    assert report.median([3.0, 1.0, 2.0]) == 2.0
    assert report.median([4.0, 1.0, 2.0, 3.0]) == 2.5
    assert math.isnan(report.median([]))
    assert report.slowest_per_op([[1.0, 5.0], [2.0, 1.0], [0.5, 0.5]]) == [2.0, 5.0]
    assert report.slowest_per_op([]) == []
    with pytest.raises(ValueError):
        report.slowest_per_op([[1.0], [1.0, 2.0]])


def test_speedup_and_dispatch_floor() -> None:
    assert report.speedup(10.0, 2.0) == 5.0
    assert math.isnan(report.speedup(None, 2.0)) and math.isnan(report.speedup(1.0, float("nan")))
    floor = report.dispatch_floor([[1e-6, 3e-6, 2e-6], [2e-6, 1e-6, 2e-6]])
    assert floor["time_s"] == 2e-6 and floor["ops"] == 3 and "doors_s" not in floor
    doors = [{"cpp": [1e-6, 2e-6, 1e-6], "python": [5e-6, 6e-6, 5e-6]}, {"cpp": [2e-6, 1e-6, 1e-6], "python": [4e-6] * 3}]
    floor = report.dispatch_floor([[1e-6] * 3, [1e-6] * 3], doors)
    assert floor["doors_s"] == {"cpp": 2e-6, "python": 5e-6}  # per op the slowest rank, then the median
    assert "doors_s" not in report.dispatch_floor([[1e-6], [1e-6]], [{"cpp": [1e-6]}, {}])  # not every rank: none


def test_format_ms() -> None:
    assert [report.format_ms(s) for s in (6.12e-5, 1.084e-3, 24.04e-3, 382.4e-3)] == ["0.0612", "1.08", "24.0", "382"]
    assert report.format_ms(None) == "-" and report.format_ms(float("nan")) == "-"


def _row(dtype: str = "fp32", nbytes: int = 64 * MiB, **kw):
    measured = {"candidate": ([0.05, 0.04, 0.06], 0), "gloo": ([0.10, 0.12, 0.11], 0),
                "openmpi": ([0.08, 0.08], 0), "deepspeed": ([0.06], 2)}
    na = {}
    if dtype == "bf16":
        del measured["openmpi"]
        na["openmpi"] = "n/a: MPI has no bf16 type"
    return report.build_row(layout="1x4", nodes=1, local=4, dtype=dtype, itemsize=4 if dtype == "fp32" else 2,
                            nbytes=nbytes, measured=measured, na=na, copy_bw=8 * 64 * MiB / 0.03, **kw)


def test_build_row() -> None:
    row = _row()
    assert row["candidate"]["time_s"] == 0.05 and row["candidate"]["ops"] == 3 and row["iters"] == 3
    assert row["candidate"]["busbw"] == pytest.approx(row["candidate"]["algbw"] * 1.5)
    assert row["floor_s"] == pytest.approx(0.03)
    assert row["pct_floor"] == pytest.approx(60.0) and row["gloo"]["pct_floor"] == pytest.approx(27.27, abs=0.01)
    assert row["speedup"] == pytest.approx({"gloo": 2.2, "openmpi": 1.6, "deepspeed": 1.2})
    assert row["ratio"] == pytest.approx(2.2)
    assert row["deepspeed"]["wrong"] == 2 and report.wrong_total([row, _row("bf16")]) == 4
    bf16 = _row("bf16")
    assert bf16["openmpi"] is None and bf16["na"] == {"openmpi": "n/a: MPI has no bf16 type"}
    assert "openmpi" not in bf16["speedup"] or math.isnan(bf16["speedup"]["openmpi"])


def test_build_row_roofline_and_link() -> None:
    traffic = {"mem_bytes": 16 * 64 * MiB, "link_bytes": 64 * MiB}
    row = _row(traffic=traffic, link_mbit=1000.0)
    assert row["roofline_s"] == pytest.approx(64 * MiB / 125e6)
    assert row["pct_link"] == pytest.approx(report.pct_of_link(row["candidate"]["algbw"], 1000.0))
    assert row["gloo_pct_link"] == row["gloo"]["pct_link"]


def _result() -> bench.LayoutResult:
    res = bench.LayoutResult("1x4", 1, 4, 4, copy_bw=17e9, dispatch_floor={"time_s": 2.5e-6, "ops": 10},
                             notes={"deepspeed": "DeepSpeed skipped: not installed; install: pip"})
    res.rows = [_row("fp32", s) for s in (4 << 10, 64 * MiB)] + [_row("bf16", 4 << 10)]
    res.roofline = {"copy_bw": 17e9, "copy_ranks": 2, "model": "test"}
    return res


def test_print_layout_shows_floors_notes_and_na() -> None:
    from rich.console import Console

    buf = io.StringIO()
    cfg = bench.build_config(["--layouts", "1x4"])
    bench.print_layout(Console(file=buf, width=200), cfg, _result())
    out = buf.getvalue()
    assert "dispatch floor" in out and "2.5 us" in out
    assert "memory floor" in out and "17.00 GB/s" in out
    assert "DeepSpeed skipped: not installed" in out
    assert "n/a: MPI has no bf16 type" in out and " n/a " in out
    assert "OpenMPI" in out and "DS-SHM" in out


def test_print_layout_shows_each_sizes_path_and_traffic() -> None:
    from rich.console import Console

    from fireflyer.hfreduce.config import HFReduceConfig

    res = _result()
    res.rows = [_row("fp32", s, traffic=report.path_traffic(s, 1, 4, 4, HFReduceConfig())) for s in (4 << 10, 64 * MiB)]
    assert [r["path"] for r in res.rows] == ["one-shot", "pipeline"]
    buf = io.StringIO()
    bench.print_layout(Console(file=buf, width=200), bench.build_config(["--layouts", "1x4"]), res)
    out = buf.getvalue()
    lines = {ln.split()[0]: ln for ln in out.splitlines() if ln.strip().startswith(("4K", "64M"))}
    assert "one-shot" in lines["4K"] and "28\u00d7" in lines["4K"] and "8\u00d7" in lines["4K"]
    assert "pipeline" in lines["64M"] and "19\u00d7" in lines["64M"]
    assert "path" in out and "traffic" in out and "the roofline uses the path's traffic" in out
    # rows without a path (a gloo candidate) get no such columns
    buf = io.StringIO()
    bench.print_layout(Console(file=buf, width=200), bench.build_config(["--layouts", "1x4"]), _result())
    assert "\u00d7" not in buf.getvalue() and " path " not in buf.getvalue()


def test_plot_series_and_png(tmp_path) -> None:
    res = _result()
    series = report.plot_series(res, "fp32")
    assert set(series) == {"candidate", "gloo", "openmpi", "deepspeed", "memory floor"}
    assert series["candidate"] == [(4 << 10, 0.05), (64 * MiB, 0.05)]
    assert "openmpi" not in report.plot_series(res, "bf16")
    cfg = bench.build_config(["--layouts", "1x4", "--png", str(tmp_path / "a.png")])
    report.write_png(cfg.png_path, cfg, [res])
    assert (tmp_path / "a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_doc_fields_record_peers_and_floors() -> None:
    from fireflyer.bench import allreduce_peers as bench_peers

    cfg = bench.build_config(["--layouts", "1x4"])
    peers = {"deepspeed": bench_peers.PeerStatus("deepspeed", False, note="DeepSpeed skipped: not installed")}
    doc = bench.doc_fields(cfg, peers, [_result()])
    assert doc["peers"]["deepspeed"]["available"] is False
    assert doc["dispatch_floor"]["1x4"]["time_s"] == 2.5e-6
    assert doc["layouts"][0]["notes"]["deepspeed"].startswith("DeepSpeed skipped")
    assert doc["speedups"]["1x4"][f"fp32/{64 * MiB}"]["openmpi"] == pytest.approx(1.6)
    assert doc["config"]["busy"] == 0


def test_a_busy_run_records_its_load_and_writes_beside_the_quiet_one() -> None:
    quiet = bench.build_config(["--layouts", "1x4"])
    assert quiet.busy == 0 and quiet.json_path == "benchmarks/results/allreduce.json"
    busy = bench.build_config(["--layouts", "1x4", "--busy", "2"])
    assert busy.busy == 2 and busy.json_path == "benchmarks/results/allreduce-busy2.json"
    assert busy.png_path == "benchmarks/results/allreduce-busy2.png"
    assert bench.doc_fields(busy, {}, [_result()])["config"]["busy"] == 2
    for bad in ("-1", "65"):
        with pytest.raises(bench.UserError, match="--busy must be 0 to 64"):
            bench.build_config(["--busy", bad])


def test_the_busy_processes_run_beside_the_block_and_end_with_it() -> None:
    import os

    from fireflyer.bench.harness import busy_host

    with busy_host(0) as none:
        assert none == []
    with busy_host(2) as pids:
        assert len(pids) == 2
        for pid in pids:
            assert b"while True: pass" in open(f"/proc/{pid}/cmdline", "rb").read()
    for pid in pids:  # reaped: gone from /proc
        assert not os.path.exists(f"/proc/{pid}")


# -- the ranks' side ---------------------------------------------------------------------


def test_timed_round_checks_the_first_op() -> None:
    blocks = [bench_worker.seeded_block(r, 0, 0, 2) for r in range(2)]
    expected = torch.stack(blocks).sum(0).float()
    buf = torch.empty(1000)
    calls = []

    def good(b):
        return lambda: (calls.append(1), bench_worker.fill(b, expected))

    times, wrong = bench_worker.timed_round(good, lambda: None, buf, blocks[0].float(), expected, 7, 3, 4)
    assert len(times) == 7 and wrong == 0 and len(calls) == 3 + 7
    times, wrong = bench_worker.timed_round(lambda b: lambda: None, lambda: None, buf, blocks[0].float(),
                                            expected, 2, 0, 4)
    assert len(times) == 2 and wrong > 0  # this rank's input is not the sum


def test_serve_answers_rounds_over_the_channel() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    parent, rank = bench_worker.Channel(a), bench_worker.Channel(b)
    world = 1  # the sum of one rank is its input: the identity is a correct allreduce
    systems = {"identity": lambda buf: lambda: None}
    handlers = {"ping": lambda cmd: {"pong": cmd["n"]}}
    t = threading.Thread(target=bench_worker.serve, args=(rank, 0, world, systems, lambda: None, handlers, 30.0))
    t.start()
    try:
        parent.send({"cmd": "ping", "n": 3})
        assert parent.recv(10) == {"pong": 3}
        for dtype, di in (("fp32", 0), ("bf16", 1)):
            parent.send({"cmd": "round", "system": "identity", "dtype": dtype, "bytes": 4096 + 8, "ops": 4,
                         "warmup": 2, "size_index": 0, "dtype_index": di})
            msg = parent.recv(10)
            assert len(msg["times"]) == 4 and msg["wrong"] == 0
        parent.send({"cmd": "exit"})
        assert parent.recv(10) == {"ok": True}
    finally:
        t.join(10)
        parent.close()
        rank.close()
    assert not t.is_alive()


def test_channel_keeps_a_partial_line_and_sees_eof() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ch = bench_worker.Channel(b)
    a.sendall(b'{"x": ')
    with pytest.raises(TimeoutError):
        ch.recv(0.05)
    a.sendall(b'1}\n')
    assert ch.recv(1) == {"x": 1}
    a.close()
    assert ch.recv(1) is None
    ch.close()


def test_noop_backend_does_nothing() -> None:
    pg = bench_worker.NoopProcessGroup(0, 1)
    x = torch.ones(1)
    work = pg.allreduce([x])
    assert work.wait() and work.is_completed() and work.get_future().value() == [x]
    assert pg.getBackendName() == bench_worker.NOOP_BACKEND and x.item() == 1.0


def test_fault_hook_targets_one_set(monkeypatch) -> None:
    monkeypatch.setenv("FIREFLYER_BENCH_FAULT", "deepspeed/1:exit")
    bench_worker._inject_fault(1)  # the torch set's rank 1: untouched
    bench_worker._inject_fault(0, "deepspeed")
    with pytest.raises(SystemExit):
        bench_worker._inject_fault(1, "deepspeed")
    monkeypatch.setenv("FIREFLYER_BENCH_FAULT", "1:exit")
    with pytest.raises(SystemExit):
        bench_worker._inject_fault(1)
