"""Table II and Table III: node ratios, network and server prices, and the catalogue."""

import pytest

from fireflyer.errors import UserError
from fireflyer.fabric import catalog, paper
from fireflyer.fabric.cost import compare_nodes
from fireflyer.fabric.plan import PlanConfig, plan


@pytest.fixture(scope="module")
def plan10k():
    return plan(PlanConfig(gpus=10000), catalog.default())


def test_table2_node_ratios():
    cat = catalog.default()
    c = compare_nodes(cat.node("pcie-a100"), cat.node("dgx-a100"))
    assert c.tf32_ratio == pytest.approx(107 / 131)
    assert c.fp16_ratio == pytest.approx(220 / 263)
    assert c.relative_performance == pytest.approx(paper.TABLE2["relative_performance"], abs=0.005)
    assert c.price_ratio == pytest.approx(paper.TABLE2["relative_price"], abs=0.01)
    assert c.cost_performance == pytest.approx(paper.TABLE2["cost_performance"], rel=0.02)
    assert c.power_ratio == pytest.approx(2500 / 4200)
    assert 1 - c.power_ratio == pytest.approx(0.40, abs=0.005)  # "trim energy consumption by 40%"


def test_table3_server_prices_are_exact(plan10k):
    assert plan10k.design.cost.servers == paper.TABLE3["ours"]["servers"]
    assert plan10k.three_layer.cost.servers == paper.TABLE3["three_layer"]["servers"]
    assert plan10k.dgx.cost.servers == paper.TABLE3["dgx"]["servers"]


@pytest.mark.parametrize("which", ["ours", "three_layer", "dgx"])
def test_table3_network_and_total_prices(plan10k, which):
    d = {"ours": plan10k.design, "three_layer": plan10k.three_layer, "dgx": plan10k.dgx}[which]
    want = paper.TABLE3[which]
    assert d.cost.network == pytest.approx(want["network"], rel=0.05)
    assert d.cost.total == pytest.approx(want["total"], rel=0.01)


def test_table3_claims(plan10k):
    ours, three, dgx = plan10k.design.cost, plan10k.three_layer.cost, plan10k.dgx.cost
    assert 1 - ours.network / three.network == pytest.approx(0.40, abs=0.05)  # "a saving of 40%"
    assert ours.total / dgx.total == pytest.approx(0.5, abs=0.02)          # "reducing costs by half"


def test_whole_cluster_power_is_just_over_3_mw(plan10k):
    lo, hi = paper.CLUSTER_POWER_MW
    assert lo * 1e6 < plan10k.design.cost.power_w < hi * 1e6


def test_catalog_override_merges_field_by_field(tmp_path):
    f = tmp_path / "mine.toml"
    f.write_text('[node.pcie-a100]\nprice = 10.0\n[node.mybox]\nbase = "pcie-a100"\ngpus = 4\nshared_root_ports = []\n'
                 '[switch.qm8700]\npower_w = 300\n')
    cat = catalog.load(f)
    assert cat.node("pcie-a100").price == 10.0
    assert cat.node("pcie-a100").power_w == 2500  # untouched
    assert cat.node("mybox").gpus == 4 and cat.node("mybox").price == 10.0
    assert cat.switch("qm8700").power_w == 300
    p = plan(PlanConfig(gpus=10000), cat)
    assert p.design.cost.servers == 12500


def test_catalog_errors(tmp_path):
    cat = catalog.default()
    with pytest.raises(UserError, match="unknown node preset 'x'.*pcie-a100"):
        cat.node("x")
    with pytest.raises(UserError, match="unknown switch preset"):
        cat.switch("x")
    bad = tmp_path / "bad.toml"
    bad.write_text("[node.pcie-a100]\ngpuz = 8\n")
    with pytest.raises(UserError, match="unknown field.*gpuz"):
        catalog.load(bad)
    bad.write_text("[switch.qm8700]\nradix = 2\n")
    with pytest.raises(UserError, match="radix"):
        catalog.load(bad)
    bad.write_text("not toml [")
    with pytest.raises(UserError, match="not valid TOML"):
        catalog.load(bad)
    with pytest.raises(UserError, match="cannot read"):
        catalog.load(tmp_path / "missing.toml")
    bad.write_text('[node.a]\nbase = "b"\n[node.b]\nbase = "a"\n')
    with pytest.raises(UserError, match="circle"):
        catalog.load(bad)


def test_presets():
    cat = catalog.default()
    a100 = cat.node("pcie-a100")
    assert (a100.gpus, a100.nics, a100.nic_gbps, a100.nvlink) == (8, 1, 200, "none")
    assert a100.shared_root_ports == ((5, 6),)
    assert cat.node("pcie-a100-nvlink").nvlink == "pairs"
    dgx = cat.node("dgx-a100")
    assert dgx.nics + dgx.storage_nics == 9 and dgx.nvlink == "nvswitch"
    assert cat.switch("qm8700").radix == 40
    frame = cat.switch("frame800")
    assert frame.is_frame and frame.frame_ports == 800 and frame.chips == 60
