"""The scheduler's policy: pure, no I/O, no clock. A snapshot in, decisions out.

One cycle decides, for a cluster of whole nodes and a queue of tasks, which queued tasks
start (and on which nodes), which running tasks must be suspended, and why the rest
wait. The rules follow HAI Platform's:

* **Whole nodes, all or nothing.** A task asks for N nodes and gets all N at once, or none.
* **Priority first**, high to low (HAI's levels, :class:`Priority`).
* **Chains keep their place.** A suspended task comes back as a new attempt of the same
  chain, ordered by the chain's first submission, so preemption never sends it to the back.
* **Quotas** cap the nodes a user may hold at once per (group, priority); a user's own
  row overrides the ``public`` row.
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

Everything is plain data; a cycle over 10,000 tasks and 1,250 nodes is a sort and a scan.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Iterable, Mapping, Sequence


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
        raise ValueError(f"unknown priority {value!r}; choose one of "
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

    @property
    def order(self) -> int:
        return self.id if self.chain_first_id is None else self.chain_first_id


@dataclass(frozen=True, kw_only=True)
class PolicyConfig:
    time_share_after: float = 240 * 60.0
    """Seconds a running task is safe from tasks of its own priority (HAI: 240 minutes)."""
    max_cross_zone: int = 1
    """Tasks that may span zones at once."""
    default_quota: int | None = None
    """Nodes a user may hold per (group, priority) without a quota row; None: no limit."""

    def __post_init__(self) -> None:
        if self.time_share_after < 0:
            raise ValueError(f"time_share_after must be non-negative seconds, got {self.time_share_after}")
        if self.max_cross_zone < 0:
            raise ValueError(f"max_cross_zone must be non-negative, got {self.max_cross_zone}")
        if self.default_quota is not None and self.default_quota < 0:
            raise ValueError(f"default_quota must be non-negative or None, got {self.default_quota}")


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


Quotas = Mapping[tuple[str, str, Priority], int]
"""(user, group, priority) -> nodes; the user ``public`` is everyone's default."""


def _quota(quotas: Quotas, user: str, group: str, priority: Priority, default: int | None) -> int | None:
    for who in (user, "public"):
        q = quotas.get((who, group, priority))
        if q is not None:
            return q
    return default


def _protected(task: Task, cfg: PolicyConfig) -> bool:
    return task.state != QUEUED and task.run_seconds < cfg.time_share_after


def order_tasks(tasks: Sequence[Task], cfg: PolicyConfig) -> list[Task]:
    """The order in which tasks claim capacity: priority, then protection, then turns, then queue position.

    Within a priority, running tasks still inside their time-share window come first;
    then everyone else, users holding fewer nodes at that priority first (so users take
    turns), each user's tasks in queue order, and a user's running tasks before that
    user's queued ones (never interrupted for the same user at the same priority).
    """
    held: dict[tuple[str, Priority], int] = defaultdict(int)
    for t in tasks:
        if t.state != QUEUED:
            held[(t.user, t.priority)] += t.nodes
    return sorted(tasks, key=lambda t: (
        -int(t.priority),
        0 if _protected(t, cfg) else 1,
        held[(t.user, t.priority)] if not _protected(t, cfg) else 0,
        t.user if not _protected(t, cfg) else "",
        0 if t.state != QUEUED else 1,
        t.order,
        t.id,
    ))


def schedule(nodes: Iterable[Node], tasks: Iterable[Task], quotas: Quotas | None = None,
             cfg: PolicyConfig | None = None) -> Decisions:
    """One scheduling cycle."""
    cfg = cfg or PolicyConfig()
    quotas = quotas or {}
    node_list = list(nodes)
    by_name = {n.name: n for n in node_list}
    usable = {n.name for n in node_list if n.usable}
    tasks = list(tasks)
    out = Decisions()

    # 1. Who may hold nodes this cycle: claim capacity in order, all-or-nothing, within quota.
    capacity = len(usable)
    used: dict[tuple[str, str, Priority], int] = defaultdict(int)
    can_run: set[int] = set()
    # A queued task that does not fit blocks later queued tasks of its own priority, so a big
    # task is not starved by smaller ones behind it. Lower priorities may use the gap: they are
    # preempted once the big one fits. Tasks later in the order have not claimed capacity yet,
    # so a task that does not fit could not fit by preempting them either.
    blocked: set[Priority] = set()
    for t in order_tasks(tasks, cfg):
        if t.state == SUSPENDING:
            continue  # already on its way out; its nodes free up when it stops
        if t.state == RUNNING and any(n not in usable for n in t.assigned):
            out.suspends.append(Suspend(t.id, "a node it runs on was drained or failed"))
            continue
        q = _quota(quotas, t.user, t.group, t.priority, cfg.default_quota)
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
        if t.nodes <= capacity and not (t.state == QUEUED and t.priority in blocked):
            capacity -= t.nodes
            used[key] += t.nodes
            can_run.add(t.id)
        elif t.state == RUNNING:
            out.suspends.append(Suspend(t.id, "preempted by a task of higher priority or a user's turn"))
        else:
            if t.priority not in blocked:
                blocked.add(t.priority)
                out.waiting[t.id] = "waiting for nodes"
            else:
                out.waiting[t.id] = "waiting behind an earlier task of its priority"

    # 2. Place the tasks that may start on nodes free now; the rest wait for preempted nodes to free up.
    busy = {n for t in tasks if t.state != QUEUED for n in t.assigned}
    free_by_zone: dict[str, list[str]] = defaultdict(list)
    for name in sorted(usable - busy):
        free_by_zone[by_name[name].zone].append(name)
    cross_zone = sum(1 for t in tasks if t.state != QUEUED and len({by_name[n].zone for n in t.assigned
                                                                   if n in by_name}) > 1)
    for t in order_tasks([t for t in tasks if t.state == QUEUED and t.id in can_run], cfg):
        placed = _place(t.nodes, free_by_zone, allow_cross=cross_zone < cfg.max_cross_zone)
        if placed is None:
            out.waiting[t.id] = "waiting for preempted or finishing tasks to free their nodes"
            continue
        if len({by_name[n].zone for n in placed}) > 1:
            cross_zone += 1
        for name in placed:
            free_by_zone[by_name[name].zone].remove(name)
        out.starts.append(Start(t.id, placed))
    return out


def _place(count: int, free_by_zone: dict[str, list[str]], *, allow_cross: bool) -> tuple[str, ...] | None:
    """Best fit inside one zone; else, if allowed, two zones whose node lists meet at one rank pair."""
    fitting = [z for z, free in free_by_zone.items() if len(free) >= count]
    if fitting:
        zone = min(fitting, key=lambda z: (len(free_by_zone[z]), z))
        return tuple(free_by_zone[zone][:count])
    if not allow_cross:
        return None
    zones = sorted(free_by_zone, key=lambda z: (-len(free_by_zone[z]), z))
    if len(zones) < 2 or len(free_by_zone[zones[0]]) + len(free_by_zone[zones[1]]) < count:
        return None  # only two zones may be joined, so only one pair crosses
    first = free_by_zone[zones[0]]
    rest = count - len(first)
    return tuple(first) + tuple(free_by_zone[zones[1]][:rest])
