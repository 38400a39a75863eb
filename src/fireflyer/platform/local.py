"""The local executor, the embedded default: every emulated node is this machine.

Each attempt gets a supervisor process in a session of its own, so killing the daemon
leaves running tasks alone; the daemon finds them again by their handle,
``PID:STARTTIME:ATTEMPT_DIR``. The start time (from ``/proc``) guards against a reused pid.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from fireflyer.platform.executor import Launch
from fireflyer.platform.layout import AttemptDir, Home


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot, or None when it is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    if fields[0] in ("Z", "X"):
        return None
    return fields[19]


def _belongs_to(pid: int, adir: AttemptDir) -> bool:
    """Whether ``pid`` is a rank of this attempt (its environment names the attempt's directory)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return f"FIREFLYER_TASK_DIR={adir.root}".encode() in environ.split(b"\0")


def kill_ranks(adir: AttemptDir) -> int:
    """SIGKILL every rank of the attempt still running here (each is its own process group)."""
    killed = 0
    if not adir.started.is_dir():
        return 0
    for marker in adir.started.glob("rank*"):
        try:
            pid = int(marker.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
        if _start_time(pid) is not None and _belongs_to(pid, adir):
            try:
                os.killpg(pid, signal.SIGKILL)
                killed += 1
            except (ProcessLookupError, PermissionError):
                pass
    return killed


class LocalExecutor:
    name = "local"

    def __init__(self) -> None:
        self._children: dict[int, subprocess.Popen] = {}

    def launch(self, launch: Launch, attempt_dir: str) -> str:
        adir = AttemptDir(attempt_dir)
        adir.create()
        with open(adir.logs / "supervisor.log", "ab") as log:
            proc = subprocess.Popen([sys.executable, "-m", "fireflyer.platform.supervisor", str(adir.root)],
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True, cwd=adir.root)
        self._children[proc.pid] = proc
        started = _start_time(proc.pid) or "0"
        return f"{proc.pid}:{started}:{adir.root}"

    @staticmethod
    def _parse(handle: str) -> tuple[int, str, AttemptDir]:
        pid, started, root = handle.split(":", 2)
        return int(pid), started, AttemptDir(root)

    def alive(self, handle: str) -> bool:
        pid, started, _ = self._parse(handle)
        child = self._children.get(pid)
        if child is not None and child.poll() is not None:  # reap our own child
            del self._children[pid]
            return False
        return _start_time(pid) == started

    def kill(self, handle: str) -> None:
        pid, started, adir = self._parse(handle)
        if _start_time(pid) == started:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        kill_ranks(adir)
        child = self._children.pop(pid, None)
        if child is not None:
            try:
                child.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass

    def find(self, task_id: int, attempt_dir: str) -> str | None:
        """The handle of an attempt launched before the daemon could record it, if its supervisor runs."""
        from fireflyer.platform.layout import read_json

        info = read_json(AttemptDir(attempt_dir).supervisor)
        if not info:
            return None
        started = _start_time(int(info["pid"]))
        return None if started is None else f"{info['pid']}:{started}:{attempt_dir}"


def kill_active(home: Home) -> int:
    """Kill every attempt the home's store still counts as active (after ``platform stop``: a full teardown)."""
    if not home.db.exists():
        return 0
    from fireflyer.platform.store import ACTIVE, Store

    store = Store(home.db)
    try:
        handles = [t.handle for t in store.tasks(ACTIVE) if t.handle]
    finally:
        store.close()
    executor = LocalExecutor()
    for handle in handles:
        executor.kill(handle)
    return len(handles)
