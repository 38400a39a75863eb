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

from fireflyer.fsutil import open_beneath, read_owned
from fireflyer.platform import env
from fireflyer.platform.accounts import Account
from fireflyer.platform.executors.base import Launch
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


def _uid(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def _belongs_to(pid: int, adir: AttemptDir) -> bool:
    """Whether ``pid`` is a rank of this attempt: it runs as the attempt's account, and its
    environment names the attempt's directory (a pid read from a file the task could write
    must not make the daemon kill anybody else's process)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
        owner = adir.owner
    except OSError:
        return False
    return _uid(pid) == owner and f"{env.TASK_DIR}={adir.root}".encode() in environ.split(b"\0")


def _is_supervisor(pid: int, adir: AttemptDir) -> bool:
    """Whether ``pid`` is this attempt's supervisor (as :func:`_belongs_to`, by its command line)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        owner = adir.owner
    except OSError:
        return False
    return _uid(pid) == owner and any(m in argv for m in SUPERVISORS) and str(adir.root).encode() in argv


SUPERVISORS = (b"fireflyer.platform.attempt.supervisor", b"fireflyer.platform.attempt.replicas")
"""The modules an attempt's supervisor runs as (a fault-tolerant attempt's is :mod:`fireflyer.platform.attempt.replicas`)."""


def kill_ranks(adir: AttemptDir) -> int:
    """SIGKILL every rank of the attempt still running here (each is its own process group)."""
    killed = 0
    if not adir.started.is_dir() or adir.started.is_symlink():
        return 0
    for marker in adir.started.glob("rank*"):
        try:  # written by the rank, so by the task's account: a file of theirs, and small
            pid = int(read_owned(marker, adir.owner, limit=4096).split()[0])
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
        how: dict = {}
        if launch.account is not None:  # as the task's account, with nothing of the daemon's environment
            account = Account.from_json(launch.account)
            how = {"env": account.env(), **account.popen()}
        else:
            adir.create()
        log = open_beneath(adir.root, "logs/supervisor.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            module = "fireflyer.platform.attempt.replicas" if launch.fault_tolerant else "fireflyer.platform.attempt.supervisor"
            proc = subprocess.Popen([sys.executable, "-m", module, str(adir.root)],
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True, cwd=adir.root, **how)
        finally:
            os.close(log)
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
        adir = AttemptDir(attempt_dir)
        try:
            info = adir.read_json(adir.supervisor)
            pid = int(info["pid"])
        except (OSError, ValueError, TypeError, KeyError):
            return None
        started = _start_time(pid)
        if started is None or not _is_supervisor(pid, adir):
            return None
        return f"{pid}:{started}:{attempt_dir}"


def kill_active(home: Home) -> int:
    """Kill every attempt the home's store still counts as active (after ``platform stop``: a full teardown)."""
    if not home.db.exists():
        return 0
    from fireflyer.platform.state.store import ACTIVE, Store

    store = Store(home.db)
    try:
        handles = [t.handle for t in store.tasks(ACTIVE) if t.handle]
    finally:
        store.close()
    executor = LocalExecutor()
    for handle in handles:
        executor.kill(handle)
    return len(handles)
