"""The task commands: ``fireflyer submit|queue|describe|logs|suspend|resume|stop|nodes|drain|undrain``.

Each acts through an :class:`~fireflyer.platform.scheduler.api.Api`: the platform's state directly
(``--home``, or ``FIREFLYER_PLATFORM_HOME``, default ``~/.fireflyer/platform``; the daemon
acts on what they record within a tick) or a platform server (``--server`` /
``FIREFLYER_SERVER``, with the token in ``FIREFLYER_TOKEN``). Task ids are chain ids: the
id ``submit`` prints stays valid through every suspend, resume and restart (any attempt's
id works too). Every command prints a table, or JSON with ``--json``.
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator

from fireflyer.cliutil import ArgumentParser, plural
from fireflyer.errors import UserError
from fireflyer.platform import env as names
from fireflyer.platform.scheduler.api import ENV_PASSED, MAX_TASK_ID, Api, ApiError, PlatformApi, Unavailable, open_home
from fireflyer.platform.commands.render import ago, emit, table, when
from fireflyer.platform.state.store import FINISHED


def home_arg(p: ArgumentParser) -> None:
    p.add_argument("--home", default=None, help=f"the platform's directory (default: ${names.HOME} or "
                                                "~/.fireflyer/platform)")


def json_arg(p: ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _server_arg(p: ArgumentParser) -> None:
    p.add_argument("--server", default=os.environ.get(names.SERVER) or None,
                   help=f"a platform server's URL (default ${names.SERVER}); the token comes from ${names.TOKEN}")


def _target_args(p: ArgumentParser) -> None:
    """Where a command acts: a local home, or a server (``--server`` / ``FIREFLYER_SERVER``) with a token."""
    home_arg(p)
    _server_arg(p)
    json_arg(p)


@contextmanager
def api_errors() -> Iterator[None]:
    """The API's errors as the CLI's: a user's mistake exits 2, an unusable platform 1 (try again later)."""
    try:
        yield
    except Unavailable:  # a FireflyerError: the CLI exits 1, try again later
        raise
    except ApiError as exc:
        raise UserError(str(exc)) from None


def connect(args: Any) -> Api:
    """The API a command acts through: the server's with ``--server``, else the home's."""
    with api_errors():
        if args.server:
            from fireflyer.platform.commands.remote import RemoteApi

            return RemoteApi(args.server, os.environ.get(names.TOKEN))
        return PlatformApi(open_home(args.home))


def task_id(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise UserError(f"a task id is a number, got {text!r}") from None
    if not 1 <= value <= MAX_TASK_ID:
        raise UserError(f"a task id is a number from 1 to {MAX_TASK_ID}, got {text!r}")
    return value


# ---------------------------------------------------------------------- the commands
def _env_pairs(pairs: Iterable[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UserError(f"-e takes KEY=VALUE, got {pair!r}")
        out[key] = value
    return out


def submit(argv: list[str]) -> int:
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
    p.add_argument("--fault-tolerant", action="store_true",
                   help="each node a replica (torchft): a node that dies or is drained is replaced on a healthy "
                        "free node while the others go on (at least 2 nodes; e.g. fireflyer train)")
    _target_args(p)
    if "--" not in argv:
        p.parse_known_args(argv)  # --help, and flag errors, come first
        raise UserError("put the task's command after '--', e.g. fireflyer submit -n 1 -- python train.py")
    split = argv.index("--")
    args, command = p.parse_args(argv[:split]), argv[split + 1:]
    if not command:
        raise UserError("no command after '--'")
    env = _env_pairs(args.env)
    with connect(args) as api, api_errors():
        local = isinstance(api, PlatformApi)
        if local:  # a local task inherits the submitter's paths; a remote one the server's
            env = {**{k: os.environ[k] for k in ENV_PASSED if k in os.environ}, **env}
        t = api.submit(nodes=args.nodes, command=command, priority=args.priority, group=args.group,
                       name=args.name, ranks_per_node=args.ranks_per_node, env=env, request_id=args.request_id,
                       cwd=os.getcwd(), user=args.user, **({"fault_tolerant": True} if args.fault_tolerant else {}))
        if local:
            from fireflyer.platform.scheduler.pidlock import daemon_pid

            if daemon_pid(api.home) is None:
                print(f"note: no daemon runs for {api.home.root}; the task waits until 'fireflyer platform start'",
                      file=sys.stderr)
    return emit(args.json, t, lambda: f"submitted task {t['id']} ({t['name']}): {plural(t['nodes'], 'node')}"
                                      f"{' (fault-tolerant)' if t.get('fault_tolerant') else ''}, "
                                      f"priority {t['priority']}, group {t['group']}")


def queue(argv: list[str]) -> int:
    p = ArgumentParser(prog="fireflyer queue", description="The platform's tasks (latest attempt of each).")
    p.add_argument("--all", action="store_true", help="include finished tasks")
    p.add_argument("--limit", type=int, default=100, help="at most this many tasks (default 100)")
    p.add_argument("--offset", type=int, default=0, help="skip this many first (paging)")
    p.add_argument("--user", default=None, help="only this user's tasks")
    p.add_argument("--state", default=None, help="only tasks in this state (queued, running, held, finished, ...)")
    _target_args(p)
    args = p.parse_args(argv)
    with connect(args) as api, api_errors():
        page = api.tasks(all=args.all, user=args.user, state=args.state, limit=args.limit, offset=args.offset)
    rows = page["tasks"]
    now = time.time()

    def render() -> str:
        if not rows:
            return "no tasks" + ("" if args.all else " (--all shows finished ones)")
        out = table([(t["id"], t["name"], t["user"], t["priority"], t["nodes"], t["outcome"], t["attempt"],
                      ",".join(t["assigned"]) or "-",
                      ago(now - (t["started_at"] or t["submitted_at"])) if t["state"] != FINISHED
                      else when(t["finished_at"])) for t in rows],
                    ["ID", "NAME", "USER", "PRIORITY", "NODES", "STATE", "ATTEMPT", "ON", "TIME"])
        more = page["total"] - page["offset"] - len(rows)
        return out + (f"\n({more} more: --offset {page['offset'] + len(rows)})" if more > 0 else "")

    return emit(args.json, rows, render)


def describe(argv: list[str]) -> int:
    p = ArgumentParser(prog="fireflyer describe", description="A task, its chain of attempts and its history.")
    p.add_argument("id", help="the task's id")
    _target_args(p)
    args = p.parse_args(argv)
    with connect(args) as api, api_errors():
        d = api.describe(task_id(args.id))

    def render() -> str:
        head = [f"task {d['id']} ({d['name']}): {d['outcome']}",
                f"  user {d['user']}, group {d['group']}, priority {d['priority']}, {plural(d['nodes'], 'node')} x "
                f"{plural(d['ranks_per_node'], 'rank')}, whole-life state {d['whole_life_state']}",
                f"  command: {' '.join(d['command'])}"]
        if d.get("logs"):
            head.append(f"  logs: {d['logs']}")
        head += ["", "attempts:"]
        attempts = table([(a["task_id"], a["attempt"], a["outcome"], ",".join(a["assigned"]) or "-",
                           when(a["started_at"]), when(a["finished_at"]), a["stop"] or "-", a["detail"] or "")
                          for a in d["attempts"]],
                         ["TASK", "ATTEMPT", "STATE", "NODES", "STARTED", "ENDED", "STOP", "DETAIL"])
        history = table([(when(e["at"]), e["task_id"], e["kind"], e["detail"]) for e in d["events"]],
                        ["AT", "TASK", "EVENT", "DETAIL"])
        return "\n".join(head) + "\n" + attempts + _replicas(d) + "\n\nhistory:\n" + history

    return emit(args.json, d, render)


def _replicas(d: dict) -> str:
    """A fault-tolerant task's replicas and quorum, for ``describe`` (empty for any other task)."""
    if not d.get("fault_tolerant"):
        return ""
    rows = [(r["name"], r["node"], r["state"], r["restarts"], when(r["started_at"]), r["detail"] or "")
            for r in d.get("replicas") or []]
    q = d.get("quorum")
    quorum = (f"quorum {q['id']}: {', '.join(q['replicas']) or 'none'} ({len(q['replicas'])} of {d['nodes']} "
              f"replicas)") if q else "quorum: not known (the task is not running, or its Lighthouse not read yet)"
    return ("\n\nreplicas (latest attempt):\n"
            + (table(rows, ["REPLICA", "NODE", "STATE", "RESTARTS", "STARTED", "DETAIL"]) if rows else "none yet")
            + "\n" + quorum)


def logs(argv: list[str]) -> int:
    p = ArgumentParser(prog="fireflyer logs", description="A task's per-rank log (the latest attempt's by default).")
    p.add_argument("id", help="the task's id")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing until the task finishes")
    p.add_argument("-r", "--rank", type=int, default=0, help="which rank (default 0)")
    p.add_argument("--attempt", type=int, default=None, help="which attempt of the chain (default: the latest run)")
    p.add_argument("--tail", type=int, default=None, help="only the last N lines")
    home_arg(p)
    _server_arg(p)
    args = p.parse_args(argv)
    chain = task_id(args.id)
    with connect(args) as api, api_errors():
        if not args.follow:
            sys.stdout.write(api.logs(chain, rank=args.rank, attempt=args.attempt, tail=args.tail)["text"])
            return 0
        for chunk in api.follow(chain, rank=args.rank):
            sys.stdout.write(chunk)
            sys.stdout.flush()
    return 0


def _request(name: str, done: str) -> Callable[[list[str]], int]:
    def run(argv: list[str]) -> int:
        p = ArgumentParser(prog=f"fireflyer {name}", description=done)
        p.add_argument("id", help="the task's id")
        _target_args(p)
        args = p.parse_args(argv)
        with connect(args) as api, api_errors():
            t = getattr(api, name)(task_id(args.id))
        return emit(args.json, t, lambda: f"task {t['id']}: {name} requested ({t['outcome']})")

    return run


suspend = _request("suspend", "Ask a running task to save and stop; it waits, held, for 'fireflyer resume'.")
resume = _request("resume", "Queue a suspended task again, in its old place.")
stop = _request("stop", "Stop a task for good (it is not requeued).")


def nodes(argv: list[str]) -> int:
    p = ArgumentParser(prog="fireflyer nodes", description="The platform's nodes.")
    _target_args(p)
    args = p.parse_args(argv)
    with connect(args) as api, api_errors():
        data = api.nodes()
    return emit(args.json, data, lambda: table([(d["name"], d["zone"], d["state"], d["task"] or "-", d["reason"])
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
        with connect(args) as api, api_errors():
            out = api.drain(args.node, args.reason) if drained else api.undrain(args.node)
        return emit(args.json, out, lambda: f"{args.node}: {'drained' if drained else 'back in service'}")

    return run


drain = _drain(True)
undrain = _drain(False)

COMMANDS: dict[str, Callable[[list[str]], int]] = {
    "submit": submit, "queue": queue, "describe": describe, "logs": logs, "suspend": suspend, "resume": resume,
    "stop": stop, "nodes": nodes, "drain": drain, "undrain": undrain,
}
