"""Figure 7: the allreduce model against the paper's chart readings, each point within 10%
(the reproduction table's tolerance) but the named misses, from one set of physical parameters
(no per-point constants)."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fireflyer.errors import UserError
from fireflyer.fabric import catalog, paper, reproduce
from fireflyer.fabric.collectives import ModelParams, allreduce, busbw_factor, sweep
from fireflyer.fabric.trees import (
    double_binary_tree,
    ring_edges,
    zoned_double_binary_tree,
)

TOL = reproduce.WITHIN


def _points(series, label):
    """``series``' GPU counts, the reproduction table's named misses marked as strict expected failures."""
    out = []
    for g in sorted(series):
        why = reproduce.WHY.get(label.format(g=g), "")
        if why and not why.startswith("calibration"):
            out.append(pytest.param(g, marks=pytest.mark.xfail(strict=True, reason=why)))
        else:
            out.append(g)
    return out


@pytest.fixture(scope="module")
def a100():
    return catalog.default().node("pcie-a100")


@pytest.fixture(scope="module")
def a100_nvlink():
    return catalog.default().node("pcie-a100-nvlink")


def _algbw(algo, node, net, gpus, placement="packed"):
    return sweep([algo], [gpus], paper.FIG7_BYTES, node, network=net, placement_policy=placement)[0].algbw_gb_s


@pytest.mark.parametrize("gpus", _points(paper.FIG7A_HFREDUCE, "HFReduce, {g} GPUs (GB/s)"))
def test_fig7a_hfreduce(net, a100, gpus):
    run = paper.FIG7_RUN_GPUS.get(gpus, gpus)  # the chart's "1440" ran on 160 nodes
    assert _algbw("hfreduce", a100, net, run) == pytest.approx(paper.FIG7A_HFREDUCE[gpus], rel=TOL)


def test_fig7a_hfreduce_is_bound_by_the_shared_root_port(net, a100):
    # the paper's explanation of "slightly over 8 GB/s" against the 13.3 GB/s memory ceiling
    r = sweep(["hfreduce"], [128], paper.FIG7_BYTES, a100, network=net)[0]
    assert r.bottleneck == "shared root port (GPU5/6)"
    assert r.caps["host memory"] == pytest.approx(320 / 24)
    assert r.caps["NIC"] == pytest.approx(12.5)
    assert r.steady_gb_s == pytest.approx(37.5 / 4)


@pytest.mark.parametrize("gpus", [16, 32, 64, 128, 256, 512])
def test_fig7a_nccl_band_up_to_512(net, a100, gpus):
    *_, lo, hi = paper.FIG7A_NCCL_BAND
    got = _algbw("ring", a100, net, gpus)
    assert lo * (1 - TOL) <= got <= hi * (1 + TOL)


def test_fig7a_nccl_falls_with_scale_and_hfreduce_stays_ahead(net, a100):
    ring = [_algbw("ring", a100, net, g) for g in (16, 128, 512, 1024, 1440)]
    hf = [_algbw("hfreduce", a100, net, g) for g in (16, 128, 512, 1024, 1440)]
    assert ring == sorted(ring, reverse=True)
    assert all(1.5 < h / r < 4.2 for h, r in zip(hf, ring))


@pytest.mark.xfail(strict=True, reason="the model has no mechanism for NCCL's cliff between 512 and 1,024 GPUs "
                                       "(1.63 GB/s read off the chart; the paper does not explain it)")
@pytest.mark.parametrize("gpus", sorted(paper.FIG7A_NCCL))
def test_fig7a_nccl_cliff_at_1024(net, a100, gpus):
    assert _algbw("ring", a100, net, gpus) == pytest.approx(paper.FIG7A_NCCL[gpus], rel=TOL)


@pytest.mark.parametrize("gpus", _points(paper.FIG7B_IN_ZONE, "HFReduce+NVLink, {g} GPUs (GB/s)"))
def test_fig7b_hfreduce_nvlink_in_zone(net, a100_nvlink, gpus):
    assert _algbw("hfreduce-nvlink", a100_nvlink, net, gpus) == pytest.approx(paper.FIG7B_IN_ZONE[gpus], rel=TOL)


@pytest.mark.parametrize("gpus", sorted(paper.FIG7B_CROSS_ZONE))
def test_fig7b_hfreduce_nvlink_cross_zone(net, a100_nvlink, gpus):
    r = sweep(["hfreduce-nvlink"], [gpus], paper.FIG7_BYTES, a100_nvlink, network=net,
              placement_policy="cross-zone")[0]
    assert r.algbw_gb_s == pytest.approx(paper.FIG7B_CROSS_ZONE[gpus], rel=TOL)
    assert r.cross_zone_flows == 4  # one pair of nodes, both trees, both directions


def test_nvlink_beats_plain_hfreduce(net, a100, a100_nvlink):
    for g in (16, 128, 1024):
        assert _algbw("hfreduce-nvlink", a100_nvlink, net, g) > _algbw("hfreduce", a100, net, g)


def test_results_are_consistent(a100):
    r = allreduce("hfreduce", 64, 100 << 20, a100)
    assert r.algbw_gb_s == pytest.approx(r.size_bytes / r.seconds / 1e9)
    assert r.busbw_gb_s == pytest.approx(r.algbw_gb_s * busbw_factor(64))
    assert r.algbw_gb_s < r.steady_gb_s == min(r.caps.values())


def test_dgx_ring_is_nic_bound_not_p2p(net):
    dgx = catalog.default().node("dgx-a100")
    r = allreduce("ring", 128, paper.FIG7_BYTES, dgx)
    assert r.bottleneck in ("NIC", "GPU<->NIC P2P")
    assert r.steady_gb_s > 10 * allreduce("ring", 128, paper.FIG7_BYTES, catalog.default().node("pcie-a100")).steady_gb_s
    assert r.algbw_gb_s > 30  # the ring's 254 steps of latency weigh at this speed


def test_bad_input(a100):
    with pytest.raises(UserError, match="at least 2 GPUs"):
        allreduce("ring", 1, 1024, a100)
    with pytest.raises(UserError, match="whole number"):
        allreduce("ring", 12, 1024, a100)
    with pytest.raises(UserError, match="unknown algorithm"):
        allreduce("butterfly", 16, 1024, a100)
    with pytest.raises(UserError, match="NVLink"):
        allreduce("hfreduce-nvlink", 16, 1024, a100)
    with pytest.raises(UserError):
        ModelParams(chunk_bytes=0)


def test_double_binary_tree_loads():
    for n in (2, 3, 4, 5, 16, 100, 180, 1250):
        for t in (double_binary_tree(n), zoned_double_binary_tree(np.zeros(n, dtype=int))):
            u = t.node_units()
            assert u["sends"].max() <= 2.0
            assert int(math.log2(n)) <= t.depth <= int(math.log2(n)) + 1
            for par in t.parents:
                assert (par < 0).sum() == 1  # one root per tree
    assert double_binary_tree(2).node_units()["sends"].max() == 1.0  # two nodes just swap halves


@settings(max_examples=40, deadline=None)
@given(a=st.integers(1, 400), b=st.integers(1, 400))
def test_zoned_tree_crosses_through_one_pair(a, b):
    zone = np.repeat([0, 1], [a, b])
    t = zoned_double_binary_tree(zone)
    e = t.edges()
    crossing = {tuple(sorted(p)) for p in e[:, :2][zone[e[:, 0]] != zone[e[:, 1]]].tolist()}
    assert len(crossing) == 1
    assert t.node_units()["sends"].max() <= 2.0
    assert len(e) == 2 * (a + b - 1)


def test_ring_edges():
    assert ring_edges(1).shape == (0, 2)
    assert ring_edges(4).tolist() == [[0, 1], [1, 2], [2, 3], [3, 0]]


@settings(max_examples=30, deadline=None)
@given(nodes=st.integers(2, 600))
def test_hfreduce_never_beats_its_bottleneck(nodes):
    a100 = catalog.default().node("pcie-a100")
    r = allreduce("hfreduce", nodes * 8, paper.FIG7_BYTES, a100)
    assert 0 < r.algbw_gb_s < r.steady_gb_s <= 37.5 / 4 + 1e-9
