"""The paper's pipeline placement as a pure function, on many layouts."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fireflyer.haiscale.pipeline_placement import (
    ACROSS_NODES,
    INSIDE_NODES,
    plan_pipelines,
)


def node_keys(sizes: list[int], seed: int | None = None) -> list[str]:
    """One key per global rank; ranks numbered node by node unless ``seed`` shuffles them."""
    keys = [f"host{n}" for n, size in enumerate(sizes) for _ in range(size)]
    if seed is not None:
        random.Random(seed).shuffle(keys)
    return keys


def check_partition(keys: list[str], pp_size: int) -> None:
    """Invariants every placement keeps, whatever the layout."""
    plan = plan_pipelines(keys, pp_size)
    world = len(keys)
    assert sorted(r for p in plan.pipelines for r in p) == list(range(world))
    assert sorted(r for g in plan.dp_groups for r in g) == list(range(world))
    assert all(len(p) == pp_size for p in plan.pipelines)
    assert len(plan.dp_groups) == pp_size and all(len(g) == world // pp_size for g in plan.dp_groups)
    # stage s is the s-th lowest rank of its pipeline (torch's group-rank order)
    assert all(list(p) == sorted(p) for p in plan.pipelines + plan.dp_groups)
    for i, pipeline in enumerate(plan.pipelines):
        for stage, rank in enumerate(pipeline):
            assert rank in plan.dp_groups[stage]
            assert plan.pipeline_of(rank) == i and plan.stage_of(rank) == stage
    for node in plan.nodes:
        assert len({keys[r] for r in node}) == 1


layouts = st.tuples(st.integers(1, 9), st.integers(1, 8)).flatmap(
    lambda nl: st.tuples(st.just(nl[0]), st.just(nl[1]),
                         st.sampled_from([d for d in range(1, nl[0] * nl[1] + 1) if nl[0] * nl[1] % d == 0])))


@settings(max_examples=150, deadline=None)
@given(layouts, st.one_of(st.none(), st.integers(0, 1000)))
def test_every_rank_in_one_pipeline_and_one_dp_group(layout, seed):
    nodes, local, pp = layout
    check_partition(node_keys([local] * nodes, seed), pp)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=1, max_size=7), st.data())
def test_uneven_nodes_still_partition(sizes, data):
    world = sum(sizes)
    pp = data.draw(st.sampled_from([d for d in range(1, world + 1) if world % d == 0]))
    check_partition(node_keys(sizes), pp)


@settings(max_examples=150, deadline=None)
@given(layouts, st.one_of(st.none(), st.integers(0, 1000)))
def test_a_node_s_ranks_go_to_different_pipelines(layout, seed):
    nodes, local, pp = layout
    keys = node_keys([local] * nodes, seed)
    plan = plan_pipelines(keys, pp)
    if nodes >= pp:
        assert plan.strategy == ACROSS_NODES
        for pipeline in plan.pipelines:
            assert len({keys[r] for r in pipeline}) == pp, pipeline
    else:
        assert plan.strategy == INSIDE_NODES
        assert any("pp_size" in n and "node" in n for n in plan.notes)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 4), st.integers(1, 4), st.integers(1, 8))
def test_paper_grid_when_nodes_are_a_multiple_of_pp_size(blocks, pp, local):
    """Stage s of pipeline (block b, local l) sits on node b*pp+s; DP groups are whole nodes."""
    nodes = blocks * pp
    keys = node_keys([local] * nodes)
    plan = plan_pipelines(keys, pp)
    assert plan.notes == ()
    expected = {tuple((b * pp + s) * local + l for s in range(pp)) for b in range(blocks) for l in range(local)}
    assert set(plan.pipelines) == expected
    for s, group in enumerate(plan.dp_groups):
        assert set(group) == {(b * pp + s) * local + l for b in range(blocks) for l in range(local)}


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 4), st.integers(1, 4), st.integers(1, 8), st.integers(0, 1000))
def test_any_rank_numbering_keeps_pipelines_across_nodes(blocks, pp, local, seed):
    """Ranks not numbered node by node: stages still on distinct nodes, and a note when DP groups split nodes."""
    keys = node_keys([local] * blocks * pp, seed)
    plan = plan_pipelines(keys, pp)
    for pipeline in plan.pipelines:
        assert len({keys[r] for r in pipeline}) == pp
    whole = all(sum(keys.count(k) for k in {keys[r] for r in g}) == len(g) for g in plan.dp_groups)
    assert whole == (plan.notes == ())


def test_two_nodes_two_ranks_matches_the_paper():
    # torchrun numbering: node0 = ranks 0,1; node1 = ranks 2,3
    plan = plan_pipelines(["a", "a", "b", "b"], 2)
    assert plan.pipelines == ((0, 2), (1, 3))
    assert plan.dp_groups == ((0, 1), (2, 3))
    assert plan.strategy == ACROSS_NODES and plan.notes == ()


def test_eight_nodes_of_eight_pp4():
    keys = node_keys([8] * 8)
    plan = plan_pipelines(keys, 4)
    assert len(plan.pipelines) == 16
    assert (0, 8, 16, 24) in plan.pipelines and (32, 40, 48, 56) in plan.pipelines
    assert (7, 15, 23, 31) in plan.pipelines
    assert plan.dp_groups[0] == tuple(range(8)) + tuple(range(32, 40))


def test_fallbacks_say_what_happened():
    inside = plan_pipelines(node_keys([4]), 2)
    assert inside.strategy == INSIDE_NODES and inside.pipelines == ((0, 1), (2, 3))
    assert len(inside.notes) == 1 and "at least pp_size nodes" in inside.notes[0]
    ragged = plan_pipelines(node_keys([2, 2, 2]), 2)
    assert ragged.strategy == ACROSS_NODES
    assert any("not whole nodes" in n for n in ragged.notes)
    uneven = plan_pipelines(node_keys([3, 1]), 2)
    assert any("two ranks of one node" in n for n in uneven.notes)


def test_trivial_sizes():
    keys = node_keys([2, 2])
    one = plan_pipelines(keys, 1)
    assert sorted(one.pipelines) == [(0,), (1,), (2,), (3,)] and one.dp_groups == ((0, 1, 2, 3),) and one.notes == ()
    whole = plan_pipelines(keys, 4)
    assert whole.pipelines == ((0, 1, 2, 3),) and whole.dp_groups == ((0,), (1,), (2,), (3,))


@pytest.mark.parametrize("pp, error, words", [
    (3, ValueError, "Choose pp_size from 1, 2, 4, 8"),
    (0, ValueError, "at least 1"),
    (-2, ValueError, "at least 1"),
    (2.0, TypeError, "must be an int"),
    (True, TypeError, "must be an int"),
])
def test_bad_pp_size(pp, error, words):
    with pytest.raises(error, match=words):
        plan_pipelines(node_keys([4, 4]), pp)


def test_empty_layout():
    with pytest.raises(ValueError, match="no ranks"):
        plan_pipelines([], 1)
    with pytest.raises(ValueError, match="not in this placement"):
        plan_pipelines(["a"], 1).stage_of(5)
