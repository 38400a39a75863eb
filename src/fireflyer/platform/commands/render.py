"""How the platform's commands print: aligned text tables, times, and JSON with ``--json``.

Shared by the task and daemon commands and the server's (``fireflyer platform serve|user``).
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Callable, Sequence


def table(rows: Sequence[Sequence[Any]], headers: Sequence[str]) -> str:
    """A plain, aligned text table (pipes and terminals alike)."""
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    return "\n".join(lines)


def when(t: float | None) -> str:
    """A moment this year, to the second (``-``: never)."""
    return "-" if t is None else datetime.fromtimestamp(t).strftime("%m-%d %H:%M:%S")


def day(t: float | None) -> str:
    """A date and time to the minute (``-``: never)."""
    return "-" if t is None else datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M")


def ago(seconds: float) -> str:
    """A duration, short: ``42s``, ``17m``, ``3h05m``."""
    seconds = max(0, int(seconds))
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def to_json(data: Any) -> str:
    return json.dumps(data, indent=1, default=str)


def emit(as_json: bool, data: Any, render: Callable[[], str]) -> int:
    """Print ``data`` as JSON, or what ``render`` makes of it; the command's exit code (0)."""
    print(to_json(data) if as_json else render())
    return 0
