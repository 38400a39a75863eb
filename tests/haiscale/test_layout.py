"""The layout planner: the paper's placement of pp × dp × ep × tp, as a pure function of node keys."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.device_mesh import DeviceMesh

from fireflyer.errors import UserError, UserTypeError
from fireflyer.haiscale import LayoutPlan, plan_layout
from fireflyer.haiscale.layout_plan import GROUP_KINDS, MESH_DIMS
from fireflyer.haiscale.pipeline_placement import divisors


def keys(sizes: list[int]) -> list[str]:
    return [f"node{n}" for n, size in enumerate(sizes) for _ in range(size)]


def node_of(plan: LayoutPlan) -> dict[int, int]:
    return {r: n for n, node in enumerate(plan.nodes) for r in node}


def check_invariants(plan: LayoutPlan, sizes: list[int]) -> None:
    world = sum(sizes)
    flat = [r for stage in plan.mesh for rep in stage for ep in rep for r in ep]
    assert sorted(flat) == list(range(world)), "every rank exactly once"
    assert torch.tensor(plan.mesh).shape == plan.shape
    degree = dict(zip(MESH_DIMS, plan.shape), dense=plan.dp * plan.ep, expert=plan.dp)
    for kind in GROUP_KINDS:
        groups = plan.groups(kind)
        assert sorted(r for g in groups for r in g) == list(range(world)), f"{kind} groups partition the world"
        assert {len(g) for g in groups} == {degree[kind]}
        assert all(list(g) == sorted(g) for g in groups), f"{kind} groups ascend (a process group's order)"
    where = node_of(plan)
    for group in plan.groups("tp"):
        (n,) = {where[r] for r in group}  # one node
        local = plan.nodes[n].index(group[0])
        assert plan.nodes[n][local:local + plan.tp] == group, "tp consecutive ranks of the node"
    unit = plan.ep * plan.tp
    blocks = [sorted(r for e in rep for r in e) for stage in plan.mesh for rep in stage]  # ep × tp blocks
    for block in blocks:
        covered = {where[r] for r in block}
        if all(size % unit == 0 for size in sizes):
            assert len(covered) == 1, "an ep × tp block inside one node when it fits"
        elif len(covered) > 1:
            assert sorted(r for n in covered for r in plan.nodes[n]) == block, "else whole nodes (a zone)"
    spans = any(len({where[r] for r in block}) > 1 for block in blocks)
    assert spans == any("zone" in note for note in plan.notes), "a zone is noted"
    if len(set(sizes)) == 1 and sizes[0] % unit == 0 and len(sizes) >= plan.pp:
        for pipeline in plan.groups("pp"):
            assert len({where[r] for r in pipeline}) == plan.pp, "even nodes, nodes >= pp: stages on distinct nodes"
    for rank in range(world):
        c = plan.coords(rank)
        assert plan.mesh[c["pp"]][c["dp"]][c["ep"]][c["tp"]] == rank
        for d in MESH_DIMS:
            group = plan.group_of(d, rank)
            assert group.index(rank) == c[d], "a rank's index along a dim is its rank in that dim's group"
            others = [k for k in MESH_DIMS if k != d]
            assert all(all(plan.coords(r)[k] == c[k] for k in others) for r in group)
        assert plan.group_of("expert", rank) == plan.group_of("dp", rank)
        dense = plan.group_of("dense", rank)
        assert all(plan.coords(r)["pp"] == c["pp"] and plan.coords(r)["tp"] == c["tp"] for r in dense)


@st.composite
def layouts(draw):
    """Random node sizes (even or not) and degrees that divide the world (placeable or not)."""
    n_nodes = draw(st.integers(1, 6))
    if draw(st.booleans()):
        sizes = [draw(st.sampled_from([1, 2, 4, 6, 8]))] * n_nodes
    else:
        sizes = draw(st.lists(st.integers(1, 8), min_size=n_nodes, max_size=n_nodes))
    world = sum(sizes)
    pp = draw(st.sampled_from(divisors(world)))
    tp = draw(st.sampled_from(divisors(world // pp)))
    ep = draw(st.sampled_from(divisors(world // (pp * tp))))
    return sizes, pp, tp, ep


@settings(max_examples=400, deadline=None)
@given(layouts())
def test_any_layout_is_placed_or_refused_with_its_reason(case):
    sizes, pp, tp, ep = case
    try:
        plan = plan_layout(keys(sizes), pp=pp, tp=tp, ep=ep)
    except UserError as e:
        message = str(e)
        if any(size % tp for size in sizes):
            assert f"tp={tp} does not divide the rank count of every node" in message
        else:
            assert "EP group must lie inside one node, or cover whole consecutive nodes" in message
        return
    assert plan.dp == sum(sizes) // (pp * tp * ep)
    check_invariants(plan, sizes)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 3), st.integers(1, 3), st.sampled_from([1, 2]), st.sampled_from([1, 2, 4]),
       st.integers(1, 2))
def test_even_nodes_get_the_papers_placement(pp, blocks, tp, ep, units_per_node):
    """Nodes a multiple of pp, each holding whole ep × tp blocks: every pipeline crosses pp distinct
    nodes, and the ranks holding a stage (its dense group) are whole nodes."""
    size = ep * tp * units_per_node
    sizes = [size] * (pp * blocks)
    plan = plan_layout(keys(sizes), pp=pp, tp=tp, ep=ep)
    check_invariants(plan, sizes)
    assert plan.notes == ()
    where = node_of(plan)
    for pipeline in plan.groups("pp"):
        assert len({where[r] for r in pipeline}) == pp, "a pipeline's stages on distinct nodes"
    for group in plan.groups("dense"):
        nodes = {where[r] for r in group}
        whole = {r for n in nodes for r in plan.nodes[n]}
        tp_rank = plan.coords(group[0])["tp"]
        assert set(group) == {r for r in whole if plan.coords(r)["tp"] == tp_rank}, "a stage's ranks: whole nodes"


def test_fewer_nodes_than_stages_say_so():
    plan = plan_layout(keys([4]), pp=2)
    check_invariants(plan, [4])
    assert any("pipeline cannot have each stage on its own node" in n for n in plan.notes)


def test_the_paper_grid_on_four_nodes_of_eight():
    plan = plan_layout(keys([8] * 4), pp=2, tp=2, ep=2)
    assert plan.shape == (2, 4, 2, 2)
    assert plan.groups("tp")[:2] == ((0, 1), (2, 3))
    assert plan.group_of("ep", 0) == (0, 2)
    assert plan.group_of("pp", 0) == (0, 8)  # stage 1 on the next node, same local rank
    assert plan.group_of("dp", 0) == (0, 4, 16, 20)  # stage 0's replicas: nodes 0 and 2
    assert plan.coords(13) == {"pp": 1, "dp": 1, "ep": 0, "tp": 1}


def test_the_mesh_is_a_device_mesh_array():
    plan = plan_layout(keys([2, 2]), ep=2)
    mesh = DeviceMesh("cpu", torch.tensor(plan.mesh), mesh_dim_names=MESH_DIMS, _init_backend=False, _rank=3)
    assert mesh.shape == (1, 2, 2, 1)
    assert mesh.mesh.flatten().tolist() == [0, 1, 2, 3]


def test_an_ep_group_larger_than_a_node_covers_whole_nodes_with_a_note():
    plan = plan_layout(keys([2, 2, 2, 2]), ep=4)
    assert plan.groups("ep") == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert any("spans 2 whole nodes (a zone)" in n for n in plan.notes)


def test_ranks_not_numbered_node_by_node_still_place_when_the_grid_can_follow():
    plan = plan_layout(["a", "b", "a", "b"], pp=2)
    assert plan.groups("pp") == ((0, 1), (2, 3))  # each pipeline on both nodes


def test_ranks_the_grid_cannot_follow_are_refused():
    with pytest.raises(UserError, match="not numbered node by node"):
        plan_layout(["a", "b", "b", "a"], tp=2, pp=2)


@pytest.mark.parametrize("degrees, message", [
    (dict(dp=3), r"pp×dp×ep×tp = 1×3×1×1 = 3 but the world size is 4.*give dp=4 or leave dp=None"),
    (dict(dp=2, pp=3), r"= 6 but the world size is 4.*its divisors are 1, 2, 4"),
    (dict(ep=3), r"pp×ep×tp = 1×3×1 = 3 does not divide the world size 4.*divisors: 1, 2, 4"),
    (dict(tp=4), r"tp=4 does not divide the rank count of every node \(nodes of \[2\] ranks\).*tp from 1, 2"),
    (dict(pp=0), r"pp must be at least 1, got 0"),
])
def test_impossible_layouts_say_why(degrees, message):
    with pytest.raises(UserError, match=message):
        plan_layout(keys([2, 2]), **degrees)


def test_a_straddling_ep_group_is_refused():
    with pytest.raises(UserError, match=r"ep×tp = 2×2 = 4 ranks cannot be placed on nodes of \[6\] ranks.*ep from 1, 3"):
        plan_layout(keys([6, 6]), tp=2, ep=2)


@pytest.mark.parametrize("bad", [2.0, "2", True, None])
def test_degrees_must_be_ints(bad):
    with pytest.raises(UserTypeError, match="tp must be an int"):
        plan_layout(keys([2, 2]), tp=bad)


def test_unknown_group_kind_and_rank():
    plan = plan_layout(keys([2, 2]))
    with pytest.raises(UserError, match="choose from pp, dp, ep, tp, dense, expert"):
        plan.groups("sp")
    with pytest.raises(UserError, match="rank 4 is not in this layout of 4 ranks"):
        plan.coords(4)


def test_no_ranks():
    with pytest.raises(UserError, match="no ranks"):
        plan_layout([])


def test_every_group_count():
    plan = plan_layout(keys([4, 4]), pp=2, tp=2)
    counts = {kind: len(plan.groups(kind)) for kind in GROUP_KINDS}
    assert counts == {"pp": 4, "dp": 4, "ep": 8, "tp": 4, "dense": 4, "expert": 4}
    assert list(itertools.chain(*plan.groups("tp"))) == list(range(8))
