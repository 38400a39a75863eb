"""``fireflyer plan``, ``fireflyer simulate`` and ``fireflyer bench fabric`` end to end, in process."""

import json
import subprocess
import sys

import pytest

from fireflyer import cli
from fireflyer.errors import UserError
from fireflyer.fabric.cli import parse_counts, parse_size


def run(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_plan_10000_prints_the_tables(capsys):
    rc, out, _ = run(capsys, "plan", "--gpus", "10000")
    assert rc == 0
    assert "1,250 pcie-a100 nodes" in out
    assert "2 zones of two-layer fat trees" in out
    for word in ("switches", "122", "200", "1,320", "320", "network price", "total price", "power (kW)"):
        assert word in out
    assert "cost-performance 1.40" in out
    assert "hfreduce allreduce of 186 MiB over all 10,000 GPUs" in out


def test_plan_json_and_plots(capsys, tmp_path):
    rc, out, err = run(capsys, "plan", "--gpus", "10000", "--json", "--plot", str(tmp_path))
    assert rc == 0
    data = json.loads(out)
    assert data["design"]["switches"] == 122
    assert data["alternative"]["switches_by_layer"] == {"leaf": 500, "spine": 500, "core": 320}
    assert data["three_layer"]["switches"] == 200
    for name in ("fabric-topology.png", "fabric-cost.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    assert "wrote" in err


def test_plan_multiplane(capsys):
    rc, out, _ = run(capsys, "plan", "--gpus", "32768", "--node", "pcie-nextgen", "--switch", "roce128",
                     "--planes", "4", "--json")
    data = json.loads(out)
    assert rc == 0
    assert data["design"]["planes"] == 4 and data["design"]["switches"] == 768
    assert data["design"]["endpoints"] == 32768


@pytest.mark.parametrize("argv, message", [
    (["plan", "--gpus", "0"], "--gpus must be at least 1"),
    (["plan", "--gpus", "64", "--node", "nope"], "unknown node preset 'nope'"),
    (["plan", "--gpus", "64", "--switch", "nope"], "unknown switch preset 'nope'"),
    (["plan", "--gpus", "100000000", "--switch", "qm8700"], "zones"),
    (["plan", "--gpus", "64", "--planes", "4"], "cannot reach 4 planes"),
    (["plan"], "--gpus"),
    (["simulate", "allreduce", "--gpus", "0"], "positive whole numbers"),
    (["simulate", "allreduce", "--gpus", "12"], "whole number of 8-GPU nodes"),
    (["simulate", "allreduce", "--algo", "butterfly"], "unknown algorithm"),
    (["simulate", "allreduce", "--size", "lots"], "cannot read size"),
    (["simulate", "allreduce", "--algo", "hfreduce-nvlink"], "NVLink"),
    (["simulate", "teleport"], "unknown simulation"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    rc, _, err = run(capsys, *argv)
    assert rc == 2
    assert message in err
    assert len(err.strip().splitlines()) == 1
    assert "Traceback" not in err


def test_radix_too_small_from_a_catalog(capsys, tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[switch.tiny]\nradix = 2\ngbps = 100\nprice = 1\npower_w = 1\n")
    rc, _, err = run(capsys, "plan", "--gpus", "64", "--switch", "tiny", "--catalog", str(f))
    assert rc == 2 and "radix must be an even number of at least 4" in err


def test_simulate_allreduce_table_json_plot(capsys, tmp_path):
    rc, out, _ = run(capsys, "simulate", "allreduce", "--gpus", "16,128", "--algo", "hfreduce,ring,tree")
    assert rc == 0
    assert "shared root port (GPU5/6)" in out and out.count("hfreduce") >= 2
    png = tmp_path / "sim.png"
    rc, out, _ = run(capsys, "simulate", "allreduce", "--node", "pcie-a100-nvlink", "--gpus", "16,32,1024",
                     "--placement", "cross-zone", "--json", "--plot", str(png))
    data = json.loads(out)
    assert rc == 0 and data["placement"] == "cross-zone"
    assert {r["algo"] for r in data["results"]} == {"hfreduce", "ring", "hfreduce-nvlink"}
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_simulate_placement(capsys):
    rc, out, _ = run(capsys, "simulate", "placement", "--tasks", "300,300,300,300", "--json")
    data = json.loads(out)
    assert rc == 0
    assert data["hai"]["cross_zone_tasks"] <= 1
    assert data["naive"]["max_bridge_load"] > data["hai"]["max_bridge_load"]


def test_bench_fabric_writes_json_and_png(capsys, tmp_path):
    rc, _, _ = run(capsys, "bench", "fabric", "--sizes", "1000,10000", "--multiplane", "32768", "--repeats", "1",
                     "--out", str(tmp_path))
    assert rc == 0
    data = json.loads((tmp_path / "fabric.json").read_text())
    assert [r["gpus"] for r in data["rows"]] == [1000, 10000, 32768]
    assert set(data["targets"]) == {"10000", "32768"}
    assert (tmp_path / "fabric.png").read_bytes()[:4] == b"\x89PNG"


def test_parsers():
    assert parse_size("186MiB") == 186 << 20
    assert parse_size("4M") == 4 << 20 and parse_size("1G") == 1 << 30 and parse_size("123") == 123
    assert parse_counts("16, 32,1_024") == [16, 32, 1024]
    with pytest.raises(UserError):
        parse_size("0")
    with pytest.raises(UserError):
        parse_counts(",")


def test_fabric_never_imports_torch():
    code = ("import sys, fireflyer.fabric.cli, fireflyer.bench.fabric, fireflyer.fabric.placement, "
            "fireflyer.fabric.report, fireflyer.fabric.plan; assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
