"""The platform's state in SQLite (WAL): nodes, quotas, tasks and their chains, and a history of events.

Every change is one transaction, so a scheduler killed with -9 at any moment leaves
either the state before a change or the state after it, and restarts from there. A
submit may carry a client ``request_id``; submitting the same id again returns the
first task instead of queueing a duplicate, so a client that retries after a crash
cannot double-submit.

A task is one attempt of a chain. When a running task is suspended (interrupt), found
unschedulable or restarted by a hook, the chain gets a new queued attempt with the
same ``chain_first_id`` (its place in the queue), ``attempt`` one higher and the
chain's ``whole_life_state`` carried over; a user's stop or a normal exit ends it.
"""

from __future__ import annotations

import errno
import functools
import json
import sqlite3
import time
from dataclasses import dataclass
from functools import lru_cache
from enum import IntFlag
from pathlib import Path
from typing import Any, Iterable

from fireflyer.errors import FireflyerError, UserError
from fireflyer.fsutil import private_dir, private_file
from fireflyer.platform.state.policy import QUEUED, RUNNING, SUSPENDING, Decisions, Node, Priority, Task

FINISHED = "finished"
HELD = "held"
"""A chain's next attempt that waits for ``resume`` (its user suspended it) instead of the queue."""
STATES = (QUEUED, RUNNING, SUSPENDING, HELD, FINISHED)
ACTIVE = (QUEUED, RUNNING, SUSPENDING, HELD)


class StopCode(IntFlag):
    """Why an attempt ended (HAI's bit values)."""

    STOP = 1
    INTERRUPT = 16
    UNSCHEDULABLE = 32
    FAILED = 128
    INIT_FAILED = 256
    TIMEOUT = 512
    MANUAL_STOP = 1024
    HOOK_RESTART = 2048


REQUEUE = StopCode.INTERRUPT | StopCode.UNSCHEDULABLE | StopCode.HOOK_RESTART

_SCHEMA = """
CREATE TABLE IF NOT EXISTS nodes (
    name TEXT PRIMARY KEY, zone TEXT NOT NULL, healthy INTEGER NOT NULL DEFAULT 1,
    drained INTEGER NOT NULL DEFAULT 0, reason TEXT NOT NULL DEFAULT '');
CREATE TABLE IF NOT EXISTS members (
    user TEXT NOT NULL, grp TEXT NOT NULL, PRIMARY KEY (user, grp));
CREATE TABLE IF NOT EXISTS quotas (
    user TEXT NOT NULL, grp TEXT NOT NULL, priority INTEGER NOT NULL, nodes INTEGER NOT NULL,
    PRIMARY KEY (user, grp, priority));
CREATE TABLE IF NOT EXISTS tasks (
    id INTEGER PRIMARY KEY AUTOINCREMENT, chain_first_id INTEGER, attempt INTEGER NOT NULL DEFAULT 0,
    name TEXT NOT NULL, user TEXT NOT NULL, grp TEXT NOT NULL, priority INTEGER NOT NULL,
    nodes INTEGER NOT NULL, command TEXT NOT NULL, state TEXT NOT NULL, assigned TEXT NOT NULL DEFAULT '[]',
    submitted_at REAL NOT NULL, started_at REAL, finished_at REAL, stop_code INTEGER NOT NULL DEFAULT 0,
    whole_life_state INTEGER NOT NULL DEFAULT 0, request_id TEXT UNIQUE,
    ranks_per_node INTEGER NOT NULL DEFAULT 1, cwd TEXT NOT NULL DEFAULT '', env TEXT NOT NULL DEFAULT '{}',
    handle TEXT, stop_requested INTEGER NOT NULL DEFAULT 0, hold INTEGER NOT NULL DEFAULT 0,
    detail TEXT NOT NULL DEFAULT '');
CREATE INDEX IF NOT EXISTS tasks_chain ON tasks(chain_first_id);
CREATE INDEX IF NOT EXISTS tasks_state ON tasks(state);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT, task_id INTEGER NOT NULL, at REAL NOT NULL,
    kind TEXT NOT NULL, detail TEXT NOT NULL DEFAULT '');
CREATE TABLE IF NOT EXISTS replicas (
    task_id INTEGER NOT NULL, slot INTEGER NOT NULL, start INTEGER NOT NULL, node TEXT NOT NULL,
    state TEXT NOT NULL, started_at REAL, ended_at REAL, detail TEXT NOT NULL DEFAULT '',
    PRIMARY KEY (task_id, slot, start));
"""


@dataclass(frozen=True)
class TaskRow:
    id: int
    chain_first_id: int
    attempt: int
    name: str
    user: str
    group: str
    priority: Priority
    nodes: int
    command: list[str]
    state: str
    assigned: tuple[str, ...]
    submitted_at: float
    started_at: float | None
    finished_at: float | None
    stop_code: int
    whole_life_state: int
    ranks_per_node: int = 1
    cwd: str = ""
    env_json: str = "{}"
    handle: str | None = None
    stop_requested: bool = False
    hold: bool = False
    detail: str = ""
    fault_tolerant: bool = False
    """Each node a replica of the job: a lost node is replaced while the others go on (see :mod:`.replicas`)."""

    @property
    def env(self) -> dict[str, str]:
        """The variables the task was submitted with (decoded on use: listings never need them)."""
        return json.loads(self.env_json)



class UnknownTask(FireflyerError, LookupError):
    """No such task; the message names it."""


class StoreUnavailable(FireflyerError, RuntimeError):
    """The platform's state cannot be written (or read) now: its disk is full or failing, or another process
    held the database past the timeout. The change was not made (its transaction rolled back); retry once
    the message's cause is fixed."""


_STORAGE_CODES = {sqlite3.SQLITE_FULL: "free space on its disk, then retry",
                  sqlite3.SQLITE_IOERR: "check its disk, then retry",
                  sqlite3.SQLITE_BUSY: "another process held it too long; retry",
                  sqlite3.SQLITE_LOCKED: "another process held it too long; retry",
                  sqlite3.SQLITE_READONLY: "its disk or files are read-only",
                  sqlite3.SQLITE_CANTOPEN: "check its disk's free space and its files' permissions"}
STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS)
"""OS errors that mean the disk, not the request, is at fault."""


def storage_problem(exc: BaseException, path: str | Path) -> StoreUnavailable | None:
    """``exc`` (from SQLite or the OS) as a :class:`StoreUnavailable` naming ``path``; None for any other error."""
    if isinstance(exc, sqlite3.OperationalError):
        why, advice = str(exc), _STORAGE_CODES.get(getattr(exc, "sqlite_errorcode", 0) & 0xFF)
    elif isinstance(exc, OSError) and exc.errno in STORAGE_ERRNOS:
        why, advice = exc.strerror or str(exc), "free space on its disk or check the disk, then retry"
    else:
        return None
    if advice is None:
        return None
    return StoreUnavailable(f"the platform's state ({path}) cannot be used now: {why}; {advice}")


def _answers_unavailable(cls: type) -> type:
    """Every public method of the store (and its constructor) raises :class:`StoreUnavailable` for
    a storage failure, instead of SQLite's own error: callers tell "retry later" from a bug."""

    def guard(method):
        @functools.wraps(method)
        def guarded(self, *args, **kwargs):
            try:
                return method(self, *args, **kwargs)
            except (sqlite3.OperationalError, OSError) as exc:
                problem = storage_problem(exc, getattr(self, "path", "?"))
                if problem is None:
                    raise
                raise problem from exc
        return guarded

    for name, value in list(vars(cls).items()):
        if callable(value) and (name == "__init__" or not name.startswith("_")):
            setattr(cls, name, guard(value))
    return cls


@_answers_unavailable
class Store:
    """One SQLite database file. Safe for one scheduler process and many readers."""

    def __init__(self, path: str | Path, *, timeout: float = 10.0) -> None:
        self.path = str(path)
        # The platform's home holds every task's environment, its logs and the token hashes:
        # no other Unix user may enter it, and the database is its owner's alone (SQLite gives
        # its WAL and shared-memory files the database's permissions).
        private_dir(Path(self.path).parent)
        self._db = sqlite3.connect(self.path, timeout=timeout, isolation_level=None)
        private_file(self.path)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("PRAGMA foreign_keys=ON")
        self._db.executescript(_SCHEMA)
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(tasks)")}
        if "fault_tolerant" not in columns:  # a platform made before fault-tolerant tasks
            self._db.execute("ALTER TABLE tasks ADD COLUMN fault_tolerant INTEGER NOT NULL DEFAULT 0")

    def close(self) -> None:
        self._db.close()

    def _tx(self):
        return _Transaction(self._db)

    # ------------------------------------------------------------------ nodes and quotas
    def add_nodes(self, nodes: Iterable[Node]) -> None:
        with self._tx() as db:
            db.executemany("INSERT INTO nodes(name, zone, healthy, drained) VALUES (?,?,?,?) "
                           "ON CONFLICT(name) DO UPDATE SET zone=excluded.zone",
                           [(n.name, n.zone, int(n.healthy), int(n.drained)) for n in nodes])

    def nodes(self) -> list[Node]:
        rows = self._db.execute("SELECT name, zone, healthy, drained FROM nodes ORDER BY name").fetchall()
        return [Node(name, zone, bool(h), bool(d)) for name, zone, h, d in rows]

    def sync_nodes(self, nodes: Iterable[Node], *, reason: str) -> list[str]:
        """Take nodes' zone and health from the resource manager (Slurm); returns the names whose state changed.

        A node that became drained or unhealthy there gets ``reason``; one that came back
        is cleared. Nodes the manager no longer lists are marked unhealthy.
        """
        changed = []
        with self._tx() as db:
            known = {r[0]: (bool(r[1]), bool(r[2])) for r in db.execute("SELECT name, healthy, drained FROM nodes")}
            seen = set()
            for n in nodes:
                seen.add(n.name)
                if known.get(n.name) == (n.healthy, n.drained):
                    db.execute("UPDATE nodes SET zone=? WHERE name=?", (n.zone, n.name))
                    continue
                changed.append(n.name)
                why = "" if n.usable else reason
                db.execute("INSERT INTO nodes(name, zone, healthy, drained, reason) VALUES (?,?,?,?,?) "
                           "ON CONFLICT(name) DO UPDATE SET zone=excluded.zone, healthy=excluded.healthy, "
                           "drained=excluded.drained, reason=excluded.reason",
                           (n.name, n.zone, int(n.healthy), int(n.drained), why))
            for name, (healthy, _) in known.items():
                if name not in seen and healthy:
                    changed.append(name)
                    db.execute("UPDATE nodes SET healthy=0, reason=? WHERE name=?", (f"{reason}: not listed", name))
        return changed

    def node_reasons(self) -> dict[str, str]:
        """Why each node is drained or unhealthy ('' when it is neither)."""
        return dict(self._db.execute("SELECT name, reason FROM nodes"))

    def set_drained(self, name: str, drained: bool, reason: str = "") -> None:
        with self._tx() as db:
            if db.execute("UPDATE nodes SET drained=?, reason=? WHERE name=?", (int(drained), reason, name)).rowcount != 1:
                known = [r[0] for r in db.execute("SELECT name FROM nodes ORDER BY name LIMIT 8")]
                raise UserError(f"unknown node {name!r}; nodes include {', '.join(known) or 'none'}")

    def set_quota(self, user: str, group: str, priority: Priority, nodes: int) -> None:
        if nodes < 0:
            raise UserError(f"a quota is a non-negative node count, got {nodes}")
        with self._tx() as db:
            db.execute("INSERT INTO quotas VALUES (?,?,?,?) ON CONFLICT(user, grp, priority) DO UPDATE SET "
                       "nodes=excluded.nodes", (user, group, int(priority), nodes))

    def set_member(self, user: str, group: str, member: bool = True) -> None:
        """Put ``user`` in ``group`` (or take them out). Everyone is in ``default`` without a row."""
        with self._tx() as db:
            if member:
                db.execute("INSERT OR IGNORE INTO members VALUES (?,?)", (user, group))
            else:
                db.execute("DELETE FROM members WHERE user=? AND grp=?", (user, group))

    def members(self) -> dict[str, list[str]]:
        """group -> its users (sorted), for the groups with any."""
        out: dict[str, list[str]] = {}
        for user, grp in self._db.execute("SELECT user, grp FROM members ORDER BY grp, user"):
            out.setdefault(grp, []).append(user)
        return out

    def is_member(self, user: str, group: str) -> bool:
        return group == "default" or self._db.execute(
            "SELECT 1 FROM members WHERE user=? AND grp=?", (user, group)).fetchone() is not None

    def unix_accounts(self) -> dict[str, str]:
        """User -> the Unix account their tasks run as, from the server's ``users`` table (none: empty)."""
        try:
            return dict(self._db.execute("SELECT name, unix FROM users WHERE unix IS NOT NULL"))
        except sqlite3.OperationalError as exc:
            if "no such" in str(exc):  # no server user yet, or a table from before Unix accounts
                return {}
            raise

    def quotas(self) -> dict[tuple[str, str, Priority], int]:
        return {(u, g, Priority(p)): n for u, g, p, n in self._db.execute("SELECT user, grp, priority, nodes FROM quotas")}

    # ------------------------------------------------------------------ tasks
    def submit(self, *, user: str, nodes: int, command: list[str], priority: Priority | str | int = Priority.NORMAL,
               group: str = "default", name: str = "", request_id: str | None = None, now: float | None = None,
               ranks_per_node: int = 1, cwd: str = "", env: dict[str, str] | None = None,
               fault_tolerant: bool = False) -> int:
        """Queue a new chain; returns its task id (the earlier one if ``request_id`` was seen before)."""
        priority = Priority.parse(priority)
        if nodes < 1:
            raise UserError(f"a task needs at least one node, got {nodes}")
        if not command:
            raise UserError("a task needs a command")
        if ranks_per_node < 1:
            raise UserError(f"a task needs at least one rank per node, got {ranks_per_node}")
        if fault_tolerant and nodes < 2:
            raise UserError(f"a fault-tolerant task needs at least 2 nodes (each one a replica), got {nodes}")
        now = time.time() if now is None else now
        # Idempotency keys are the submitting user's own: another user's key never finds (or
        # blocks) this user's task. The column is unique, so the key is stored under its user.
        key = None if request_id is None else f"{user}\x1f{request_id}"
        with self._tx() as db:
            if key is not None:
                row = db.execute("SELECT id FROM tasks WHERE request_id=?", (key,)).fetchone()
                if row:
                    return int(row[0])
            cur = db.execute("INSERT INTO tasks(name, user, grp, priority, nodes, command, state, submitted_at, "
                             "request_id, ranks_per_node, cwd, env, fault_tolerant) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                             (name, user, group, int(priority), nodes, json.dumps(command), QUEUED, now, key,
                              ranks_per_node, cwd, json.dumps(env or {}), int(fault_tolerant)))
            task_id = int(cur.lastrowid)
            db.execute("UPDATE tasks SET chain_first_id=?, name=? WHERE id=?", (task_id, name or f"task{task_id}",
                                                                              task_id))
            db.execute("INSERT INTO events(task_id, at, kind) VALUES (?,?,'submitted')", (task_id, now))
        return task_id

    def task(self, task_id: int) -> TaskRow:
        row = self._db.execute(f"SELECT {_COLS} FROM tasks WHERE id=?", (task_id,)).fetchone()
        if row is None:
            raise UnknownTask(f"no task {task_id}")
        return _row(row)

    def tasks(self, states: Iterable[str] = (QUEUED, RUNNING, SUSPENDING)) -> list[TaskRow]:
        """Attempts in ``states`` (default: the ones the scheduler considers), oldest first."""
        states = tuple(states)
        marks = ",".join("?" * len(states))
        return [_row(r) for r in self._db.execute(f"SELECT {_COLS} FROM tasks WHERE state IN ({marks}) ORDER BY id",
                                                  states)]

    def policy_tasks(self, now: float | None = None) -> list[Task]:
        """What the policy needs of every task it considers, and nothing more (one cycle's read)."""
        now = time.time() if now is None else now
        rows = self._db.execute("SELECT id, user, nodes, priority, grp, chain_first_id, state, assigned, started_at, "
                                "fault_tolerant FROM tasks WHERE state IN (?,?,?) ORDER BY id",
                                (QUEUED, RUNNING, SUSPENDING))
        return [Task(i, u, n, Priority(p), g, c, st, tuple(json.loads(a)) if a != "[]" else (),
                     max(0.0, now - started) if started is not None and st != QUEUED else 0.0, bool(ft))
                for i, u, n, p, g, c, st, a, started, ft in rows]

    def chain(self, chain_first_id: int) -> list[TaskRow]:
        return [_row(r) for r in self._db.execute(f"SELECT {_COLS} FROM tasks WHERE chain_first_id=? ORDER BY attempt",
                                                  (chain_first_id,))]

    def events(self, task_id: int) -> list[tuple[float, str, str]]:
        return list(self._db.execute("SELECT at, kind, detail FROM events WHERE task_id=? ORDER BY id", (task_id,)))

    def chain_events(self, chain_first_id: int) -> list[tuple[int, float, str, str]]:
        """(task id, time, kind, detail) for every attempt of a chain, in order."""
        return list(self._db.execute("SELECT e.task_id, e.at, e.kind, e.detail FROM events e JOIN tasks t "
                                     "ON t.id = e.task_id WHERE t.chain_first_id=? ORDER BY e.id", (chain_first_id,)))

    def latest(self, task_id: int) -> TaskRow:
        """The newest attempt of the chain that ``task_id`` (any attempt's id) belongs to."""
        t = self.task(task_id)
        row = self._db.execute(f"SELECT {_COLS} FROM tasks WHERE chain_first_id=? ORDER BY attempt DESC LIMIT 1",
                               (t.chain_first_id,)).fetchone()
        return _row(row)

    def listing(self, *, active_only: bool, user: str | None = None, state: str | None = None,
                priority: int | None = None, limit: int = 100, offset: int = 0) -> tuple[int, list[tuple]]:
        """(total, one page of rows) of each chain's newest attempt, filtered and ordered in SQL.

        Running first, then queued, held and finished; within the unfinished, higher
        priority and then older chains first; the newest finished chains first. Rows hold
        :data:`LISTING_COLS`, undecoded, so a page of 10,000 costs little more than reading it.
        """
        where, args = [], []
        if active_only:
            where.append(f"state IN ({','.join('?' * len(ACTIVE))})")
            args += ACTIVE
        else:
            where.append("id IN (SELECT MAX(id) FROM tasks GROUP BY chain_first_id)")
        for column, value in (("user", user), ("state", state), ("priority", priority)):
            if value is not None:
                where.append(f"{column} = ?")
                args.append(value)
        cond = " AND ".join(where)
        total = self._db.execute(f"SELECT COUNT(*) FROM tasks WHERE {cond}", args).fetchone()[0]
        rows = self._db.execute(
            f"SELECT {LISTING_COLS} FROM tasks WHERE {cond} ORDER BY "
            "CASE state WHEN 'running' THEN 0 WHEN 'suspending' THEN 0 WHEN 'queued' THEN 1 WHEN 'held' THEN 2 "
            "ELSE 3 END, CASE WHEN state != 'finished' THEN -priority ELSE 0 END, "
            "CASE WHEN state != 'finished' THEN chain_first_id ELSE -chain_first_id END LIMIT ? OFFSET ?",
            [*args, limit, offset]).fetchall()
        return total, rows

    def node_intervals(self, *, since: float) -> list[tuple[float, float | None, int]]:
        """(started, finished or None, nodes) of every attempt that held nodes after ``since``."""
        return list(self._db.execute("SELECT started_at, finished_at, nodes FROM tasks WHERE started_at IS NOT NULL "
                                     "AND (finished_at IS NULL OR finished_at >= ?)", (since,)))

    def event(self, task_id: int, kind: str, detail: str = "", now: float | None = None) -> None:
        with self._tx() as db:
            db.execute("INSERT INTO events(task_id, at, kind, detail) VALUES (?,?,?,?)",
                       (task_id, time.time() if now is None else now, kind, detail))

    def set_handle(self, task_id: int, handle: str | None) -> None:
        with self._tx() as db:
            db.execute("UPDATE tasks SET handle=? WHERE id=?", (handle, task_id))
            db.execute("INSERT INTO events(task_id, at, kind, detail) VALUES (?,?,'launched',?)",
                       (task_id, time.time(), handle or ""))

    # ------------------------------------------------------------------ users' requests
    def request_stop(self, task_id: int, *, now: float | None = None) -> TaskRow:
        """A user's stop of a chain: a queued or held attempt ends now, a running one is told to stop."""
        now = time.time() if now is None else now
        t = self.latest(task_id)
        if t.state in (QUEUED, HELD):
            self.finish(t.id, StopCode.MANUAL_STOP, detail="stopped by its user before it ran", now=now)
        elif t.state in (RUNNING, SUSPENDING):
            with self._tx() as db:
                db.execute("UPDATE tasks SET stop_requested=1 WHERE id=?", (t.id,))
                db.execute("INSERT INTO events(task_id, at, kind) VALUES (?,?,'stop requested')", (t.id, now))
        else:
            raise UserError(f"task {task_id} has already finished ({stop_text(t.stop_code)})")
        return self.task(t.id)

    def request_suspend(self, task_id: int, *, now: float | None = None) -> TaskRow:
        """A user's suspend: the running attempt saves and stops; its chain waits (held) for ``resume``."""
        now = time.time() if now is None else now
        t = self.latest(task_id)
        if t.state not in (RUNNING, SUSPENDING):
            raise UserError(f"task {task_id} is {t.state}, not running: only a running task can be suspended")
        with self._tx() as db:
            db.execute("UPDATE tasks SET state=?, hold=1 WHERE id=? AND state IN (?,?)",
                       (SUSPENDING, t.id, RUNNING, SUSPENDING))
            db.execute("INSERT INTO events(task_id, at, kind, detail) VALUES (?,?,'suspending','by its user')",
                       (t.id, now))
        return self.task(t.id)

    def resume(self, task_id: int, *, now: float | None = None) -> TaskRow:
        """Queue a held chain again, in its old place."""
        now = time.time() if now is None else now
        t = self.latest(task_id)
        if t.state == SUSPENDING and t.hold:
            with self._tx() as db:  # not stopped yet: it will come back queued instead of held
                db.execute("UPDATE tasks SET hold=0 WHERE id=?", (t.id,))
            return self.task(t.id)
        if t.state != HELD:
            raise UserError(f"task {task_id} is {t.state}, not suspended by its user: nothing to resume")
        with self._tx() as db:
            db.execute("UPDATE tasks SET state=?, submitted_at=? WHERE id=? AND state=?", (QUEUED, now, t.id, HELD))
            db.execute("INSERT INTO events(task_id, at, kind) VALUES (?,?,'resumed')", (t.id, now))
        return self.task(t.id)

    # ------------------------------------------------------------------ a cycle's decisions
    def apply(self, decisions: Decisions, now: float | None = None) -> list[int]:
        """Record starts and suspends in one transaction; returns the ids that really started.

        A start only applies to a task still queued (optimistic, as HAI's scheduler does);
        a suspend only to a task still running.
        """
        now = time.time() if now is None else now
        started = []
        with self._tx() as db:
            for s in decisions.starts:
                cur = db.execute("UPDATE tasks SET state=?, assigned=?, started_at=? WHERE id=? AND state=?",
                                 (RUNNING, json.dumps(list(s.nodes)), now, s.task_id, QUEUED))
                if cur.rowcount == 1:
                    started.append(s.task_id)
                    db.execute("INSERT INTO events(task_id, at, kind, detail) VALUES (?,?,'started',?)",
                               (s.task_id, now, " ".join(s.nodes)))
                    if db.execute("SELECT fault_tolerant FROM tasks WHERE id=?", (s.task_id,)).fetchone()[0]:
                        db.executemany("INSERT OR REPLACE INTO replicas(task_id, slot, start, node, state) "
                                       "VALUES (?,?,0,?,'starting')",
                                       [(s.task_id, slot, node) for slot, node in enumerate(s.nodes)])
            for s in decisions.suspends:
                if db.execute("UPDATE tasks SET state=? WHERE id=? AND state=?",
                              (SUSPENDING, s.task_id, RUNNING)).rowcount == 1:
                    db.execute("INSERT INTO events(task_id, at, kind, detail) VALUES (?,?,'suspending',?)",
                               (s.task_id, now, s.reason))
        return started

    def finish(self, task_id: int, stop_code: StopCode, *, detail: str = "", whole_life_state: int | None = None,
               now: float | None = None) -> int | None:
        """End an attempt; returns the new attempt's id when the chain is requeued.

        Interrupts, unschedulable starts and hook restarts requeue the chain; a user's stop
        (``MANUAL_STOP``) never does, whatever else is set.
        """
        now = time.time() if now is None else now
        with self._tx() as db:
            row = db.execute(f"SELECT {_COLS} FROM tasks WHERE id=?", (task_id,)).fetchone()
            if row is None:
                raise UnknownTask(f"no task {task_id}")
            t = _row(row)
            if t.state == FINISHED:
                return None
            life = t.whole_life_state if whole_life_state is None else whole_life_state
            db.execute("UPDATE tasks SET state=?, finished_at=?, stop_code=?, whole_life_state=?, detail=? WHERE id=?",
                       (FINISHED, now, int(stop_code), life, detail, task_id))
            db.execute("INSERT INTO events(task_id, at, kind, detail) VALUES (?,?,'finished',?)",
                       (task_id, now, f"{stop_text(stop_code)}: {detail}" if detail else stop_text(stop_code)))
            if not (stop_code & REQUEUE) or stop_code & StopCode.MANUAL_STOP:
                return None
            cur = db.execute("INSERT INTO tasks(chain_first_id, attempt, name, user, grp, priority, nodes, command, "
                             "state, submitted_at, whole_life_state, ranks_per_node, cwd, env, fault_tolerant) "
                             "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                             (t.chain_first_id, t.attempt + 1, t.name, t.user, t.group, int(t.priority), t.nodes,
                              json.dumps(t.command), HELD if t.hold else QUEUED, now, life, t.ranks_per_node,
                              t.cwd, t.env_json, int(t.fault_tolerant)))
            new_id = int(cur.lastrowid)
            db.execute("INSERT INTO events(task_id, at, kind, detail) VALUES (?,?,?,?)",
                       (new_id, now, "held" if t.hold else "requeued",
                        f"attempt {t.attempt + 1} of chain {t.chain_first_id} after {stop_text(stop_code)}"))
            return new_id


    # ------------------------------------------------------------------ a fault-tolerant task's replicas
    def replicas(self, task_id: int) -> list[ReplicaRow]:
        """Every start of every replica of an attempt, by slot and start."""
        return [ReplicaRow(*r) for r in self._db.execute(
            "SELECT slot, start, node, state, started_at, ended_at, detail FROM replicas WHERE task_id=? "
            "ORDER BY slot, start", (task_id,))]

    def replica_state(self, task_id: int, slot: int, start: int, state: str, *, at: float | None = None,
                      detail: str | None = None) -> None:
        """A replica's start is running (``at``: since when) or done; a start after the first is recorded as an event."""
        with self._tx() as db:
            row = db.execute("SELECT node, state FROM replicas WHERE task_id=? AND slot=? AND start=?",
                             (task_id, slot, start)).fetchone()
            if row is None or row[1] == state:
                return
            column = "started_at" if state == "running" else "ended_at"
            db.execute(f"UPDATE replicas SET state=?, {column}=COALESCE(?, {column}), detail=COALESCE(?, detail) "
                       "WHERE task_id=? AND slot=? AND start=?", (state, at, detail, task_id, slot, start))
            if state == "running" and start > 0:
                db.execute("INSERT INTO events(task_id, at, kind, detail) VALUES (?,?,'replica started',?)",
                           (task_id, at or time.time(), f"replica {slot} on {row[0]} (start {start})"))

    def lose_replica(self, task_id: int, slot: int, start: int, detail: str, *, now: float | None = None) -> None:
        """A replica's node is lost: the start ends, and the node goes back to the pool (unless drained)."""
        now = time.time() if now is None else now
        with self._tx() as db:
            row = db.execute("SELECT node, state FROM replicas WHERE task_id=? AND slot=? AND start=?",
                             (task_id, slot, start)).fetchone()
            if row is None or row[1] == "lost":
                return
            node = row[0]
            db.execute("UPDATE replicas SET state='lost', ended_at=?, detail=? WHERE task_id=? AND slot=? AND start=?",
                       (now, detail, task_id, slot, start))
            assigned = json.loads(db.execute("SELECT assigned FROM tasks WHERE id=?", (task_id,)).fetchone()[0])
            if node in assigned:
                assigned.remove(node)
            db.execute("UPDATE tasks SET assigned=? WHERE id=?", (json.dumps(assigned), task_id))
            db.execute("INSERT INTO events(task_id, at, kind, detail) VALUES (?,?,'replica lost',?)",
                       (task_id, now, f"replica {slot} on {node}: {detail}"))

    def grant_replica(self, task_id: int, slot: int, node: str, lost: str, *, now: float | None = None) -> int:
        """Start replica ``slot`` again on ``node`` (in place of ``lost``); returns the new start's number."""
        now = time.time() if now is None else now
        with self._tx() as db:
            start = db.execute("SELECT COALESCE(MAX(start), -1) + 1 FROM replicas WHERE task_id=? AND slot=?",
                               (task_id, slot)).fetchone()[0]
            db.execute("INSERT INTO replicas(task_id, slot, start, node, state) VALUES (?,?,?,?,'starting')",
                       (task_id, slot, start, node))
            assigned = json.loads(db.execute("SELECT assigned FROM tasks WHERE id=?", (task_id,)).fetchone()[0])
            db.execute("UPDATE tasks SET assigned=? WHERE id=?", (json.dumps(assigned + [node]), task_id))
            db.execute("INSERT INTO events(task_id, at, kind, detail) VALUES (?,?,'replica replaced',?)",
                       (task_id, now, f"replica {slot}: {lost} -> {node}"))
        return int(start)


@dataclass(frozen=True)
class ReplicaRow:
    """One start of one replica of a fault-tolerant attempt."""

    slot: int
    """The replica's place in the job's layout (its ranks' ``FIREFLYER_NODE_ID`` is ``node{slot}``)."""
    start: int
    """0 for the attempt's first start, one more for each replacement."""
    node: str
    state: str
    """``starting``, ``running``, ``done`` (its ranks exited 0) or ``lost``."""
    started_at: float | None
    ended_at: float | None
    detail: str


_COLS = ("id, chain_first_id, attempt, name, user, grp, priority, nodes, command, state, assigned, submitted_at, "
         "started_at, finished_at, stop_code, whole_life_state, ranks_per_node, cwd, env, handle, stop_requested, "
         "hold, detail, fault_tolerant")


LISTING_COLS = ("chain_first_id, id, attempt, name, user, grp, priority, nodes, ranks_per_node, command, state, "
                "assigned, submitted_at, started_at, finished_at, stop_code, detail, whole_life_state, handle, "
                "fault_tolerant")


def _row(r: tuple[Any, ...]) -> TaskRow:
    return TaskRow(r[0], r[1], r[2], r[3], r[4], r[5], _PRIORITY[r[6]], r[7], json.loads(r[8]), r[9],
                   tuple(json.loads(r[10])) if r[10] != "[]" else (), r[11], r[12], r[13], r[14], r[15], r[16],
                   r[17], r[18], r[19], bool(r[20]), bool(r[21]), r[22], bool(r[23]))


_PRIORITY = {int(p): p for p in Priority}


@lru_cache(maxsize=256)
def stop_text(code: int) -> str:
    """``INTERRUPT`` or ``FAILED|TIMEOUT``: the set flags' names, or ``running`` for 0."""
    names = [f.name for f in StopCode if f.name and code & f]
    return "|".join(names) if names else "0"


class _Transaction:
    """``BEGIN IMMEDIATE`` ... ``COMMIT``, or ``ROLLBACK`` on error: one change, all or nothing."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __enter__(self) -> sqlite3.Connection:
        self.db.execute("BEGIN IMMEDIATE")
        return self.db

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            try:
                self.db.execute("COMMIT")
                return
            except sqlite3.Error:
                self._rollback()  # a COMMIT that failed (a full disk) may leave the transaction open
                raise
        self._rollback()

    def _rollback(self) -> None:
        if self.db.in_transaction:
            try:
                self.db.execute("ROLLBACK")
            except sqlite3.Error:
                pass  # SQLite undoes an unfinished transaction itself (at the latest when next opened)
