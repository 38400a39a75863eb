"""A real platform: ``fireflyer platform start`` in a home of its own, driven through the CLI.

The platform's end-to-end tests and the platform benchmark both run one:
``LivePlatform(home, "--nodes", "2")`` starts the daemon (``--tick`` 0.1 s unless given),
every command goes through ``python -m fireflyer`` with ``FIREFLYER_PLATFORM_HOME`` set,
and :meth:`LivePlatform.close` stops it and kills any rank it left behind. The tasks they
submit are real scripts under :mod:`fireflyer.testing.jobs` (:data:`JOB`, :data:`MARKS_JOB`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from fireflyer.errors import FireflyerError
from fireflyer.platform.layout import Home
from fireflyer.platform.executors.local import kill_active

JOBS = Path(__file__).with_name("jobs")
JOB = str(JOBS / "platform_job.py")
"""Counts steps, checkpoints on a suspend and resumes (:mod:`fireflyer.testing.jobs.platform_job`)."""
MARKS_JOB = str(JOBS / "marks_job.py")
"""Marks when it runs and when it answers a suspend (:mod:`fireflyer.testing.jobs.marks_job`)."""


class LivePlatformError(FireflyerError, RuntimeError):
    """A CLI command of the live platform failed or hung, or what it waited for never came."""


def run_cli(*args: str, home: Path | None = None, check: bool = True, timeout: float = 60,
            cwd: str | None = None) -> subprocess.CompletedProcess:
    """``python -m fireflyer ARGS...`` (on the platform in ``home``, where given); raises
    :class:`LivePlatformError` when it exits non-zero (unless ``check`` is false) or outlives ``timeout``."""
    env = {**os.environ}
    if home is not None:
        env["FIREFLYER_PLATFORM_HOME"] = str(home)
    try:
        done = subprocess.run([sys.executable, "-m", "fireflyer", *args], capture_output=True, text=True, env=env,
                              timeout=timeout, cwd=cwd)
    except subprocess.TimeoutExpired:
        raise LivePlatformError(f"fireflyer {' '.join(args)} did not return in {timeout:g} s") from None
    if check and done.returncode != 0:
        raise LivePlatformError(f"fireflyer {' '.join(args)} exited {done.returncode}: {done.stderr.strip()}")
    return done


class LivePlatform:
    """A started platform in ``home``; ``flags`` go to ``platform start``.

    ``timeout``: the default for every CLI call and wait; ``poll_s``: how often a wait looks
    (the benchmark polls every few milliseconds, the tests every tenth of a second)."""

    def __init__(self, home: Path, *flags: str, tick: float = 0.1, timeout: float = 60.0,
                 poll_s: float = 0.1) -> None:
        self.home = Path(home)
        self.timeout, self.poll_s = timeout, poll_s
        self._store: Any = None
        try:
            self.cli("platform", "start", "--tick", str(tick), *flags)
        except BaseException:
            self.close()
            raise

    # -- the CLI -------------------------------------------------------------------------

    def cli(self, *args: str, check: bool = True, timeout: float | None = None,
            cwd: str | None = None) -> subprocess.CompletedProcess:
        return run_cli(*args, home=self.home, check=check, timeout=timeout or self.timeout, cwd=cwd)

    def json(self, *args: str) -> Any:
        return json.loads(self.cli(*args, "--json").stdout)

    def submit(self, *command: str, nodes: int = 1, priority: str = "NORMAL", name: str = "",
               user: str | None = "alice", extra: tuple[str, ...] = ()) -> int:
        """Submit ``command``; its task id. ``user=None``: as whoever runs this."""
        who = ("--user", user) if user is not None else ()
        out = json.loads(self.cli("submit", "-n", str(nodes), "-p", priority, "--name", name, *who, *extra,
                                  "--json", "--", *command).stdout)
        return int(out["id"])

    def job(self, state: Path, steps: int, *opts: str, **kw: Any) -> int:
        """Submit :data:`JOB` counting ``steps`` steps with its progress in ``state``."""
        return self.submit(sys.executable, JOB, str(state), str(steps), *opts, **kw)

    def describe(self, task: int) -> dict:
        return self.json("describe", str(task))

    # -- waiting ---------------------------------------------------------------------------

    def wait(self, what: str, pred: Callable[[], Any], timeout: float | None = None) -> Any:
        """``pred()``'s first true value, polled every ``poll_s``; LivePlatformError past ``timeout``."""
        timeout = timeout or self.timeout
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = pred()
            if value:
                return value
            time.sleep(self.poll_s)
        raise LivePlatformError(f"timed out after {timeout:g} s waiting for {what}; "
                                f"daemon log tail: {self.log_tail()}")

    def wait_state(self, task: int, *states: str, timeout: float | None = None) -> dict:
        """``describe`` of ``task`` once it is in one of ``states``."""
        def check() -> dict | None:
            d = self.describe(task)
            return d if d["state"] in states else None
        return self.wait(f"task {task} to be {'/'.join(states)}", check, timeout)

    @property
    def store(self) -> Any:
        """The platform's store, read directly (no CLI call: what a tight wait polls)."""
        if self._store is None:
            from fireflyer.platform.state.store import Store

            self._store = Store(Home(self.home).db)
        return self._store

    def wait_stored(self, chain: int, *states: str, timeout: float | None = None) -> Any:
        """The latest attempt of ``chain`` in the store once it is in one of ``states``."""
        def reached() -> Any:
            t = self.store.latest(chain)
            return t if t.state in states else None

        return self.wait(f"task {chain} to be {'/'.join(states)}", reached, timeout)

    def finish(self, chain: int) -> None:
        """Stop a chain for good and wait until it has."""
        from fireflyer.platform.state.store import FINISHED

        if self.store.latest(chain).state != FINISHED:
            self.cli("stop", str(chain))
        self.wait_stored(chain, FINISHED)

    def log_tail(self, n: int = 8) -> str:
        log = Home(self.home).log
        return " | ".join(log.read_text().splitlines()[-n:]) if log.exists() else "(no log)"

    def close(self) -> None:
        """Stop the daemon and kill every rank it left; always safe to call."""
        try:
            self.cli("platform", "stop", check=False)
        except LivePlatformError:
            pass
        finally:
            if self._store is not None:
                self._store.close()
                self._store = None
            kill_active(Home(self.home))
