"""Communication patterns between nodes: the double binary tree (Sanders, Speck and Träff,
as NCCL and HFReduce use it) and the ring, as arrays of parents and edges.

Nodes are ranks 0..n-1 in the order the job lists them; where they sit in the network is
the router's business. In the double binary tree each rank is a leaf of at least one of
the two trees, so each node sends and receives about 2 units per unit of data.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fireflyer.errors import UserError


def btree_parents(n: int) -> np.ndarray:
    """Parent of each rank in the binary tree where a rank's height is its lowest set bit.

    Rank 0 is the root with one child; odd ranks are leaves. This is the tree NCCL's
    double binary tree starts from.
    """
    if n < 1:
        raise UserError(f"a tree needs at least 1 node, got {n}")
    r = np.arange(n, dtype=np.int64)
    bit = r & -r
    up = (r ^ bit) | (bit << 1)
    over = up >= n
    up[over] = (r ^ bit)[over]
    up[0] = -1
    return up


def depth_of(parent: np.ndarray) -> int:
    """Edges from the deepest node up to the root."""
    return int(_levels(parent).max()) if len(parent) else 0


def _levels(parent: np.ndarray) -> np.ndarray:
    n = len(parent)
    level = np.full(n, -1, dtype=np.int64)
    for v in range(n):
        path = []
        u = v
        while u >= 0 and level[u] < 0:
            path.append(u)
            u = parent[u]
        base = -1 if u < 0 else level[u]
        for w in reversed(path):
            base += 1
            level[w] = base
    return level


@dataclass(frozen=True)
class DoubleBinaryTree:
    """Two trees over ``n`` ranks. ``parents[t][r]`` is rank r's parent in tree t (-1: root)."""

    n: int
    parents: tuple[np.ndarray, np.ndarray]
    depth: int

    def edges(self) -> np.ndarray:
        """(child, parent, tree) rows: every tree edge once."""
        rows = []
        for t, par in enumerate(self.parents):
            child = np.nonzero(par >= 0)[0]
            rows.append(np.stack([child, par[child], np.full(len(child), t)], axis=1))
        return np.concatenate(rows) if rows else np.zeros((0, 3), dtype=np.int64)

    def node_units(self) -> dict[str, np.ndarray]:
        """Per rank, units sent, received and added per unit of data (each tree carries half).

        In each tree a rank sends half a unit to its parent (reduce) and to each child
        (broadcast), and receives as much; it adds what its children send up.
        """
        sends = np.zeros(self.n)
        adds = np.zeros(self.n)
        for par in self.parents:
            has_parent = (par >= 0).astype(float)
            children = np.bincount(par[par >= 0], minlength=self.n).astype(float)
            sends += 0.5 * (has_parent + children)
            adds += 0.5 * children
        return {"sends": sends, "recvs": sends.copy(), "adds": adds}


def double_binary_tree(n: int) -> DoubleBinaryTree:
    """The double binary tree over ranks 0..n-1: tree A as :func:`btree_parents`; tree B the
    same shape on mirrored ranks (n even) or ranks moved one on (n odd), so that the leaves
    of one tree (all odd ranks) are the inner nodes of the other."""
    a = btree_parents(n)
    r = np.arange(n, dtype=np.int64)
    rank_of = (n - 1 - r) if n % 2 == 0 else (r + 1) % n
    b = np.full(n, -1, dtype=np.int64)
    has = a >= 0
    b[rank_of[has]] = rank_of[a[has]]
    depth = max(depth_of(a), depth_of(b))
    return DoubleBinaryTree(n=n, parents=(a, b), depth=depth)


def _rooted_pair(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Trees A and B over local ranks 0..n-1, both rooted at rank 0 with a single child.

    A is :func:`btree_parents`. B has A's shape with ranks 1..n-1 moved one place on
    (wrapping inside 1..n-1), so A's leaves (odd ranks) are mostly B's inner nodes.
    """
    a = btree_parents(n)
    if n <= 2:
        return a, a.copy()
    p = np.arange(n, dtype=np.int64)
    rank_of = np.where(p == 0, 0, (p % (n - 1)) + 1)
    b = np.full(n, -1, dtype=np.int64)
    has = a >= 0
    b[rank_of[has]] = rank_of[a[has]]
    return a, b


def zoned_double_binary_tree(zone: np.ndarray) -> DoubleBinaryTree:
    """A double binary tree that crosses zones through one pair of nodes, as HAI arranges it.

    Each zone's ranks get their own pair of trees, both rooted at the zone's first rank;
    every other zone's root then hangs under the first zone's root in both trees, so the
    only links between zones are those root-to-root pairs (one pair for two zones).
    """
    zone = np.asarray(zone)
    n = len(zone)
    if n < 1:
        raise UserError("a tree needs at least 1 node")
    a = np.full(n, -1, dtype=np.int64)
    b = np.full(n, -1, dtype=np.int64)
    _, first = np.unique(zone, return_index=True)
    roots = []
    for z in zone[np.sort(first)]:
        ranks = np.nonzero(zone == z)[0]
        la, lb = _rooted_pair(len(ranks))
        for tree, local in ((a, la), (b, lb)):
            has = local >= 0
            tree[ranks[has]] = ranks[local[has]]
        roots.append(ranks[0])
    for r in roots[1:]:
        a[r] = roots[0]
        b[r] = roots[0]
    depth = max(depth_of(a), depth_of(b))
    return DoubleBinaryTree(n=n, parents=(a, b), depth=depth)


def tree_depth(n: int) -> int:
    """Depth of the in-order binary tree over n ranks: floor(log2 n)."""
    if n < 1:
        raise UserError(f"a tree needs at least 1 node, got {n}")
    return int(n).bit_length() - 1


def ring_edges(n: int) -> np.ndarray:
    """(src, dst) rows of a ring over ranks 0..n-1 (none for one rank)."""
    if n < 2:
        return np.zeros((0, 2), dtype=np.int64)
    src = np.arange(n)
    return np.stack([src, (src + 1) % n], axis=1)
