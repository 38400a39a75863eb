"""The platform's commands: ``fireflyer submit|queue|describe|logs|suspend|resume|stop|nodes|drain|undrain``
and ``fireflyer platform start|stop|status``.

They read and write the platform's SQLite state directly (``--home``, or
``FIREFLYER_PLATFORM_HOME``, default ``~/.fireflyer/platform``); the daemon acts on
what they record within a tick. Task ids are chain ids: the id ``submit`` prints stays
valid through every suspend, resume and restart (any attempt's id works too).
Every command prints a table, or JSON with ``--json``.
"""

from __future__ import annotations

import getpass
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from fireflyer.cliutil import ArgumentParser
from fireflyer.errors import UserError
from fireflyer.platform import config as platform_config
from fireflyer.platform.config import PlatformConfig
from fireflyer.platform.executor import Timeouts
from fireflyer.platform.layout import HOME_ENV, Home, read_json
from fireflyer.platform.policy import QUEUED, RUNNING, SUSPENDING, Priority
from fireflyer.platform.store import (ACTIVE, FINISHED, HELD, StopCode, Store, TaskRow, UnknownTask,
                                      stop_text)

START_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 15.0
ENV_PASSED = ("PATH", "VIRTUAL_ENV", "PYTHONPATH", "HOME", "LANG", "LC_ALL", "TMPDIR")
"""The submitter's variables a task inherits (HAI passes its task spec's environments; -e adds more)."""


# ---------------------------------------------------------------------- helpers
def _home_arg(p: ArgumentParser) -> None:
    p.add_argument("--home", default=None, help=f"the platform's directory (default: ${HOME_ENV} or "
                                                "~/.fireflyer/platform)")


def _json_arg(p: ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _open(args: Any) -> tuple[Home, Store]:
    home = Home(args.home)
    if not home.db.exists():
        raise UserError(f"no platform in {home.root}: start one with 'fireflyer platform start'"
                        + ("" if args.home else f" (or point --home/{HOME_ENV} at one)"))
    return home, Store(home.db)


def _task_id(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise UserError(f"a task id is a number, got {text!r}") from None
    if value < 1:
        raise UserError(f"a task id is a positive number, got {text!r}")
    return value


def _latest(store: Store, task_id: int) -> TaskRow:
    try:
        return store.latest(task_id)
    except UnknownTask:
        raise UserError(f"no task {task_id} (see 'fireflyer queue --all')") from None


def _when(t: float | None) -> str:
    return "-" if t is None else datetime.fromtimestamp(t).strftime("%m-%d %H:%M:%S")


def _ago(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def table(rows: Sequence[Sequence[Any]], headers: Sequence[str]) -> str:
    """A plain, aligned text table (pipes and terminals alike)."""
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    return "\n".join(lines)


def _emit(args: Any, data: Any, render: Callable[[], str]) -> int:
    print(json.dumps(data, indent=1, default=str) if args.json else render())
    return 0


def task_json(t: TaskRow) -> dict[str, Any]:
    return {"id": t.chain_first_id, "task_id": t.id, "attempt": t.attempt, "name": t.name, "user": t.user,
            "group": t.group, "priority": t.priority.name, "nodes": t.nodes, "ranks_per_node": t.ranks_per_node,
            "command": t.command, "state": t.state, "assigned": list(t.assigned), "submitted_at": t.submitted_at,
            "started_at": t.started_at, "finished_at": t.finished_at, "stop_code": t.stop_code,
            "stop": stop_text(t.stop_code) if t.state == FINISHED else None, "detail": t.detail,
            "whole_life_state": t.whole_life_state, "handle": t.handle}


def _outcome(t: TaskRow) -> str:
    if t.state != FINISHED:
        return t.state
    if t.stop_code & StopCode.MANUAL_STOP:
        return "stopped"
    if t.stop_code & (StopCode.FAILED | StopCode.INIT_FAILED | StopCode.TIMEOUT):
        return "failed"
    for flag, word in ((StopCode.INTERRUPT, "suspended"), (StopCode.UNSCHEDULABLE, "unschedulable"),
                       (StopCode.HOOK_RESTART, "restarted")):
        if t.stop_code & flag:
            return word
    return "succeeded" if t.stop_code == StopCode.STOP else stop_text(t.stop_code).lower()


# ---------------------------------------------------------------------- platform start|stop|status
def _platform(argv: list[str]) -> int:
    p = ArgumentParser(prog="fireflyer platform", description="Run the platform's scheduler daemon.")
    sub = p.add_subparsers(dest="action", required=True, metavar="start|stop|status")
    start = sub.add_parser("start", help="start the daemon (configures the platform on first start)")
    _home_arg(start)
    start.add_argument("--executor", choices=("local", "slurm"), help="local emulated nodes (default) or Slurm")
    start.add_argument("--nodes", type=int, help="emulated nodes (local executor; default 2)")
    start.add_argument("--zones", type=int, help="zones the nodes are split into (default 1)")
    start.add_argument("--ranks-per-node", type=int, help="ranks per node for tasks that don't say (default 1)")
    start.add_argument("--tick", type=float, help="seconds between scheduling cycles (default 1)")
    start.add_argument("--max-restarts", type=int, help="restarts of a failed task per chain (default 3)")
    start.add_argument("--time-share-after", type=float, help="seconds before same-priority turn-taking (14400)")
    start.add_argument("--suspend-ack", type=float, help="seconds a task has to acknowledge a suspend (5)")
    start.add_argument("--suspend-grace", type=float, help="seconds to save after acknowledging (60)")
    start.add_argument("--watchdog", type=float, help="seconds of log silence that count as a hang (1800)")
    start.add_argument("--unschedulable-after", type=float, help="seconds for all ranks to start (180)")
    start.add_argument("--prolog", help="node health check run before a task's ranks start on it (a command line)")
    start.add_argument("--partition", help="Slurm partition (slurm executor)")
    start.add_argument("--foreground", action="store_true", help="run in this process, logging to the terminal")
    stop = sub.add_parser("stop", help="stop the daemon (running tasks keep running; the next start adopts them)")
    _home_arg(stop)
    status = sub.add_parser("status", help="is the daemon up, and what it runs")
    _home_arg(status)
    _json_arg(status)
    quota = sub.add_parser("quota", help="show quotas, or set one: quota USER GROUP PRIORITY NODES "
                                         "(USER 'public' is everyone's default)")
    quota.add_argument("setting", nargs="*", metavar="USER GROUP PRIORITY NODES")
    _home_arg(quota)
    _json_arg(quota)
    args = p.parse_args(argv)
    home = Home(args.home)
    if args.action == "start":
        return _start(home, args)
    if args.action == "stop":
        return _stop_daemon(home)
    if args.action == "quota":
        return _quota(args)
    return _status(home, args)


def _quota(args: Any) -> int:
    _, store = _open(args)
    try:
        if args.setting:
            if len(args.setting) != 4:
                raise UserError("quota takes USER GROUP PRIORITY NODES, e.g. quota alice default HIGH 4")
            user, group, priority, nodes = args.setting
            try:
                store.set_quota(user, group, Priority.parse(priority), int(nodes))
            except ValueError as exc:
                raise UserError(str(exc)) from None
        rows = sorted(store.quotas().items(), key=lambda kv: (kv[0][0], kv[0][1], -kv[0][2]))
    finally:
        store.close()
    data = [{"user": u, "group": g, "priority": p.name, "nodes": n} for (u, g, p), n in rows]
    return _emit(args, data, lambda: table([(d["user"], d["group"], d["priority"], d["nodes"]) for d in data],
                                           ["USER", "GROUP", "PRIORITY", "NODES"]) if data else
                 "no quotas: every user may use every node at every priority")


def _configure(home: Home, args: Any) -> PlatformConfig:
    try:
        cfg = platform_config.load(home) or PlatformConfig()
        t = cfg.timeouts
        timeouts = Timeouts(suspend_ack=args.suspend_ack or t.suspend_ack,
                            suspend_grace=args.suspend_grace or t.suspend_grace,
                            watchdog=args.watchdog or t.watchdog,
                            unschedulable=args.unschedulable_after or t.unschedulable, kill_grace=t.kill_grace)
        changes = {k: v for k, v in {
            "executor": args.executor, "nodes": args.nodes, "zones": args.zones,
            "ranks_per_node": args.ranks_per_node, "tick": args.tick, "max_restarts": args.max_restarts,
            "time_share_after": args.time_share_after, "partition": args.partition,
            "prolog": tuple(shlex.split(args.prolog)) if args.prolog else None}.items() if v is not None}
        cfg = cfg.replace(timeouts=timeouts, **changes)
    except (TypeError, ValueError) as exc:
        raise UserError(str(exc)) from None
    return cfg


def _register_nodes(cfg: PlatformConfig, store: Store) -> int:
    if cfg.executor == "slurm":
        from fireflyer.platform.slurm import slurm_nodes

        nodes = slurm_nodes(cfg.partition)
        if not nodes:
            raise UserError("Slurm reports no nodes (is slurmctld running? see 'sinfo')")
    else:
        nodes = cfg.emulated_nodes()
        have = {n.name for n in store.nodes()}
        extra = sorted(have - {n.name for n in nodes})
        if extra:
            raise UserError(f"this platform already has nodes {', '.join(extra)} beyond --nodes {cfg.nodes}; "
                            "use a new --home to shrink it")
    store.add_nodes(nodes)
    return len(nodes)


def _start(home: Home, args: Any) -> int:
    from fireflyer.platform.daemon import daemon_pid

    pid = daemon_pid(home)
    if pid is not None:
        raise UserError(f"a platform daemon already runs for {home.root} (pid {pid}); "
                        "'fireflyer platform stop' first to change its settings")
    cfg = _configure(home, args)
    store = Store(home.db)
    try:
        count = _register_nodes(cfg, store)
    finally:
        store.close()
    platform_config.save(home, cfg)
    if args.foreground:
        from fireflyer.platform import daemon

        return daemon.main([str(home.root)])
    home.heartbeat.unlink(missing_ok=True)
    with open(home.log, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "fireflyer.platform.daemon", str(home.root)],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if home.heartbeat.exists():
            print(f"platform started: daemon pid {proc.pid}, {cfg.executor} executor, {count} nodes, "
                  f"home {home.root}")
            return 0
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    tail = home.log.read_text(errors="replace").strip().splitlines()[-1:] if home.log.exists() else []
    if proc.poll() is None:
        proc.kill()
    raise UserError(f"the daemon did not come up in {START_TIMEOUT_S:g} s"
                    + (f": {tail[0]}" if tail else f" (see {home.log})"))


def _stop_daemon(home: Home) -> int:
    from fireflyer.platform.daemon import daemon_pid

    pid = daemon_pid(home)
    if pid is None:
        print(f"no platform daemon runs for {home.root}")
        return 0
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while time.monotonic() < deadline and daemon_pid(home) is not None:
        time.sleep(0.05)
    if daemon_pid(home) is not None:
        os.kill(pid, signal.SIGKILL)
        print(f"platform daemon {pid} did not stop in {STOP_TIMEOUT_S:g} s: killed (its tasks keep running)")
        return 0
    print(f"platform daemon {pid} stopped (running tasks keep running; 'fireflyer platform start' adopts them)")
    return 0


def _status(home: Home, args: Any) -> int:
    from fireflyer.platform.daemon import daemon_pid

    pid = daemon_pid(home)
    cfg = platform_config.load(home)
    beat = read_json(home.heartbeat) if home.heartbeat.exists() else None
    counts: dict[str, int] = {}
    nodes = 0
    if home.db.exists():
        store = Store(home.db)
        try:
            for t in store.tasks(ACTIVE):
                counts[t.state] = counts.get(t.state, 0) + 1
            nodes = len(store.nodes())
        finally:
            store.close()
    data = {"home": str(home.root), "daemon_pid": pid, "running": pid is not None,
            "last_cycle": beat.get("at") if beat else None, "executor": cfg.executor if cfg else None,
            "nodes": nodes, "tasks": counts}

    def render() -> str:
        up = f"up (pid {pid}, last cycle {_ago(time.time() - beat['at'])} ago)" if pid and beat else \
            ("up (pid %s)" % pid if pid else "down")
        states = ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "no tasks"
        return (f"platform {home.root}: daemon {up}; {cfg.executor if cfg else 'not configured'} executor, "
                f"{nodes} nodes; {states}")

    return _emit(args, data, render)


# ---------------------------------------------------------------------- tasks
def _env_pairs(pairs: Iterable[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UserError(f"-e takes KEY=VALUE, got {pair!r}")
        out[key] = value
    return out


def _check_command(command: list[str], cwd: str) -> None:
    exe = command[0]
    if "/" in exe:
        path = Path(cwd, exe)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise UserError(f"command {exe!r} is not an executable file (from {cwd})")
    elif shutil.which(exe) is None:
        raise UserError(f"command {exe!r} not found on PATH")


def _submit(argv: list[str]) -> int:
    p = ArgumentParser(prog="fireflyer submit", usage="fireflyer submit -n NODES [options] -- CMD [ARGS...]",
                       description="Queue a task of whole nodes.")
    p.add_argument("-n", "--nodes", type=int, required=True, help="whole nodes the task needs (all or nothing)")
    p.add_argument("-p", "--priority", default="NORMAL",
                   help="LOW, BELOW_NORMAL, UNDER_NORMAL, NORMAL (default), ABOVE_NORMAL, HIGH, VERY_HIGH, "
                        "EXTREME_HIGH, or the number")
    p.add_argument("-g", "--group", default="default", help="the node group / quota group (default 'default')")
    p.add_argument("--name", default="", help="a name for the task (default taskID)")
    p.add_argument("--user", default=None, help="submit as this user (default: you)")
    p.add_argument("--ranks-per-node", type=int, default=None, help="ranks per node (default: the platform's)")
    p.add_argument("-e", "--env", action="append", default=[], metavar="KEY=VALUE", help="set a variable")
    p.add_argument("--request-id", default=None, help="idempotency key: resubmitting it returns the first task")
    _home_arg(p)
    _json_arg(p)
    if "--" not in argv:
        p.parse_known_args(argv)  # --help, and flag errors, come first
        raise UserError("put the task's command after '--', e.g. fireflyer submit -n 1 -- python train.py")
    split = argv.index("--")
    args, command = p.parse_args(argv[:split]), argv[split + 1:]
    if not command:
        raise UserError("no command after '--'")
    home, store = _open(args)
    try:
        cfg = platform_config.load(home) or PlatformConfig()
        try:
            priority = Priority.parse(args.priority)
        except ValueError as exc:
            raise UserError(str(exc)) from None
        nodes = store.nodes()
        if args.nodes < 1:
            raise UserError(f"-n/--nodes must be at least 1, got {args.nodes}")
        if args.nodes > len(nodes):
            raise UserError(f"the task asks for {args.nodes} nodes but the platform has {len(nodes)}")
        cwd = os.getcwd()
        _check_command(command, cwd)
        env = {k: os.environ[k] for k in ENV_PASSED if k in os.environ}
        env.update(_env_pairs(args.env))
        try:
            task_id = store.submit(user=args.user or getpass.getuser(), nodes=args.nodes, command=command,
                                   priority=priority, group=args.group, name=args.name,
                                   request_id=args.request_id, ranks_per_node=args.ranks_per_node or cfg.ranks_per_node,
                                   cwd=cwd, env=env)
        except ValueError as exc:
            raise UserError(str(exc)) from None
        t = store.task(task_id)
    finally:
        store.close()
    from fireflyer.platform.daemon import daemon_pid

    if daemon_pid(home) is None:
        print(f"note: no daemon runs for {home.root}; the task waits until 'fireflyer platform start'",
              file=sys.stderr)
    return _emit(args, task_json(t), lambda: f"submitted task {t.id} ({t.name}): {t.nodes} node(s), "
                                           f"priority {t.priority.name}, group {t.group}")


def _queue(argv: list[str]) -> int:
    p = ArgumentParser(prog="fireflyer queue", description="The platform's tasks (latest attempt of each).")
    p.add_argument("--all", action="store_true", help="include finished tasks")
    p.add_argument("--limit", type=int, default=100, help="at most this many finished tasks with --all")
    p.add_argument("--user", default=None, help="only this user's tasks")
    _home_arg(p)
    _json_arg(p)
    args = p.parse_args(argv)
    _, store = _open(args)
    try:
        active = {t.chain_first_id: t for t in store.tasks(ACTIVE)}
        rows = list(active.values())
        if args.all:
            rows += [t for t in store.recent(args.limit) if t.chain_first_id not in active]
    finally:
        store.close()
    if args.user:
        rows = [t for t in rows if t.user == args.user]
    order = {RUNNING: 0, SUSPENDING: 0, QUEUED: 1, HELD: 2, FINISHED: 3}
    rows.sort(key=lambda t: (order.get(t.state, 4), -t.priority, t.chain_first_id))
    now = time.time()

    def render() -> str:
        if not rows:
            return "no tasks" + ("" if args.all else " (--all shows finished ones)")
        return table([(t.chain_first_id, t.name, t.user, t.priority.name, t.nodes, _outcome(t), t.attempt,
                       ",".join(t.assigned) or "-",
                       _ago(now - (t.started_at or t.submitted_at)) if t.state != FINISHED else _when(t.finished_at))
                      for t in rows], ["ID", "NAME", "USER", "PRIORITY", "NODES", "STATE", "ATTEMPT", "ON", "TIME"])

    return _emit(args, [task_json(t) for t in rows], render)


def _describe(argv: list[str]) -> int:
    p = ArgumentParser(prog="fireflyer describe", description="A task, its chain of attempts and its history.")
    p.add_argument("id", help="the task's id")
    _home_arg(p)
    _json_arg(p)
    args = p.parse_args(argv)
    home, store = _open(args)
    try:
        t = _latest(store, _task_id(args.id))
        chain = store.chain(t.chain_first_id)
        events = store.chain_events(t.chain_first_id)
    finally:
        store.close()
    data = {**task_json(t), "attempts": [task_json(a) for a in chain],
            "events": [{"task_id": i, "at": at, "kind": k, "detail": d} for i, at, k, d in events],
            "logs": str(home.attempt(t.id).logs)}

    def render() -> str:
        head = [f"task {t.chain_first_id} ({t.name}): {_outcome(t)}",
                f"  user {t.user}, group {t.group}, priority {t.priority.name}, {t.nodes} node(s) x "
                f"{t.ranks_per_node} rank(s), whole-life state {t.whole_life_state}",
                f"  command: {' '.join(t.command)}", f"  logs: {home.attempt(t.id).logs}", "", "attempts:"]
        attempts = table([(a.id, a.attempt, _outcome(a), ",".join(a.assigned) or "-", _when(a.started_at),
                           _when(a.finished_at), stop_text(a.stop_code) if a.state == FINISHED else "-",
                           a.detail or "") for a in chain],
                         ["TASK", "ATTEMPT", "STATE", "NODES", "STARTED", "ENDED", "STOP", "DETAIL"])
        history = table([(_when(at), i, k, d) for i, at, k, d in events], ["AT", "TASK", "EVENT", "DETAIL"])
        return "\n".join(head) + "\n" + attempts + "\n\nhistory:\n" + history

    return _emit(args, data, render)


def _logs(argv: list[str]) -> int:
    p = ArgumentParser(prog="fireflyer logs", description="A task's per-rank log (the latest attempt's by default).")
    p.add_argument("id", help="the task's id")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing until the task finishes")
    p.add_argument("-r", "--rank", type=int, default=0, help="which rank (default 0)")
    p.add_argument("--attempt", type=int, default=None, help="which attempt of the chain (default: the latest run)")
    _home_arg(p)
    args = p.parse_args(argv)
    home, store = _open(args)
    try:
        t = _latest(store, _task_id(args.id))
        chain = store.chain(t.chain_first_id)
        if args.attempt is not None:
            picked = [a for a in chain if a.attempt == args.attempt]
            if not picked:
                raise UserError(f"task {args.id} has attempts 0..{chain[-1].attempt}, not {args.attempt}")
            target = picked[0]
        else:
            ran = [a for a in chain if a.started_at is not None]
            target = ran[-1] if ran else chain[-1]
        if args.rank < 0 or args.rank >= target.nodes * target.ranks_per_node:
            raise UserError(f"task {args.id} has ranks 0..{target.nodes * target.ranks_per_node - 1}, "
                            f"not {args.rank}")
        path = home.attempt(target.id).rank_log(args.rank)
        if not args.follow:
            if not path.exists():
                raise UserError(f"task {args.id} has no log for rank {args.rank} yet ({target.state})")
            sys.stdout.write(path.read_text(errors="replace"))
            return 0
        return _follow(home, store, target, args.rank)
    finally:
        store.close()


def _follow(home: Home, store: Store, t: TaskRow, rank: int) -> int:
    """Print the log as it grows; move on to the chain's next attempt; end when the chain finishes."""
    current, pos = t, 0
    while True:
        chunk = b""
        path = home.attempt(current.id).rank_log(rank)
        if path.exists():
            with open(path, "rb") as f:
                f.seek(pos)
                chunk = f.read()
            if chunk:
                sys.stdout.write(chunk.decode(errors="replace"))
                sys.stdout.flush()
                pos += len(chunk)
        if not chunk and store.task(current.id).state == FINISHED:
            latest = store.latest(current.id)
            if latest.id == current.id or latest.state in (FINISHED, HELD):
                if latest.id != current.id:
                    print(f"--- task {t.chain_first_id}: attempt {latest.attempt} is {_outcome(latest)}")
                return 0
            if latest.started_at is not None:
                print(f"--- task {t.chain_first_id}: attempt {latest.attempt} on {','.join(latest.assigned)}",
                      flush=True)
                current, pos = latest, 0
                continue
        time.sleep(0.2)


def _request(name: str, act: Callable[[Store, int], TaskRow], done: str) -> Callable[[list[str]], int]:
    def run(argv: list[str]) -> int:
        p = ArgumentParser(prog=f"fireflyer {name}", description=done)
        p.add_argument("id", help="the task's id")
        _home_arg(p)
        _json_arg(p)
        args = p.parse_args(argv)
        _, store = _open(args)
        try:
            task_id = _task_id(args.id)
            _latest(store, task_id)
            try:
                t = act(store, task_id)
            except ValueError as exc:
                raise UserError(str(exc)) from None
        finally:
            store.close()
        return _emit(args, task_json(t), lambda: f"task {t.chain_first_id}: {name} requested ({_outcome(t)})")

    return run


def _nodes(argv: list[str]) -> int:
    p = ArgumentParser(prog="fireflyer nodes", description="The platform's nodes.")
    _home_arg(p)
    _json_arg(p)
    args = p.parse_args(argv)
    _, store = _open(args)
    try:
        nodes = store.nodes()
        reasons = store.node_reasons()
        busy = {n: t for t in store.tasks((RUNNING, SUSPENDING)) for n in t.assigned}
    finally:
        store.close()

    def state(n: Any) -> str:
        if n.drained:
            return "drained"
        if not n.healthy:
            return "unhealthy"
        return "busy" if n.name in busy else "idle"

    data = [{"name": n.name, "zone": n.zone, "state": state(n), "healthy": n.healthy, "drained": n.drained,
             "reason": reasons.get(n.name, ""), "task": busy[n.name].chain_first_id if n.name in busy else None}
            for n in nodes]
    return _emit(args, data, lambda: table([(d["name"], d["zone"], d["state"], d["task"] or "-", d["reason"])
                                            for d in data], ["NODE", "ZONE", "STATE", "TASK", "REASON"]))


def _drain(drained: bool) -> Callable[[list[str]], int]:
    name = "drain" if drained else "undrain"

    def run(argv: list[str]) -> int:
        p = ArgumentParser(prog=f"fireflyer {name}",
                           description="Take a node out of scheduling; its task is suspended and moves elsewhere."
                           if drained else "Return a drained node to scheduling.")
        p.add_argument("node")
        if drained:
            p.add_argument("--reason", default="drained by an admin")
        _home_arg(p)
        _json_arg(p)
        args = p.parse_args(argv)
        home, store = _open(args)
        try:
            try:
                store.set_drained(args.node, drained, reason=getattr(args, "reason", ""))
            except ValueError as exc:
                raise UserError(str(exc)) from None
        finally:
            store.close()
        cfg = platform_config.load(home)
        if cfg is not None and cfg.executor == "slurm":
            from fireflyer.platform import slurm

            (slurm.drain(args.node, args.reason) if drained else slurm.undrain(args.node))
        return _emit(args, {"node": args.node, "drained": drained},
                     lambda: f"{args.node}: {'drained' if drained else 'back in service'}")

    return run


COMMANDS: dict[str, Callable[[list[str]], int]] = {
    "platform": _platform,
    "submit": _submit,
    "queue": _queue,
    "describe": _describe,
    "logs": _logs,
    "suspend": _request("suspend", lambda s, i: s.request_suspend(i),
                        "Ask a running task to save and stop; it waits, held, for 'fireflyer resume'."),
    "resume": _request("resume", lambda s, i: s.resume(i), "Queue a suspended task again, in its old place."),
    "stop": _request("stop", lambda s, i: s.request_stop(i), "Stop a task for good (it is not requeued)."),
    "nodes": _nodes,
    "drain": _drain(True),
    "undrain": _drain(False),
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in COMMANDS:
        raise UserError(f"unknown platform command {argv[:1]}; choose one of {', '.join(COMMANDS)}")
    return COMMANDS[argv[0]](argv[1:])
