"""Where nodes sit in a (zoned) two-layer fat tree, and how static routing loads its links.

Routing is destination-based and static (D-mod-k), as Fire-Flyer runs it (paper VI-A2:
adaptive routing spread congestion, so they chose static routes). In a zone each leaf
has k/2 up-lanes; traffic to endpoint ``d`` leaves its source leaf on lane ``d mod k/2``
and comes down to ``d``'s leaf on the same lane, so downlinks never collide and uplinks
collide only when two destinations share a lane. A flow to another zone goes to a
bridge link chosen by destination (``d mod bridges``), crosses the bridge switch, and
is routed again in the other zone. Bridge links sit on the last ports of each zone.

Loads are in units per unit of data; a link's share of the collective's rate is
``link_gb_s / load``. A three-layer fabric is taken as non-blocking (no loads computed).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fireflyer.errors import UserError
from fireflyer.fabric.topology import Fabric

PLACEMENTS = ("packed", "cross-zone", "naive")


@dataclass(frozen=True)
class Placement:
    """Zone and endpoint port of each rank (node) of one job, in one plane."""

    zone: np.ndarray
    port: np.ndarray
    zone_aware: bool = True
    """Whether the job's trees know the zones (HAI: one crossing pair) or follow rank order blindly."""

    @property
    def nodes(self) -> int:
        return len(self.zone)

    @property
    def zones_used(self) -> int:
        return len(np.unique(self.zone))


@dataclass(frozen=True)
class LinkLoads:
    """The result of routing a set of flows."""

    loads: np.ndarray
    """Load on every link (units per unit of data)."""
    bridge_mask: np.ndarray
    """Which links are bridge links (cross-zone)."""
    cross_flows: int
    """Flows that cross zones."""

    @property
    def max_load(self) -> float:
        return float(self.loads.max()) if self.loads.size else 0.0

    @property
    def max_bridge_load(self) -> float:
        b = self.loads[self.bridge_mask]
        return float(b.max()) if b.size else 0.0

    @property
    def bridge_traffic(self) -> float:
        """Units crossing bridge links, both directions and all bridges (per unit of data)."""
        return float(self.loads[self.bridge_mask].sum()) / 2.0


class Network:
    """A two-layer (zoned) fabric that can place jobs and route flows in one plane."""

    def __init__(self, fabric: Fabric, nics_per_node_per_plane: int = 1, nodes_per_zone: int | None = None) -> None:
        self.fabric = fabric
        self.routable = fabric.layers == 2
        self.half = fabric.radix // 2
        self.zones = fabric.zones
        self.ports = fabric.leaves_per_zone * self.half if self.routable else fabric.ports
        self.bridges = fabric.bridge
        self.bridge_links = fabric.bridge_links
        self.bridge_ports = self.bridges * self.bridge_links
        self.stride = max(1, nics_per_node_per_plane)
        self.node_slots = (self.ports - self.bridge_ports) // self.stride
        if nodes_per_zone is not None:
            self.node_slots = min(self.node_slots, nodes_per_zone)
        if self.node_slots < 1:
            raise UserError("the fabric has no ports left for nodes")
        self.link_gb_s = fabric.link_gb_s
        # link ids per zone: ep_up[ports], ep_down[ports], lane_up[ports], lane_down[ports]
        self.block = 4 * self.ports
        self.n_links = self.zones * self.block

    # -- placement ----------------------------------------------------------------------------

    @property
    def capacity_nodes(self) -> int:
        return self.zones * self.node_slots

    def place(self, nodes: int, policy: str = "packed", *, seed: int = 0, start: int = 0) -> Placement:
        """Ranks 0..nodes-1 on node slots.

        ``packed``: zone by zone in rank order (what HAI does for a task). ``cross-zone``:
        half the ranks in zone 0 and half in zone 1, zone by zone (Figure 7b's cross-zone
        runs). ``naive``: random slots in any zone, in random rank order.
        """
        if nodes < 1:
            raise UserError(f"a job needs at least 1 node, got {nodes}")
        if nodes > self.capacity_nodes:
            raise UserError(f"{nodes} nodes do not fit this fabric ({self.capacity_nodes} node slots)")
        if policy == "packed":
            slots = np.arange(start, start + nodes)
            if slots[-1] >= self.capacity_nodes:
                raise UserError("job placed past the end of the fabric")
        elif policy == "cross-zone":
            if self.zones < 2:
                raise UserError("cross-zone placement needs a fabric of at least 2 zones")
            first = (nodes + 1) // 2
            if first > self.node_slots:
                raise UserError(f"{nodes} nodes do not fit two zones of {self.node_slots} slots")
            slots = np.concatenate([np.arange(first), self.node_slots + np.arange(nodes - first)])
        elif policy == "naive":
            rng = np.random.default_rng(seed)
            slots = rng.choice(self.capacity_nodes, size=nodes, replace=False)
        else:
            raise UserError(f"unknown placement {policy!r}; choose one of: {', '.join(PLACEMENTS)}")
        return self.placement_of_slots(slots, zone_aware=policy != "naive")

    def placement_of_slots(self, slots: np.ndarray, *, zone_aware: bool = True) -> Placement:
        slots = np.asarray(slots, dtype=np.int64)
        zone = slots // self.node_slots
        port = (slots % self.node_slots) * self.stride
        return Placement(zone=zone, port=port, zone_aware=zone_aware)

    # -- routing ------------------------------------------------------------------------------

    def bridge_port(self, bridge: np.ndarray, link: np.ndarray) -> np.ndarray:
        """Endpoint port (in any zone) of bridge ``bridge``'s link ``link``: the last ports."""
        return self.ports - 1 - (bridge * self.bridge_links + link)

    def _segment(self, zone: np.ndarray, a: np.ndarray, b: np.ndarray) -> list[np.ndarray]:
        """Link ids of intra-zone routes a -> b (arrays), as a list of id arrays (-1: unused)."""
        base = zone * self.block
        leaf_a, leaf_b = a // self.half, b // self.half
        lane = b % self.half
        other = leaf_a != leaf_b
        up = np.where(other, base + 2 * self.ports + leaf_a * self.half + lane, -1)
        down = np.where(other, base + 3 * self.ports + leaf_b * self.half + lane, -1)
        return [base + a, up, down, base + self.ports + b]

    def bridge_mask(self) -> np.ndarray:
        """Which link ids are bridge links (both directions, every zone)."""
        mask = np.zeros(self.n_links if self.routable else 0, dtype=bool)
        if self.routable and self.bridge_ports:
            bp = self.bridge_port(np.repeat(np.arange(self.bridges), self.bridge_links),
                                  np.tile(np.arange(self.bridge_links), self.bridges))
            for z in range(self.zones):
                mask[z * self.block + bp] = True
                mask[z * self.block + self.ports + bp] = True
        return mask

    def route(self, placement: Placement, src: np.ndarray, dst: np.ndarray, demand: np.ndarray) -> LinkLoads:
        """Loads on every link of flows from rank ``src`` to rank ``dst`` carrying ``demand`` each."""
        src = np.asarray(src, dtype=np.int64)
        dst = np.asarray(dst, dtype=np.int64)
        demand = np.broadcast_to(np.asarray(demand, dtype=float), src.shape)
        loads = np.zeros(self.n_links if self.routable else 0)
        mask = self.bridge_mask()
        if not self.routable or src.size == 0:
            return LinkLoads(loads=loads, bridge_mask=mask, cross_flows=0)
        za, zb = placement.zone[src], placement.zone[dst]
        pa, pb = placement.port[src], placement.port[dst]
        same = za == zb
        ids: list[np.ndarray] = []
        weights: list[np.ndarray] = []
        # flows inside one zone
        for seg in self._segment(za[same], pa[same], pb[same]):
            ids.append(seg)
            weights.append(demand[same])
        cross = ~same
        if cross.any():
            if self.bridges == 0:
                raise UserError("flows cross zones but the fabric has no bridge switches")
            d = pb[cross] + za[cross] * self.ports  # destination address, made unique across zones
            bridge = d % self.bridges
            link = (d // self.bridges) % self.bridge_links
            bport = self.bridge_port(bridge, link)
            for seg in self._segment(za[cross], pa[cross], bport):
                ids.append(seg)
                weights.append(demand[cross])
            for seg in self._segment(zb[cross], bport, pb[cross]):
                ids.append(seg)
                weights.append(demand[cross])
        all_ids = np.concatenate(ids)
        all_w = np.concatenate(weights)
        keep = all_ids >= 0
        loads = np.bincount(all_ids[keep], weights=all_w[keep], minlength=self.n_links)
        return LinkLoads(loads=loads, bridge_mask=mask, cross_flows=int(cross.sum()))
