"""Whether the daemon's cycles do their work: the disks it writes on, its health over time, and the
heartbeat file through which ``fireflyer platform status`` reads it."""

from __future__ import annotations

import json
import logging
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from fireflyer.platform.layout import Home
from fireflyer.platform.state.store import STORAGE_ERRNOS

log = logging.getLogger("fireflyer.platform")
MIN_FREE_BYTES = 1 << 20
"""Below this much free space on the home's or the attempts' disk the daemon reports itself unhealthy:
the next state change, status file or log line may not fit."""


def unwritable(folder: Path) -> str | None:
    """Why a task's supervisor could not write in ``folder`` (or its nearest existing parent) now: a full
    or failing disk; None when a small file can be written and made durable there (or fails for another
    reason). A disk full but for root's reserve counts as full: supervisors may not run as root."""
    while not folder.is_dir() and folder != folder.parent:
        folder = folder.parent
    full = low_space(folder)
    if full:
        return full[0]
    # The folder may be the task's own: a new file of a name it cannot guess, never through a link.
    probe = folder / f".probe.{secrets.token_hex(8)}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, b"x")
            os.fsync(fd)
        finally:
            os.close(fd)
            probe.unlink(missing_ok=True)
    except OSError as exc:
        return f"{exc.strerror} in {folder}" if exc.errno in STORAGE_ERRNOS else None
    return None


def low_space(*folders: Path) -> list[str]:
    """A problem for each disk of ``folders`` with under :data:`MIN_FREE_BYTES` free (none where it cannot tell)."""
    problems, disks = [], set()
    for folder in folders:
        try:
            disk, st = os.stat(folder).st_dev, os.statvfs(folder)
        except OSError:
            continue
        free = st.f_bavail * st.f_frsize
        if free < MIN_FREE_BYTES and disk not in disks:
            problems.append(f"the disk of {folder} is full ({free // 1024} KiB free)")
        disks.add(disk)
    return problems


HEARTBEAT_BYTES = 1024
HEALTH_LOG_S = 60.0
"""While the daemon stays unhealthy, it repeats the reason in its log this often (not every cycle)."""
STALE_AFTER_S = 60.0
"""A heartbeat older than this (or ten ticks, if longer) means the daemon's cycles have stalled."""


@dataclass
class Health:
    """Whether the daemon's cycles do their work: what the heartbeat tells ``platform status``."""

    problem: str | None = None
    since: float | None = None
    logged_at: float = 0.0

    def update(self, problem: str | None, now: float, trace: str | None = None) -> None:
        """Log a change of health in one line (a traceback only for an unexpected error, once)."""
        if problem is None:
            if self.problem is not None:
                log.info("daemon healthy again after %.0f s", now - (self.since or now))
            self.problem = self.since = None
            return
        new = self.problem is None or (trace is not None and problem != self.problem)
        if new or now - self.logged_at >= HEALTH_LOG_S:
            log.error("daemon unhealthy: %s%s", problem, f"\n{trace}" if trace and new else "")
            self.logged_at = now
        self.since = self.since or now
        self.problem = problem

    def to_json(self) -> dict:
        return {"healthy": self.problem is None, "problem": self.problem, "since": self.since}


def write_heartbeat(home: Home, beat: dict) -> None:
    """The daemon's pulse and health, rewritten in place at a fixed size: overwriting blocks the file
    already has needs no free space, so a daemon on a full disk can still say that it is."""
    while True:
        data = json.dumps(beat).encode()
        if len(data) < HEARTBEAT_BYTES or not beat.get("problem"):
            break
        beat = {**beat, "problem": beat["problem"][: len(beat["problem"]) // 2] + "..."}
    fd = os.open(home.heartbeat, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, data.ljust(HEARTBEAT_BYTES - 1) + b"\n", 0)
    finally:
        os.close(fd)


def read_heartbeat(home: Home) -> dict | None:
    """The last heartbeat, or None (no daemon has written one, or it cannot be read)."""
    for _ in range(3):
        try:
            text = home.heartbeat.read_text()
        except OSError:
            return None
        try:
            beat = json.loads(text)
            return beat if isinstance(beat, dict) else None
        except ValueError:  # read while it was being rewritten
            time.sleep(0.01)
    return None


def why_unhealthy(beat: dict | None, tick: float, now: float) -> str | None:
    """Why a running daemon is unhealthy, from its heartbeat; None when it is well (or has not cycled yet)."""
    if beat is None:
        return None
    if beat.get("healthy") is False:
        since = beat.get("since")
        return str(beat.get("problem") or "unknown") + (f" (for {now - since:.0f} s)" if since else "")
    stale = max(STALE_AFTER_S, 10 * tick)
    if now - beat.get("at", now) > stale:
        return (f"no cycle for {now - beat['at']:.0f} s (a cycle is stuck, or the daemon cannot write its "
                "heartbeat)")
    return None
