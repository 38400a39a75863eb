"""haiscale.layout on real ranks (2 emulated nodes x 2): the groups, the DeviceMesh over them, and
an all_reduce on every group, through the door users use."""

from __future__ import annotations

import pytest
import torch

from fireflyer.testing.cases import layout as layout_cases
from fireflyer.testing.cluster import LocalCluster

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster([2, 2], env={"FIREFLYER_TEST_COMM": "0"}) as c:
        yield c


def check_sums_and_mesh(results: list[dict]) -> None:
    for rank, got in enumerate(results):
        for kind, ranks in got["groups"].items():
            assert rank in ranks
            assert got["sums"][kind] == sum(r + 1 for r in ranks), (rank, kind)
        assert got["mesh_dims"] == ["pp", "dp", "ep", "tp"]
        assert got["mesh_same_group"], "the mesh reuses the layout's groups"
        assert got["mesh_local"] == got["coords"] == got["rank_in_group"]
        assert got["mesh_groups"] == {d: got["groups"][d] for d in ("pp", "dp", "ep", "tp")}
        assert got["mesh"] == results[0]["mesh"]


def test_ep_inside_nodes_dp_across(cluster):
    results = cluster.run(layout_cases.describe, {"ep": 2})
    check_sums_and_mesh(results)
    assert results[0]["mesh_shape"] == [1, 2, 2, 1]
    assert [r["groups"]["ep"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["groups"]["dp"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [r["groups"]["expert"] for r in results] == [r["groups"]["dp"] for r in results]
    assert all(r["groups"]["dense"] == [0, 1, 2, 3] for r in results)


def test_pp_stages_on_different_nodes(cluster):
    results = cluster.run(layout_cases.describe, {"pp": 2, "ep": 2})
    check_sums_and_mesh(results)
    assert [r["groups"]["pp"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [r["coords"]["pp"] for r in results] == [0, 0, 1, 1]
    assert [r["groups"]["dense"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]


def test_tp_pairs_inside_nodes(cluster):
    results = cluster.run(layout_cases.describe, {"tp": 2})
    check_sums_and_mesh(results)
    assert [r["groups"]["tp"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["coords"]["tp"] for r in results] == [0, 1, 0, 1]
    assert [r["groups"]["dense"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]


def test_every_rank_refuses_a_layout_that_does_not_fit(cluster):
    errors = cluster.run(layout_cases.bad_degrees, {"tp": 2, "dp": 1})
    assert all(e.startswith("UserError: pp×dp×ep×tp = 1×1×1×2 = 2 but the world size is 4") for e in errors)
    errors = cluster.run(layout_cases.bad_degrees, {"tp": 4})  # passes the world check, fails on the nodes
    assert all("tp=4 does not divide the rank count of every node (nodes of [2] ranks)" in e for e in errors)


def test_the_groups_drive_moe_and_ddp(cluster):
    results = cluster.run(layout_cases.moe_ddp_step)
    assert [r["experts"][0] for r in results] == [0, 4, 0, 4]  # EP inside a node: a node holds all 8 experts
    for rank, got in enumerate(results):
        assert got["ddp"].keys() == got["by_hand"].keys()
        for name, grad in got["ddp"].items():
            torch.testing.assert_close(grad, got["by_hand"][name], rtol=1e-6, atol=1e-6,
                                       msg=lambda m: f"rank {rank} {name}: {m}")
