"""The node layout and NCCL's double binary tree over nodes (pure functions, no I/O)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fireflyer.hfreduce.plans.topology import Layout, TreeLinks, split, tree_depth, tree_links, tree_root

SIZES = list(range(1, 65)) + [100, 127, 128, 129, 1000]


def _links(n: int, tree: int) -> list[TreeLinks]:
    return [tree_links(n, v, tree) for v in range(n)]


def _expected_root(n: int, tree: int) -> int:
    if tree == 0 or n == 1:
        return 0
    return n - 1 if n % 2 == 0 else 1


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("tree", [0, 1])
def test_each_tree_is_a_binary_spanning_tree(n: int, tree: int) -> None:
    links = _links(n, tree)
    roots = [v for v, link in enumerate(links) if link.is_root]
    assert roots == [_expected_root(n, tree)]
    assert tree_root(n, tree) == roots[0]

    for v, link in enumerate(links):
        assert len(link.children) <= 2, (v, link)
        assert len(set(link.children)) == len(link.children)
        assert v not in link.children
        for c in link.children:
            assert 0 <= c < n
            assert links[c].parent == v, f"child {c} of {v} names parent {links[c].parent}"
        if not link.is_root:
            assert 0 <= link.parent < n
            assert v in links[link.parent].children, f"{v} is not among its parent {link.parent}'s children"

    # Walk down from the root: every node once, so the links form a tree without cycles.
    seen = [roots[0]]
    frontier = [roots[0]]
    while frontier:
        frontier = [c for v in frontier for c in links[v].children]
        seen.extend(frontier)
        assert len(seen) <= n, "a node was reached twice: the links have a cycle"
    assert sorted(seen) == list(range(n))


@pytest.mark.parametrize("n", SIZES)
def test_tree1_is_mirror_for_even_and_shift_for_odd(n: int) -> None:
    if n % 2 == 0:
        to_base = lambda x: n - 1 - x  # noqa: E731
        from_base = to_base
    else:
        to_base = lambda x: (x - 1) % n  # noqa: E731
        from_base = lambda x: (x + 1) % n  # noqa: E731
    for v in range(n):
        base = tree_links(n, to_base(v), 0)
        got = tree_links(n, v, 1)
        assert got.parent == (from_base(base.parent) if base.parent >= 0 else -1)
        assert got.children == tuple(from_base(c) for c in base.children)


@pytest.mark.parametrize("n", SIZES)
def test_depth_is_ceil_log2(n: int) -> None:
    want = (n - 1).bit_length()  # ceil(log2 n), 0 for n == 1
    assert tree_depth(n, 0) == want
    assert tree_depth(n, 1) == want


@pytest.mark.parametrize("n", [n for n in SIZES if n % 2 == 0])
def test_even_n_no_node_is_internal_in_both_trees(n: int) -> None:
    internal0 = {v for v in range(n) if tree_links(n, v, 0).children}
    internal1 = {v for v in range(n) if tree_links(n, v, 1).children}
    assert internal0 and internal1
    assert not internal0 & internal1


def test_n8_table() -> None:
    assert tree_links(8, 2, 0) == TreeLinks(4, (1, 3))
    assert tree_links(8, 1, 1) == TreeLinks(3, (2, 0))
    assert tree_links(8, 0, 0) == TreeLinks(-1, (4,))
    assert tree_links(8, 4, 0) == TreeLinks(0, (2, 6))
    assert tree_links(8, 7, 1) == TreeLinks(-1, (3,))


def test_n14_table() -> None:
    assert tree_links(14, 0, 0) == TreeLinks(-1, (8,))
    assert tree_links(14, 8, 0) == TreeLinks(0, (4, 12))
    assert tree_links(14, 12, 0) == TreeLinks(8, (10, 13))
    assert tree_links(14, 13, 0) == TreeLinks(12, ())


def test_single_node_is_a_lone_root_in_both_trees() -> None:
    assert tree_links(1, 0, 0) == TreeLinks(-1, ())
    assert tree_links(1, 0, 1) == TreeLinks(-1, ())


def test_bad_tree_or_node_raises() -> None:
    with pytest.raises(ValueError, match="tree must be 0 or 1"):
        tree_links(4, 0, 2)
    with pytest.raises(ValueError, match="outside 0..3"):
        tree_links(4, 4, 0)
    with pytest.raises(ValueError, match="outside"):
        tree_links(4, -1, 0)


# -- Layout ----------------------------------------------------------------------------


def test_layout_groups_by_key_and_orders_nodes_by_lowest_rank() -> None:
    layout = Layout.from_node_keys(["zeta", "alpha", "zeta", "mid", "alpha", "zeta"])
    assert layout.nodes == ((0, 2, 5), (1, 4), (3,))
    assert layout.world_size == 6
    assert layout.num_nodes == 3
    assert layout.rails == 1
    assert not layout.homogeneous
    assert [layout.node_of(r) for r in range(6)] == [0, 1, 0, 2, 1, 0]
    assert [layout.local_rank(r) for r in range(6)] == [0, 0, 1, 0, 1, 2]
    assert [layout.local_size(i) for i in range(3)] == [3, 2, 1]
    assert layout.rail_peer(0, 2) == 5
    assert layout.rail_peer(1, 1) == 4


def test_layout_homogeneous_rails() -> None:
    layout = Layout.from_node_keys(["a", "a", "b", "b", "c", "c"])
    assert layout.nodes == ((0, 1), (2, 3), (4, 5))
    assert layout.homogeneous
    assert layout.rails == 2
    assert [layout.rail_peer(i, 1) for i in range(3)] == [1, 3, 5]


@given(st.lists(st.sampled_from("abcdef"), min_size=1, max_size=40))
def test_layout_from_any_keys_is_a_partition(keys: list[str]) -> None:
    layout = Layout.from_node_keys(keys)
    flat = [r for node in layout.nodes for r in node]
    assert sorted(flat) == list(range(len(keys)))
    assert [node[0] for node in layout.nodes] == sorted(node[0] for node in layout.nodes)
    for node in layout.nodes:
        assert list(node) == sorted(node)
        assert len({keys[r] for r in node}) == 1
    assert layout.num_nodes == len(set(keys))
    assert layout.rails == min(keys.count(k) for k in set(keys))
    for r in range(len(keys)):
        assert layout.nodes[layout.node_of(r)][layout.local_rank(r)] == r


def test_layout_errors() -> None:
    with pytest.raises(ValueError, match="at least one rank"):
        Layout.from_node_keys([])
    layout = Layout.from_node_keys(["a", "b"])
    with pytest.raises(ValueError, match="rank 2 is not in this layout of 2 ranks"):
        layout.node_of(2)
    with pytest.raises(ValueError, match="rank -1"):
        layout.local_rank(-1)


# -- split -----------------------------------------------------------------------------


@given(st.integers(0, 10**7), st.integers(1, 600))
def test_split_covers_exactly_with_near_equal_parts(total: int, parts: int) -> None:
    ranges = [split(total, parts, i) for i in range(parts)]
    assert ranges[0][0] == 0
    assert ranges[-1][1] == total
    for (_, hi), (lo, _) in zip(ranges, ranges[1:]):
        assert hi == lo
    sizes = [hi - lo for lo, hi in ranges]
    assert min(sizes) >= 0
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # the larger parts come first
    assert sum(sizes) == total


def test_split_examples() -> None:
    assert [split(10, 3, i) for i in range(3)] == [(0, 4), (4, 7), (7, 10)]
    assert [split(2, 4, i) for i in range(4)] == [(0, 1), (1, 2), (2, 2), (2, 2)]
    assert split(0, 1, 0) == (0, 0)
