"""The table math and flag parsing of `fireflyer bench allreduce`; no processes started."""

from __future__ import annotations

import math

import pytest
import torch

from fireflyer.errors import UserError
from fireflyer.bench import allreduce as bench, allreduce_worker as bench_worker
from fireflyer.fabric import traffic
from fireflyer.bench import allreduce_report as report
from fireflyer.hfreduce.config import HFReduceConfig


@pytest.mark.parametrize("text,expected", [
    ("1048576", 1 << 20), ("512K", 512 << 10), ("64M", 64 << 20), ("64MiB", 64 << 20),
    ("64mb", 64 << 20), ("1G", 1 << 30), ("1.5K", 1536), (" 4 ", 4),
])
def test_parse_size(text: str, expected: int) -> None:
    assert bench.parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "M", "64Q", "-1M", "1.3"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(UserError):
        bench.parse_size(text)


def test_format_size_round_trips() -> None:
    for n in (4, 1000, 1 << 10, 3 << 20, 1 << 30):
        assert bench.parse_size(bench.format_size(n)) == n


def test_busbw_factor() -> None:
    assert bench.busbw_factor(1) == 0.0
    assert bench.busbw_factor(2) == 1.0
    assert bench.busbw_factor(4) == 1.5
    assert bench.busbw_factor(8) == pytest.approx(1.75)
    with pytest.raises(ValueError):
        bench.busbw_factor(0)


def test_algbw_and_ratio() -> None:
    assert bench.algbw_gbps(2_000_000_000, 2.0) == 1.0
    assert math.isnan(bench.algbw_gbps(1, 0.0))
    assert bench.ratio(3.0, 2.0) == 1.5
    assert math.isnan(bench.ratio(1.0, 0.0))
    assert math.isnan(bench.ratio(1.0, float("nan")))


def test_roofline_and_percentages() -> None:
    # memory-bound: 10 GB at 20 GB/s
    assert bench.roofline_seconds(10e9, 20e9) == 0.5
    # link-bound: 1 GB at 125 MB/s beats 0.5 s of memory
    assert bench.roofline_seconds(10e9, 20e9, 1e9, 125e6) == 8.0
    assert bench.pct_of_roofline(0.5, 1.0) == 50.0
    assert bench.pct_of_link(0.125, 1000) == pytest.approx(100.0)
    assert bench.pct_of_link(0.1, 1000) == pytest.approx(80.0)


def test_aggregate_copy_bw_takes_best_trial() -> None:
    copies = [{"trial": 0, "bytes": 100, "seconds": 1.0}, {"trial": 0, "bytes": 100, "seconds": 2.0},
              {"trial": 1, "bytes": 100, "seconds": 0.5}, {"trial": 1, "bytes": 100, "seconds": 1.0}]
    assert bench.aggregate_copy_bw(copies) == 200.0


def _cfg(**kw) -> HFReduceConfig:
    return HFReduceConfig(**kw)


@pytest.mark.parametrize("layout,nbytes,itemsize,config,path", [
    ((1, 4), 4 << 10, 4, {}, "one-shot"),
    ((1, 4), 256 << 10, 4, {}, "one-shot"),            # the default one-shot limit, inclusive
    ((1, 4), (256 << 10) + 2, 2, {}, "pipeline"),
    ((1, 4), 64 << 20, 4, {}, "pipeline"),
    ((1, 4), 4 << 10, 4, {"oneshot_bytes": 0}, "pipeline"),
    ((1, 4), 64 << 10, 4, {"chunk_bytes": 32 << 10}, "pipeline"),  # one chunk at most
    ((1, 4), 32 << 10, 4, {"chunk_bytes": 32 << 10}, "one-shot"),
    ((2, 2), 4 << 10, 4, {}, "pipeline+trees"),         # several nodes: the trees, whatever the size
    ((2, 2), 64 << 20, 2, {}, "pipeline+trees"),
])
def test_path_traffic_takes_the_engines_path(layout, nbytes, itemsize, config, path) -> None:
    nodes, local = layout
    t = report.path_traffic(nbytes, nodes, local, itemsize, _cfg(**config))
    assert t["path"] == path
    model = traffic.engine_traffic(nbytes, local, nodes, itemsize, path=path)
    assert t["mem_bytes"] == model["mem_bytes"] and t["link_bytes"] == model["link_bytes"]
    assert t["traffic_x"] == pytest.approx(model["mem_bytes"] / nbytes)
    assert t["floor_x"] == 2 * local


def test_path_traffic_multiples() -> None:
    # 1x4: one shot copies every input in and reads all four per rank (28x); the pipeline 19x; floor 8x
    assert report.path_traffic(4 << 10, 1, 4, 4, _cfg())["traffic_x"] == pytest.approx(28.0)
    assert report.path_traffic(64 << 20, 1, 4, 4, _cfg())["traffic_x"] == pytest.approx(19.0)
    assert [report.format_x(x) for x in (28.0, 19.02, 20.5, None, float("nan"))] == ["28\u00d7", "19\u00d7",
                                                                                   "20.5\u00d7", "-", "-"]


def test_thresholds_follow_the_config() -> None:
    assert report.thresholds(_cfg()) == {"oneshot_bytes": 256 << 10, "chunk_one_node": 256 << 10,
                                         "chunk_many_nodes": 4 << 20}
    assert report.thresholds(_cfg(chunk_bytes=32 << 10)) == {"oneshot_bytes": 32 << 10, "chunk_one_node": 32 << 10,
                                                             "chunk_many_nodes": 32 << 10}
    line = report.format_thresholds(report.thresholds(_cfg()))
    assert "one-shot up to 256KiB" in line and "256KiB on one node" in line and "4MiB across nodes" in line
    assert "one-shot off" in report.format_thresholds(report.thresholds(_cfg(oneshot_bytes=0)))
    assert "\n" not in line


def test_bench_reads_the_engine_config_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("FIREFLYER_HFREDUCE_ONESHOT_BYTES", "0")
    monkeypatch.setenv("FIREFLYER_HFREDUCE_CHUNK_BYTES", str(1 << 20))
    cfg = bench.build_config(["--layouts", "1x4"])
    assert cfg.engine.oneshot_bytes == 0 and cfg.engine.chunk_bytes == 1 << 20
    assert bench.doc_fields(cfg, {}, [])["config"]["thresholds"]["oneshot_bytes"] == 0
    monkeypatch.setenv("FIREFLYER_HFREDUCE_ONESHOT_BYTES", "lots")
    with pytest.raises(UserError, match="FIREFLYER_HFREDUCE_ONESHOT_BYTES"):
        bench.build_config(["--layouts", "1x4"])


def test_collect_uses_each_sizes_path_for_the_roofline() -> None:
    cfg = bench.build_config(["--layouts", "1x4", "--sizes", "4K,64M", "--dtypes", "fp32"])
    lay = bench.parse_layout("1x4")
    res = bench.LayoutResult("1x4", 1, 4, 4)
    copies = [{"trial": 0, "bytes": 10**9, "seconds": 0.1}]  # 10 GB/s
    measured = [("fp32", s, {"candidate": ([1e-3], 0), "gloo": ([2e-3], 0)}, {}) for s in (4 << 10, 64 << 20)]
    bench._collect(res, cfg, lay, copies, measured)
    small, big = res.rows
    assert (small["path"], small["traffic_x"], small["floor_x"]) == ("one-shot", pytest.approx(28.0), 8.0)
    assert small["roofline_s"] == pytest.approx(28 * (4 << 10) / 1e10)
    assert big["path"] == "pipeline" and big["roofline_s"] == pytest.approx(19 * (64 << 20) / 1e10)
    assert res.roofline["model"] == report.TRAFFIC_MODEL and res.roofline["path"] == "pipeline"
    assert res.roofline["traffic"]["mem_bytes"] == pytest.approx(19 * (64 << 20))
    # a gloo candidate is not the engine: no path, no roofline
    res = bench.LayoutResult("1x4", 1, 4, 4)
    bench._collect(res, bench.build_config(["--layouts", "1x4", "--candidate", "gloo"]), lay, copies, measured)
    assert "path" not in res.rows[0] and "roofline_s" not in res.rows[0]


def test_sizes_and_default_iters() -> None:
    assert bench.power2_sizes(1 << 20, 16 << 20) == [1 << 20, 2 << 20, 4 << 20, 8 << 20, 16 << 20]
    assert bench.default_iters(1 << 20) == 20
    assert bench.default_iters(64 << 20) == 4
    assert bench.default_iters(256 << 20) == 2


def test_parse_layout() -> None:
    assert bench.parse_layout("1x4") == bench.Layout(1, 4, False)
    lay = bench.parse_layout("2x2-shaped")
    assert (lay.world, lay.shaped, lay.name) == (4, True, "2x2-shaped")
    for bad in ("1x1", "1x4-shaped", "4", "2x2-fast"):
        with pytest.raises(UserError):
            bench.parse_layout(bad)


def test_build_config() -> None:
    cfg = bench.build_config(["--quick", "--candidate", "gloo", "--layouts", "1x4"])
    assert [s for s, _, _ in cfg.schedule] == list(bench.QUICK_SIZES)
    assert all(it == 5 and wu == 1 for _, it, wu in cfg.schedule) and cfg.rounds == 1
    cfg = bench.build_config([])
    assert [s for s, _, _ in cfg.schedule] == list(bench.TABLE_SIZES)
    assert cfg.schedule[0][0] == 4 << 10 and cfg.schedule[-1][0] == 256 << 20 and cfg.dtypes == ("fp32", "bf16")
    assert cfg.rounds == 2 and cfg.systems == ("candidate", "gloo", "openmpi", "deepspeed")
    assert [lay.name for lay in cfg.layouts] == list(bench.DEFAULT_LAYOUTS)
    # the old sweep flags still work: every power of two between
    cfg = bench.build_config(["--min-bytes", "1M", "--max-bytes", "16M", "--iters", "3", "--warmup", "0"])
    assert [s for s, _, _ in cfg.schedule] == bench.power2_sizes(1 << 20, 16 << 20)
    assert all(it == 3 and wu == 0 for _, it, wu in cfg.schedule)
    cfg = bench.build_config(["--sizes", "64K,4K,64K", "--systems", "hfreduce,openmpi", "--rounds", "3"])
    assert [s for s, _, _ in cfg.schedule] == [4 << 10, 64 << 10]
    assert cfg.systems == ("candidate", "openmpi") and cfg.peers == ("openmpi",) and cfg.rounds == 3
    for bad in (["--bogus"], ["--dtypes", "fp64"], ["--min-bytes", "8M", "--max-bytes", "4M"],
                ["--iters", "0"], ["--link-mbit", "0"], ["--layouts", ""], ["--min-bytes", "6"],
                ["--sizes", "6"], ["--sizes", "4K", "--max-bytes", "1M"], ["--systems", "nccl"],
                ["--systems", ","], ["--rounds", "0"]):
        with pytest.raises(UserError):
            bench.build_config(bad)


def test_default_schedule() -> None:
    ops = {s: (report.default_ops(s), report.default_warmup(s)) for s in bench.TABLE_SIZES}
    # small ops are quick and noisy: more of them, for every system alike
    assert ops[4 << 10] == ops[64 << 10] == ops[256 << 10] == (150, 2)
    assert ops[1 << 20] == ops[4 << 20] == (50, 2)
    assert report.default_ops((256 << 10) + 4) == 50 and report.default_ops((4 << 20) + 4) == 15
    assert ops[16 << 20] == (15, 2)  # issue 15's 2 rounds x 15
    assert ops[64 << 20] == (8, 1) and ops[256 << 20] == (3, 1)
    cfg = bench.build_config([])
    assert [(s, n) for s, n, _ in cfg.schedule][:2] == [(4 << 10, 150), (64 << 10, 150)]
    assert all(n == 7 for _, n, _ in bench.build_config(["--iters", "7"]).schedule)  # --iters overrides


def test_parse_systems() -> None:
    assert bench.parse_systems("all", "hfreduce") == report.SYSTEMS
    assert bench.parse_systems("deepspeed, hfreduce", "hfreduce") == ("candidate", "deepspeed")
    assert bench.parse_systems("mpi,ds", "hfreduce") == ("openmpi", "deepspeed")
    # a gloo candidate is "candidate"; plain "gloo" stays the baseline
    assert bench.parse_systems("candidate,gloo", "gloo") == ("candidate", "gloo")


def test_headline_row_prefers_64m_fp32() -> None:
    rows = [{"dtype": d, "bytes": b} for d in ("fp32", "bf16") for b in (16 << 20, 64 << 20, 256 << 20)]
    assert bench.headline_row(rows) == {"dtype": "fp32", "bytes": 64 << 20}
    assert bench.headline_row(rows[:1]) == rows[0]
    assert bench.headline_row([]) is None


@pytest.mark.parametrize("n", [1, 100, bench_worker.PERIOD, 3 * bench_worker.PERIOD + 7])
def test_worker_fill_and_count_wrong(n: int) -> None:
    blocks = [bench_worker.seeded_block(r, 0, 0, 3) for r in range(3)]
    expected = torch.stack(blocks).sum(0).float()
    buf = torch.empty(n)
    bench_worker.fill(buf, expected)
    assert bench_worker.count_wrong(buf, expected) == 0
    buf[n // 2] += 1
    assert bench_worker.count_wrong(buf, expected) == 1
    assert bench_worker.segment_length(4) == 50
