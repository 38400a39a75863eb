"""What users may do with the platform, as plain data: the one core under the CLI and the HTTP server.

A :class:`PlatformApi` acts for one user over a platform home (its SQLite state and
attempt directories). The local CLI acts as everyone (``user=None``); the server opens
one per request for the token's user, who sees and controls only their own tasks
unless they are an admin. Every method returns JSON-able data and raises an
:class:`ApiError` (with an HTTP status) for bad input, unknown ids, forbidden access
or a request the task's state does not allow.
"""

from __future__ import annotations

import codecs
import functools
import getpass
import inspect
import json
import os
import shutil
import time
from functools import lru_cache
from pathlib import Path
from typing import Any, BinaryIO, Iterator, Protocol

from fireflyer.errors import FireflyerError, UserError
from fireflyer.platform import env as names
from fireflyer.platform import config as platform_config
from fireflyer.fsutil import open_owned
from fireflyer.platform.accounts import DEFAULT_PATH, AccountProblem, run_as
from fireflyer.platform.config import PlatformConfig
from fireflyer.platform.layout import Home
from fireflyer.platform.state.policy import QUEUED, RUNNING, SUSPENDING, Priority
from fireflyer.platform.state.store import (ACTIVE, FINISHED, HELD, STATES, StopCode, Store, StoreUnavailable, TaskRow,
                                      UnknownTask, stop_text)

MAX_LIMIT = 10_000
ENV_PASSED = ("PATH", "VIRTUAL_ENV", "PYTHONPATH", "HOME", "LANG", "LC_ALL", "TMPDIR")
"""The submitter's variables a local submit passes on (HAI passes its task spec's environments)."""


class ApiError(FireflyerError):
    """A request that cannot be done; the message is one line for the user."""

    status = 400


class NotFound(ApiError):
    status = 404


class Forbidden(ApiError):
    status = 403


class Conflict(ApiError):
    status = 409


class Unavailable(ApiError):
    """The platform's state cannot be used now (a full or failing disk, a database held too long): retry later."""

    status = 503


class NoPlatform(NotFound, UserError):
    """No platform lives in the home a command or server was pointed at."""


def open_home(root: str | os.PathLike | Home | None = None) -> Home:
    """The platform home at ``root`` (default ``$FIREFLYER_PLATFORM_HOME``, else ``~/.fireflyer/platform``);
    :class:`NoPlatform` unless a platform was started there."""
    home = root if isinstance(root, Home) else Home(root)
    if not home.db.exists():
        raise NoPlatform(f"no platform in {home.root}: start one with 'fireflyer platform start'"
                         + ("" if root is not None else f" (or point --home/{names.HOME} at one)"))
    return home


def parse_priority(value: object) -> Priority:
    """A priority's name or number, or :class:`ApiError` naming the levels."""
    try:
        return Priority.parse(value)  # type: ignore[arg-type]
    except ValueError as exc:
        raise ApiError(str(exc)) from None


class Api(Protocol):
    """What users may do with the platform, locally (:class:`PlatformApi`) or over HTTP
    (:class:`fireflyer.platform.commands.remote.RemoteApi`): the same methods, the same JSON-able data.

    Every method raises :class:`ApiError` (its ``status`` an HTTP status) for a request that
    cannot be done, :class:`Unavailable` when the platform's state cannot be used now.
    Task ids are chain ids (any attempt's id works too).
    """

    def close(self) -> None: ...
    def __enter__(self) -> "Api": ...
    def __exit__(self, *exc: object) -> None: ...
    def me(self) -> dict[str, Any]: ...
    def submit(self, *, nodes: int, command: list[str], priority: str | int = "NORMAL", group: str = "default",
               name: str = "", ranks_per_node: int | None = None, env: dict[str, str] | None = None,
               request_id: str | None = None, cwd: str | None = None, user: str | None = None,
               fault_tolerant: bool = False) -> dict[str, Any]: ...
    def tasks(self, *, all: bool = False, user: str | None = None, state: str | None = None,
              priority: str | None = None, limit: int = 100, offset: int = 0) -> dict[str, Any]: ...
    def describe(self, task_id: int) -> dict[str, Any]: ...
    def logs(self, task_id: int, *, rank: int = 0, attempt: int | None = None,
             tail: int | None = None) -> dict[str, Any]: ...
    def follow(self, task_id: int, *, rank: int = 0, poll: float = 0.2,
               timeout: float | None = None) -> Iterator[str]: ...
    def suspend(self, task_id: int) -> dict[str, Any]: ...
    def resume(self, task_id: int) -> dict[str, Any]: ...
    def stop(self, task_id: int) -> dict[str, Any]: ...
    def nodes(self) -> list[dict[str, Any]]: ...
    def drain(self, node: str, reason: str = "drained by an admin") -> dict[str, Any]: ...
    def undrain(self, node: str) -> dict[str, Any]: ...
    def overview(self, *, hours: float = 24.0, buckets: int = 96) -> dict[str, Any]: ...


def _answers_503(cls: type) -> type:
    """Every public method (and the constructor) raises :class:`Unavailable` where the store could not be used."""

    def guard(method):
        if inspect.isgeneratorfunction(method):
            @functools.wraps(method)
            def stream(*args, **kwargs):
                try:
                    yield from method(*args, **kwargs)
                except StoreUnavailable as exc:
                    raise Unavailable(str(exc)) from None
            return stream

        @functools.wraps(method)
        def call(*args, **kwargs):
            try:
                return method(*args, **kwargs)
            except StoreUnavailable as exc:
                raise Unavailable(str(exc)) from None
        return call

    for name, value in list(vars(cls).items()):
        if inspect.isfunction(value) and (name == "__init__" or not name.startswith("_")):
            setattr(cls, name, guard(value))
    return cls


def outcome(t: TaskRow) -> str:
    """One word for where an attempt stands or how it ended."""
    return t.state if t.state != FINISHED else _ended(t.stop_code)


@lru_cache(maxsize=256)
def _ended(code: int) -> str:
    if code & StopCode.MANUAL_STOP:
        return "stopped"
    if code & (StopCode.FAILED | StopCode.INIT_FAILED | StopCode.TIMEOUT):
        return "failed"
    for flag, word in ((StopCode.INTERRUPT, "suspended"), (StopCode.UNSCHEDULABLE, "unschedulable"),
                       (StopCode.HOOK_RESTART, "restarted")):
        if code & flag:
            return word
    return "succeeded" if code == StopCode.STOP else stop_text(code).lower()


def task_json(t: TaskRow) -> dict[str, Any]:
    return {"id": t.chain_first_id, "task_id": t.id, "attempt": t.attempt, "name": t.name, "user": t.user,
            "group": t.group, "priority": t.priority.name, "nodes": t.nodes, "ranks_per_node": t.ranks_per_node,
            "command": t.command, "state": t.state, "outcome": outcome(t), "assigned": list(t.assigned),
            "submitted_at": t.submitted_at, "started_at": t.started_at, "finished_at": t.finished_at,
            "stop_code": t.stop_code, "stop": stop_text(t.stop_code) if t.state == FINISHED else None,
            "detail": t.detail, "whole_life_state": t.whole_life_state, "handle": t.handle,
            "fault_tolerant": t.fault_tolerant}


_NAMES = {int(p): p.name for p in Priority}


def _listed(r: tuple) -> dict[str, Any]:
    """:func:`task_json` of a :meth:`Store.listing` row (the same keys, built without a TaskRow)."""
    (chain, tid, attempt, name, user, group, prio, nodes, rpn, command, state, assigned, submitted, started,
     finished, code, detail, life, handle, ft) = r
    done = state == FINISHED
    return {"id": chain, "task_id": tid, "attempt": attempt, "name": name, "user": user, "group": group,
            "priority": _NAMES[prio], "nodes": nodes, "ranks_per_node": rpn, "command": json.loads(command),
            "state": state, "outcome": _ended(code) if done else state,
            "assigned": json.loads(assigned) if assigned != "[]" else [], "submitted_at": submitted,
            "started_at": started, "finished_at": finished, "stop_code": code,
            "stop": stop_text(code) if done else None, "detail": detail, "whole_life_state": life,
            "handle": handle, "fault_tolerant": bool(ft)}


def check_command(command: list[str], cwd: str, *, path: str | None = None) -> None:
    """The command's program must exist where the task will run (``path``: the task's PATH, default ours)."""
    exe = command[0]
    if "/" in exe:
        found = Path(cwd, exe)
        if not (found.is_file() and os.access(found, os.X_OK)):
            raise ApiError(f"command {exe!r} is not an executable file (from {cwd})")
    elif shutil.which(exe, path=path) is None:
        raise ApiError(f"command {exe!r} not found on PATH")


MAX_TASK_ID = 2**62  # well inside SQLite's signed 64-bit integers
MAX_NAME = 200
MAX_GROUP = 64
MAX_REQUEST_ID = 128


def check_text(field: str, value: object, least: int, most: int) -> None:
    """A user's string: of the right type and length, with no control characters (NUL included)."""
    if not isinstance(value, str) or not least <= len(value) <= most:
        size = f"{least} to {most}" if least else f"at most {most}"
        got = f"{len(value)} characters" if isinstance(value, str) else type(value).__name__
        raise ApiError(f"{field} must be a string of {size} characters, got {got}")
    if any(ord(c) < 32 for c in value):
        raise ApiError(f"{field} must not contain control characters")


@_answers_503
class PlatformApi(Api):
    def __init__(self, home: Home, *, user: str | None = None, admin: bool = True) -> None:
        self.home = open_home(home)
        self.user = user
        self.admin = admin if user is not None else True
        self.store = Store(home.db)

    def close(self) -> None:
        self.store.close()

    def __enter__(self) -> "PlatformApi":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ helpers
    def _config(self) -> PlatformConfig:
        return platform_config.load(self.home) or PlatformConfig()

    def _chain(self, task_id: int) -> TaskRow:
        """The latest attempt of the chain ``task_id`` names, if the caller may see it."""
        if not isinstance(task_id, int) or not 1 <= task_id <= MAX_TASK_ID:
            raise ApiError(f"a task id is a number from 1 to {MAX_TASK_ID}, got {task_id!r}")
        try:
            t = self.store.latest(task_id)
        except UnknownTask:
            raise NotFound(f"no task {task_id}") from None
        if not self.admin and t.user != self.user:
            raise Forbidden(f"task {task_id} belongs to another user")
        return t

    def me(self) -> dict[str, Any]:
        return {"user": self.user or getpass.getuser(), "admin": self.admin}

    # ------------------------------------------------------------------ tasks
    def submit(self, *, nodes: int, command: list[str], priority: str | int = "NORMAL", group: str = "default",
               name: str = "", ranks_per_node: int | None = None, env: dict[str, str] | None = None,
               request_id: str | None = None, cwd: str | None = None, user: str | None = None,
               fault_tolerant: bool = False) -> dict[str, Any]:
        if user is not None and user != self.user and not self.admin:
            raise Forbidden("only an admin may submit for another user")
        owner = user or self.user or getpass.getuser()
        prio = parse_priority(priority)
        if not isinstance(nodes, int) or nodes < 1:
            raise ApiError(f"a task needs at least 1 node, got {nodes!r}")
        have = len(self.store.nodes())
        if nodes > have:
            raise ApiError(f"the task asks for {nodes} nodes but the platform has {have}")
        if not command or not all(isinstance(c, str) and c for c in command):
            raise ApiError("a task needs a command: a list of non-empty strings")
        if not isinstance(fault_tolerant, bool):
            raise ApiError(f"fault_tolerant must be true or false, got {fault_tolerant!r}")
        if fault_tolerant and nodes < 2:
            raise ApiError(f"a fault-tolerant task needs at least 2 nodes (each node is a replica, and one replica "
                           f"has nothing to go on with when it is lost), got {nodes}")
        if fault_tolerant and self._config().executor != "local":
            raise ApiError(f"fault-tolerant tasks run on the local executor only for now, not on "
                           f"{self._config().executor}; submit without --fault-tolerant")
        rpn = self._config().ranks_per_node if ranks_per_node is None else ranks_per_node
        slots = self._config().slots()
        if not isinstance(rpn, int) or isinstance(rpn, bool) or not 1 <= rpn <= slots:
            raise ApiError(f"ranks_per_node must be 1..{slots} (the slots of a node), got {rpn!r}")
        check_text("name", name, 0, MAX_NAME)
        check_text("group", group, 1, MAX_GROUP)
        if request_id is not None:
            check_text("request_id", request_id, 1, MAX_REQUEST_ID)
        if not self.admin:
            self._check_entitled(owner, group, prio)
        cfg = self._config()
        try:
            account = run_as(owner, self.store.unix_accounts(), isolate=cfg.isolate, allow_root=cfg.allow_root_tasks)
        except AccountProblem as exc:
            raise Forbidden(str(exc)) from None
        cwd = cwd or (account.home if account else os.getcwd())
        check_text("cwd", cwd, 1, 4096)
        if not os.path.isabs(cwd) or not os.path.isdir(cwd):
            raise ApiError(f"working directory {cwd!r} does not exist (give an absolute path)")
        if account is not None and not account.can_enter(cwd):
            raise ApiError(f"working directory {cwd!r} is not one {account.name} can enter (tasks of {owner} run "
                           f"as {account.name})")
        check_command(command, cwd, path=(env or {}).get("PATH", DEFAULT_PATH) if account else None)
        for key, value in (env or {}).items():
            if not key or "=" in key or "\0" in key or "\0" in str(value):
                raise ApiError(f"bad environment variable {key!r}")
        try:
            task_id = self.store.submit(user=owner, nodes=nodes, command=list(command), priority=prio, group=group,
                                        name=name, request_id=request_id,
                                        ranks_per_node=rpn, cwd=cwd, env=dict(env or {}),
                                        fault_tolerant=fault_tolerant)
        except ValueError as exc:
            raise ApiError(str(exc)) from None
        return task_json(self.store.task(task_id))

    def _check_entitled(self, user: str, group: str, priority: Priority) -> None:
        """A non-admin submits only in their groups, and above NORMAL only where a quota grants it."""
        if not isinstance(group, str) or not self.store.is_member(user, group):
            raise Forbidden(f"{user} is not in group {group!r}: an admin adds them with "
                            f"'fireflyer platform group {group} add {user}'")
        if priority > Priority.NORMAL:
            quotas = self.store.quotas()
            granted = max((quotas.get((who, group, priority), 0) for who in (user, "public")), default=0)
            if granted < 1:
                raise Forbidden(f"priority {priority.name} in group {group!r} needs a quota that grants it: an admin "
                                f"sets one with 'fireflyer platform quota {user} {group} {priority.name} NODES'")

    def tasks(self, *, all: bool = False, user: str | None = None, state: str | None = None,
              priority: str | None = None, limit: int = 100, offset: int = 0) -> dict[str, Any]:
        if not 1 <= limit <= MAX_LIMIT or offset < 0:
            raise ApiError(f"limit must be 1..{MAX_LIMIT} and offset at least 0")
        if state is not None and state not in STATES:
            raise ApiError(f"unknown state {state!r}; choose one of {', '.join(STATES)}")
        prio = None if priority is None else parse_priority(priority)
        if not self.admin:
            if user is not None and user != self.user:
                raise Forbidden("only an admin may list another user's tasks")
            user = self.user
        total, rows = self.store.listing(active_only=not all and state is None, user=user, state=state,
                                         priority=None if prio is None else int(prio), limit=limit, offset=offset)
        return {"tasks": [_listed(r) for r in rows], "total": total, "limit": limit, "offset": offset}

    def describe(self, task_id: int) -> dict[str, Any]:
        t = self._chain(task_id)
        chain = self.store.chain(t.chain_first_id)
        events = self.store.chain_events(t.chain_first_id)
        out = {**task_json(t), "attempts": [task_json(a) for a in chain],
               "events": [{"task_id": i, "at": at, "kind": k, "detail": d} for i, at, k, d in events],
               "logs": str(self.home.attempt(t.id).logs)}
        if t.fault_tolerant:
            out.update(self._replicas(chain))
        return out

    def _replicas(self, chain: list[TaskRow]) -> dict[str, Any]:
        """A fault-tolerant chain's replicas (of its latest attempt that ran: each slot's current node and state,
        and how often it was replaced) and the quorum its Lighthouse last formed (while it runs)."""
        ran = [a for a in chain if a.started_at is not None]
        if not ran:
            return {"replicas": [], "quorum": None}
        t = ran[-1]
        slots: dict[int, dict[str, Any]] = {}
        for r in self.store.replicas(t.id):
            slots[r.slot] = {"slot": r.slot, "name": f"node{r.slot}", "node": r.node, "state": r.state,
                             "restarts": r.start, "started_at": r.started_at, "ended_at": r.ended_at,
                             "detail": r.detail}
        quorum = None
        if t.state in (RUNNING, SUSPENDING):
            adir = self.home.attempt(t.id)
            try:
                data = adir.read_json(adir.root / "replicas.json", limit=1 << 20)
            except (OSError, ValueError):
                data = None
            q = data.get("quorum") if isinstance(data, dict) else None
            if isinstance(q, dict) and isinstance(q.get("id"), int) and isinstance(q.get("replicas"), list):
                quorum = {"id": q["id"], "replicas": [str(n) for n in q["replicas"][:1000]],
                          "at": q.get("at") if isinstance(q.get("at"), (int, float)) else None}
        return {"replicas": [slots[s] for s in sorted(slots)], "quorum": quorum}

    def _attempt_for_logs(self, t: TaskRow, attempt: int | None) -> TaskRow:
        chain = self.store.chain(t.chain_first_id)
        if attempt is not None:
            picked = [a for a in chain if a.attempt == attempt]
            if not picked:
                raise NotFound(f"task {t.chain_first_id} has attempts 0..{chain[-1].attempt}, not {attempt}")
            return picked[0]
        ran = [a for a in chain if a.started_at is not None]
        return ran[-1] if ran else chain[-1]

    def log_path(self, task_id: int, *, rank: int = 0, attempt: int | None = None) -> tuple[Path, TaskRow]:
        target = self._attempt_for_logs(self._chain(task_id), attempt)
        ranks = target.nodes * target.ranks_per_node
        if not isinstance(rank, int) or not 0 <= rank < ranks:
            raise ApiError(f"task {task_id} has ranks 0..{ranks - 1}, not {rank}")
        return self.home.attempt(target.id).rank_log(rank), target

    def logs(self, task_id: int, *, rank: int = 0, attempt: int | None = None,
             tail: int | None = None) -> dict[str, Any]:
        path, target = self.log_path(task_id, rank=rank, attempt=attempt)
        if tail is not None and tail < 1:
            raise ApiError(f"tail must be at least 1, got {tail}")
        try:
            with self._open_log(target, rank) as f:
                text = _tail(f, tail) if tail else f.read().decode(errors="replace")
        except FileNotFoundError:
            raise NotFound(f"task {task_id} has no log for rank {rank} yet ({target.state})") from None
        return {"task_id": target.chain_first_id, "attempt": target.attempt, "rank": rank, "text": text,
                "state": target.state}

    def _open_log(self, t: TaskRow, rank: int) -> BinaryIO:
        """A rank's log, opened only if it is a file of the attempt's account (the platform may be root,
        and the task could have put a link to any file there)."""
        adir = self.home.attempt(t.id)
        try:
            return os.fdopen(open_owned(adir.rank_log(rank), adir.owner), "rb")
        except PermissionError:
            raise Forbidden(f"the log of rank {rank} of task {t.chain_first_id} is not a file of the task's own "
                            "account, so it is not shown") from None

    def follow(self, task_id: int, *, rank: int = 0, poll: float = 0.2,
               timeout: float | None = None) -> Iterator[str]:
        """The log as it grows, across the chain's attempts; ends when the chain finishes or is held."""
        _, current = self.log_path(task_id, rank=rank)
        first = current.chain_first_id
        pos = 0
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a character may span two reads
        deadline = None if timeout is None else time.monotonic() + timeout
        while deadline is None or time.monotonic() < deadline:
            chunk = b""
            try:
                with self._open_log(current, rank) as f:
                    f.seek(pos)
                    chunk = f.read()
            except FileNotFoundError:
                pass
            else:
                if chunk:
                    pos += len(chunk)
                    yield decoder.decode(chunk)
            if not chunk and self.store.task(current.id).state == FINISHED:
                latest = self.store.latest(current.id)
                if latest.id == current.id or latest.state in (FINISHED, HELD):
                    if latest.id != current.id:
                        yield f"--- task {first}: attempt {latest.attempt} is {outcome(latest)}\n"
                    return
                if latest.started_at is not None:
                    yield f"--- task {first}: attempt {latest.attempt} on {','.join(latest.assigned)}\n"
                    current, pos = latest, 0
                    decoder.reset()
                    continue
            yield ""  # nothing new: a consumer (the server's log stream) may stop here between polls
            time.sleep(poll)

    def suspend(self, task_id: int) -> dict[str, Any]:
        return self._request(task_id, self.store.request_suspend)

    def resume(self, task_id: int) -> dict[str, Any]:
        return self._request(task_id, self.store.resume)

    def stop(self, task_id: int) -> dict[str, Any]:
        return self._request(task_id, self.store.request_stop)

    def _request(self, task_id: int, act: Any) -> dict[str, Any]:
        self._chain(task_id)
        try:
            return task_json(act(task_id))
        except ValueError as exc:
            raise Conflict(str(exc)) from None

    # ------------------------------------------------------------------ nodes and the cluster
    def nodes(self, running: list[TaskRow] | None = None) -> list[dict[str, Any]]:
        """Every node with its state; ``running``: the attempts holding nodes, when the caller has them."""
        reasons = self.store.node_reasons()
        if running is None:
            running = self.store.tasks((RUNNING, SUSPENDING))
        busy = {n: t for t in running for n in t.assigned}
        out = []
        for n in self.store.nodes():
            state = "drained" if n.drained else "unhealthy" if not n.healthy else "busy" if n.name in busy else "idle"
            out.append({"name": n.name, "zone": n.zone, "state": state, "healthy": n.healthy, "drained": n.drained,
                        "reason": reasons.get(n.name, ""),
                        "task": busy[n.name].chain_first_id if n.name in busy else None})
        return out

    def _set_drained(self, node: str, drained: bool, reason: str) -> dict[str, Any]:
        self._admin("drain or undrain nodes")
        try:
            self.store.set_drained(node, drained, reason=reason)
        except ValueError as exc:
            raise NotFound(str(exc)) from None
        if self._config().executor == "slurm":
            from fireflyer.platform.executors import slurm

            try:
                slurm.drain(node, reason) if drained else slurm.undrain(node)
            except (RuntimeError, OSError) as exc:
                raise ApiError(f"drained here, but Slurm refused: {exc}") from None
        return {"node": node, "drained": drained}

    def drain(self, node: str, reason: str = "drained by an admin") -> dict[str, Any]:
        return self._set_drained(node, True, reason)

    def undrain(self, node: str) -> dict[str, Any]:
        return self._set_drained(node, False, "")

    # ------------------------------------------------------------------ quotas and groups (admins)
    def _admin(self, what: str) -> None:
        if not self.admin:
            raise Forbidden(f"only an admin may {what}")

    def quotas(self) -> list[dict[str, Any]]:
        """Every quota row, by user, group and priority (highest first)."""
        rows = sorted(self.store.quotas().items(), key=lambda kv: (kv[0][0], kv[0][1], -kv[0][2]))
        return [{"user": u, "group": g, "priority": p.name, "nodes": n} for (u, g, p), n in rows]

    def set_quota(self, user: str, group: str, priority: str | int, nodes: int | str) -> list[dict[str, Any]]:
        """Let ``user`` (``public``: everyone without a row) hold ``nodes`` nodes in ``group`` at ``priority``."""
        self._admin("set quotas")
        prio = parse_priority(priority)
        try:
            self.store.set_quota(user, group, prio, int(nodes))
        except ValueError as exc:
            raise ApiError(str(exc)) from None
        return self.quotas()

    def default_quota(self) -> int | str | None:
        """The platform's ``default_quota`` setting (``"half"``, a node count, or None: no default)."""
        return self._config().policy.default_quota

    def groups(self) -> list[dict[str, Any]]:
        """Every group with members (everyone is in ``default`` without being listed)."""
        return [{"group": g, "users": us} for g, us in sorted(self.store.members().items())]

    def set_members(self, group: str, users: list[str], *, member: bool) -> list[dict[str, Any]]:
        """Put ``users`` in ``group`` (or, ``member=False``, take them out)."""
        self._admin("change groups")
        check_text("group", group, 1, MAX_GROUP)
        for user in users:
            check_text("user", user, 1, MAX_GROUP)
        if group == "default":
            raise ApiError("everyone is in group 'default'; it has no members to change")
        for user in users:
            self.store.set_member(user, group, member=member)
        return self.groups()

    def overview(self, *, hours: float = 24.0, buckets: int = 96) -> dict[str, Any]:
        if not 0 < hours <= 24 * 30 or not 1 <= buckets <= 1000:
            raise ApiError("hours must be in (0, 720] and buckets in 1..1000")
        active = self.store.tasks(ACTIVE)
        nodes = self.nodes([t for t in active if t.state in (RUNNING, SUSPENDING)])
        counts = {k: sum(1 for n in nodes if n["state"] == k) for k in ("busy", "idle", "drained", "unhealthy")}
        usable = counts["busy"] + counts["idle"]
        queue = {p.name: 0 for p in sorted(Priority, reverse=True)}
        running = dict(queue)
        for t in active:
            if t.state == QUEUED:
                queue[t.priority.name] += 1
            elif t.state in (RUNNING, SUSPENDING):
                running[t.priority.name] += 1
        used: dict[tuple[str, str, Priority], int] = {}
        for t in active:
            if t.state in (RUNNING, SUSPENDING):
                used[(t.user, t.group, t.priority)] = used.get((t.user, t.group, t.priority), 0) + t.nodes
        quotas = self.store.quotas()
        default = self._config().policy.for_nodes(len(nodes)).default_quota
        keys = sorted(set(used) | set(quotas), key=lambda k: (k[0], k[1], -k[2]))
        quota_use = [{"user": u, "group": g, "priority": p.name, "used": used.get((u, g, p), 0),
                      "quota": quotas.get((u, g, p), quotas.get(("public", g, p), default))}
                     for u, g, p in keys if self.admin or u == self.user]
        now = time.time()
        start = now - hours * 3600
        width = hours * 3600 / buckets
        busy_time = [0.0] * buckets
        for started, finished, n in self.store.node_intervals(since=start):
            lo, hi = max(started, start), min(finished if finished is not None else now, now)
            if hi <= lo:
                continue
            first, last = int((lo - start) // width), min(buckets - 1, int((hi - start) // width))
            for b in range(first, last + 1):
                b0 = start + b * width
                overlap = min(hi, b0 + width) - max(lo, b0)
                if overlap > 0:
                    busy_time[b] += overlap * n
        history = [{"at": start + (b + 1) * width, "busy": busy_time[b] / width, "total": len(nodes)}
                   for b in range(buckets)]
        return {"nodes": {"total": len(nodes), **counts}, "utilisation": counts["busy"] / usable if usable else 0.0,
                "queue_by_priority": queue, "running_by_priority": running, "quota_use": quota_use,
                "history": history}


def _tail(f: BinaryIO, lines: int) -> str:
    """The last ``lines`` lines, reading only the end of a large file."""
    pos = f.seek(0, os.SEEK_END)
    data = b""
    while pos > 0 and data.count(b"\n") <= lines:
        step = min(1 << 16, pos)
        pos -= step
        f.seek(pos)
        data = f.read(step) + data
    return b"".join(data.splitlines(keepends=True)[-lines:]).decode(errors="replace")
