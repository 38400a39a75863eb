"""``fireflyer bench allreduce --order canonical``: its flags and refusals, the summary arithmetic on
made-up rank results, the loud failure on wrong bits, and one quick run through the CLI (real ranks,
1x2 and 2x1). No timing asserts."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fireflyer.bench import canonical
from fireflyer.bench.allreduce import split_order
from fireflyer.bench.canonical import (CanonicalBenchConfig, DDPSettings, build_config, summarise_layout, verdicts,
                                       wrong_total)
from fireflyer.errors import UserError

MiB = 1 << 20


def fireflyer(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fireflyer.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_defaults_and_quick():
    cfg = build_config([])
    assert cfg.layouts == ((1, 4), (2, 2)) and cfg.sizes == (64 << 10, MiB, 16 * MiB, 64 * MiB)
    assert cfg.dtypes == ("fp32", "bf16") and cfg.out_dir == "benchmarks/results"
    assert cfg.ddp.shape.d_model == 128 and cfg.ddp.micro_batches == 4
    quick = build_config(["--quick", "--out", "/tmp/x"])
    assert quick.layouts == ((1, 2), (2, 1)) and quick.sizes == (64 << 10, MiB) and quick.rounds == 1
    assert quick.ddp.shape.layers == 1 and quick.out_dir == "/tmp/x"
    assert build_config(["--quick", "--layouts", "2x2", "--sizes", "1M,64K,1M"]).layouts == ((2, 2),)
    assert build_config(["--quick", "--sizes", "1M,64K,1M"]).sizes == (64 << 10, MiB)


@pytest.mark.parametrize("argv, words", [
    (["--layouts", "3x1+1"], "is not NODESxRANKS"),
    (["--layouts", "2x3"], "canonical order refuses it"),
    (["--layouts", "1x1"], "needs 2..16 ranks"),
    (["--layouts", ""], "is not NODESxRANKS"),
    (["--sizes", "6"], "multiple of 4"),
    (["--sizes", "1G"], "from 4 to 256M"),
    (["--sizes", "lots"], "cannot read size"),
    (["--dtypes", "fp16"], "--dtypes must be some of"),
    (["--dtypes", "fp32,fp32"], "each once"),
    (["--iters", "0"], "--iters must be 1..10000"),
    (["--rounds", "0"], "--rounds"),
    (["--warmup", "-1"], "--warmup"),
    (["--micro-batches", "3"], "power of two"),
    (["--ddp-steps", "0"], "--ddp-steps"),
    (["--d-model", "30", "--heads", "4"], "model flags"),
    (["--timeout", "0"], "--timeout"),
])
def test_bad_flags_are_one_line(argv, words):
    with pytest.raises(UserError, match=words) as err:
        build_config(argv)
    assert "\n" not in str(err.value)


def test_three_single_rank_nodes_are_a_canonical_layout():
    assert CanonicalBenchConfig(layouts=((3, 1),)).layouts == ((3, 1),)
    with pytest.raises(UserError, match="micro-batches"):
        DDPSettings(micro_batches=0)


@pytest.mark.parametrize("argv, order, rest", [
    ([], "fast", []),
    (["--quick"], "fast", ["--quick"]),
    (["--order", "canonical", "--quick"], "canonical", ["--quick"]),
    (["--quick", "--order=canonical"], "canonical", ["--quick"]),
    (["--order", "fast", "--sizes", "4K"], "fast", ["--sizes", "4K"]),
])
def test_split_order(argv, order, rest):
    assert split_order(argv) == (order, rest)


@pytest.mark.parametrize("argv, words", [(["--order", "tree"], "fast or canonical, got 'tree'"),
                                         (["--order"], "needs a value")])
def test_split_order_refuses(argv, words):
    with pytest.raises(UserError, match=words):
        split_order(argv)


def _rank(fast: list[float], canon: list[float], *, wrong: int = 0, ddp: tuple[list[float], list[float]] = ([1.0],
          [1.1])) -> dict:
    row = {"dtype": "fp32", "bytes": 64 * MiB, "times": {"fast": fast, "canonical": canon}, "wrong_bytes": wrong,
           "fast_differs_bytes": 5, "checked": 1}
    return {"rank": 0, "threads": 1, "copies": [{"trial": 0, "bytes": 1e9, "seconds": 1.0}],
            "allreduce": [row], "ddp": {"times": {"fast": ddp[0], "canonical": ddp[1]}, "params": 10}}


def test_summary_takes_the_slowest_rank_per_op_then_the_median():
    cfg = build_config(["--layouts", "1x2", "--dtypes", "fp32", "--sizes", "64M"])
    ranks = [_rank([1.0, 5.0, 1.0], [2.0, 1.0, 1.0], ddp=([1.0, 3.0], [1.0, 1.0])),
             _rank([2.0, 1.0, 3.0], [1.0, 1.0, 1.5], ddp=([2.0, 2.0], [2.0, 3.0]))]
    lay = summarise_layout(cfg, (1, 2), ranks, canonical.engine_config())
    (row,) = lay["rows"]
    # slowest per op: fast 2, 5, 3 -> 3; canonical 2, 1, 1.5 -> 1.5
    assert row["fast_s"] == 3.0 and row["canonical_s"] == 1.5 and row["ratio"] == 0.5
    assert row["canonical_algbw_gbps"] == pytest.approx(64 * MiB / 1.5 / 1e9)
    assert row["wrong_bytes"] == 0 and row["fast_differs_bytes"] == 10 and row["path"] == "pipeline"
    assert lay["copy_bw"] == pytest.approx(2e9) and row["roofline_s"] > 0
    # DDP: slowest per step fast 2, 3 -> 2.5; canonical 2, 3 -> 2.5
    assert lay["ddp"]["fast_s"] == 2.5 and lay["ddp"]["canonical_s"] == 2.5 and lay["ddp"]["ratio"] == 1.0
    v = verdicts([lay])
    assert [(x["target"], x["met"]) for x in v] == [("allreduce", True), ("ddp_step", True)]
    slow = summarise_layout(cfg, (1, 2), [_rank([1.0], [1.4], ddp=([1.0], [1.2]))] * 2, canonical.engine_config())
    assert [x["met"] for x in verdicts([slow])] == [False, False]


def test_wrong_bits_are_loud_and_exit_1(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(canonical, "run_layout", lambda cfg, layout: [_rank([1.0], [1.0], wrong=3)] * 2)
    code = canonical.main(["--layouts", "1x2", "--dtypes", "fp32", "--sizes", "64M", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 1 and "CANONICAL RESULTS WRONG: 6 bytes" in out and "6 WRONG" in out
    doc = json.loads((tmp_path / "allreduce-canonical.json").read_text())
    assert doc["wrong_bytes_total"] == 6 and doc["ok"] is False and wrong_total([{"rows": doc["rows"]}]) == 6
    assert doc["command"][:5] == ["fireflyer", "bench", "allreduce", "--order", "canonical"]


@pytest.mark.parametrize("args, words", [
    (["--order", "tree"], "--order must be fast or canonical"),
    (["--order", "canonical", "--layouts", "3x1+1"], "is not NODESxRANKS"),
    (["--order=canonical", "--layouts", "2x3"], "canonical order refuses it"),
])
def test_bad_input_through_the_cli_is_one_line(args, words):
    done = fireflyer("bench", "allreduce", *args)
    assert done.returncode == 2, done.stdout + done.stderr
    assert words in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and done.stderr.startswith("fireflyer bench: error:")


@pytest.mark.heavy  # the canonical order's bits are in the default tier (tests/hfreduce, tests/haiscale)
@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_quick_run_through_the_cli(tmp_path):
    done = fireflyer("bench", "allreduce", "--order", "canonical", "--quick", "--layouts", "2x1", "--timeout", "200", "--out",
                     str(tmp_path), timeout=280)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "target DDP step canonical/fast <= 1.15x" in done.stdout and "roofline at 1M fp32" in done.stdout
    doc = json.loads((tmp_path / "allreduce-canonical.json").read_text())
    assert doc["ok"] and doc["wrong_bytes_total"] == 0 and doc["order"] == "canonical"
    rows = {(r["layout"], r["dtype"], r["bytes"]): r for r in doc["rows"]}
    assert set(rows) == {(lay, d, b) for lay in ("2x1",) for d in ("fp32", "bf16") for b in (64 << 10, MiB)}
    for r in rows.values():
        assert r["wrong_bytes"] == 0 and r["checked_ops"] == 2 and r["fast_s"] > 0 and r["canonical_s"] > 0
        assert r["roofline_s"] > 0
    assert {d["layout"] for d in doc["ddp"]} == {"2x1"}
    assert all(d["fast_s"] > 0 and d["canonical_s"] > 0 and d["params"] > 0 for d in doc["ddp"])
    assert {v["target"] for v in doc["verdicts"]} == {"ddp_step"}  # 64M is not in --quick
    assert (tmp_path / "allreduce-canonical.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
