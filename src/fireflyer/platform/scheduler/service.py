"""The daemon's process: one per home (:mod:`.pidlock`), cycles every ``tick`` seconds until SIGTERM or
SIGINT, a heartbeat after each (:mod:`.health`); ``python -m fireflyer.platform.scheduler.service HOME``
is what ``fireflyer platform start`` runs."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import traceback

from fireflyer.errors import UserError
from fireflyer.platform import config as platform_config
from fireflyer.platform.layout import Home
from fireflyer.platform.scheduler.daemon import Daemon
from fireflyer.platform.scheduler.health import Health, write_heartbeat
from fireflyer.platform.scheduler.pidlock import AlreadyRunning, lock
from fireflyer.platform.state.store import StoreUnavailable

log = logging.getLogger("fireflyer.platform")


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
        print("usage: python -m fireflyer.platform.scheduler.service HOME", file=sys.stderr)
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
