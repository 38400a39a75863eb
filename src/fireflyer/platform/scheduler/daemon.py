"""The scheduler daemon: every ``tick`` seconds, watch, decide, act.

One cycle:

1. **Watch** the running attempts. An attempt whose supervisor wrote ``status.json`` is
   finished in the store with that stop code; a failed one is restarted (its chain gets
   a new attempt that resumes from the task's own checkpoint) until ``max_restarts``;
   nodes whose health check failed are drained. A supervisor that vanished without a
   status is a lost attempt: its ranks are killed and the chain restarts. Requests the
   store holds (a user's stop, a suspend) are passed on as control files.
2. **Decide** with the pure policy (:func:`fireflyer.platform.state.policy.schedule`).
3. **Act**: record the decisions in one transaction, then launch the started attempts.

All state is in SQLite, so the daemon can be killed with -9 at any moment: running
attempts keep running (their supervisors are detached), and the next daemon adopts
them. Only one daemon runs per home (an exclusive lock on ``daemon.pid``, :mod:`.pidlock`).

Beside it in this room: :mod:`.reports` reads what an attempt's supervisor leaves behind, :mod:`.health`
says whether the cycles do their work (the heartbeat, the disks), and :mod:`.service` runs the cycles as
the daemon's process.
"""


from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass, field

from fireflyer.platform.config import PlatformConfig
from fireflyer.platform.executors.base import Executor, Launch
from fireflyer.platform.accounts import AccountProblem, run_as
from fireflyer.platform.layout import AttemptDir, Home, open_runs_dir
from fireflyer.platform.scheduler.health import low_space, unwritable
from fireflyer.platform.scheduler.reports import MAX_DETAIL, last_log_line, read_status, replica_records, timestamp
from fireflyer.platform.state.policy import RUNNING, SUSPENDING, schedule
from fireflyer.platform.state.store import STORAGE_ERRNOS, ReplicaRow, Store, StopCode, StoreUnavailable, TaskRow
from fireflyer.ports import free_port

log = logging.getLogger("fireflyer.platform")
NODE_SYNC_S = 10.0
"""How often the daemon re-reads node health from Slurm (slurm executor)."""


def make_executor(cfg: PlatformConfig) -> Executor:
    if cfg.executor == "slurm":
        from fireflyer.platform.executors.slurm import SlurmExecutor

        return SlurmExecutor(partition=cfg.partition)
    from fireflyer.platform.executors.local import LocalExecutor

    return LocalExecutor()


@dataclass
class Cycle:
    """What one tick did (for logs, tests and the benchmark)."""

    finished: list[tuple[int, str]] = field(default_factory=list)
    started: list[int] = field(default_factory=list)
    suspending: list[int] = field(default_factory=list)
    decide_s: float = 0.0
    problems: list[str] = field(default_factory=list)
    """Storage faults the cycle met and went on past (a control file it could not write, a full disk)."""


class Daemon:
    def __init__(self, home: Home, cfg: PlatformConfig, executor: Executor | None = None,
                 store: Store | None = None) -> None:
        self.home, self.cfg = home, cfg
        self.store = store or Store(home.db)
        self.executor = executor or make_executor(cfg)
        self._node_sync_at = 0.0
        self._told_waiting: set[tuple[int, int, int]] = set()
        """Lost replicas already noted as waiting for a free node (once each)."""
        self._unrecorded: dict[int, tuple] = {}
        """Attempts whose end is known but the store could not take yet: task id -> _finish's arguments."""

    def _sync_slurm_nodes(self, now: float) -> None:
        """Slurm is the source of truth for node health: a node it marks DOWN or DRAIN is not used."""
        if self.cfg.executor != "slurm" or now - self._node_sync_at < NODE_SYNC_S:
            return
        from fireflyer.platform.executors.slurm import slurm_nodes

        self._node_sync_at = now
        changed = self.store.sync_nodes(slurm_nodes(self.cfg.partition), reason="down or drained in Slurm")
        if changed:
            log.info("nodes changed in Slurm: %s", ", ".join(changed))

    def _drain(self, node: str, reason: str) -> None:
        self.store.set_drained(node, True, reason=reason)
        if self.cfg.executor == "slurm":
            from fireflyer.platform.executors import slurm

            try:
                slurm.drain(node, reason)
            except (RuntimeError, OSError) as exc:
                log.warning("could not drain %s in Slurm: %s", node, exc)

    # ------------------------------------------------------------------ 1. watch
    def _finish(self, t: TaskRow, code: StopCode, detail: str, *, life: int | None = None,
                failed_nodes: tuple[str, ...] = (), restart: bool = True) -> int | None:
        adir = self.home.attempt(t.id)
        if code & (StopCode.FAILED | StopCode.INIT_FAILED) and not adir.status.exists():
            problem = unwritable(adir.root)
            if problem:  # its supervisor (or its launch) may have failed for want of space: not the task's fault
                code, restart = StopCode.UNSCHEDULABLE, True
                detail += f"; its end could not be recorded ({problem}): requeued, not counted as a failure"
        self._unrecorded[t.id] = (code, detail, life, failed_nodes, restart)  # until the store has it
        for node in failed_nodes:
            self._drain(node, f"failed its health check in task {t.id}")
            self.store.event(t.id, "drained", node)
            log.warning("task %s: drained %s (%s)", t.id, node, detail)
        if t.stop_requested:
            code |= StopCode.MANUAL_STOP
        elif not restart:
            detail += "; not restarted (an admin must fix this first)"
        elif code & (StopCode.FAILED | StopCode.INIT_FAILED) and not code & StopCode.HOOK_RESTART:
            failures = sum(1 for a in self.store.chain(t.chain_first_id)
                           if a.id != t.id and a.stop_code & (StopCode.FAILED | StopCode.INIT_FAILED))
            if failures < self.cfg.max_restarts:
                code |= StopCode.HOOK_RESTART
                detail += f"; restart {failures + 1} of {self.cfg.max_restarts}"
            else:
                detail += f"; no restarts left ({self.cfg.max_restarts} used)"
        new = self.store.finish(t.id, code, detail=detail, whole_life_state=life)
        del self._unrecorded[t.id]
        log.info("task %s finished: %s %s%s", t.id, StopCode(code), detail,
                 f"; chain continues as task {new}" if new else "")
        return new

    def _watch(self, t: TaskRow, now: float, cycle: Cycle) -> None:
        adir = self.home.attempt(t.id)
        handle = t.handle
        if handle is None:  # launched, or not, just before a crash
            handle = self.executor.find(t.id, str(adir.root))
            if handle is None:
                self._finish(t, StopCode.UNSCHEDULABLE, "the scheduler stopped before the attempt was launched")
                cycle.finished.append((t.id, "lost before launch"))
                return
            self.store.set_handle(t.id, handle)
        status = read_status(adir)
        if t.fault_tolerant:
            self._watch_replicas(t, adir)
        if status is None:
            if t.stop_requested:
                adir.raise_flag("stop", "by its user")
            if t.state == SUSPENDING:
                adir.raise_flag("suspend", "by its user" if t.hold else "preempted by the scheduler")
            if self.executor.alive(handle):
                if not adir.supervisor.exists() and t.started_at is not None and \
                        now - t.started_at > self.cfg.timeouts.unschedulable:
                    self.executor.kill(handle)
                    self._finish(t, StopCode.UNSCHEDULABLE,
                                 f"did not start within {self.cfg.timeouts.unschedulable:g} s")
                    cycle.finished.append((t.id, "unschedulable"))
                return
            status = read_status(adir)  # it may have ended between the two looks
        if status is None:
            self.executor.kill(handle)
            last = last_log_line(adir)
            self._finish(t, StopCode.FAILED, "its supervisor ended without a status (killed, or its host failed)"
                         + (f"; its log ends: {last}" if last else ""))
            cycle.finished.append((t.id, "lost"))
            return
        self.executor.kill(handle)  # the supervisor has stopped every rank; this reaps and makes sure
        code, detail, failed_nodes = StopCode(status["stop_code"]), status["detail"], status["failed_nodes"]
        if failed_nodes and adir.owner != os.geteuid():
            # The supervisor ran as the task's account, which could have written any status:
            # it may end its own task as it likes, but not drain nodes other users need.
            code = (code & ~StopCode.HOOK_RESTART) | StopCode.FAILED
            detail += (f"; {', '.join(failed_nodes)} not drained: the report came from the task's own account "
                       "(Slurm's health check, or an admin, drains nodes)")
            failed_nodes = ()
        self._finish(t, code, detail, life=status["whole_life_state"], failed_nodes=failed_nodes)
        cycle.finished.append((t.id, detail))

    def _watch_replicas(self, t: TaskRow, adir: AttemptDir) -> None:
        """A fault-tolerant attempt: record what its supervisor says of its replicas (started, done, lost, a
        granted node that failed its check, which is drained), and ask it to stop a replica whose node was drained."""
        try:
            data = adir.read_json(adir.root / "replicas.json", limit=1 << 20)
        except (OSError, ValueError):
            return
        if not isinstance(data, dict):
            return
        rows = {(r.slot, r.start): r for r in self.store.replicas(t.id)}
        nodes = {n.name: n for n in self.store.nodes()}
        for rep in replica_records(data.get("replicas")):
            row = rows.get((rep["slot"], rep["start"]))
            if row is None or row.node != rep["node"]:
                continue  # only the daemon starts replicas: a record it does not know is ignored
            state, detail = rep["state"], rep["detail"][:MAX_DETAIL]
            if state == "running" and row.state == "starting":
                self.store.replica_state(t.id, row.slot, row.start, "running", at=timestamp(rep.get("started_at")))
            elif state == "done" and row.state != "done":
                self.store.replica_state(t.id, row.slot, row.start, "done", at=timestamp(rep.get("ended_at")))
            elif state == "lost" and row.state != "lost":
                self.store.lose_replica(t.id, row.slot, row.start, detail or "lost")
                log.warning("task %s: replica %s on %s lost: %s", t.id, row.slot, row.node, detail)
            node = nodes.get(row.node)
            if state == "running" and node is not None and not node.usable:
                why = self.store.node_reasons().get(row.node) or "drained"
                adir.raise_flag(f"release.{row.slot}", f"its node {row.node} was drained ({why})")
        for rej in replica_records(data.get("rejected")):
            row = rows.get((rep_slot := rej["slot"], rej["start"]))
            if row is None or row.node != rej["node"] or row.state == "lost":
                continue
            if adir.owner == os.geteuid():  # as for any health check: never on the word of the task's own account
                self._drain(row.node, f"failed its health check in task {t.id}")
                self.store.event(t.id, "drained", row.node)
            self.store.lose_replica(t.id, rep_slot, row.start, rej["detail"][:MAX_DETAIL] or "failed its health check")

    def _grant(self, grants: list, now: float) -> None:
        """Start lost replicas of fault-tolerant attempts on the free nodes the policy granted them."""
        granted = set()
        for g in grants:
            t = self.store.task(g.task_id)
            if t.state != RUNNING:
                continue
            granted.add(t.id)
            latest: dict[int, ReplicaRow] = {}
            for row in self.store.replicas(t.id):
                latest[row.slot] = row
            lost = [row for row in latest.values() if row.state == "lost"]
            for row, node in zip(lost, g.nodes):
                start = self.store.grant_replica(t.id, row.slot, node, row.node, now=now)
                self.home.attempt(t.id).raise_flag(f"replace.{row.slot}.{start}", node)
                log.info("task %s: replica %s lost on %s, starting on %s", t.id, row.slot, row.node, node)
        for t in self.store.tasks((RUNNING,)):
            if not t.fault_tolerant or t.id in granted:
                continue
            for row in self.store.replicas(t.id):
                key = (t.id, row.slot, row.start)
                if row.state == "lost" and key not in self._told_waiting and not any(
                        r.slot == row.slot and r.start > row.start for r in self.store.replicas(t.id)):
                    self._told_waiting.add(key)
                    self.store.event(t.id, "replica waiting", f"replica {row.slot}: no healthy free node; going on "
                                                              "without it until one is free")

    def _lost_nodes(self, task_id: int) -> tuple[str, ...]:
        return tuple(r.node for r in self.store.replicas(task_id) if r.state == "lost")

    # ------------------------------------------------------------------ 3. act
    def _launch(self, task_id: int) -> None:
        t = self.store.task(task_id)
        adir = self.home.attempt(t.id)
        try:
            account = run_as(t.user, self.store.unix_accounts(), isolate=self.cfg.isolate,
                             allow_root=self.cfg.allow_root_tasks)
            if account is not None:
                self._check_runs_dir()
        except (AccountProblem, OSError) as exc:
            self._finish(t, StopCode.FAILED | StopCode.INIT_FAILED, f"could not launch: {exc}", restart=False)
            return
        launch = Launch(task_id=t.id, chain_id=t.chain_first_id, attempt=t.attempt, name=t.name, user=t.user,
                        command=tuple(t.command), nodes=t.assigned, ranks_per_node=t.ranks_per_node,
                        master_port=free_port(), cwd=t.cwd or (account.home if account else os.getcwd()),
                        env=t.env, whole_life_state=t.whole_life_state, timeouts=self.cfg.timeouts,
                        prolog=self.cfg.prolog, account=None if account is None else account.to_json(),
                        fault_tolerant=t.fault_tolerant)
        try:
            adir.prepare(launch.to_json(), *((account.uid, account.gid) if account else ()))
            handle = self.executor.launch(launch, str(adir.root))
        except (OSError, RuntimeError, ValueError) as exc:
            self._finish(t, StopCode.FAILED | StopCode.INIT_FAILED, f"could not launch: {exc}")
            return
        self.store.set_handle(t.id, handle)
        log.info("task %s (%s, attempt %s) launched on %s%s: %s", t.id, t.name, t.attempt, " ".join(t.assigned),
                 f" as {account.name}" if account else "", handle)

    def _check_runs_dir(self) -> None:
        """An isolating platform's attempts must live where their accounts can reach them, outside the home."""
        runs, home = self.home.runs.resolve(), self.home.root.resolve()
        if runs == home or home in runs.parents:
            raise AccountProblem(f"tasks run as their owners' accounts, which cannot enter the platform's private "
                                 f"home {home}: set runs_dir to a folder outside it that every user can reach "
                                 "('fireflyer platform start --runs-dir DIR')")
        open_runs_dir(runs)

    def tick(self, now: float | None = None) -> Cycle:
        now = time.time() if now is None else now
        cycle = Cycle()
        # A StoreUnavailable (a full disk) ends the cycle where it is raised: whatever it could not
        # record rolled back, nothing after it is decided or launched, and the next cycle starts again
        # from what the store holds.
        try:
            self._sync_slurm_nodes(now)
        except StoreUnavailable:
            raise
        except (RuntimeError, OSError) as exc:  # the controller is away: keep the last known state
            log.warning("could not read nodes from Slurm: %s", exc)
        running = self.store.tasks((RUNNING, SUSPENDING))
        ids = {t.id for t in running}
        self._unrecorded = {i: end for i, end in self._unrecorded.items() if i in ids}
        for t in running:
            try:
                if t.id in self._unrecorded:  # its end is known: record that, not what its files say now
                    code, detail, life, failed_nodes, restart = self._unrecorded[t.id]
                    self._finish(t, code, detail, life=life, failed_nodes=failed_nodes, restart=restart)
                    cycle.finished.append((t.id, detail))
                else:
                    self._watch(t, now, cycle)
            except StoreUnavailable:
                raise
            except (RuntimeError, OSError) as exc:  # e.g. squeue timed out: look again next cycle
                log.warning("task %s: could not check it this cycle: %s", t.id, exc)
                _note(cycle, exc, f"task {t.id}")
        full = low_space(self.home.root, self.home.runs)
        cycle.problems += full
        t0 = time.perf_counter()
        nodes = self.store.nodes()
        considered = [dataclasses.replace(p, lost=self._lost_nodes(p.id)) if p.fault_tolerant and p.state == RUNNING
                      else p for p in self.store.policy_tasks(now)]
        decisions = schedule(nodes, considered, self.store.quotas(), self.cfg.policy.for_nodes(len(nodes)))
        cycle.decide_s = time.perf_counter() - t0
        if full:  # a new attempt's files would not fit, nor could its end be told: none starts
            decisions.waiting.update((s.task_id, "waiting for free disk space") for s in decisions.starts)
            decisions.starts = []
        started = self.store.apply(decisions, now=time.time())
        cycle.suspending = [s.task_id for s in decisions.suspends]
        for s in decisions.suspends:
            log.info("task %s: suspending (%s)", s.task_id, s.reason)
            try:
                self.home.attempt(s.task_id).raise_flag("suspend", s.reason)
            except OSError as exc:  # recorded as suspending: the next cycle's watch raises the flag again
                _note(cycle, exc, f"task {s.task_id}'s suspend")
                if exc.errno not in STORAGE_ERRNOS:
                    raise
        for task_id in started:
            self._launch(task_id)
        cycle.started = started
        self._grant(decisions.grants, now)
        return cycle


def _note(cycle: Cycle, exc: BaseException, what: str) -> None:
    if isinstance(exc, OSError) and exc.errno in STORAGE_ERRNOS:
        cycle.problems.append(f"{what}: {exc.strerror} ({exc.filename or 'a file'})")
