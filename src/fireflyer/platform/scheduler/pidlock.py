"""One daemon per home: an exclusive lock on the home's ``daemon.pid``, held while the daemon lives,
and the running daemon's pid read from it."""

from __future__ import annotations

import fcntl
import os

from fireflyer.errors import FireflyerError
from fireflyer.fsutil import private_dir
from fireflyer.platform.layout import Home


class AlreadyRunning(FireflyerError, RuntimeError):
    pass


def lock(home: Home) -> int:
    """Take the home's daemon lock (held until the process exits); raises if another daemon has it."""
    private_dir(home.root)
    fd = os.open(home.pidfile, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        other = os.read(fd, 32).decode().strip() or "?"
        os.close(fd)
        raise AlreadyRunning(f"a platform daemon already runs for {home.root} (pid {other})") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def daemon_pid(home: Home) -> int | None:
    """The running daemon's pid, or None (the lock is free, or no pid file)."""
    try:
        fd = os.open(home.pidfile, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            text = os.read(fd, 32).decode().strip()
            return int(text) if text.isdigit() else None
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)
