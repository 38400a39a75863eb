"""The placement study: several tasks share a zoned cluster and all run an allreduce at once.

**HAI placement** (paper III-B, VI-C): whole nodes; a task goes into one zone if any zone
has room; at most one task may span zones, and its trees cross between zones through
one pair of nodes. **Naive placement**: tasks take free nodes anywhere, in any order, and
their trees follow rank order without knowing the zones.

Every task's flows are routed together with static routing; a task's network rate is its
busiest link's capacity over that link's total load (links shared equally per unit of
data), and its node caps still apply.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fireflyer.errors import UserError
from fireflyer.fabric.catalog import NodeSpec
from fireflyer.fabric.collectives import AllreduceResult, ModelParams, allreduce, flows
from fireflyer.fabric.routing import Network, Placement

POLICIES = ("hai", "naive")


@dataclass(frozen=True, kw_only=True)
class TaskResult:
    nodes: int
    zones: int
    cross_zone_pairs: int
    """Distinct node pairs that talk across zones."""
    result: AllreduceResult

    def to_dict(self) -> dict:
        return {"nodes": self.nodes, "zones": self.zones, "cross_zone_pairs": self.cross_zone_pairs,
                "seconds": self.result.seconds, "algbw_gb_s": self.result.algbw_gb_s,
                "bottleneck": self.result.bottleneck}


@dataclass(frozen=True, kw_only=True)
class PolicyResult:
    policy: str
    tasks: list[TaskResult]
    unplaced: list[int] = field(default_factory=list)
    cross_zone_tasks: int = 0
    max_bridge_load: float = 0.0
    """Busiest bridge link, units per unit of data."""
    bridge_traffic: float = 0.0
    """Units crossing zones per unit of data, all tasks."""

    @property
    def mean_algbw_gb_s(self) -> float:
        return float(np.mean([t.result.algbw_gb_s for t in self.tasks])) if self.tasks else 0.0

    @property
    def slowest_seconds(self) -> float:
        return max((t.result.seconds for t in self.tasks), default=0.0)

    def to_dict(self) -> dict:
        return {"policy": self.policy, "tasks": [t.to_dict() for t in self.tasks], "unplaced": self.unplaced,
                "cross_zone_tasks": self.cross_zone_tasks, "max_bridge_load": self.max_bridge_load,
                "bridge_traffic": self.bridge_traffic, "mean_algbw_gb_s": self.mean_algbw_gb_s,
                "slowest_seconds": self.slowest_seconds}


def place_hai(network: Network, tasks: list[int]) -> tuple[list[Placement | None], list[int]]:
    """Largest task first; into the zone with least room that still fits it; one task may span zones."""
    free = [list(range(z * network.node_slots, (z + 1) * network.node_slots)) for z in range(network.zones)]
    out: list[Placement | None] = [None] * len(tasks)
    unplaced: list[int] = []
    spanned = False
    for i in sorted(range(len(tasks)), key=lambda i: -tasks[i]):
        n = tasks[i]
        fits = [z for z in range(network.zones) if len(free[z]) >= n]
        if fits:
            z = min(fits, key=lambda z: len(free[z]))
            slots, free[z] = free[z][:n], free[z][n:]
        elif not spanned and sum(len(f) for f in free) >= n:
            spanned = True
            slots = []
            for z in sorted(range(network.zones), key=lambda z: -len(free[z])):
                take = min(n - len(slots), len(free[z]))
                slots += free[z][:take]
                free[z] = free[z][take:]
        else:
            unplaced.append(n)
            continue
        out[i] = network.placement_of_slots(np.array(slots), zone_aware=True)
    return out, unplaced


def place_naive(network: Network, tasks: list[int], seed: int = 0) -> tuple[list[Placement | None], list[int]]:
    """Free nodes in random order, handed out task by task; ranks follow that order."""
    rng = np.random.default_rng(seed)
    free = list(rng.permutation(network.capacity_nodes))
    out: list[Placement | None] = []
    unplaced = []
    for n in tasks:
        if n > len(free):
            out.append(None)
            unplaced.append(n)
            continue
        slots, free = free[:n], free[n:]
        out.append(network.placement_of_slots(np.array(slots), zone_aware=False))
    return out, unplaced


def study(network: Network, node: NodeSpec, tasks: list[int], *, algo: str = "hfreduce",
          size_bytes: int = 186 << 20, seed: int = 0, params: ModelParams | None = None) -> dict[str, PolicyResult]:
    """Both policies on the same tasks (node counts)."""
    if not tasks or min(tasks) < 1:
        raise UserError("tasks must be a non-empty list of node counts, each at least 1")
    out = {}
    for policy in POLICIES:
        placed, unplaced = place_hai(network, tasks) if policy == "hai" else place_naive(network, tasks, seed)
        out[policy] = _run(policy, network, node, tasks, placed, unplaced, algo, size_bytes, params)
    return out


def _run(policy: str, network: Network, node: NodeSpec, tasks: list[int], placed: list[Placement | None],
         unplaced: list[int], algo: str, size: int, params: ModelParams | None) -> PolicyResult:
    per_task = []
    total = np.zeros(network.n_links)
    cross_tasks = 0
    for n, pl in zip(tasks, placed):
        if pl is None or n < 2:
            per_task.append(None)
            continue
        src, dst, demand = flows(algo, n, node, pl)
        ll = network.route(pl, src, dst, demand)
        total += ll.loads
        pairs = {tuple(sorted((int(a), int(b)))) for a, b in zip(src, dst) if pl.zone[a] != pl.zone[b]}
        cross_tasks += pl.zones_used > 1
        per_task.append((pl, ll.loads > 0, len(pairs)))
    mask = network.bridge_mask()
    results = []
    for n, item in zip(tasks, per_task):
        if item is None:
            continue
        pl, used, pairs = item
        busiest = float(total[used].max()) if used.any() else 0.0
        extra = {"network links (shared)": network.link_gb_s / busiest} if busiest > 0 else {}
        r = allreduce(algo, n * node.gpus, size, node, placement=pl, params=params, extra_caps=extra)
        results.append(TaskResult(nodes=n, zones=pl.zones_used, cross_zone_pairs=pairs, result=r))
    bridge = total[mask]
    return PolicyResult(policy=policy, tasks=results, unplaced=unplaced, cross_zone_tasks=int(cross_tasks),
                        max_bridge_load=float(bridge.max()) if bridge.size else 0.0,
                        bridge_traffic=float(bridge.sum()) / 2.0)


def render(results: dict[str, PolicyResult]) -> str:
    lines = ["policy  tasks  cross-zone tasks  max bridge load  zone-crossing traffic  mean algbw  slowest allreduce"]
    for name, r in results.items():
        lines.append(f"{name:<6}  {len(r.tasks):>5}  {r.cross_zone_tasks:>16}  {r.max_bridge_load:>15.1f}  "
                     f"{r.bridge_traffic:>21.1f}  {r.mean_algbw_gb_s:>6.2f} GB/s  {r.slowest_seconds * 1000:>14.1f} ms")
    return "\n".join(lines)
