"""The scheduler's policy: pure, no I/O, no clock. A snapshot in, decisions out.

One cycle decides, for a cluster of whole nodes and a queue of tasks, which queued tasks
start (and on which nodes), which running tasks must be suspended, and why the rest
wait. The rules follow HAI Platform's:

* **Whole nodes, all or nothing.** A task asks for N nodes and gets all N at once, or none.
* **Priority first**, high to low (HAI's levels, :class:`Priority`).
* **Chains keep their place.** A suspended task comes back as a new attempt of the same
  chain, ordered by the chain's first submission, so preemption never sends it to the back.
* **Quotas** cap the nodes a user may hold at once per (group, priority); a user's own
  row overrides the ``public`` row. A user with neither holds ``default_quota`` nodes
  for sure; beyond it their tasks only borrow: they come after every other task of
  their priority, so they run on nodes no one else there is waiting for and are the
  first suspended when someone is.
* **Demotion**: a running ABOVE_NORMAL attempt counts as NORMAL after ``demote_after``
  (HAI: 30 minutes), so a new ABOVE_NORMAL task may take its nodes.
* **Turn-taking** among users at the same priority: a running task is safe from
  other tasks of its priority until it has run ``time_share_after`` seconds; after
  that, a user holding fewer nodes at that priority goes ahead of it. A task is never
  interrupted for another task of the same user at the same priority.
* **Preemption** of lower priorities goes through the suspend handshake: this module
  only says which tasks to suspend; their nodes are free once they have stopped.
* **Zones.** A task stays inside one zone when it fits (best fit). At most
  ``max_cross_zone`` tasks may span zones, and such a task's nodes are ordered so only
  one neighbouring pair of ranks crosses between zones.
* Drained or unhealthy nodes are never used.
* **Fault-tolerant tasks** (each node a replica) are not suspended for a drained or failed
  node while another of their nodes is usable: they go on without it, and at their place in
  the order take free nodes for the replicas they miss (never preempting anyone for them).
  Only a task that lost every node is suspended.

Everything is plain data; a cycle over 10,000 tasks and 1,250 nodes is a sort and a scan.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field, replace
from enum import IntEnum
from typing import Callable, Iterable, Mapping, Sequence
from fireflyer.errors import UserError


class Priority(IntEnum):
    """HAI Platform's priority levels."""

    LOW = 0
    BELOW_NORMAL = 5
    UNDER_NORMAL = 8
    NORMAL = 10
    ABOVE_NORMAL = 20
    HIGH = 30
    VERY_HIGH = 40
    EXTREME_HIGH = 50

    @classmethod
    def parse(cls, value: "str | int | Priority") -> "Priority":
        if isinstance(value, Priority):
            return value
        if isinstance(value, int) or (isinstance(value, str) and value.lstrip("-").isdigit()):
            try:
                return cls(int(value))
            except ValueError:
                pass
        else:
            try:
                return cls[str(value).upper().replace("-", "_")]
            except KeyError:
                pass
        raise UserError(f"unknown priority {value!r}; choose one of "
                         f"{', '.join(f'{p.name} ({p.value})' for p in cls)}")


@dataclass(frozen=True)
class Node:
    name: str
    zone: str = "zone0"
    healthy: bool = True
    drained: bool = False

    @property
    def usable(self) -> bool:
        return self.healthy and not self.drained


QUEUED, RUNNING, SUSPENDING = "queued", "running", "suspending"


@dataclass(frozen=True)
class Task:
    """One attempt of a chain, as the policy sees it."""

    id: int
    user: str
    nodes: int
    priority: Priority = Priority.NORMAL
    group: str = "default"
    chain_first_id: int | None = None
    """The first id of the task's chain: its place in the queue. Defaults to ``id``."""
    state: str = QUEUED
    assigned: tuple[str, ...] = ()
    run_seconds: float = 0.0
    """How long a running task has run in this attempt."""
    fault_tolerant: bool = False
    """Each node a replica: a running task short of ``nodes`` (a node lost) is granted free ones."""
    lost: tuple[str, ...] = ()
    """Nodes a fault-tolerant attempt lost: granted to it again only when no other node is free."""

    @property
    def order(self) -> int:
        return self.id if self.chain_first_id is None else self.chain_first_id


@dataclass(frozen=True, kw_only=True)
class PolicyConfig:
    time_share_after: float = 240 * 60.0
    """Seconds a running task is safe from tasks of its own priority (HAI: 240 minutes)."""
    max_cross_zone: int = 1
    """Tasks that may span zones at once."""
    default_quota: int | str | None = None
    """Nodes a user without a quota row (their own or ``public``) holds for sure per (group, priority);
    their tasks beyond it borrow idle nodes and give them back first. ``"half"``: half the cluster's
    nodes, rounded up (:meth:`for_nodes`); None: no default, no borrowing."""
    demote_after: float | None = 30 * 60.0
    """Seconds after which a running ABOVE_NORMAL attempt counts as NORMAL (HAI's rule); None: never."""

    def __post_init__(self) -> None:
        if self.time_share_after < 0:
            raise UserError(f"time_share_after must be non-negative seconds, got {self.time_share_after}")
        if self.max_cross_zone < 0:
            raise UserError(f"max_cross_zone must be non-negative, got {self.max_cross_zone}")
        if self.demote_after is not None and self.demote_after < 0:
            raise UserError(f"demote_after must be non-negative seconds or None, got {self.demote_after}")
        quota = self.default_quota
        if quota not in (None, "half") and (type(quota) is not int or quota < 0):
            raise UserError(f"default_quota must be a node count, 'half' or none (no default), got {quota!r}")

    def for_nodes(self, nodes: int) -> "PolicyConfig":
        """These settings on a cluster of ``nodes`` nodes: a ``"half"`` default quota made a node count."""
        if self.default_quota != "half":
            return self
        return replace(self, default_quota=-(-nodes // 2))


@dataclass(frozen=True)
class Start:
    task_id: int
    nodes: tuple[str, ...]


@dataclass(frozen=True)
class Suspend:
    task_id: int
    reason: str


@dataclass
class Decisions:
    starts: list[Start] = field(default_factory=list)
    suspends: list[Suspend] = field(default_factory=list)
    waiting: dict[int, str] = field(default_factory=dict)
    """Queued tasks that stay queued, with the reason."""
    grants: list[Start] = field(default_factory=list)
    """Free nodes a running fault-tolerant task may take for the replicas it lost."""


Quotas = Mapping[tuple[str, str, Priority], int]
"""(user, group, priority) -> nodes; the user ``public`` is everyone's default."""


def _quota(quotas: Quotas, user: str, group: str, priority: Priority) -> int | None:
    """The quota row that limits the user (their own, else ``public``), or None."""
    for who in (user, "public"):
        q = quotas.get((who, group, priority))
        if q is not None:
            return q
    return None


def borrowing(tasks: Sequence[Task], quotas: Quotas, cfg: PolicyConfig) -> set[int]:
    """The tasks beyond their user's default quota, counting each user's tasks in ``tasks``' order.

    Only users without a quota row for the task's (group, priority) have a default quota;
    a row is a hard limit instead. Suspending tasks are on their way out and do not count.
    Tasks count at the priority they claim nodes at (:func:`effective_priority`), so a user's
    running task is counted before their queued ones and never gives way to them.
    """
    if cfg.default_quota is None:
        return set()
    held: dict[tuple[str, str, Priority], int] = defaultdict(int)
    out = set()
    for t in tasks:
        if t.state == SUSPENDING or _quota(quotas, t.user, t.group, t.priority) is not None:
            continue
        key = (t.user, t.group, effective_priority(t, cfg))
        held[key] += t.nodes
        if held[key] > cfg.default_quota:
            out.add(t.id)
    return out


def effective_priority(task: Task, cfg: PolicyConfig) -> Priority:
    """The priority a task claims nodes at: ABOVE_NORMAL drops to NORMAL once it has run ``demote_after``."""
    if (task.priority == Priority.ABOVE_NORMAL and task.state != QUEUED and cfg.demote_after is not None
            and task.run_seconds >= cfg.demote_after):
        return Priority.NORMAL
    return task.priority


def _protected(task: Task, cfg: PolicyConfig) -> bool:
    return task.state != QUEUED and task.run_seconds < cfg.time_share_after


def order_tasks(tasks: Sequence[Task], cfg: PolicyConfig, quotas: Quotas | None = None) -> list[Task]:
    """The order in which tasks claim capacity: priority, then protection, then turns, then queue position.

    Within a priority, running tasks still inside their time-share window come first;
    then everyone else, users holding fewer nodes at that priority first (so users take
    turns), each user's tasks in queue order, and a user's running tasks before that
    user's queued ones (never interrupted for the same user at the same priority).
    Tasks beyond their user's default quota (:func:`borrowing`) come last in their priority.
    """
    return _order(tasks, cfg, quotas or {})[0]


def _order(tasks: Sequence[Task], cfg: PolicyConfig, quotas: Quotas) -> tuple[list[Task], set[int]]:
    """:func:`order_tasks`, and the ids of the borrowing tasks."""
    prio = {t.id: effective_priority(t, cfg) for t in tasks}
    held: dict[tuple[str, Priority], int] = defaultdict(int)
    for t in tasks:
        if t.state != QUEUED:
            held[(t.user, prio[t.id])] += t.nodes
    order = sorted(tasks, key=lambda t: (
        -int(prio[t.id]),
        0 if _protected(t, cfg) else 1,
        held[(t.user, prio[t.id])] if not _protected(t, cfg) else 0,
        t.user if not _protected(t, cfg) else "",
        0 if t.state != QUEUED else 1,
        t.order,
        t.id,
    ))
    lent = borrowing(order, quotas, cfg)
    if lent:  # a stable sort: the borrowers keep their order among themselves
        order.sort(key=lambda t: (-int(prio[t.id]), t.id in lent))
    return order, lent


def schedule(nodes: Iterable[Node], tasks: Iterable[Task], quotas: Quotas | None = None,
             cfg: PolicyConfig | None = None) -> Decisions:
    """One scheduling cycle.

    Tasks claim real nodes in :func:`order_tasks` order, so zones count from the start: a
    running task keeps its nodes if no task before it claimed one of them (else it is
    suspended); a queued task claims nodes by :func:`_claim`, free ones first, then ones
    of tasks already on their way out, then those of the running tasks latest in the
    order, which are then preempted. A queued task starts once all its nodes are free.
    """
    quotas = quotas or {}
    node_list = list(nodes)
    cfg = (cfg or PolicyConfig()).for_nodes(len(node_list))
    zone_of = {n.name: n.zone for n in node_list}
    usable = {n.name for n in node_list if n.usable}
    tasks = list(tasks)
    order, lent = _order(tasks, cfg, quotas)
    out = Decisions()

    # Who holds each node now, and how dear it is to take: free 0, leaving 1, else later in the order is cheaper.
    owner: dict[str, Task] = {n: t for t in tasks if t.state != QUEUED for n in t.assigned}
    def kept(t: Task) -> tuple[str, ...]:
        """The nodes a running task goes on with: all of them, or a fault-tolerant task's usable ones."""
        return tuple(n for n in t.assigned if n in usable) if t.fault_tolerant else t.assigned

    leaving = {t.id for t in tasks if t.state == SUSPENDING or
               (t.state == RUNNING and (not kept(t) or any(n not in usable for n in kept(t))))}
    place_in_order = {t.id: i for i, t in enumerate(order)}

    def price(name: str) -> int:
        t = owner.get(name)
        if t is None:
            return 0
        return 1 if t.id in leaving else 2 + len(order) - place_in_order[t.id]

    claimed: set[str] = set()
    pool = _Pool({n: zone_of[n] for n in usable}, price, claimed)
    cross_used = 0
    used: dict[tuple[str, str, Priority], int] = defaultdict(int)
    claims: dict[int, tuple[str, ...]] = {}
    # A queued task that cannot be placed blocks later queued tasks of its own priority, so a big
    # task is not starved by smaller ones behind it. Lower priorities may use the gap: they are
    # preempted once the big one fits.
    blocked: set[Priority] = set()
    for t in order:
        if t.state == SUSPENDING:
            continue  # already on its way out; its nodes free up when it stops
        if t.state == RUNNING and t.id in leaving:
            out.suspends.append(Suspend(t.id, "a node it runs on was drained or failed"))
            continue
        q = _quota(quotas, t.user, t.group, t.priority)
        key = (t.user, t.group, t.priority)
        if q is not None and used[key] + t.nodes > q:
            if t.state == QUEUED:
                out.waiting[t.id] = f"over quota: {t.user} may hold {q} node(s) at {t.priority.name} in {t.group}"
            else:
                out.suspends.append(Suspend(t.id, "over quota"))
            continue
        if t.nodes > len(usable):
            if t.state == QUEUED:
                out.waiting[t.id] = f"asks for {t.nodes} nodes; {len(usable)} are usable"
            continue
        if t.state == RUNNING:
            mine = kept(t)
            crosses = len({zone_of.get(n) for n in mine}) > 1
            if claimed.isdisjoint(mine) and (not crosses or cross_used < cfg.max_cross_zone):
                pool.take(mine)
                used[key] += t.nodes
                cross_used += crosses
                if t.fault_tolerant and len(mine) < t.nodes:
                    free = pool.free(t.nodes - len(mine), near={zone_of[n] for n in mine}, last=set(t.lost))
                    if free:
                        pool.take(free)
                        out.grants.append(Start(t.id, free))
            elif t.id in lent:
                out.suspends.append(Suspend(t.id, f"beyond {t.user}'s default quota of {cfg.default_quota} node(s): "
                                                  "another task needs the nodes it borrowed"))
            else:
                out.suspends.append(Suspend(t.id, "preempted by a task of higher priority or a user's turn"))
            continue
        if t.priority in blocked:
            out.waiting[t.id] = "waiting behind an earlier task of its priority"
            continue
        placed = pool.claim(t.nodes, allow_cross=cross_used < cfg.max_cross_zone)
        if placed is None:
            blocked.add(t.priority)
            out.waiting[t.id] = "waiting for nodes" if t.id not in lent else \
                f"waiting for idle nodes: beyond {cfg.default_quota} node(s) (the default quota) {t.user} only borrows"
            continue
        pool.take(placed)
        used[key] += t.nodes
        cross_used += len({zone_of[n] for n in placed}) > 1
        claims[t.id] = placed

    # Start what may start on nodes that are free now; the rest wait for preempted tasks to stop.
    for t in order:
        placed = claims.get(t.id)
        if placed is None:
            continue
        if any(n in owner for n in placed):
            out.waiting[t.id] = "waiting for preempted or finishing tasks to free their nodes"
        else:
            out.starts.append(Start(t.id, placed))
    return out


def _cost(picked: list[tuple[int, str]]) -> tuple[int, ...]:
    """Dearest first, so one task of a higher priority outweighs any number of lower ones."""
    return tuple(sorted((p for p, _ in picked), reverse=True))


class _Pool:
    """The nodes not yet claimed this cycle, per zone, cheapest first (sorted once per cycle)."""

    def __init__(self, zone_of: Mapping[str, str], price: Callable[[str], int], claimed: set[str]) -> None:
        by_zone: dict[str, list[tuple[int, str]]] = defaultdict(list)
        for name, zone in zone_of.items():
            by_zone[zone].append((price(name), name))
        self.zones = {z: sorted(pairs) for z, pairs in by_zone.items()}
        self.left = {z: len(pairs) for z, pairs in self.zones.items()}
        self.zone_of = zone_of
        self.claimed = claimed

    def take(self, names: Iterable[str]) -> None:
        for name in names:
            if name not in self.claimed and name in self.zone_of:
                self.claimed.add(name)
                self.left[self.zone_of[name]] -= 1

    def _cheapest(self, zone: str, count: int) -> list[tuple[int, str]]:
        pairs = self.zones[zone]
        if len(pairs) > 2 * self.left[zone] + 8:  # drop claimed entries now and then: amortised O(1)
            pairs = self.zones[zone] = [p for p in pairs if p[1] not in self.claimed]
        picked = []
        for pair in pairs:
            if pair[1] not in self.claimed:
                picked.append(pair)
                if len(picked) == count:
                    break
        return picked

    def free(self, count: int, *, near: set[str], last: set[str]) -> tuple[str, ...]:
        """Up to ``count`` unclaimed nodes that no task holds: those in the zones ``near`` first, ``last`` last."""
        found = sorted((name in last, zone not in near, name) for zone, pairs in self.zones.items()
                       for price, name in pairs if price == 0 and name not in self.claimed)
        return tuple(found[i][2] for i in range(min(count, len(found))))

    def claim(self, count: int, *, allow_cross: bool) -> tuple[str, ...] | None:
        """The cheapest ``count`` nodes in one zone (the fullest such zone among equals); else, if
        allowed, the cheapest ``count`` across two zones, ordered so one rank pair crosses.

        A node's price is 0 when free, more when its task would have to go, so tasks are
        preempted only when free nodes do not suffice, and then those latest in the order.
        """
        fitting = []
        for zone, left in self.left.items():
            if left >= count:
                picked = self._cheapest(zone, count)
                fitting.append((_cost(picked), left, zone, picked))
        if fitting:
            picked = min(fitting)[3]
            return tuple(sorted(n for _, n in picked))
        if not allow_cross or sum(self.left.values()) < count:
            return None
        best = None
        zones = sorted(z for z, left in self.left.items() if left)
        for i, a in enumerate(zones):  # only two zones may be joined, so only one pair crosses
            for b in zones[i + 1:]:
                if self.left[a] + self.left[b] < count:
                    continue
                both = sorted(self._cheapest(a, count) + self._cheapest(b, count))[:count]
                cost = _cost(both)
                if best is None or cost < best[0]:
                    best = (cost, a, both)
        if best is None:
            return None
        _, a, both = best
        return tuple(sorted(n for _, n in both if self.zone_of[n] == a)) + \
            tuple(sorted(n for _, n in both if self.zone_of[n] != a))
