"""A day on a simulated cluster, scheduled by the real policy or by FIFO: pure, seeded, no clock.

:func:`simulate` steps a cluster of whole nodes through time in fixed steps (one
scheduling cycle per step, 60 s by default) and drives it with one of three policies:

* ``hai``: the platform's own :func:`fireflyer.platform.state.policy.schedule`, with priorities,
  turn-taking and preemption through the suspend handshake. A preempted task holds its
  nodes for ``suspend_s`` while it stops, loses the work done since its last checkpoint
  (one every ``checkpoint_every_s`` of running, as the paper's checkpoint manager does),
  and its chain comes back queued in its old place; each resumed attempt first pays
  ``restart_cost_s`` (start-up and checkpoint load) before it makes progress again.
* ``fifo``: strict submission order, no priorities, no preemption. The head of the
  queue starts when it fits; nothing behind it may pass (head-of-line blocking).
* ``fifo_backfill``: submission order, but any queued task that fits now starts
  (greedy backfill, no reservation for the head; no priorities, no preemption).

Both FIFOs place tasks with the same zone rules as the platform (each start is asked of
``schedule`` with only the running tasks and that one task), so the comparison is about
the queue discipline, not placement.

The workload (:func:`make_workload`) is chosen up front and documented in
:data:`DEFAULT_CLASSES`: a busy day whose offered work about equals the cluster's
capacity. What it measures (:class:`PolicyResult`): node utilisation (node-time held by
tasks over capacity), useful utilisation (less the work lost to preemption, restart
costs and the time suspending tasks hold their nodes), queue wait per priority (submit
to first start), and preemptions.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from fireflyer.platform.state.policy import (
    QUEUED,
    RUNNING,
    SUSPENDING,
    Node,
    PolicyConfig,
    Priority,
    Quotas,
    Task,
    effective_priority,
    schedule,
)
from fireflyer.errors import UserError

POLICIES = ("hai", "fifo", "fifo_backfill")
FINISHED = "finished"


# ---------------------------------------------------------------------- the workload
@dataclass(frozen=True, kw_only=True)
class JobClass:
    """One kind of job in the synthetic day."""

    name: str
    priority: Priority
    count: int
    """How many such jobs arrive over the day."""
    sizes: tuple[int, ...]
    """Node counts, drawn uniformly (repeat a size to weight it)."""
    hours: tuple[float, float]
    """Run time on the nodes (work), log-uniform between these bounds, in hours."""
    arrive: tuple[float, float] = (0.0, 20.0)
    """Arrival window in hours after the day starts (uniform inside it)."""
    bursts: int = 0
    """If positive, arrivals come in this many evenly spaced bursts inside the window, each within 10 minutes."""
    at_start: int = 0
    """Of ``count``, this many are already queued when the day starts (last night's backlog)."""

    def __post_init__(self) -> None:
        if self.count < 0 or not 0 <= self.at_start <= self.count:
            raise UserError(f"job class {self.name}: need 0 <= at_start <= count, got {self.at_start}, {self.count}")
        if not self.sizes or min(self.sizes) < 1:
            raise UserError(f"job class {self.name}: sizes must be positive node counts, got {self.sizes}")
        lo, hi = self.hours
        if not 0 < lo <= hi:
            raise UserError(f"job class {self.name}: hours must be 0 < low <= high, got {self.hours}")
        a, b = self.arrive
        if not 0 <= a <= b:
            raise UserError(f"job class {self.name}: arrive must be 0 <= start <= end hours, got {self.arrive}")
        if self.bursts < 0:
            raise UserError(f"job class {self.name}: bursts must be non-negative, got {self.bursts}")

    def mean_node_hours(self) -> float:
        """Expected node-hours of one job (log-uniform mean times the mean size)."""
        lo, hi = self.hours
        mean_h = lo if hi == lo else (hi - lo) / math.log(hi / lo)
        return mean_h * sum(self.sizes) / len(self.sizes)


P = Priority
DEFAULT_CLASSES: tuple[JobClass, ...] = (
    # Long data-parallel training runs, the bulk of the work; a dozen are queued overnight.
    JobClass(name="training", priority=P.NORMAL, count=44, sizes=(4, 8, 8, 16), hours=(2.0, 10.0), at_start=12),
    # Background work that should only use what is left over.
    JobClass(name="background", priority=P.LOW, count=30, sizes=(1, 2, 4, 8), hours=(1.0, 8.0), at_start=10),
    # A few large runs (a quarter or half of the cluster).
    JobClass(name="large", priority=P.ABOVE_NORMAL, count=3, sizes=(32, 64), hours=(3.0, 6.0)),
    # Researchers' short experiments, in bursts (stand-ups, deadlines).
    JobClass(name="experiments", priority=P.HIGH, count=48, sizes=(1, 2, 4, 8), hours=(1 / 6, 1.0), bursts=8),
    # Urgent evaluations that must run now.
    JobClass(name="urgent", priority=P.VERY_HIGH, count=8, sizes=(8, 16), hours=(0.25, 1.5)),
)
"""The default day on 128 nodes: about 3,100 node-hours offered against 3,072 of capacity."""


@dataclass(frozen=True)
class Job:
    id: int
    """Submission order (1, 2, ...): the chain's place in the queue."""
    kind: str
    user: str
    group: str
    priority: Priority
    nodes: int
    work_s: float
    """Seconds of running it needs to finish."""
    submit_s: float


def make_workload(classes: Sequence[JobClass] = DEFAULT_CLASSES, *, seed: int = 0, users: int = 10,
                  groups: int = 3, max_nodes: int | None = None) -> list[Job]:
    """The day's jobs in submission order. Deterministic for a seed.

    Jobs larger than ``max_nodes`` (the cluster) are clipped to it, so every job can run.
    Users ``u0..`` are drawn uniformly; user ``uK`` is in group ``gK % groups``.
    """
    if users < 1 or groups < 1:
        raise UserError(f"need at least one user and one group, got users={users}, groups={groups}")
    rng = random.Random(seed)
    drafts: list[tuple[float, int, int, Job]] = []
    for ci, jc in enumerate(classes):
        lo_h, hi_h = jc.hours
        a, b = jc.arrive
        for k in range(jc.count):
            if k < jc.at_start:
                at = 0.0
            elif jc.bursts:
                burst = rng.randrange(jc.bursts)
                at = (a + (b - a) * (burst + 0.5) / jc.bursts) * 3600 + rng.uniform(0, 600)
            else:
                at = rng.uniform(a, b) * 3600
            hours = math.exp(rng.uniform(math.log(lo_h), math.log(hi_h)))
            size = rng.choice(jc.sizes)
            if max_nodes is not None:
                size = min(size, max_nodes)
            u = rng.randrange(users)
            drafts.append((at, ci, k, Job(0, jc.name, f"u{u}", f"g{u % groups}", jc.priority, size,
                                          round(hours * 3600.0, 3), round(at, 3))))
    drafts.sort(key=lambda d: d[:3])
    return [Job(i + 1, j.kind, j.user, j.group, j.priority, j.nodes, j.work_s, j.submit_s)
            for i, (_, _, _, j) in enumerate(drafts)]


def offered_node_hours(classes: Sequence[JobClass] = DEFAULT_CLASSES) -> float:
    """Expected node-hours the classes bring in a day."""
    return sum(jc.count * jc.mean_node_hours() for jc in classes)


# ---------------------------------------------------------------------- the simulation
@dataclass(frozen=True, kw_only=True)
class SimConfig:
    nodes: int = 128
    """Whole nodes in the cluster."""
    zones: int = 2
    """Zones the nodes are split into, in order."""
    hours: float = 24.0
    """Simulated time."""
    step_s: float = 60.0
    """Seconds between scheduling cycles (HAI ticks every second; a coarser step is faster to simulate)."""
    checkpoint_every_s: float = 300.0
    """A running task checkpoints after every this many seconds of progress (the paper: every 5 minutes)."""
    restart_cost_s: float = 60.0
    """A resumed attempt spends this long starting and loading its checkpoint before it makes progress."""
    suspend_s: float = 10.0
    """A preempted task holds its nodes this long while it stops (HAI: 5 s to acknowledge, 5 s more to stop)."""
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    """The scheduler's settings under the ``hai`` policy (HAI's: 240 minutes before turn-taking,
    demotion after 30 minutes, one task across zones; no default quota)."""
    record_assignments: bool = False
    """Keep every cycle's node assignment in the result (for tests; memory grows with steps)."""

    def __post_init__(self) -> None:
        if not isinstance(self.nodes, int) or self.nodes < 1:
            raise UserError(f"nodes must be a positive integer, got {self.nodes!r}")
        if not isinstance(self.zones, int) or not 1 <= self.zones <= self.nodes:
            raise UserError(f"zones must be between 1 and nodes ({self.nodes}), got {self.zones!r}")
        if not self.hours > 0 or not self.step_s > 0:
            raise UserError(f"hours and step_s must be positive, got {self.hours}, {self.step_s}")
        if not self.checkpoint_every_s > 0:
            raise UserError(f"checkpoint_every_s must be positive, got {self.checkpoint_every_s}")
        for name in ("restart_cost_s", "suspend_s"):
            if getattr(self, name) < 0:
                raise UserError(f"{name} must be non-negative seconds, got {getattr(self, name)}")
        if not isinstance(self.policy, PolicyConfig):
            raise UserError(f"policy must be a PolicyConfig, got {type(self.policy).__name__}")

    def cluster(self) -> list[Node]:
        width = len(str(self.nodes - 1))
        return [Node(f"n{i:0{width}d}", f"zone{i * self.zones // self.nodes}") for i in range(self.nodes)]


@dataclass(frozen=True)
class Step:
    """One cycle, after its decisions."""

    t: float
    busy: int
    """Nodes held by running or suspending tasks."""
    running: int
    queued: int
    assignments: tuple[tuple[int, tuple[str, ...]], ...] = ()
    """(job id, nodes) for every task holding nodes (only with ``record_assignments``)."""


@dataclass(frozen=True)
class Preemption:
    t: float
    job: int
    priority: Priority
    """The job's priority in that cycle (a long-running ABOVE_NORMAL job's is NORMAL: HAI's demotion)."""
    user: str
    reason: str
    top_queued: Priority | None
    """The highest priority among tasks queued in that cycle."""
    lost_s: float
    """Work since the last checkpoint, thrown away (seconds on each of the job's nodes)."""


@dataclass(frozen=True)
class JobOutcome:
    id: int
    kind: str
    priority: Priority
    nodes: int
    submit_s: float
    first_start_s: float | None
    finish_s: float | None
    attempts: int
    starts: tuple[float, ...]
    """When each attempt started."""


@dataclass(frozen=True)
class WaitStats:
    jobs: int
    started: int
    mean_s: float
    p95_s: float
    max_s: float


@dataclass(frozen=True)
class PolicyResult:
    policy: str
    capacity_node_s: float
    allocated_node_s: float
    lost_node_s: float
    restart_node_s: float
    suspend_node_s: float
    preemptions: int
    jobs: tuple[JobOutcome, ...]
    steps: tuple[Step, ...]
    preemption_events: tuple[Preemption, ...]
    horizon_s: float

    @property
    def useful_node_s(self) -> float:
        return self.allocated_node_s - self.lost_node_s - self.restart_node_s - self.suspend_node_s

    @property
    def utilisation(self) -> float:
        return self.allocated_node_s / self.capacity_node_s

    @property
    def useful_utilisation(self) -> float:
        return self.useful_node_s / self.capacity_node_s

    @property
    def finished(self) -> int:
        return sum(1 for j in self.jobs if j.finish_s is not None)

    def waits(self, priority: Priority | None = None) -> WaitStats:
        """Submit to first start, over jobs submitted within the run.

        A job that never started counts with its wait so far (a lower bound).
        """
        picked = [j for j in self.jobs if (priority is None or j.priority == priority) and j.submit_s < self.horizon_s]
        waits = [(j.first_start_s if j.first_start_s is not None else self.horizon_s) - j.submit_s for j in picked]
        started = sum(1 for j in picked if j.first_start_s is not None)
        if not waits:
            return WaitStats(0, 0, 0.0, 0.0, 0.0)
        return WaitStats(len(waits), started, sum(waits) / len(waits), percentile(waits, 95), max(waits))

    def summary(self) -> dict[str, Any]:
        prios = sorted({j.priority for j in self.jobs}, reverse=True)
        return {
            "policy": self.policy,
            "utilisation": self.utilisation,
            "useful_utilisation": self.useful_utilisation,
            "node_hours": {"capacity": self.capacity_node_s / 3600, "allocated": self.allocated_node_s / 3600,
                           "useful": self.useful_node_s / 3600, "lost_work": self.lost_node_s / 3600,
                           "restart": self.restart_node_s / 3600, "suspending": self.suspend_node_s / 3600},
            "preemptions": self.preemptions,
            "jobs": len(self.jobs), "finished": self.finished,
            "wait_s": {p.name: asdict(self.waits(p)) for p in prios},
            "wait_s_all": asdict(self.waits()),
        }


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile (0 < q <= 100)."""
    if not values:
        raise UserError("percentile of no values")
    s = sorted(values)
    return s[max(0, math.ceil(q / 100 * len(s)) - 1)]


@dataclass
class _Chain:
    """A job's life in the simulation (mutable; internal)."""

    job: Job
    state: str = QUEUED
    attempt_id: int = 0
    attempts: int = 0
    assigned: tuple[str, ...] = ()
    work: float = 0.0
    """Progress so far, in seconds of running."""
    saved: float = 0.0
    """Progress at the last checkpoint."""
    attempt_base: float = 0.0
    started_at: float = 0.0
    restart_left: float = 0.0
    suspend_until: float = 0.0
    first_start: float | None = None
    finish: float | None = None
    starts: list[float] = field(default_factory=list)

    def policy_task(self, t: float, *, fifo: bool = False) -> Task:
        if fifo:  # one user, one priority: only the queue order is left
            return Task(self.attempt_id, "fifo", self.job.nodes, Priority.NORMAL, "default", self.job.id,
                        self.state, self.assigned, 0.0)
        run = t - self.started_at if self.state != QUEUED else 0.0
        return Task(self.attempt_id, self.job.user, self.job.nodes, self.job.priority, self.job.group, self.job.id,
                    self.state, self.assigned, run)


def simulate(jobs: Sequence[Job], cfg: SimConfig = SimConfig(), policy: str = "hai",
             quotas: Quotas | None = None) -> PolicyResult:
    """Run the cluster through ``cfg.hours`` under ``policy`` (one of :data:`POLICIES`)."""
    if policy not in POLICIES:
        raise UserError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
    too_big = [j.id for j in jobs if j.nodes > cfg.nodes]
    if too_big:
        raise UserError(f"jobs {too_big[:5]} ask for more than the cluster's {cfg.nodes} nodes")
    ids = [j.id for j in jobs]
    if ids != sorted(ids) or len(set(ids)) != len(ids):
        raise UserError("jobs must have unique ids in submission order")
    nodes = cfg.cluster()
    hai_cfg = cfg.policy.for_nodes(len(nodes))
    fifo_cfg = PolicyConfig(time_share_after=math.inf, max_cross_zone=cfg.policy.max_cross_zone, demote_after=None)
    horizon = cfg.hours * 3600.0
    pending = sorted(jobs, key=lambda j: (j.submit_s, j.id))
    next_arrival = 0
    chains: list[_Chain] = []
    by_attempt: dict[int, _Chain] = {}
    next_attempt_id = max(ids, default=0) + 1
    allocated = lost = restart = suspending = 0.0
    steps: list[Step] = []
    events: list[Preemption] = []
    t = 0.0
    while t < horizon - 1e-9:
        dt = min(cfg.step_s, horizon - t)
        # 1. arrivals, and suspended tasks that have stopped: their chains queue again in their old place
        while next_arrival < len(pending) and pending[next_arrival].submit_s <= t:
            job = pending[next_arrival]
            c = _Chain(job, attempt_id=job.id)
            chains.append(c)
            by_attempt[c.attempt_id] = c
            next_arrival += 1
        for c in chains:
            if c.state == SUSPENDING and c.suspend_until <= t + 1e-9:
                del by_attempt[c.attempt_id]
                c.state, c.assigned, c.attempt_id = QUEUED, (), next_attempt_id
                next_attempt_id += 1
                by_attempt[c.attempt_id] = c
        active = [c for c in chains if c.state != FINISHED]
        # 2. decide
        if policy == "hai":
            decisions = schedule(nodes, [c.policy_task(t) for c in active], quotas, hai_cfg)
            starts = [(by_attempt[s.task_id], s.nodes) for s in decisions.starts]
            queued = [c for c in active if c.state == QUEUED]
            top = max((c.job.priority for c in queued), default=None)
            for s in decisions.suspends:
                c = by_attempt[s.task_id]
                if c.state != RUNNING:
                    continue
                thrown = c.work - c.saved
                events.append(Preemption(t, c.job.id, effective_priority(c.policy_task(t), hai_cfg), c.job.user,
                                         s.reason, top, thrown))
                lost += thrown * c.job.nodes
                c.work = c.saved
                c.state, c.suspend_until = SUSPENDING, t + cfg.suspend_s
        else:
            starts = _fifo_starts(nodes, active, t, fifo_cfg, backfill=policy == "fifo_backfill")
        for c, placed in starts:
            c.state, c.assigned, c.started_at = RUNNING, placed, t
            c.attempt_base = c.saved = c.work
            c.restart_left = cfg.restart_cost_s if c.attempts > 0 else 0.0
            c.attempts += 1
            c.starts.append(t)
            if c.first_start is None:
                c.first_start = t
        holding = [c for c in chains if c.state in (RUNNING, SUSPENDING)]
        held = [n for c in holding for n in c.assigned]
        assert len(held) == len(set(held)) <= cfg.nodes, "a node is double-booked"
        steps.append(Step(t, len(held), sum(1 for c in holding if c.state == RUNNING),
                          sum(1 for c in chains if c.state == QUEUED),
                          tuple((c.job.id, c.assigned) for c in holding) if cfg.record_assignments else ()))
        # 3. run the step
        for c in holding:
            n = c.job.nodes
            if c.state == SUSPENDING:
                hold = min(dt, max(0.0, c.suspend_until - t))
                allocated += hold * n
                suspending += hold * n
                continue
            left = dt
            spent_restart = min(left, c.restart_left)
            c.restart_left -= spent_restart
            left -= spent_restart
            restart += spent_restart * n
            need = c.job.work_s - c.work
            run = min(left, need)
            c.work += run
            c.saved = c.attempt_base + math.floor((c.work - c.attempt_base) / cfg.checkpoint_every_s) * \
                cfg.checkpoint_every_s
            allocated += (spent_restart + run) * n
            if run >= need - 1e-9:
                c.work = c.saved = c.job.work_s
                c.state, c.finish, c.assigned = FINISHED, t + spent_restart + run, ()
        t += dt
    outcomes = tuple(JobOutcome(c.job.id, c.job.kind, c.job.priority, c.job.nodes, c.job.submit_s, c.first_start,
                                c.finish, c.attempts, tuple(c.starts)) for c in chains)
    unsubmitted = tuple(JobOutcome(j.id, j.kind, j.priority, j.nodes, j.submit_s, None, None, 0, ())
                        for j in pending[next_arrival:])
    return PolicyResult(policy, cfg.nodes * horizon, allocated, lost, restart, suspending, len(events),
                        tuple(sorted(outcomes + unsubmitted, key=lambda o: o.id)), tuple(steps), tuple(events),
                        horizon)


def _fifo_starts(nodes: list[Node], active: list[_Chain], t: float, cfg: PolicyConfig, *,
                 backfill: bool) -> list[tuple[_Chain, tuple[str, ...]]]:
    """Queued tasks in submission order; each start is asked of the policy with only the running tasks."""
    holding = [c.policy_task(t, fifo=True) for c in active if c.state != QUEUED]
    free = len(nodes) - sum(task.nodes for task in holding)
    out = []
    for c in sorted((c for c in active if c.state == QUEUED), key=lambda c: c.job.id):
        placed = None
        if c.job.nodes <= free:
            d = schedule(nodes, holding + [c.policy_task(t, fifo=True)], None, cfg)
            placed = d.starts[0].nodes if d.starts else None
        if placed is None:
            if backfill:
                continue
            break  # head-of-line blocking: nothing passes the head
        out.append((c, placed))
        holding.append(Task(c.attempt_id, "fifo", c.job.nodes, Priority.NORMAL, "default", c.job.id, RUNNING, placed))
        free -= c.job.nodes
    return out


def compare(jobs: Sequence[Job], cfg: SimConfig = SimConfig(), policies: Sequence[str] = POLICIES,
            quotas: Quotas | None = None) -> dict[str, PolicyResult]:
    """The same day under each policy."""
    return {p: simulate(jobs, cfg, p, quotas) for p in policies}
