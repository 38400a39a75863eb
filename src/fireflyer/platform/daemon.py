"""The scheduler daemon: every ``tick`` seconds, watch, decide, act.

One cycle:

1. **Watch** the running attempts. An attempt whose supervisor wrote ``status.json`` is
   finished in the store with that stop code; a failed one is restarted (its chain gets
   a new attempt that resumes from the task's own checkpoint) until ``max_restarts``;
   nodes whose health check failed are drained. A supervisor that vanished without a
   status is a lost attempt: its ranks are killed and the chain restarts. Requests the
   store holds (a user's stop, a suspend) are passed on as control files.
2. **Decide** with the pure policy (:func:`fireflyer.platform.policy.schedule`).
3. **Act**: record the decisions in one transaction, then launch the started attempts.

All state is in SQLite, so the daemon can be killed with -9 at any moment: running
attempts keep running (their supervisors are detached), and the next daemon adopts
them. Only one daemon runs per home (an exclusive lock on ``daemon.pid``).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

from fireflyer.fsutil import private_dir
from fireflyer.platform import config as platform_config
from fireflyer.platform.config import PlatformConfig
from fireflyer.platform.executor import Executor, Launch
from fireflyer.platform.layout import Home, read_json, write_json_atomic
from fireflyer.platform.policy import RUNNING, SUSPENDING, schedule
from fireflyer.platform.store import Store, StopCode, TaskRow
from fireflyer.ports import free_port

log = logging.getLogger("fireflyer.platform")
NODE_SYNC_S = 10.0
"""How often the daemon re-reads node health from Slurm (slurm executor)."""


def make_executor(cfg: PlatformConfig) -> Executor:
    if cfg.executor == "slurm":
        from fireflyer.platform.slurm import SlurmExecutor

        return SlurmExecutor(partition=cfg.partition)
    from fireflyer.platform.local import LocalExecutor

    return LocalExecutor()


@dataclass
class Cycle:
    """What one tick did (for logs, tests and the benchmark)."""

    finished: list[tuple[int, str]] = field(default_factory=list)
    started: list[int] = field(default_factory=list)
    suspending: list[int] = field(default_factory=list)
    decide_s: float = 0.0


class Daemon:
    def __init__(self, home: Home, cfg: PlatformConfig, executor: Executor | None = None,
                 store: Store | None = None) -> None:
        self.home, self.cfg = home, cfg
        self.store = store or Store(home.db)
        self.executor = executor or make_executor(cfg)
        self._node_sync_at = 0.0

    def _sync_slurm_nodes(self, now: float) -> None:
        """Slurm is the source of truth for node health: a node it marks DOWN or DRAIN is not used."""
        if self.cfg.executor != "slurm" or now - self._node_sync_at < NODE_SYNC_S:
            return
        from fireflyer.platform.slurm import slurm_nodes

        self._node_sync_at = now
        changed = self.store.sync_nodes(slurm_nodes(self.cfg.partition), reason="down or drained in Slurm")
        if changed:
            log.info("nodes changed in Slurm: %s", ", ".join(changed))

    def _drain(self, node: str, reason: str) -> None:
        self.store.set_drained(node, True, reason=reason)
        if self.cfg.executor == "slurm":
            from fireflyer.platform import slurm

            try:
                slurm.drain(node, reason)
            except (RuntimeError, OSError) as exc:
                log.warning("could not drain %s in Slurm: %s", node, exc)

    # ------------------------------------------------------------------ 1. watch
    def _finish(self, t: TaskRow, code: StopCode, detail: str, *, life: int | None = None,
                failed_nodes: tuple[str, ...] = ()) -> int | None:
        for node in failed_nodes:
            self._drain(node, f"failed its health check in task {t.id}")
            self.store.event(t.id, "drained", node)
            log.warning("task %s: drained %s (%s)", t.id, node, detail)
        if t.stop_requested:
            code |= StopCode.MANUAL_STOP
        elif code & (StopCode.FAILED | StopCode.INIT_FAILED) and not code & StopCode.HOOK_RESTART:
            failures = sum(1 for a in self.store.chain(t.chain_first_id)
                           if a.id != t.id and a.stop_code & (StopCode.FAILED | StopCode.INIT_FAILED))
            if failures < self.cfg.max_restarts:
                code |= StopCode.HOOK_RESTART
                detail += f"; restart {failures + 1} of {self.cfg.max_restarts}"
            else:
                detail += f"; no restarts left ({self.cfg.max_restarts} used)"
        new = self.store.finish(t.id, code, detail=detail, whole_life_state=life)
        log.info("task %s finished: %s %s%s", t.id, StopCode(code), detail,
                 f"; chain continues as task {new}" if new else "")
        return new

    def _watch(self, t: TaskRow, now: float, cycle: Cycle) -> None:
        adir = self.home.attempt(t.id)
        handle = t.handle
        if handle is None:  # launched, or not, just before a crash
            find = getattr(self.executor, "find", None)
            handle = find(t.id, str(adir.root)) if find else None
            if handle is None:
                self._finish(t, StopCode.UNSCHEDULABLE, "the scheduler stopped before the attempt was launched")
                cycle.finished.append((t.id, "lost before launch"))
                return
            self.store.set_handle(t.id, handle)
        status = read_json(adir.status)
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
            status = read_json(adir.status)  # it may have ended between the two looks
        if status is None:
            self.executor.kill(handle)
            self._finish(t, StopCode.FAILED, "its supervisor ended without a status (killed, or its host failed)")
            cycle.finished.append((t.id, "lost"))
            return
        self.executor.kill(handle)  # the supervisor has stopped every rank; this reaps and makes sure
        self._finish(t, StopCode(status["stop_code"]), status.get("detail", ""),
                     life=status.get("whole_life_state"), failed_nodes=tuple(status.get("failed_nodes", ())))
        cycle.finished.append((t.id, status.get("detail", "")))

    # ------------------------------------------------------------------ 3. act
    def _launch(self, task_id: int) -> None:
        t = self.store.task(task_id)
        adir = self.home.attempt(t.id)
        adir.create()
        launch = Launch(task_id=t.id, chain_id=t.chain_first_id, attempt=t.attempt, name=t.name, user=t.user,
                        command=tuple(t.command), nodes=t.assigned, ranks_per_node=t.ranks_per_node,
                        master_port=free_port(), cwd=t.cwd or os.getcwd(), env=t.env,
                        whole_life_state=t.whole_life_state, timeouts=self.cfg.timeouts, prolog=self.cfg.prolog)
        write_json_atomic(adir.spec, launch.to_json())
        try:
            handle = self.executor.launch(launch, str(adir.root))
        except (OSError, RuntimeError, ValueError) as exc:
            self._finish(t, StopCode.FAILED | StopCode.INIT_FAILED, f"could not launch: {exc}")
            return
        self.store.set_handle(t.id, handle)
        log.info("task %s (%s, attempt %s) launched on %s: %s", t.id, t.name, t.attempt, " ".join(t.assigned),
                 handle)

    def tick(self, now: float | None = None) -> Cycle:
        now = time.time() if now is None else now
        cycle = Cycle()
        try:
            self._sync_slurm_nodes(now)
        except (RuntimeError, OSError) as exc:  # the controller is away: keep the last known state
            log.warning("could not read nodes from Slurm: %s", exc)
        for t in self.store.tasks((RUNNING, SUSPENDING)):
            try:
                self._watch(t, now, cycle)
            except (RuntimeError, OSError) as exc:  # e.g. squeue timed out: look again next cycle
                log.warning("task %s: could not check it this cycle: %s", t.id, exc)
        t0 = time.perf_counter()
        decisions = schedule(self.store.nodes(), self.store.policy_tasks(now), self.store.quotas(),
                             self.cfg.policy())
        cycle.decide_s = time.perf_counter() - t0
        started = self.store.apply(decisions, now=time.time())
        cycle.suspending = [s.task_id for s in decisions.suspends]
        for s in decisions.suspends:
            log.info("task %s: suspending (%s)", s.task_id, s.reason)
            self.home.attempt(s.task_id).raise_flag("suspend", s.reason)
        for task_id in started:
            self._launch(task_id)
        cycle.started = started
        return cycle


# ---------------------------------------------------------------------- the process
class AlreadyRunning(RuntimeError):
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


def serve(home: Home, stop: threading.Event | None = None) -> None:
    """Run cycles until SIGTERM/SIGINT (or ``stop`` is set)."""
    cfg = platform_config.load(home)
    if cfg is None:
        raise RuntimeError(f"no platform configured in {home.root}: run 'fireflyer platform start' first")
    fd = lock(home)
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    daemon = Daemon(home, cfg)
    log.info("daemon %s up: %s executor, %s nodes, tick %s s", os.getpid(), cfg.executor,
             len(daemon.store.nodes()), cfg.tick)
    try:
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                cycle = daemon.tick()
                if cycle.started or cycle.finished or cycle.suspending:
                    log.debug("cycle: %s", cycle)
            except Exception:  # a bad cycle (a locked database, a failing executor) must not end the daemon
                log.error("cycle failed:\n%s", traceback.format_exc())
            home.heartbeat.write_text(json.dumps({"pid": os.getpid(), "at": time.time()}))
            stop.wait(max(0.0, cfg.tick - (time.monotonic() - t0)))
    finally:
        log.info("daemon %s down", os.getpid())
        daemon.store.close()
        os.close(fd)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m fireflyer.platform.daemon HOME", file=sys.stderr)
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
