"""Is a process still there? Used to notice dead local peers and to sweep what dead jobs left behind."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """True unless ``pid`` is gone or a zombie. A process we may not signal counts as alive."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][:1] not in ("Z", "X")
    except (OSError, IndexError):
        return True
