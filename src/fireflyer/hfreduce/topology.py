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
