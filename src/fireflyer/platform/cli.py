"""The platform's commands: ``fireflyer submit|queue|describe|logs|suspend|resume|stop|nodes|drain|undrain``
and ``fireflyer platform start|stop|status``.

They read and write the platform's SQLite state directly (``--home``, or
``FIREFLYER_PLATFORM_HOME``, default ``~/.fireflyer/platform``); the daemon acts on
what they record within a tick. Task ids are chain ids: the id ``submit`` prints stays
valid through every suspend, resume and restart (any attempt's id works too).
Every command prints a table, or JSON with ``--json``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from datetime import datetime
from typing import Any, Callable, Iterable, Sequence

from fireflyer.cliutil import ArgumentParser
from fireflyer.errors import UserError
from fireflyer.platform import config as platform_config
from fireflyer.platform.config import PlatformConfig
from fireflyer.platform.executor import Timeouts
from fireflyer.platform.env import HOME as HOME_ENV
from fireflyer.platform.layout import Home
from fireflyer.platform.policy import Priority
from fireflyer.platform.api import ENV_PASSED, MAX_GROUP, MAX_TASK_ID, ApiError, PlatformApi, Unavailable, check_text
from fireflyer.platform.remote import SERVER_ENV, TOKEN_ENV, RemoteApi
from fireflyer.platform.store import ACTIVE, FINISHED, Store, StoreUnavailable

START_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 15.0


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
    if not 1 <= value <= MAX_TASK_ID:
        raise UserError(f"a task id is a number from 1 to {MAX_TASK_ID}, got {text!r}")
    return value


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


def _target_args(p: ArgumentParser) -> None:
    """Where a command acts: a local home, or a server (``--server`` / ``FIREFLYER_SERVER``) with a token."""
    _home_arg(p)
    p.add_argument("--server", default=os.environ.get(SERVER_ENV) or None,
                   help=f"a platform server's URL (default ${SERVER_ENV}); the token comes from ${TOKEN_ENV}")
    _json_arg(p)


class _Api:
    """The API a command acts through, with its errors turned into one-line user errors."""

    def __init__(self, args: Any) -> None:
        try:
            if args.server:
                self.api: Any = RemoteApi(args.server, os.environ.get(TOKEN_ENV))
            else:
                home = Home(args.home)
                if not home.db.exists():
                    raise UserError(f"no platform in {home.root}: start one with 'fireflyer platform start'"
                                    + ("" if args.home else f" (or point --home/{HOME_ENV} at one)"))
                self.api = PlatformApi(home)
        except Unavailable as exc:
            raise RuntimeError(str(exc)) from None
        except ApiError as exc:
            raise UserError(str(exc)) from None
        self.remote = bool(args.server)

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self.api, name)

        def call(*a: Any, **kw: Any) -> Any:
            try:
                return method(*a, **kw)
            except Unavailable as exc:  # not the user's mistake: exit 1, try again later
                raise RuntimeError(str(exc)) from None
            except ApiError as exc:
                raise UserError(str(exc)) from None

        return call

    def __enter__(self) -> "_Api":
        return self

    def __exit__(self, *exc: object) -> None:
        self.api.close()


# ---------------------------------------------------------------------- platform start|stop|status
def _platform(argv: list[str]) -> int:
    if argv and argv[0] in ("serve", "user"):  # the HTTP server and its users
        from fireflyer.platform.server.cli import main as server_main

        return server_main(argv)
    p = ArgumentParser(prog="fireflyer platform", description="Run the platform's scheduler daemon, its HTTP server "
                       "('fireflyer platform serve --help') and its users ('fireflyer platform user --help').")
    sub = p.add_subparsers(dest="action", required=True, metavar="start|stop|status|quota|group|serve|user")
    start = sub.add_parser("start", help="start the daemon (configures the platform on first start)")
    _home_arg(start)
    start.add_argument("--executor", choices=("local", "slurm"), help="local emulated nodes (default) or Slurm")
    start.add_argument("--nodes", type=int, help="emulated nodes (local executor; default 2)")
    start.add_argument("--zones", type=int, help="zones the nodes are split into (default 1)")
    start.add_argument("--ranks-per-node", type=int, help="ranks per node for tasks that don't say (default 1)")
    start.add_argument("--tick", type=float, help="seconds between scheduling cycles (default 1)")
    start.add_argument("--max-restarts", type=int, help="restarts of a failed task per chain (default 3)")
    start.add_argument("--time-share-after", type=float, help="seconds before same-priority turn-taking (14400)")
    start.add_argument("--demote-after", type=float,
                       help="seconds after which a running ABOVE_NORMAL task counts as NORMAL (1800)")
    start.add_argument("--suspend-ack", type=float, help="seconds a task has to acknowledge a suspend (5)")
    start.add_argument("--suspend-grace", type=float, help="seconds to save after acknowledging (60)")
    start.add_argument("--watchdog", type=float, help="seconds of log silence that count as a hang (1800)")
    start.add_argument("--unschedulable-after", type=float, help="seconds for all ranks to start (180)")
    start.add_argument("--default-quota", metavar="NODES|half|none",
                       help="nodes a user without a quota row holds for sure per group and priority; beyond them "
                            "their tasks only borrow idle nodes (default half, rounded up; none: no default)")
    start.add_argument("--prolog", help="node health check run before a task's ranks start on it (a command line)")
    start.add_argument("--partition", help="Slurm partition (slurm executor)")
    start.add_argument("--runs-dir", help="where attempt folders live (default HOME/tasks); an isolating platform "
                                          "needs one every user can reach")
    start.add_argument("--isolate", action="store_true", default=None,
                       help="run every task as its owner's Unix account (on as soon as a user maps to one)")
    start.add_argument("--allow-root-tasks", action="store_true", default=None,
                       help="let a user mapped to root run tasks as root")
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
    group = sub.add_parser("group", help="show groups, or change one: group GROUP add|remove USER... "
                                         "(everyone is in 'default')")
    group.add_argument("setting", nargs="*", metavar="GROUP add|remove USER")
    _home_arg(group)
    _json_arg(group)
    args = p.parse_args(argv)
    home = Home(args.home)
    if args.action == "group":
        return _group(args)
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
    default = (platform_config.load(Home(args.home)) or PlatformConfig()).policy.default_quota
    held = "half the nodes" if default == "half" else f"{default} node(s)"
    fallback = ("every user may hold every node" if default is None else f"a user without a row holds {held} for "
                "sure per group and priority, and beyond that only borrows idle nodes (default_quota)")
    return _emit(args, data, lambda: table([(d["user"], d["group"], d["priority"], d["nodes"]) for d in data],
                                           ["USER", "GROUP", "PRIORITY", "NODES"]) + f"\n{fallback}" if data else
                 f"no quota rows: {fallback}")


def _group(args: Any) -> int:
    _, store = _open(args)
    try:
        if args.setting:
            if len(args.setting) < 3 or args.setting[1] not in ("add", "remove"):
                raise UserError("group takes GROUP add|remove USER..., e.g. group vision add alice bob")
            name, action, *users = args.setting
            try:
                check_text("group", name, 1, MAX_GROUP)
                for user in users:
                    check_text("user", user, 1, MAX_GROUP)
            except ApiError as exc:
                raise UserError(str(exc)) from None
            if name == "default":
                raise UserError("everyone is in group 'default'; it has no members to change")
            for user in users:
                store.set_member(user, name, member=action == "add")
        groups = store.members()
    finally:
        store.close()
    data = [{"group": g, "users": us} for g, us in sorted(groups.items())]
    return _emit(args, data, lambda: table([(d["group"], " ".join(d["users"])) for d in data], ["GROUP", "USERS"])
                 if data else "no groups but 'default', which everyone is in")


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
            "partition": args.partition, "isolate": args.isolate, "allow_root_tasks": args.allow_root_tasks,
            "runs_dir": os.path.abspath(args.runs_dir) if args.runs_dir else None,
            "prolog": tuple(shlex.split(args.prolog)) if args.prolog else None}.items() if v is not None}
        policy = {k: v for k, v in {"time_share_after": args.time_share_after,
                                    "demote_after": args.demote_after}.items() if v is not None}
        if args.default_quota is not None:
            text = args.default_quota.strip().lower()
            policy["default_quota"] = (None if text == "none" else text if text == "half" else
                                       int(text) if text.isdigit() else args.default_quota)
        cfg = cfg.replace(timeouts=timeouts, policy=dataclasses.replace(cfg.policy, **policy), **changes)
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
    """One line (or JSON) on the daemon and the tasks; exit 1 when the daemon is unhealthy or the state unreadable."""
    from fireflyer.platform.daemon import daemon_pid, read_heartbeat, why_unhealthy

    pid = daemon_pid(home)
    cfg = platform_config.load(home)
    beat = read_heartbeat(home)
    problem = why_unhealthy(beat, cfg.tick if cfg else 1.0, time.time()) if pid else None
    counts: dict[str, int] = {}
    nodes = 0
    unreadable = None
    if home.db.exists():
        try:
            store = Store(home.db)
            try:
                for t in store.tasks(ACTIVE):
                    counts[t.state] = counts.get(t.state, 0) + 1
                nodes = len(store.nodes())
            finally:
                store.close()
        except StoreUnavailable as exc:
            unreadable = str(exc)
    data = {"home": str(home.root), "daemon_pid": pid, "running": pid is not None,
            "healthy": None if pid is None else problem is None, "problem": problem,
            "last_cycle": beat.get("at") if beat else None, "executor": cfg.executor if cfg else None,
            "nodes": nodes, "tasks": None if unreadable else counts, "unreadable": unreadable}

    def render() -> str:
        up = f"up (pid {pid}, last cycle {_ago(time.time() - beat['at'])} ago)" if pid and beat else \
            ("up (pid %s)" % pid if pid else "down")
        if problem:
            up = f"unhealthy: {problem} (pid {pid})"
        states = ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "no tasks"
        if unreadable:
            states = f"tasks unknown: {unreadable}"
        return (f"platform {home.root}: daemon {up}; {cfg.executor if cfg else 'not configured'} executor, "
                f"{nodes} nodes; {states}")

    _emit(args, data, render)
    return 1 if problem or unreadable else 0


# ---------------------------------------------------------------------- tasks
def _env_pairs(pairs: Iterable[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UserError(f"-e takes KEY=VALUE, got {pair!r}")
        out[key] = value
    return out


def _submit(argv: list[str]) -> int:
    p = ArgumentParser(prog="fireflyer submit", usage="fireflyer submit -n NODES [options] -- CMD [ARGS...]",
                       description="Queue a task of whole nodes.")
    p.add_argument("-n", "--nodes", type=int, required=True, help="whole nodes the task needs (all or nothing)")
    p.add_argument("-p", "--priority", default="NORMAL",
                   help="LOW, BELOW_NORMAL, UNDER_NORMAL, NORMAL (default), ABOVE_NORMAL, HIGH, VERY_HIGH, "
                        "EXTREME_HIGH, or the number")
    p.add_argument("-g", "--group", default="default", help="the node group / quota group (default 'default')")
    p.add_argument("--name", default="", help="a name for the task (default taskID)")
    p.add_argument("--user", default=None, help="submit for this user (default: you; others need an admin)")
    p.add_argument("--ranks-per-node", type=int, default=None, help="ranks per node (default: the platform's)")
    p.add_argument("-e", "--env", action="append", default=[], metavar="KEY=VALUE", help="set a variable")
    p.add_argument("--request-id", default=None, help="idempotency key: resubmitting it returns the first task")
    _target_args(p)
    if "--" not in argv:
        p.parse_known_args(argv)  # --help, and flag errors, come first
        raise UserError("put the task's command after '--', e.g. fireflyer submit -n 1 -- python train.py")
    split = argv.index("--")
    args, command = p.parse_args(argv[:split]), argv[split + 1:]
    if not command:
        raise UserError("no command after '--'")
    env = _env_pairs(args.env)
    with _Api(args) as api:
        if not api.remote:  # a local task inherits the submitter's paths; a remote one the server's
            env = {**{k: os.environ[k] for k in ENV_PASSED if k in os.environ}, **env}
        t = api.submit(nodes=args.nodes, command=command, priority=args.priority, group=args.group,
                       name=args.name, ranks_per_node=args.ranks_per_node, env=env, request_id=args.request_id,
                       cwd=os.getcwd(), user=args.user)
        if not api.remote:
            from fireflyer.platform.daemon import daemon_pid

            home = api.api.home
            if daemon_pid(home) is None:
                print(f"note: no daemon runs for {home.root}; the task waits until 'fireflyer platform start'",
                      file=sys.stderr)
    return _emit(args, t, lambda: f"submitted task {t['id']} ({t['name']}): {t['nodes']} node(s), "
                                  f"priority {t['priority']}, group {t['group']}")


def _queue(argv: list[str]) -> int:
    p = ArgumentParser(prog="fireflyer queue", description="The platform's tasks (latest attempt of each).")
    p.add_argument("--all", action="store_true", help="include finished tasks")
    p.add_argument("--limit", type=int, default=100, help="at most this many tasks (default 100)")
    p.add_argument("--offset", type=int, default=0, help="skip this many first (paging)")
    p.add_argument("--user", default=None, help="only this user's tasks")
    p.add_argument("--state", default=None, help="only tasks in this state (queued, running, held, finished, ...)")
    _target_args(p)
    args = p.parse_args(argv)
    with _Api(args) as api:
        page = api.tasks(all=args.all, user=args.user, state=args.state, limit=args.limit, offset=args.offset)
    rows = page["tasks"]
    now = time.time()

    def render() -> str:
        if not rows:
            return "no tasks" + ("" if args.all else " (--all shows finished ones)")
        out = table([(t["id"], t["name"], t["user"], t["priority"], t["nodes"], t["outcome"], t["attempt"],
                      ",".join(t["assigned"]) or "-",
                      _ago(now - (t["started_at"] or t["submitted_at"])) if t["state"] != FINISHED
                      else _when(t["finished_at"])) for t in rows],
                    ["ID", "NAME", "USER", "PRIORITY", "NODES", "STATE", "ATTEMPT", "ON", "TIME"])
        more = page["total"] - page["offset"] - len(rows)
        return out + (f"\n({more} more: --offset {page['offset'] + len(rows)})" if more > 0 else "")

    return _emit(args, rows, render)


def _describe(argv: list[str]) -> int:
    p = ArgumentParser(prog="fireflyer describe", description="A task, its chain of attempts and its history.")
    p.add_argument("id", help="the task's id")
    _target_args(p)
    args = p.parse_args(argv)
    with _Api(args) as api:
        d = api.describe(_task_id(args.id))

    def render() -> str:
        head = [f"task {d['id']} ({d['name']}): {d['outcome']}",
                f"  user {d['user']}, group {d['group']}, priority {d['priority']}, {d['nodes']} node(s) x "
                f"{d['ranks_per_node']} rank(s), whole-life state {d['whole_life_state']}",
                f"  command: {' '.join(d['command'])}"]
        if d.get("logs"):
            head.append(f"  logs: {d['logs']}")
        head += ["", "attempts:"]
        attempts = table([(a["task_id"], a["attempt"], a["outcome"], ",".join(a["assigned"]) or "-",
                           _when(a["started_at"]), _when(a["finished_at"]), a["stop"] or "-", a["detail"] or "")
                          for a in d["attempts"]],
                         ["TASK", "ATTEMPT", "STATE", "NODES", "STARTED", "ENDED", "STOP", "DETAIL"])
        history = table([(_when(e["at"]), e["task_id"], e["kind"], e["detail"]) for e in d["events"]],
                        ["AT", "TASK", "EVENT", "DETAIL"])
        return "\n".join(head) + "\n" + attempts + "\n\nhistory:\n" + history

    return _emit(args, d, render)


def _logs(argv: list[str]) -> int:
    p = ArgumentParser(prog="fireflyer logs", description="A task's per-rank log (the latest attempt's by default).")
    p.add_argument("id", help="the task's id")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing until the task finishes")
    p.add_argument("-r", "--rank", type=int, default=0, help="which rank (default 0)")
    p.add_argument("--attempt", type=int, default=None, help="which attempt of the chain (default: the latest run)")
    p.add_argument("--tail", type=int, default=None, help="only the last N lines")
    _home_arg(p)
    p.add_argument("--server", default=os.environ.get(SERVER_ENV) or None,
                   help=f"a platform server's URL (default ${SERVER_ENV}); the token comes from ${TOKEN_ENV}")
    args = p.parse_args(argv)
    task_id = _task_id(args.id)
    with _Api(args) as api:
        if not args.follow:
            sys.stdout.write(api.logs(task_id, rank=args.rank, attempt=args.attempt, tail=args.tail)["text"])
            return 0
        for chunk in api.follow(task_id, rank=args.rank):
            sys.stdout.write(chunk)
            sys.stdout.flush()
    return 0


def _request(name: str, done: str) -> Callable[[list[str]], int]:
    def run(argv: list[str]) -> int:
        p = ArgumentParser(prog=f"fireflyer {name}", description=done)
        p.add_argument("id", help="the task's id")
        _target_args(p)
        args = p.parse_args(argv)
        with _Api(args) as api:
            t = getattr(api, name)(_task_id(args.id))
        return _emit(args, t, lambda: f"task {t['id']}: {name} requested ({t['outcome']})")

    return run


def _nodes(argv: list[str]) -> int:
    p = ArgumentParser(prog="fireflyer nodes", description="The platform's nodes.")
    _target_args(p)
    args = p.parse_args(argv)
    with _Api(args) as api:
        data = api.nodes()
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
        _target_args(p)
        args = p.parse_args(argv)
        with _Api(args) as api:
            out = api.drain(args.node, args.reason) if drained else api.undrain(args.node)
        return _emit(args, out, lambda: f"{args.node}: {'drained' if drained else 'back in service'}")

    return run


COMMANDS: dict[str, Callable[[list[str]], int]] = {
    "platform": _platform,
    "submit": _submit,
    "queue": _queue,
    "describe": _describe,
    "logs": _logs,
    "suspend": _request("suspend", "Ask a running task to save and stop; it waits, held, for 'fireflyer resume'."),
    "resume": _request("resume", "Queue a suspended task again, in its old place."),
    "stop": _request("stop", "Stop a task for good (it is not requeued)."),
    "nodes": _nodes,
    "drain": _drain(True),
    "undrain": _drain(False),
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in COMMANDS:
        raise UserError(f"unknown platform command {argv[:1]}; choose one of {', '.join(COMMANDS)}")
    return COMMANDS[argv[0]](argv[1:])
