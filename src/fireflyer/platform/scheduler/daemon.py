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
them. Only one daemon runs per home (an exclusive lock on ``daemon.pid``).
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import os
import secrets
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from fireflyer.errors import FireflyerError, UserError
from fireflyer.fsutil import open_owned, private_dir
from fireflyer.platform import config as platform_config
from fireflyer.platform.config import PlatformConfig
from fireflyer.platform.executors.base import Executor, Launch
from fireflyer.platform.accounts import AccountProblem, run_as
from fireflyer.platform.layout import AttemptDir, Home, open_runs_dir
from fireflyer.platform.state.policy import RUNNING, SUSPENDING, schedule
from fireflyer.platform.state.store import STORAGE_ERRNOS, ReplicaRow, Store, StoreUnavailable, StopCode, TaskRow
from fireflyer.ports import free_port

log = logging.getLogger("fireflyer.platform")
NODE_SYNC_S = 10.0
"""How often the daemon re-reads node health from Slurm (slurm executor)."""
MIN_FREE_BYTES = 1 << 20
"""Below this much free space on the home's or the attempts' disk the daemon reports itself unhealthy:
the next state change, status file or log line may not fit."""


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
            last = _last_line(adir)
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
        for rep in _records(data.get("replicas")):
            row = rows.get((rep["slot"], rep["start"]))
            if row is None or row.node != rep["node"]:
                continue  # only the daemon starts replicas: a record it does not know is ignored
            state, detail = rep["state"], rep["detail"][:MAX_DETAIL]
            if state == "running" and row.state == "starting":
                self.store.replica_state(t.id, row.slot, row.start, "running", at=_when(rep.get("started_at")))
            elif state == "done" and row.state != "done":
                self.store.replica_state(t.id, row.slot, row.start, "done", at=_when(rep.get("ended_at")))
            elif state == "lost" and row.state != "lost":
                self.store.lose_replica(t.id, row.slot, row.start, detail or "lost")
                log.warning("task %s: replica %s on %s lost: %s", t.id, row.slot, row.node, detail)
            node = nodes.get(row.node)
            if state == "running" and node is not None and not node.usable:
                why = self.store.node_reasons().get(row.node) or "drained"
                adir.raise_flag(f"release.{row.slot}", f"its node {row.node} was drained ({why})")
        for rej in _records(data.get("rejected")):
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


def unwritable(folder: Path) -> str | None:
    """Why a task's supervisor could not write in ``folder`` (or its nearest existing parent) now: a full
    or failing disk; None when a small file can be written and made durable there (or fails for another
    reason). A disk full but for root's reserve counts as full: supervisors may not run as root."""
    while not folder.is_dir() and folder != folder.parent:
        folder = folder.parent
    full = low_space(folder)
    if full:
        return full[0]
    # The folder may be the task's own: a new file of a name it cannot guess, never through a link.
    probe = folder / f".probe.{secrets.token_hex(8)}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, b"x")
            os.fsync(fd)
        finally:
            os.close(fd)
            probe.unlink(missing_ok=True)
    except OSError as exc:
        return f"{exc.strerror} in {folder}" if exc.errno in STORAGE_ERRNOS else None
    return None


def low_space(*folders: Path) -> list[str]:
    """A problem for each disk of ``folders`` with under :data:`MIN_FREE_BYTES` free (none where it cannot tell)."""
    problems, disks = [], set()
    for folder in folders:
        try:
            disk, st = os.stat(folder).st_dev, os.statvfs(folder)
        except OSError:
            continue
        free = st.f_bavail * st.f_frsize
        if free < MIN_FREE_BYTES and disk not in disks:
            problems.append(f"the disk of {folder} is full ({free // 1024} KiB free)")
        disks.add(disk)
    return problems


MAX_DETAIL = 2000
_KNOWN_CODES = sum(int(c) for c in StopCode)


def read_status(adir: AttemptDir) -> dict | None:
    """How the attempt ended, from ``status.json``, checked as input from the task's account; None: not yet.

    A status that is not there as a small JSON file of the folder's owner, or whose fields
    are not what the supervisor writes, ends the attempt as failed and says so.
    """
    try:
        raw = adir.read_json(adir.status, limit=1 << 20)
    except (OSError, ValueError) as exc:
        return _bad_status(f"its status.json is unreadable ({exc})")
    if raw is None:
        return None
    try:
        code = raw["stop_code"]
        life = raw.get("whole_life_state")
        detail = raw.get("detail", "")
        nodes = raw.get("failed_nodes", [])
        if not isinstance(code, int) or isinstance(code, bool) or not 0 < code <= _KNOWN_CODES or code & ~_KNOWN_CODES:
            raise UserError(f"stop_code {code!r}")
        if life is not None and (not isinstance(life, int) or isinstance(life, bool) or not -2**63 <= life < 2**63):
            raise UserError(f"whole_life_state {life!r}")
        if not isinstance(detail, str) or not isinstance(nodes, list) or \
                not all(isinstance(n, str) and len(n) <= 256 for n in nodes[:1000]) or len(nodes) > 1000:
            raise UserError("detail or failed_nodes")
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        return _bad_status(f"its status.json is not a supervisor's ({exc})")
    return {"stop_code": code, "detail": detail[:MAX_DETAIL], "whole_life_state": life, "failed_nodes": tuple(nodes)}


def _records(items: object) -> list[dict]:
    """The well-formed entries of a list in ``replicas.json`` (written by the task's account: checked as input)."""
    if not isinstance(items, list):
        return []
    kinds = {"slot": int, "start": int, "node": str, "state": str, "detail": str}
    out = []
    for item in items[:10_000]:
        if isinstance(item, dict) and all(isinstance(item.get(k, "" if k == "state" else None), kind)
                                          and not isinstance(item.get(k), bool) for k, kind in kinds.items()):
            out.append(item)
    return out


def _when(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _bad_status(why: str) -> dict:
    return {"stop_code": int(StopCode.FAILED), "detail": why[:MAX_DETAIL], "whole_life_state": None,
            "failed_nodes": ()}


def _last_line(adir: AttemptDir) -> str:
    """The last line the attempt's supervisor logged (why it died without a status), if any."""
    try:
        fd = open_owned(adir.logs / "supervisor.log", adir.owner)
    except OSError:
        return ""
    try:
        size = os.fstat(fd).st_size
        os.lseek(fd, max(0, size - 4096), os.SEEK_SET)
        lines = os.read(fd, 4096).decode(errors="replace").strip().splitlines()
    finally:
        os.close(fd)
    return lines[-1][:MAX_DETAIL] if lines else ""


# ---------------------------------------------------------------------- the process
class AlreadyRunning(FireflyerError, RuntimeError):
    pass


def lock(home: Home) -> int:
    """Take the home's daemon lock (held until the process exits); raises if another daemon has it."""
    private_dir(home.root)
    fd = os.open(home.pidfile, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        other = os.read(fd, 32).decode().strip() or "?"
        os.close(fd)
        raise AlreadyRunning(f"a platform daemon already runs for {home.root} (pid {other})") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def daemon_pid(home: Home) -> int | None:
    """The running daemon's pid, or None (the lock is free, or no pid file)."""
    try:
        fd = os.open(home.pidfile, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            text = os.read(fd, 32).decode().strip()
            return int(text) if text.isdigit() else None
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


HEARTBEAT_BYTES = 1024
HEALTH_LOG_S = 60.0
"""While the daemon stays unhealthy, it repeats the reason in its log this often (not every cycle)."""
STALE_AFTER_S = 60.0
"""A heartbeat older than this (or ten ticks, if longer) means the daemon's cycles have stalled."""


@dataclass
class Health:
    """Whether the daemon's cycles do their work: what the heartbeat tells ``platform status``."""

    problem: str | None = None
    since: float | None = None
    logged_at: float = 0.0

    def update(self, problem: str | None, now: float, trace: str | None = None) -> None:
        """Log a change of health in one line (a traceback only for an unexpected error, once)."""
        if problem is None:
            if self.problem is not None:
                log.info("daemon healthy again after %.0f s", now - (self.since or now))
            self.problem = self.since = None
            return
        new = self.problem is None or (trace is not None and problem != self.problem)
        if new or now - self.logged_at >= HEALTH_LOG_S:
            log.error("daemon unhealthy: %s%s", problem, f"\n{trace}" if trace and new else "")
            self.logged_at = now
        self.since = self.since or now
        self.problem = problem

    def to_json(self) -> dict:
        return {"healthy": self.problem is None, "problem": self.problem, "since": self.since}


def write_heartbeat(home: Home, beat: dict) -> None:
    """The daemon's pulse and health, rewritten in place at a fixed size: overwriting blocks the file
    already has needs no free space, so a daemon on a full disk can still say that it is."""
    while True:
        data = json.dumps(beat).encode()
        if len(data) < HEARTBEAT_BYTES or not beat.get("problem"):
            break
        beat = {**beat, "problem": beat["problem"][: len(beat["problem"]) // 2] + "..."}
    fd = os.open(home.heartbeat, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, data.ljust(HEARTBEAT_BYTES - 1) + b"\n", 0)
    finally:
        os.close(fd)


def read_heartbeat(home: Home) -> dict | None:
    """The last heartbeat, or None (no daemon has written one, or it cannot be read)."""
    for _ in range(3):
        try:
            text = home.heartbeat.read_text()
        except OSError:
            return None
        try:
            beat = json.loads(text)
            return beat if isinstance(beat, dict) else None
        except ValueError:  # read while it was being rewritten
            time.sleep(0.01)
    return None


def why_unhealthy(beat: dict | None, tick: float, now: float) -> str | None:
    """Why a running daemon is unhealthy, from its heartbeat; None when it is well (or has not cycled yet)."""
    if beat is None:
        return None
    if beat.get("healthy") is False:
        since = beat.get("since")
        return str(beat.get("problem") or "unknown") + (f" (for {now - since:.0f} s)" if since else "")
    stale = max(STALE_AFTER_S, 10 * tick)
    if now - beat.get("at", now) > stale:
        return (f"no cycle for {now - beat['at']:.0f} s (a cycle is stuck, or the daemon cannot write its "
                "heartbeat)")
    return None


def serve(home: Home, stop: threading.Event | None = None) -> None:
    """Run cycles until SIGTERM/SIGINT (or ``stop`` is set)."""
    cfg = platform_config.load(home)
    if cfg is None:
        raise UserError(f"no platform configured in {home.root}: run 'fireflyer platform start' first")
    fd = lock(home)
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    daemon = Daemon(home, cfg)
    log.info("daemon %s up: %s executor, %s nodes, tick %s s", os.getpid(), cfg.executor,
             len(daemon.store.nodes()), cfg.tick)
    health, beat_failed = Health(), False
    try:
        while not stop.is_set():
            t0 = time.monotonic()
            trace = None
            try:
                cycle = daemon.tick()
                problem = "; ".join(cycle.problems) or None
                if cycle.started or cycle.finished or cycle.suspending:
                    log.debug("cycle: %s", cycle)
            except StoreUnavailable as exc:  # a full disk: nothing was recorded, the next cycle retries
                problem = f"its cycles cannot be recorded: {exc}"
            except Exception as exc:  # a bad cycle (a failing executor, a bug) must not end the daemon
                problem, trace = f"a cycle failed: {type(exc).__name__}: {exc}", traceback.format_exc()
            health.update(problem, time.time(), trace)
            try:
                write_heartbeat(home, {"pid": os.getpid(), "at": time.time(), **health.to_json()})
                beat_failed = False
            except OSError as exc:  # status then sees the heartbeat's age and says the daemon stalled
                if not beat_failed:
                    log.error("cannot write the heartbeat %s: %s", home.heartbeat, exc.strerror)
                beat_failed = True
            stop.wait(max(0.0, cfg.tick - (time.monotonic() - t0)))
    finally:
        log.info("daemon %s down", os.getpid())
        daemon.store.close()
        os.close(fd)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m fireflyer.platform.scheduler.daemon HOME", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stdout)
    try:
        serve(Home(args[0]))
    except (AlreadyRunning, RuntimeError) as exc:
        print(f"fireflyer platform: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
