"""``fireflyer platform start|stop|status|quota|group``: the scheduler daemon, its nodes, quotas and groups.

``serve`` and ``user`` (the HTTP server and its users) are handed to
:mod:`fireflyer.platform.commands.serve`. Quotas and groups are set through the
platform's API (:class:`~fireflyer.platform.scheduler.api.PlatformApi`), which checks them.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import signal
import subprocess
import sys
import time
from typing import Any

from fireflyer.cliutil import ArgumentParser
from fireflyer.errors import UserError
from fireflyer.platform import config as platform_config
from fireflyer.platform.scheduler.api import PlatformApi, open_home
from fireflyer.platform.config import PlatformConfig
from fireflyer.platform.executors.base import Timeouts
from fireflyer.platform.layout import Home
from fireflyer.platform.commands.render import ago, emit, table
from fireflyer.platform.state.store import ACTIVE, Store, StoreUnavailable
from fireflyer.platform.commands.tasks import api_errors, home_arg, json_arg

START_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 15.0


def main(argv: list[str]) -> int:
    if argv and argv[0] in ("serve", "user"):  # the HTTP server and its users
        from fireflyer.platform.commands.serve import main as server_main

        return server_main(argv)
    p = ArgumentParser(prog="fireflyer platform", description="Run the platform's scheduler daemon, its HTTP server "
                       "('fireflyer platform serve --help') and its users ('fireflyer platform user --help').")
    sub = p.add_subparsers(dest="action", required=True, metavar="start|stop|status|quota|group|serve|user")
    start = sub.add_parser("start", help="start the daemon (configures the platform on first start)")
    home_arg(start)
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
    home_arg(stop)
    status = sub.add_parser("status", help="is the daemon up, and what it runs")
    home_arg(status)
    json_arg(status)
    quota = sub.add_parser("quota", help="show quotas, or set one: quota USER GROUP PRIORITY NODES "
                                         "(USER 'public' is everyone's default)")
    quota.add_argument("setting", nargs="*", metavar="USER GROUP PRIORITY NODES")
    home_arg(quota)
    json_arg(quota)
    group = sub.add_parser("group", help="show groups, or change one: group GROUP add|remove USER... "
                                         "(everyone is in 'default')")
    group.add_argument("setting", nargs="*", metavar="GROUP add|remove USER")
    home_arg(group)
    json_arg(group)
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


# ---------------------------------------------------------------------- quotas and groups
def _quota(args: Any) -> int:
    with api_errors(), PlatformApi(open_home(args.home)) as api:
        if args.setting:
            if len(args.setting) != 4:
                raise UserError("quota takes USER GROUP PRIORITY NODES, e.g. quota alice default HIGH 4")
            user, group, priority, nodes = args.setting
            data = api.set_quota(user, group, priority, nodes)
        else:
            data = api.quotas()
        default = api.default_quota()
    held = "half the nodes" if default == "half" else f"{default} node(s)"
    fallback = ("every user may hold every node" if default is None else f"a user without a row holds {held} for "
                "sure per group and priority, and beyond that only borrows idle nodes (default_quota)")
    return emit(args.json, data, lambda: table([(d["user"], d["group"], d["priority"], d["nodes"]) for d in data],
                                               ["USER", "GROUP", "PRIORITY", "NODES"]) + f"\n{fallback}" if data else
                f"no quota rows: {fallback}")


def _group(args: Any) -> int:
    with api_errors(), PlatformApi(open_home(args.home)) as api:
        if args.setting:
            if len(args.setting) < 3 or args.setting[1] not in ("add", "remove"):
                raise UserError("group takes GROUP add|remove USER..., e.g. group vision add alice bob")
            name, action, *users = args.setting
            data = api.set_members(name, users, member=action == "add")
        else:
            data = api.groups()
    return emit(args.json, data, lambda: table([(d["group"], " ".join(d["users"])) for d in data],
                                               ["GROUP", "USERS"])
                if data else "no groups but 'default', which everyone is in")


# ---------------------------------------------------------------------- start|stop|status
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
        from fireflyer.platform.executors.slurm import slurm_nodes

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
    from fireflyer.platform.scheduler.pidlock import daemon_pid

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
        from fireflyer.platform.scheduler import service

        return service.main([str(home.root)])
    home.heartbeat.unlink(missing_ok=True)
    with open(home.log, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "fireflyer.platform.scheduler.service", str(home.root)],
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
    from fireflyer.platform.scheduler.pidlock import daemon_pid

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
    from fireflyer.platform.scheduler.health import read_heartbeat, why_unhealthy
    from fireflyer.platform.scheduler.pidlock import daemon_pid

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
        up = f"up (pid {pid}, last cycle {ago(time.time() - beat['at'])} ago)" if pid and beat else \
            ("up (pid %s)" % pid if pid else "down")
        if problem:
            up = f"unhealthy: {problem} (pid {pid})"
        states = ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "no tasks"
        if unreadable:
            states = f"tasks unknown: {unreadable}"
        return (f"platform {home.root}: daemon {up}; {cfg.executor if cfg else 'not configured'} executor, "
                f"{nodes} nodes; {states}")

    emit(args.json, data, render)
    return 1 if problem or unreadable else 0
