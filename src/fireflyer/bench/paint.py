"""How fast the dashboard paints, measured in headless Chromium with the browser's own timings.

``python -m fireflyer.bench.paint [--loads 9] [--tasks 50] [--url URL --token TOKEN]``

Without ``--url`` it sets up what it measures: a platform in a temporary home (``fireflyer platform start``,
4 emulated nodes), an admin made with ``fireflyer platform user add``, ``fireflyer platform serve --port 0``,
and ``--tasks`` tasks (4 run, the rest wait), all stopped and removed at the end. Each load is a fresh
navigation with the browser's cache off, signed in (the token is in the tab's ``sessionStorage``), and reports

* first contentful paint: ``performance.getEntriesByType('paint')``, from the start of the navigation;
* task rows: the ``fireflyer:tasks-rendered`` mark the page sets when its task table first has rows, i.e.
  the page, its script and style, ``/api/me`` and ``/api/tasks`` all loaded and drawn.

It prints each load and the medians. Needs Debian's ``chromium`` and ``chromium-driver`` and ``selenium``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
_TOKEN_RE = re.compile(r"ff_[A-Za-z0-9_-]{43}")
_URL_RE = re.compile(r"https?://[0-9A-Za-z.\[\]:-]+:\d+")


def _fireflyer(*args: str, timeout: float = 60) -> str:
    done = subprocess.run([sys.executable, "-m", "fireflyer", *args], check=False, capture_output=True, text=True,
                          timeout=timeout)
    if done.returncode != 0:
        raise SystemExit(f"paint_bench: fireflyer {' '.join(args)} exited {done.returncode}: {done.stderr.strip()}")
    return done.stdout


def _call(url: str, token: str, method: str = "GET", body: dict | None = None) -> Any:
    req = urllib.request.Request(url, method=method, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=15) as res:
        return json.load(res)


class _Setup:
    """A throwaway platform, server and tasks to measure against."""

    def __init__(self, tasks: int) -> None:
        self.dir = tempfile.mkdtemp(prefix="fireflyer-paint-")
        self.home = str(Path(self.dir, "home"))
        self.server: subprocess.Popen | None = None
        self.ids: list[int] = []
        _fireflyer("platform", "start", "--home", self.home, "--nodes", "4", "--tick", "0.2")
        try:
            out = _fireflyer("platform", "user", "add", "bench", "--admin", "--home", self.home)
            m = _TOKEN_RE.search(out)
            if not m:
                raise SystemExit(f"paint_bench: 'platform user add' printed no token: {out!r}")
            self.token = m.group(0)
            self.url = self._serve()
            sleeper = [sys.executable, "-c", "import time; time.sleep(3600)"]
            for i in range(tasks):
                t = _call(f"{self.url}/api/tasks", self.token, "POST",
                          {"nodes": 1, "command": sleeper, "name": f"job-{i:03d}", "priority": "NORMAL"})
                self.ids.append(int(t["id"]))
        except BaseException:
            self.close()
            raise

    def _serve(self) -> str:
        with open(Path(self.dir, "serve.log"), "w") as log:  # the child keeps its own copy of the descriptor
            self.server = subprocess.Popen([sys.executable, "-m", "fireflyer", "platform", "serve", "--home",
                                            self.home, "--port", "0"], stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            m = _URL_RE.search(Path(self.dir, "serve.log").read_text())
            if m:
                return m.group(0).rstrip("/")
            if self.server.poll() is not None:
                break
            time.sleep(0.1)
        raise SystemExit(f"paint_bench: the server printed no URL: {Path(self.dir, 'serve.log').read_text()[-500:]}")

    def close(self) -> None:
        if self.server is not None and self.server.poll() is None:
            for task in self.ids:
                try:
                    _call(f"{self.url}/api/tasks/{task}/stop", self.token, "POST")
                except OSError:
                    pass
            os.killpg(self.server.pid, signal.SIGTERM)
            try:
                self.server.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.server.pid, signal.SIGKILL)
                self.server.wait(10)
        subprocess.run([sys.executable, "-m", "fireflyer", "platform", "stop", "--home", self.home], check=False,
                       capture_output=True, timeout=60)
        shutil.rmtree(self.dir, ignore_errors=True)


def _browser() -> Any:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1360,1000"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.set_page_load_timeout(30)
    driver.set_script_timeout(30)
    return driver


_READ = """
const paint = performance.getEntriesByType('paint').find((e) => e.name === 'first-contentful-paint');
const rows = performance.getEntriesByName('fireflyer:tasks-rendered')[0];
return [paint ? paint.startTime : null, rows ? rows.startTime : null];
"""


def measure(url: str, token: str, loads: int) -> list[tuple[float, float]]:
    driver = _browser()
    try:
        driver.execute_cdp_cmd("Network.enable", {})
        driver.execute_cdp_cmd("Network.setCacheDisabled", {"cacheDisabled": True})
        driver.get(url + "/")
        driver.execute_script("sessionStorage.setItem('fireflyer.token', arguments[0])", token)
        out = []
        for i in range(loads + 1):  # the first load warms the server up and is not counted
            driver.get(url + "/")
            deadline = time.monotonic() + 30
            fcp = rows = None
            while time.monotonic() < deadline:
                fcp, rows = driver.execute_script(_READ)
                if fcp is not None and rows is not None:
                    break
                time.sleep(0.05)
            if fcp is None or rows is None:
                raise SystemExit(f"paint_bench: load {i}: no first paint or no task rows within 30 s "
                                 f"(paint {fcp}, rows {rows}); is there a task the token may see?")
            if i:
                out.append((fcp, rows))
                print(f"load {i}: first contentful paint {fcp:6.1f} ms, task rows {rows:6.1f} ms", flush=True)
        return out
    finally:
        driver.quit()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="paint_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--loads", type=int, default=9, help="page loads to time (default 9)")
    p.add_argument("--tasks", type=int, default=50, help="tasks in the throwaway platform (default 50)")
    p.add_argument("--url", help="measure this running server instead of a throwaway one")
    p.add_argument("--token", default=os.environ.get("FIREFLYER_TOKEN"),
                   help="a token for --url (default $FIREFLYER_TOKEN)")
    args = p.parse_args(argv)
    for path in (CHROMIUM, CHROMEDRIVER):
        if not os.access(path, os.X_OK):
            print(f"paint_bench: {path} missing (apt-get install chromium chromium-driver)", file=sys.stderr)
            return 2
    if args.url and not args.token:
        print("paint_bench: --url needs --token or $FIREFLYER_TOKEN", file=sys.stderr)
        return 2
    setup = None if args.url else _Setup(args.tasks)
    try:
        url, token = (args.url.rstrip("/"), args.token) if setup is None else (setup.url, setup.token)
        times = measure(url, token, max(1, args.loads))
    finally:
        if setup is not None:
            setup.close()
    fcp = statistics.median(t[0] for t in times)
    rows = statistics.median(t[1] for t in times)
    print(f"median of {len(times)} loads: first contentful paint {fcp:.1f} ms, task table with rows {rows:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
