"""Where pipeline stages go: the paper's placement of pipeline and data-parallel groups.

Fire-Flyer nodes have one InfiniBand NIC for eight PCIe GPUs (paper §V-B2). If the eight
GPUs of a node held the stages of one pipeline, every activation the pipeline sends
between nodes would queue on that one NIC at the same moments. HaiScale instead puts the
ranks of a node into *different* pipelines, that is into different data-parallel
replicas: a pipeline runs across ``pp_size`` nodes, one stage per node, and the eight
pipelines that share a node reach each pipeline phase at slightly different times, so
their traffic on the NIC is staggered.

With ``N`` nodes of ``L`` ranks and ``N`` a multiple of ``pp_size`` (``p``), the placement
is a grid. Nodes form blocks of ``p`` consecutive nodes; pipeline ``(block b, local
rank l)`` has its stage ``s`` on node ``b*p + s`` at local rank ``l``. The ranks holding
stage ``s`` (its data-parallel group) are then whole nodes, so the DP allreduce is
mostly intra-node shared memory, which hfreduce does best.

Other layouts fall back, and the placement says so in :attr:`PipelinePlacement.notes`:

* ``N >= p`` but not a multiple: the same walk (local rank 0 of every node, then local
  rank 1 of every node, ...) cut into pipelines of ``p`` still keeps a node's ranks in
  different pipelines, but a DP group is no longer made of whole nodes.
* ``N < p``: a pipeline cannot have one node per stage, so pipelines are cut from
  consecutive ranks of a node (stages inside a node, PP traffic over local links).
* Uneven nodes may leave two ranks of one node in a pipeline when a node has more ranks
  than there are pipelines.

Stage numbers follow torch: a process group numbers its ranks in ascending global-rank
order, and a ``PipelineStage`` finds its neighbours by that number, so stage ``s`` of a
pipeline is its ``s``-th lowest global rank. Every tuple here is therefore ascending.

Everything in this module is pure (node keys in, rank lists out), so it is unit-tested on
many layouts without processes.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from fireflyer.cliutil import plural
from fireflyer.errors import UserError, UserTypeError

ACROSS_NODES = "across-nodes"
"""Each stage of a pipeline on a different node (the paper's placement)."""
INSIDE_NODES = "inside-nodes"
"""Stages on consecutive ranks of a node (the fallback when nodes < pp_size)."""


@dataclass(frozen=True)
class PipelinePlacement:
    """Which ranks form each pipeline, and which hold each stage.

    ``pipelines[i][s]`` is the global rank holding stage ``s`` of pipeline ``i`` (the
    pipeline's process group); ``dp_groups[s]`` lists the ranks holding stage ``s``
    in every pipeline (that stage's data-parallel group). Pipeline ``i`` is data-parallel
    replica ``i``.
    """

    pp_size: int
    pipelines: tuple[tuple[int, ...], ...]
    dp_groups: tuple[tuple[int, ...], ...]
    nodes: tuple[tuple[int, ...], ...]
    """The global ranks of each node, nodes in order of their lowest rank."""
    strategy: str
    """:data:`ACROSS_NODES` or :data:`INSIDE_NODES`."""
    notes: tuple[str, ...]
    """Where this layout departs from the paper's placement, one sentence each (warnings)."""

    @property
    def world_size(self) -> int:
        return sum(len(n) for n in self.nodes)

    def pipeline_of(self, rank: int) -> int:
        """Index of the pipeline (data-parallel replica) that ``rank`` belongs to."""
        return self._holder(self.pipelines, rank)

    def stage_of(self, rank: int) -> int:
        """The stage ``rank`` holds (its rank in its pipeline's process group)."""
        return self.pipelines[self.pipeline_of(rank)].index(rank)

    def node_of(self, rank: int) -> int:
        return self._holder(self.nodes, rank)

    def _holder(self, groups: Sequence[Sequence[int]], rank: int) -> int:
        """Index of the one of ``groups`` (pipelines or nodes) that holds ``rank``."""
        for i, group in enumerate(groups):
            if rank in group:
                return i
        raise UserError(f"rank {rank} is not in this placement of {self.world_size} ranks")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def group_nodes(node_of_rank: Sequence[Hashable]) -> tuple[tuple[int, ...], ...]:
    """Global ranks per node, nodes ordered by their lowest rank, ranks ascending."""
    by_key: dict[Hashable, list[int]] = {}
    for rank, key in enumerate(node_of_rank):
        by_key.setdefault(key, []).append(rank)
    return tuple(tuple(ranks) for ranks in by_key.values())


def plan_pipelines(node_of_rank: Sequence[Hashable], pp_size: int) -> PipelinePlacement:
    """Place ``len(node_of_rank)`` ranks into pipelines of ``pp_size`` stages.

    ``node_of_rank[r]`` is the node of global rank ``r`` (any hashable key, e.g. a
    hostname). Ranks need not be numbered node by node. Raises ``ValueError`` when
    ``pp_size`` cannot split the world, ``TypeError`` when it is not an integer.
    """
    if isinstance(pp_size, bool) or not isinstance(pp_size, int):
        raise UserTypeError(f"pp_size must be an int, got {type(pp_size).__name__} {pp_size!r}")
    world = len(node_of_rank)
    if world < 1:
        raise UserError("the layout has no ranks: give one node key per global rank")
    if pp_size < 1:
        raise UserError(f"pp_size must be at least 1, got {pp_size}")
    if world % pp_size:
        raise UserError(
            f"pp_size={pp_size} does not divide the world size {world}: every pipeline needs exactly "
            f"pp_size ranks. Choose pp_size from {', '.join(map(str, divisors(world)))}, or change the "
            f"number of ranks")
    nodes = group_nodes(node_of_rank)
    if len(nodes) >= pp_size:
        strategy = ACROSS_NODES
        # Local rank 0 of every node, then local rank 1 of every node, ...: any p
        # consecutive entries come from p different nodes when nodes are even.
        walk = [node[local] for local in range(max(map(len, nodes))) for node in nodes if local < len(node)]
    else:
        strategy = INSIDE_NODES
        walk = [rank for node in nodes for rank in node]
    pipelines = tuple(tuple(sorted(walk[i:i + pp_size])) for i in range(0, world, pp_size))
    dp_groups = tuple(tuple(sorted(p[s] for p in pipelines)) for s in range(pp_size))
    notes = _notes(nodes, pipelines, dp_groups, pp_size, strategy)
    return PipelinePlacement(pp_size, pipelines, dp_groups, nodes, strategy, notes)


def _notes(nodes: tuple[tuple[int, ...], ...], pipelines: tuple[tuple[int, ...], ...],
           dp_groups: tuple[tuple[int, ...], ...], pp_size: int, strategy: str) -> tuple[str, ...]:
    node_of = {r: i for i, node in enumerate(nodes) for r in node}
    notes = []
    if strategy == INSIDE_NODES:
        notes.append(
            f"{plural(len(nodes), 'node')} but pp_size={pp_size}: a pipeline cannot have each stage on its own node, "
            f"so pipelines are cut from consecutive ranks node by node (several stages share a node) and "
            f"the DP groups span nodes. For the paper's placement use at least pp_size nodes")
        return tuple(notes)
    shared = [i for i, p in enumerate(pipelines) if len({node_of[r] for r in p}) < len(p)]
    if shared:
        notes.append(
            f"{len(shared)} pipeline(s) hold two ranks of one node (nodes of {sorted({len(n) for n in nodes})} "
            f"ranks: a node has more ranks than there are pipelines); their stages share that node's NIC. "
            f"Even node sizes avoid this")
    whole = all(set(node) <= set(group) for group in dp_groups for node in nodes if set(node) & set(group))
    if not whole:
        notes.append(
            f"data-parallel groups are not whole nodes ({len(nodes)} nodes is not a multiple of "
            f"pp_size={pp_size}, or ranks are not numbered node by node), so the DP allreduce crosses more "
            f"nodes than it needs. A node count that is a multiple of pp_size gives the paper's placement")
    return tuple(notes)
