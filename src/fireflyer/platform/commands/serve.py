"""``fireflyer platform serve`` and ``fireflyer platform user add|list|revoke|token``.

``platform/commands/admin.py`` hands over ``argv`` from the sub-action on (``["serve", "--port",
"0"]``, ``["user", "add", "alice"]``). The web stack is imported only by ``serve``.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import re
import socket
import sqlite3
import sys

from fireflyer.cliutil import ArgumentParser
from fireflyer.errors import UserError
from fireflyer.platform import env
from fireflyer.platform.scheduler.api import open_home
from fireflyer.platform.commands.render import day, table, to_json
from fireflyer.platform.commands.tasks import home_arg as _home_arg

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080


# ---------------------------------------------------------------------- users
def _user(argv: list[str]) -> int:
    from fireflyer.platform.server.auth import UserProblem, Users

    p = ArgumentParser(prog="fireflyer platform user", description="The HTTP server's users and their tokens.")
    sub = p.add_subparsers(dest="action", required=True, metavar="add|list|revoke|token|unix")
    add = sub.add_parser("add", help="add a user and print their token (shown only this once)")
    add.add_argument("name")
    add.add_argument("--admin", action="store_true", help="may see and control every task, and drain nodes")
    add.add_argument("--unix", metavar="ACCOUNT", help="the Unix account their tasks run as (mapping a user to an "
                                                       "account not the daemon's makes the platform isolate users)")
    unix = sub.add_parser("unix", help="map a user to the Unix account their tasks run as ('-': to none)")
    unix.add_argument("name")
    unix.add_argument("account")
    lst = sub.add_parser("list", help="the users (never their tokens)")
    lst.add_argument("--json", action="store_true", help="print JSON instead of a table")
    revoke = sub.add_parser("revoke", help="the user's token stops working at once")
    revoke.add_argument("name")
    token = sub.add_parser("token", help="a new token for the user (the old one stops working; re-enables "
                                         "a revoked user)")
    token.add_argument("name")
    for s in (add, lst, revoke, token, unix):
        _home_arg(s)
    args = p.parse_args(argv)
    home = open_home(args.home)
    try:
        with Users(home.db) as users:
            if args.action == "add":
                secret = users.add(args.name, admin=args.admin, unix=args.unix)
                runs = f", running tasks as Unix account {args.unix}" if args.unix else ""
                print(f"user {args.name} added{' (admin)' if args.admin else ''}{runs}; their token follows, shown "
                      f"only this once (clients send it as 'Authorization: Bearer TOKEN'; the CLI reads "
                      f"{env.TOKEN})", file=sys.stderr)
                print(secret)
            elif args.action == "token":
                secret = users.rotate(args.name)
                print(f"user {args.name}: new token follows (the old one no longer works)", file=sys.stderr)
                print(secret)
            elif args.action == "unix":
                account = None if args.account == "-" else args.account
                users.set_unix(args.name, account)
                print(f"user {args.name}: tasks run as " + (f"Unix account {account}" if account else
                                                            "the platform decides (no account of their own)"))
            elif args.action == "revoke":
                users.revoke(args.name)
                print(f"user {args.name}: token revoked ('fireflyer platform user token {args.name}' gives a new one)")
            else:
                rows = users.list()
                data = [{"name": u.name, "admin": u.admin, "created": u.created, "revoked": u.revoked,
                         "unix": u.unix} for u in rows]
                if args.json:
                    print(to_json(data))
                elif not rows:
                    print("no users: add one with 'fireflyer platform user add NAME [--admin]'")
                else:
                    print(table([(u.name, "admin" if u.admin else "user", u.unix or "-", day(u.created),
                                  f"revoked {day(u.revoked)}" if u.revoked else "active") for u in rows],
                                ["USER", "ROLE", "UNIX", "CREATED", "TOKEN"]))
    except UserProblem as exc:
        raise UserError(str(exc)) from None
    except sqlite3.Error as exc:  # a full disk, a locked or unreadable database
        raise UserError(f"the platform's database in {home.root} cannot be used now: {exc}") from None
    return 0


# ---------------------------------------------------------------------- serve
def _bind(host: str, port: int) -> socket.socket:
    """A bound socket (uvicorn listens on it), so a busy port is one clear error before anything starts."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise UserError(f"cannot listen on host {host!r}: {exc.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise UserError(f"port {port} on {host} is in use: pick another with --port (--port 0 takes a free "
                            "one)") from None
        if exc.errno == errno.EACCES:
            raise UserError(f"no permission to listen on port {port} (ports below 1024 need root): "
                            "pick another with --port") from None
        if exc.errno == errno.EADDRNOTAVAIL:
            raise UserError(f"{host} is not an address of this machine: pick another with --host") from None
        raise UserError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _serve(argv: list[str]) -> int:
    p = ArgumentParser(prog="fireflyer platform serve",
                       description="Serve the platform's HTTP API (OpenAPI at /docs) and its dashboard (at /).")
    p.add_argument("--host", default=DEFAULT_HOST, help=f"address to listen on (default {DEFAULT_HOST}: this "
                                                        "machine only)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0 picks a free one)")
    p.add_argument("--docs", action="store_true",
                   help="serve Swagger UI at /docs (it loads its scripts from a CDN, on the dashboard's origin)")
    p.add_argument("--max-stream", type=float, default=3600.0, metavar="S",
                   help="seconds one log stream may run before the client must reconnect (default 3600)")
    _home_arg(p)
    args = p.parse_args(argv)
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be 0..65535, got {args.port}")
    if not args.max_stream > 0:
        raise UserError(f"--max-stream must be positive, got {args.max_stream}")
    home = open_home(args.home)
    try:
        import uvicorn

        from fireflyer.platform.server.app import create_app
    except ImportError as exc:
        raise UserError(f"the server needs FastAPI and uvicorn ({exc.name} is missing): "
                        "pip install 'fireflyer[server]'") from None
    from fireflyer.platform.scheduler.pidlock import daemon_pid
    from fireflyer.platform.server.auth import Users

    from fireflyer.platform import config as platform_config
    from fireflyer.platform.accounts import isolating

    with Users(home.db) as users:
        active = users.count()
        mapping = {u.name: u.unix for u in users.list() if u.unix}
    cfg = platform_config.load(home)
    as_root = os.geteuid() == 0 and not isolating(mapping, isolate=bool(cfg and cfg.isolate))
    sock = _bind(args.host, args.port)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    served = "dashboard at /, API docs at /docs" if args.docs else "dashboard at /"
    print(f"fireflyer platform server for {home.root} on http://{shown}:{port} ({served})", flush=True)
    if not active:
        print("warning: no users yet, so every API call is refused: add one with "
              f"'fireflyer platform user add NAME --admin{'' if args.home is None else f' --home {args.home}'}' "
              "(no restart needed)", file=sys.stderr, flush=True)
    if as_root and active:
        print("warning: every user's tasks run as root (the platform's own account): map each user to a Unix "
              "account of their own with 'fireflyer platform user unix NAME ACCOUNT'", file=sys.stderr, flush=True)
    if daemon_pid(home) is None:
        print(f"warning: no platform daemon runs for {home.root}: tasks stay queued until "
              "'fireflyer platform start'", file=sys.stderr, flush=True)
    if not _loopback(host):
        print(f"warning: listening on {host}, beyond this machine: tokens cross the network in clear text unless "
              "a TLS proxy sits in front", file=sys.stderr, flush=True)
    app = create_app(home, stream_limit=args.max_stream, docs=args.docs)
    logging.getLogger("uvicorn.access").addFilter(RedactTokens())
    # proxy_headers off: the client address (which failed logins are counted by) is the real peer, never
    # a header a client could forge. A short graceful shutdown, so open log streams cannot hold it up.
    config = uvicorn.Config(app, log_level="info", access_log=True, proxy_headers=False, server_header=False,
                            timeout_graceful_shutdown=3)
    ours = logging.getLogger("fireflyer.platform.server")
    if not ours.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
        ours.addHandler(handler)
        ours.setLevel(logging.INFO)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()
    return 0


class RedactTokens(logging.Filter):
    """Keeps tokens out of the access log: a client that puts one in the query string (refused, but
    logged before it is refused) leaves ``token=<redacted>``."""

    _QUERY = re.compile(r"((?:^|[?&;])(?:access_)?token=)[^&;\s\"]*", re.IGNORECASE)
    _BEARER = re.compile(r"\b(ff_)[A-Za-z0-9_\-]{8,}")

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(self.redact(a) if isinstance(a, str) else a for a in record.args)
        if isinstance(record.msg, str):
            record.msg = self.redact(record.msg)
        return True

    @classmethod
    def redact(cls, text: str) -> str:
        return cls._BEARER.sub(r"\1<redacted>", cls._QUERY.sub(r"\1<redacted>", text))


COMMANDS = {"serve": _serve, "user": _user}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in COMMANDS:
        raise UserError(f"unknown server command {argv[:1]}; choose one of {', '.join(COMMANDS)}")
    return COMMANDS[argv[0]](argv[1:])
