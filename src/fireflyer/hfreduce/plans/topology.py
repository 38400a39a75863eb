"""Who sits where: nodes, local ranks, rails, and the double binary tree over nodes.

Pure functions over plain data. A *node* is the set of ranks that share one
shared-memory arena (one host, or one ``FIREFLYER_NODE_ID``). Inside a node, the
ranks are numbered by *local rank* in global-rank order. Local rank ``r`` of every
node forms *rail* ``r``; each rail runs its own pair of trees over the nodes, so L
rails move L slices of every chunk in parallel.
"""

from __future__ import annotations

from dataclasses import dataclass
from fireflyer.errors import UserError


@dataclass(frozen=True)
class TreeLinks:
    """One rank's place in one binary tree over nodes: parent and children, or -1."""

    parent: int
    children: tuple[int, ...]

    @property
    def is_root(self) -> bool:
        return self.parent < 0


def _btree(n: int, rank: int) -> TreeLinks:
    """NCCL's in-order binary tree over 0..n-1, rooted at 0 (``ncclGetBtree``)."""
    if not 0 <= rank < n:
        raise UserError(f"rank {rank} is outside 0..{n - 1}")
    bit = 1
    while bit < n:
        bit <<= 1
    if rank == 0:
        return TreeLinks(-1, (bit >> 1,) if n > 1 else ())
    bit = rank & -rank
    up = (rank ^ bit) | (bit << 1)
    if up >= n:
        up = rank ^ bit
    children: list[int] = []
    low = bit >> 1
    if low:
        children.append(rank - low)
        child = rank + low
        while child >= n and low > 1:
            low >>= 1
            child = rank + low
        if child < n:
            children.append(child)
    return TreeLinks(up, tuple(children))


def tree_links(n: int, node: int, tree: int) -> TreeLinks:
    """Links of ``node`` in tree 0 (in-order) or tree 1 (mirror for even n, shift by one for odd n)."""
    if tree == 0:
        return _btree(n, node)
    if tree != 1:
        raise UserError(f"tree must be 0 or 1, got {tree}")
    if n % 2 == 0:
        to_base = lambda x: n - 1 - x  # noqa: E731 - the mirror is its own inverse
        from_base = to_base
    else:
        to_base = lambda x: (x - 1) % n  # noqa: E731
        from_base = lambda x: (x + 1) % n  # noqa: E731
    base = _btree(n, to_base(node))
    parent = from_base(base.parent) if base.parent >= 0 else -1
    return TreeLinks(parent, tuple(from_base(c) for c in base.children))


def binomial_links(n: int, node: int, tree: int) -> TreeLinks:
    """Links of ``node`` in the binomial trees of the canonical order.

    Tree 0 is rooted at node 0: node ``v`` takes the children ``v + 2**k`` for every ``2**k``
    below ``v``'s lowest set bit (all of them at the root), nearest first, so folding them in
    that order into ``v``'s own partial adds aligned blocks of equal size: the reduce-up builds
    the left-balanced pairwise tree over the nodes (``plans/canonical.py``). Tree 1 is its mirror
    (rooted at node ``n - 1``) where ``n`` is a power of two: the mirror pairs the same blocks,
    and a two-term sum is the same whichever side it is computed on, so both halves of a chunk
    get the same tree and the root's load is shared. Otherwise tree 1 is tree 0 again.
    """
    if not 0 <= node < n:
        raise UserError(f"node {node} is outside 0..{n - 1}")
    if tree not in (0, 1):
        raise UserError(f"tree must be 0 or 1, got {tree}")
    mirror = tree == 1 and n & (n - 1) == 0
    v = n - 1 - node if mirror else node
    low = v & -v if v else 1 << max(n - 1, 0).bit_length()
    parent = v - low if v else -1
    children = []
    step = 1
    while step < low and v + step < n:
        children.append(v + step)
        step <<= 1
    if mirror:
        parent = n - 1 - parent if parent >= 0 else -1
        children = [n - 1 - c for c in children]
    return TreeLinks(parent, tuple(children))


def tree_root(n: int, tree: int) -> int:
    return next(v for v in range(n) if tree_links(n, v, tree).is_root)


def tree_depth(n: int, tree: int) -> int:
    """Number of edges on the longest root-to-leaf path."""
    depth = {tree_root(n, tree): 0}
    frontier = [tree_root(n, tree)]
    while frontier:
        nxt = []
        for v in frontier:
            for c in tree_links(n, v, tree).children:
                depth[c] = depth[v] + 1
                nxt.append(c)
        frontier = nxt
    return max(depth.values())


@dataclass(frozen=True)
class Layout:
    """The job's shape: which global ranks form each node, in a fixed order.

    ``nodes[i]`` lists the global ranks of node ``i`` in increasing order, and the
    nodes themselves are ordered by their lowest global rank, so every rank derives
    the same layout from the same node keys.
    """

    nodes: tuple[tuple[int, ...], ...]

    @classmethod
    def from_node_keys(cls, keys: list[str]) -> "Layout":
        """Group ranks by node key (``keys[rank]``), e.g. a host name or FIREFLYER_NODE_ID."""
        if not keys:
            raise UserError("a layout needs at least one rank")
        groups: dict[str, list[int]] = {}
        for rank, key in enumerate(keys):
            groups.setdefault(key, []).append(rank)
        return cls(tuple(tuple(g) for g in sorted(groups.values(), key=lambda g: g[0])))

    @property
    def world_size(self) -> int:
        return sum(len(n) for n in self.nodes)

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def rails(self) -> int:
        """Ranks per node that take part in the inter-node trees (the smallest node's size)."""
        return min(len(n) for n in self.nodes)

    def node_of(self, rank: int) -> int:
        for i, members in enumerate(self.nodes):
            if rank in members:
                return i
        raise UserError(f"rank {rank} is not in this layout of {self.world_size} ranks")

    def local_rank(self, rank: int) -> int:
        return self.nodes[self.node_of(rank)].index(rank)

    def local_size(self, node: int) -> int:
        return len(self.nodes[node])

    def rail_peer(self, node: int, rail: int) -> int:
        """Global rank that drives ``rail`` on ``node``."""
        return self.nodes[node][rail]

    @property
    def homogeneous(self) -> bool:
        return len({len(n) for n in self.nodes}) == 1


def split(total: int, parts: int, index: int) -> tuple[int, int]:
    """Half-open range of part ``index`` when ``total`` items are cut into ``parts`` near-equal pieces."""
    base, extra = divmod(total, parts)
    lo = index * base + min(index, extra)
    return lo, lo + base + (1 if index < extra else 0)
