"""Where each rank goes in a 4-D layout of pipeline, data, expert and tensor parallelism.

The placement follows the paper's reasoning about what each kind of traffic needs:

* **TP** (tensor parallel) exchanges activations inside every layer, forward and backward,
  so it needs the fastest link there is. It sits innermost: a TP group is ``tp``
  consecutive ranks of one node (on Fire-Flyer an NVLink pair, degree 2). A node whose
  rank count ``tp`` does not divide cannot be placed, and says so.
* **EP** (expert parallel) runs two ``all_to_all`` per MoE layer. An EP group of ``ep``
  TP groups (a *unit* of ``ep × tp`` ranks) stays inside one node when it fits. When
  ``ep × tp`` is larger than a node, a unit is made of *whole consecutive nodes* (a zone:
  its all_to_all crosses the network, which :attr:`LayoutPlan.notes` says). A unit that
  would hold part of a node and part of another is refused: its EP traffic would share one
  node's NIC with the node's other units for no gain.
* **PP** (pipeline parallel): a node's units go to *different* pipelines, one stage per
  node, exactly as :func:`~fireflyer.haiscale.pipeline_placement.plan_pipelines` places
  ranks (here it places units), so the activations pipelines send between nodes are
  staggered on the node's NIC and the ranks holding one stage are whole nodes.
* **DP** (data parallel) takes the rest: the units holding the same stage in different
  pipelines.

The mesh has dims ``("pp", "dp", "ep", "tp")``: ``mesh[s][i][e][t]`` is the global rank
holding stage ``s`` of pipeline (DP replica) ``i``, at EP rank ``e`` and TP rank ``t``.
Along every dim the ranks ascend, because torch numbers a process group's ranks in
ascending global-rank order and a DeviceMesh takes a rank's index along a dim as its rank
in that dim's group; a layout where that cannot hold (ranks not numbered node by node, in
an order the grid cannot follow) is refused.

Everything here is pure (node keys in, rank grids out), so it is property-tested on many
layouts without processes; :func:`fireflyer.haiscale.layout` (module ``layout_mesh``) turns a plan into
process groups and a DeviceMesh.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from functools import cached_property

from fireflyer.errors import UserError, UserTypeError
from fireflyer.haiscale.pipeline_placement import _notes as _pipeline_notes
from fireflyer.haiscale.pipeline_placement import divisors, group_nodes, plan_pipelines

MESH_DIMS = ("pp", "dp", "ep", "tp")
"""The mesh's dim names, outermost first."""
GROUP_KINDS = (*MESH_DIMS, "dense", "expert")
"""What :meth:`LayoutPlan.groups` can list: the mesh dims, and the two gradient-averaging groups."""

Grid = tuple[tuple[tuple[tuple[int, ...], ...], ...], ...]


@dataclass(frozen=True)
class LayoutPlan:
    """The ranks of a ``pp × dp × ep × tp`` layout, and the groups each dim forms.

    ``mesh`` has shape ``(pp, dp, ep, tp)`` (nested tuples of global ranks), so
    ``torch.tensor(plan.mesh)`` is a valid DeviceMesh array for :data:`MESH_DIMS`.
    """

    pp: int
    dp: int
    ep: int
    tp: int
    mesh: Grid
    nodes: tuple[tuple[int, ...], ...]
    """The global ranks of each node, nodes in order of their lowest rank."""
    notes: tuple[str, ...]
    """Where this layout departs from the paper's placement, one sentence each (warnings)."""

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.ep * self.tp

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.pp, self.dp, self.ep, self.tp)

    @cached_property
    def _coords(self) -> dict[int, tuple[int, int, int, int]]:
        return {self.mesh[s][i][e][t]: (s, i, e, t) for s, i, e, t in itertools.product(*map(range, self.shape))}

    def coords(self, rank: int) -> dict[str, int]:
        """``rank``'s index along each dim: ``{"pp": stage, "dp": replica, "ep": ..., "tp": ...}``."""
        if rank not in self._coords:
            raise UserError(f"rank {rank!r} is not in this layout of {self.world_size} ranks (0..{self.world_size - 1})")
        return dict(zip(MESH_DIMS, self._coords[rank]))

    def groups(self, kind: str) -> tuple[tuple[int, ...], ...]:
        """The groups of ``kind``, each a tuple of global ranks in ascending order (the group's rank order).

        ``kind`` is a mesh dim (``"pp"``, ``"dp"``, ``"ep"``, ``"tp"``: the ranks that differ only
        along that dim), ``"dense"`` (dp × ep together: the ranks holding the same stage and the
        same TP shard, which average the dense, non-expert gradients) or ``"expert"`` (the dp
        groups: the ranks holding the same experts, which average the expert gradients).
        """
        if kind not in GROUP_KINDS:
            raise UserError(f"unknown group kind {kind!r}: choose from {', '.join(GROUP_KINDS)}")
        if kind == "expert":
            kind = "dp"
        if kind == "dense":
            return tuple(tuple(sorted(self.mesh[s][i][e][t] for i in range(self.dp) for e in range(self.ep)))
                         for s in range(self.pp) for t in range(self.tp))
        axis = MESH_DIMS.index(kind)
        others = [range(n) for d, n in enumerate(self.shape) if d != axis]
        out = []
        for rest in itertools.product(*others):
            group = []
            for k in range(self.shape[axis]):
                s, i, e, t = (*rest[:axis], k, *rest[axis:])
                group.append(self.mesh[s][i][e][t])
            out.append(tuple(group))
        return tuple(out)

    def group_of(self, kind: str, rank: int) -> tuple[int, ...]:
        """The group of ``kind`` that holds ``rank``."""
        self.coords(rank)
        return next(g for g in self.groups(kind) if rank in g)


def _degree(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise UserTypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise UserError(f"{name} must be at least 1, got {value}")
    return value


def check_degrees(world: int, *, dp: int | None, pp: int, tp: int, ep: int) -> int:
    """Check the degrees against the world size alone (no node keys needed); return ``dp``.

    What :func:`plan_layout` checks first, and what a collective caller checks on every rank
    before it communicates, so a bad argument fails everywhere at once.
    """
    pp, tp, ep = _degree("pp", pp), _degree("tp", tp), _degree("ep", ep)
    if world < 1:
        raise UserError("the layout has no ranks: give one node key per global rank")
    inner = pp * ep * tp
    if dp is None:
        if world % inner:
            raise UserError(
                f"pp×ep×tp = {pp}×{ep}×{tp} = {inner} does not divide the world size {world}, so dp cannot "
                f"take the rest. Choose degrees whose product divides {world} "
                f"(its divisors: {', '.join(map(str, divisors(world)))})")
        return world // inner
    dp = _degree("dp", dp)
    if dp * inner != world:
        hint = (f"with pp={pp}, ep={ep}, tp={tp} give dp={world // inner} or leave dp=None"
                if world % inner == 0 else
                f"the product must be one of the world's factorisations; its divisors are "
                f"{', '.join(map(str, divisors(world)))}")
        raise UserError(f"pp×dp×ep×tp = {pp}×{dp}×{ep}×{tp} = {dp * inner} but the world size is {world}: "
                        f"every rank needs exactly one place; {hint}")
    return dp


def plan_layout(node_of_rank: Sequence[Hashable], *, dp: int | None = None, pp: int = 1, tp: int = 1,
                ep: int = 1) -> LayoutPlan:
    """Place ``len(node_of_rank)`` ranks into a ``pp × dp × ep × tp`` mesh.

    ``node_of_rank[r]`` is the node of global rank ``r`` (any hashable key, e.g. a host).
    ``dp=None`` takes the rest: ``world // (pp × ep × tp)``. Raises :class:`UserError` when
    the degrees do not multiply to the world size, ``tp`` does not divide a node's rank
    count, or an EP unit would straddle nodes; :class:`UserTypeError` for a non-integer.
    """
    world = len(node_of_rank)
    dp = check_degrees(world, dp=dp, pp=pp, tp=tp, ep=ep)
    nodes = group_nodes(node_of_rank)
    sizes = sorted({len(n) for n in nodes})
    if any(len(n) % tp for n in nodes):
        common = [d for d in divisors(min(sizes)) if all(s % d == 0 for s in sizes)]
        raise UserError(
            f"tp={tp} does not divide the rank count of every node (nodes of {sizes} ranks): a TP group must "
            f"be tp ranks of one node, since it exchanges activations in every layer. Choose tp from "
            f"{', '.join(map(str, common))}")
    units, unit_nodes = _units(nodes, tp, ep)
    notes = []
    unit = ep * tp
    if any(len(covered) > 1 for covered in unit_nodes):
        notes.append(
            f"an EP group (ep×tp = {ep}×{tp} = {unit} ranks) is larger than a node ({sizes} ranks), so each one "
            f"spans {max(map(len, unit_nodes))} whole nodes (a zone) and its all_to_all crosses the network; "
            f"an ep×tp that fits in a node keeps expert traffic on intra-node links")
    # Pipelines over units: a unit is one "rank" of plan_pipelines, keyed by the node(s) it covers.
    placement = plan_pipelines(unit_nodes, pp)
    # Replica i holds the i-th lowest unit of every stage: that keeps each stage's ranks (and so the
    # DP groups) ascending, and each pipeline ascending too (the i-th lowest first stage lies below the
    # i-th lowest second stage, as every pipeline's does). On even layouts this is plan_pipelines's own
    # grid; elsewhere it may pair units differently, so the notes are recomputed for these pipelines.
    pipelines = tuple(zip(*placement.dp_groups))
    for note in _pipeline_notes(placement.nodes, pipelines, placement.dp_groups, pp, placement.strategy):
        notes.append(note if unit == 1 else f"counting each EP group of {unit} ranks as one: {note}")
    mesh = tuple(tuple(tuple(tuple(units[u][e * tp:(e + 1) * tp]) for e in range(ep)) for u in (p[s] for p in pipelines))
                 for s in range(pp))
    plan = LayoutPlan(pp, dp, ep, tp, mesh, nodes, tuple(notes))
    _check_ascending(plan)
    return plan


def _units(nodes: tuple[tuple[int, ...], ...], tp: int, ep: int) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """Cut the nodes' ranks (node by node) into units of ``ep × tp``; return each unit's ranks and the
    indices of the nodes it covers. A unit lies in one node or covers whole consecutive nodes."""
    unit = ep * tp
    walk = [(rank, n) for n, node in enumerate(nodes) for rank in node]
    units, covers = [], []
    for start in range(0, len(walk), unit):
        chunk = walk[start:start + unit]
        covered = tuple(sorted({n for _, n in chunk}))
        if len(covered) > 1 and sum(len(nodes[n]) for n in covered) != unit:
            sizes = sorted({len(n) for n in nodes})
            fits = [e for e in divisors(min(sizes) // tp) if all((s // tp) % e == 0 for s in sizes)]
            raise UserError(
                f"ep×tp = {ep}×{tp} = {unit} ranks cannot be placed on nodes of {sizes} ranks: an EP group must "
                f"lie inside one node, or cover whole consecutive nodes (a zone), and this one would hold part "
                f"of node {covered[0]} and part of node {covered[-1]}. With tp={tp} choose ep from "
                f"{', '.join(map(str, fits))} (inside a node) or a multiple that covers whole nodes")
        units.append(tuple(r for r, _ in chunk))
        covers.append(covered)
    return units, covers


def _check_ascending(plan: LayoutPlan) -> None:
    for kind in MESH_DIMS:
        for group in plan.groups(kind):
            if list(group) != sorted(group):
                raise UserError(
                    f"ranks are not numbered node by node in an order this layout can follow: the {kind} group "
                    f"{list(group)} would not ascend, yet a process group numbers its ranks in ascending order. "
                    f"Launch with ranks numbered node by node (torchrun and Slurm do)")
