"""Fat-tree sizing: the paper's Table III switch counts, section IX's multi-plane network, properties."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fireflyer.errors import UserError
from fireflyer.fabric import catalog, paper, topology
from fireflyer.fabric.plan import PlanConfig, build_design, plan


def test_capacities():
    assert topology.two_layer_capacity(40) == 800
    assert topology.three_layer_capacity(40) == 16000
    assert topology.two_layer_capacity(128) == 8192


def test_full_two_layer_tree_of_40_port_switches():
    f = topology.two_layer(800, 40)
    assert (f.leaf, f.spine, f.switches, f.ports) == (40, 20, 60, 800)


def test_table3_fire_flyer_two_zones_is_122_switches():
    f = topology.zoned(1250, 40, frames=True)
    assert f.zones == 2
    assert f.switches_by_layer == {"leaf": 80, "spine": 40, "bridge": 2}
    assert f.switches == paper.TABLE3["ours"]["switches"] == 122
    # the frames' leaf-spine links are on the backplane: only endpoints and bridge links are cabled
    assert f.backplane_links == 1600
    assert f.cables == 1250 + 32
    assert f.optics == 64


def test_table3_dgx_three_layer_is_1320_switches():
    f = topology.three_layer(10000, 40)
    assert f.switches_by_layer == {"leaf": 500, "spine": 500, "core": 320}
    assert f.switches == paper.TABLE3["dgx"]["switches"] == 1320
    assert {k: f.switches_by_layer[k] for k in ("core", "spine", "leaf")} == paper.TABLE3_DGX_LAYERS


def test_table3_pcie_three_layer_of_1600_endpoints_is_200_switches():
    f = topology.three_layer(1600, 40)
    assert f.switches_by_layer["core"] == 40
    assert f.switches_by_layer["spine"] + f.switches_by_layer["leaf"] == 160
    assert f.switches == paper.TABLE3["three_layer"]["switches"] == 200


def test_exact_core_is_what_the_spines_need():
    # the paper's 320 is a core built for 32 pods; the 25 pods there are need 250
    assert topology.three_layer(10000, 40, core_rounding="exact").core == 250
    assert topology.three_layer(1600, 40, core_rounding="exact").core == 40


def test_plan_of_10000_gpus_matches_table3_for_all_three_designs():
    p = plan(PlanConfig(gpus=10000), catalog.default())
    assert p.design.nodes == 1250
    assert p.design.fabric.switches == 122
    assert p.three_layer.fabric.switches == 200
    assert p.dgx.fabric.switches == 1320


def test_multiplane_section9_reaches_32768_gpus():
    cat = catalog.default()
    d = build_design(32768, cat.node("pcie-nextgen"), cat.switch("roce128"), cat, planes=4)
    f = d.fabric
    assert f.planes == paper.MULTIPLANE["planes"] and f.radix == paper.MULTIPLANE["radix"]
    assert f.zones == 1 and f.layers == 2
    assert f.endpoints == 8192 == topology.two_layer_capacity(128)
    assert f.switches_by_layer == {"leaf": 4 * 128, "spine": 4 * 64}
    assert d.nodes * 8 == paper.MULTIPLANE["gpus"]
    # one more node no longer fits two layers in 4 planes
    with pytest.raises(UserError):
        topology.two_layer(8193, 128)


def test_bad_input():
    with pytest.raises(UserError, match="at least 1 endpoint"):
        topology.two_layer(0, 40)
    with pytest.raises(UserError, match="radix"):
        topology.two_layer(10, 3)
    with pytest.raises(UserError, match="zones, planes"):
        topology.two_layer(801, 40)
    with pytest.raises(UserError, match="zones"):
        topology.zoned(10**6, 8)
    with pytest.raises(UserError, match="planes"):
        build_design(64, catalog.default().node("pcie-a100"), catalog.default().switch("qm8700"),
                     catalog.default(), planes=2)


@settings(max_examples=60, deadline=None)
@given(endpoints=st.integers(1, 16000), radix=st.sampled_from([8, 16, 40, 64]))
def test_three_layer_has_the_ports_and_core_rounding_only_adds(endpoints, radix):
    if endpoints > topology.three_layer_capacity(radix):
        return
    f = topology.three_layer(endpoints, radix)
    e = topology.three_layer(endpoints, radix, core_rounding="exact")
    assert f.ports >= endpoints
    assert f.core >= e.core and f.leaf == e.leaf and f.spine == e.spine
    # every spine uplink has a core port
    assert e.core * radix >= e.spine * radix // 2


@settings(max_examples=60, deadline=None)
@given(endpoints=st.integers(1, 20000), storage=st.integers(0, 100))
def test_zoned_design_fits_every_endpoint(endpoints, storage):
    f = topology.zoned(endpoints, 40, storage_endpoints=storage)
    assert f.ports >= endpoints + f.zones * storage
    assert sum(f.zone_endpoints) == endpoints + f.zones * storage
    assert max(f.zone_endpoints) + f.bridge * f.bridge_links <= topology.two_layer_capacity(40)
    assert (f.zones > 1) == (f.bridge > 0)


@settings(max_examples=40, deadline=None)
@given(a=st.integers(1, 15000), b=st.integers(1, 15000))
def test_switch_counts_grow_with_endpoints(a, b):
    lo, hi = sorted((a, b))
    for build in (lambda n: topology.three_layer(n, 40), lambda n: topology.zoned(n, 40),
                  lambda n: topology.zoned(n, 40, frames=True)):
        assert build(lo).switches <= build(hi).switches


@settings(max_examples=40, deadline=None)
@given(gpus=st.integers(1, 12000))
def test_a_plan_holds_every_gpu_asked_for(gpus):
    p = plan(PlanConfig(gpus=gpus), catalog.default())
    assert p.design.nodes * 8 >= gpus > (p.design.nodes - 1) * 8
    assert p.design.fabric.ports >= p.design.nodes
