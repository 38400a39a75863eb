"""How fast the server lists tasks: ``python -m fireflyer.bench.server [--tasks 10000] [--runs 9]``.

Fills a fresh platform home with ``--tasks`` tasks (four in five finished, the rest
queued, as on a cluster that has run a while), starts ``serve`` on a free loopback port
in its own process, and times ``GET /api/tasks?all=1&limit=N`` end to end from an HTTP
client on a kept-alive connection: request sent to the last byte of the JSON received,
with the token checked and every task serialised. Also times paging through the same
tasks 1,000 at a time, and, in this process, the two parts of the server's work:
``PlatformApi.tasks`` and the encoding of its answer. Prints the median (and min/max) of ``--runs`` runs after one
warm-up, and writes them as JSON with ``--json PATH``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fireflyer.errors import JobFailed
from fireflyer.bench.harness import write_json
from fireflyer.platform import config as platform_config
from fireflyer.platform.config import PlatformConfig
from fireflyer.platform.layout import Home
from fireflyer.platform.state.policy import Priority
from fireflyer.platform.server.auth import Users
from fireflyer.platform.state.store import StopCode, Store

START_TIMEOUT_S = 60.0


def fill(home: Home, tasks: int, nodes: int = 16) -> str:
    """A platform with ``tasks`` tasks of several users and priorities; returns an admin's token."""
    cfg = PlatformConfig(nodes=nodes, zones=2)
    store = Store(home.db)
    try:
        store._db.execute("PRAGMA synchronous=OFF")  # a throwaway home: no fsync per submit while filling
        store.add_nodes(cfg.emulated_nodes())
        priorities = list(Priority)
        for i in range(tasks):
            task_id = store.submit(user=f"user{i % 20}", nodes=1 + i % 4, priority=priorities[i % len(priorities)],
                                   command=["python", "train.py", f"--seed={i}"], name=f"run-{i}",
                                   group="default" if i % 3 else "research", env={"PATH": "/usr/bin"})
            if i % 5:
                store.finish(task_id, StopCode.STOP, detail="all ranks exited 0")
    finally:
        store.close()
    platform_config.save(home, cfg)
    with Users(home.db) as users:
        return users.add("bench", admin=True)


def _time(conn: http.client.HTTPConnection, path: str, token: str) -> tuple[float, bytes]:
    start = time.perf_counter()
    conn.request("GET", path, headers={"Authorization": f"Bearer {token}"})
    resp = conn.getresponse()
    body = resp.read()
    took = time.perf_counter() - start
    if resp.status != 200:
        raise JobFailed(f"GET {path}: {resp.status} {body[:200]!r}")
    return took, body


def _summary(times: list[float]) -> dict[str, float]:
    return {"median_ms": statistics.median(times) * 1e3, "min_ms": min(times) * 1e3, "max_ms": max(times) * 1e3}


def measure(home: Home, token: str, tasks: int, runs: int, log: Path) -> dict[str, Any]:
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "fireflyer", "platform", "serve", "--home", str(home.root),
                                 "--port", "0"], stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            text = log.read_text(errors="replace")
            found = re.search(r"on http://([\d.]+):(\d+) ", text)
            if found and "Application startup complete" in text:
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise JobFailed(f"the server did not start: {text[-1000:]}")
            time.sleep(0.05)
        conn = http.client.HTTPConnection(found.group(1), int(found.group(2)), timeout=60)
        whole = f"/api/tasks?all=1&limit={tasks}"
        _, body = _time(conn, whole, token)  # warm-up: imports, the first connection, SQLite's page cache
        page = json.loads(body)
        if page["total"] != tasks or len(page["tasks"]) != tasks:
            raise JobFailed(f"listed {len(page['tasks'])} of {page['total']} tasks, expected {tasks}")
        times = [_time(conn, whole, token)[0] for _ in range(runs)]
        parse = []
        for _ in range(runs):
            start = time.perf_counter()
            json.loads(body)
            parse.append(time.perf_counter() - start)
        paged = []
        for _ in range(runs):
            start = time.perf_counter()
            for offset in range(0, tasks, 1000):
                _time(conn, f"/api/tasks?all=1&limit=1000&offset={offset}", token)
            paged.append(time.perf_counter() - start)
        conn.close()
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    return {"tasks": tasks, "runs": runs, "bytes": len(body), "list_all": _summary(times),
            "client_json_parse": _summary(parse), "paged_by_1000": _summary(paged)}


def breakdown(home: Home, tasks: int, runs: int) -> dict[str, Any]:
    """Where the time goes, in this process: the core's listing, then the encoding to JSON bytes."""
    from pydantic_core import to_json

    from fireflyer.platform.scheduler.api import PlatformApi

    core, encode = [], []
    with PlatformApi(home, user="bench", admin=True) as api:
        api.tasks(all=True, limit=tasks)
        for _ in range(runs):
            start = time.perf_counter()
            page = api.tasks(all=True, limit=tasks)
            core.append(time.perf_counter() - start)
            start = time.perf_counter()
            to_json(page)
            encode.append(time.perf_counter() - start)
    return {"core_tasks": _summary(core), "json_encode": _summary(encode)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fireflyer.bench.server", description=__doc__.split("\n")[0])
    p.add_argument("--tasks", type=int, default=10_000, help="tasks in the platform (default 10000)")
    p.add_argument("--runs", type=int, default=9, help="timed runs of each request (default 9)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results here")
    args = p.parse_args(argv)
    if not 1 <= args.tasks <= 10_000 or args.runs < 1:
        p.error("--tasks must be 1..10000 (the API's page limit) and --runs at least 1")
    with tempfile.TemporaryDirectory(prefix="fireflyer-server-bench-") as tmp:
        home = Home(Path(tmp) / "home")
        start = time.perf_counter()
        token = fill(home, args.tasks)
        filled = time.perf_counter() - start
        parts = breakdown(home, args.tasks, args.runs)  # first, while this process holds little else
        result = {**measure(home, token, args.tasks, args.runs, Path(tmp) / "server.log"), **parts}
    result["fill_s"] = filled
    lst, paged, parse = result["list_all"], result["paged_by_1000"], result["client_json_parse"]
    print(f"GET /api/tasks?all=1&limit={args.tasks} ({result['bytes'] / 1e6:.1f} MB of JSON): median "
          f"{lst['median_ms']:.0f} ms (min {lst['min_ms']:.0f}, max {lst['max_ms']:.0f}) over {args.runs} runs")
    print(f"  of which, in one process: PlatformApi.tasks {result['core_tasks']['median_ms']:.0f} ms, encoding "
          f"the JSON {result['json_encode']['median_ms']:.0f} ms; parsing it in the client adds "
          f"{parse['median_ms']:.0f} ms more")
    print(f"the same tasks paged 1000 at a time (10 requests): median {paged['median_ms']:.0f} ms")
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
