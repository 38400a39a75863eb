"""A real platform for tests: ``fireflyer platform start`` in a temporary home, driven through the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from fireflyer.platform.layout import Home
from fireflyer.platform.local import kill_active

JOB = str(Path(__file__).with_name("platform_job.py"))


def run_cli(*args: str, home: Path | None = None, check: bool = True, timeout: float = 60,
            cwd: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ}
    if home is not None:
        env["FIREFLYER_PLATFORM_HOME"] = str(home)
    done = subprocess.run([sys.executable, "-m", "fireflyer", *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=cwd)
    if check and done.returncode != 0:
        raise AssertionError(f"fireflyer {' '.join(args)} exited {done.returncode}: {done.stderr.strip()}")
    return done


class Platform:
    def __init__(self, home: Path, *flags: str) -> None:
        self.home = home
        run_cli("platform", "start", "--tick", "0.1", *flags, home=home)

    def cli(self, *args: str, **kw: Any) -> subprocess.CompletedProcess:
        return run_cli(*args, home=self.home, **kw)

    def json(self, *args: str) -> Any:
        return json.loads(self.cli(*args, "--json").stdout)

    def submit(self, *command: str, nodes: int = 1, priority: str = "NORMAL", name: str = "", user: str = "alice",
               extra: tuple[str, ...] = ()) -> int:
        out = json.loads(self.cli("submit", "-n", str(nodes), "-p", priority, "--name", name, "--user", user, *extra,
                                  "--json", "--", *command).stdout)
        return int(out["id"])

    def job(self, state: Path, steps: int, *opts: str, **kw: Any) -> int:
        return self.submit(sys.executable, JOB, str(state), str(steps), *opts, **kw)

    def describe(self, task: int) -> dict:
        return self.json("describe", str(task))

    def wait(self, what: str, pred: Callable[[], Any], timeout: float = 60.0) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = pred()
            if value:
                return value
            time.sleep(0.1)
        raise AssertionError(f"timed out after {timeout:g} s waiting for {what}; "
                             f"daemon log tail: {self.log_tail()}")

    def wait_state(self, task: int, *states: str, timeout: float = 60.0) -> dict:
        def check() -> dict | None:
            d = self.describe(task)
            return d if d["state"] in states else None
        return self.wait(f"task {task} to be {'/'.join(states)}", check, timeout)

    def log_tail(self, n: int = 8) -> str:
        log = Home(self.home).log
        return " | ".join(log.read_text().splitlines()[-n:]) if log.exists() else "(no log)"

    def close(self) -> None:
        self.cli("platform", "stop", check=False)
        kill_active(Home(self.home))
