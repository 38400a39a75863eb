"""What an attempt's supervisor leaves for the daemon: ``status.json`` (how the attempt ended),
``replicas.json`` (a fault-tolerant task's replicas) and its log's last line.

The files are written by the task's account, so every one is read as input: owned by the folder's
owner, small, and of the fields the supervisor writes, or the attempt is counted as failed and the
reason said.
"""

from __future__ import annotations

import os

from fireflyer.errors import UserError
from fireflyer.fsutil import open_owned
from fireflyer.platform.layout import AttemptDir
from fireflyer.platform.state.store import StopCode

MAX_DETAIL = 2000
_KNOWN_CODES = sum(int(c) for c in StopCode)


def read_status(adir: AttemptDir) -> dict | None:
    """How the attempt ended, from ``status.json``, checked as input from the task's account; None: not yet.

    A status that is not there as a small JSON file of the folder's owner, or whose fields
    are not what the supervisor writes, ends the attempt as failed and says so.
    """
    try:
        raw = adir.read_json(adir.status, limit=1 << 20)
    except (OSError, ValueError) as exc:
        return _bad_status(f"its status.json is unreadable ({exc})")
    if raw is None:
        return None
    try:
        code = raw["stop_code"]
        life = raw.get("whole_life_state")
        detail = raw.get("detail", "")
        nodes = raw.get("failed_nodes", [])
        if not isinstance(code, int) or isinstance(code, bool) or not 0 < code <= _KNOWN_CODES or code & ~_KNOWN_CODES:
            raise UserError(f"stop_code {code!r}")
        if life is not None and (not isinstance(life, int) or isinstance(life, bool) or not -2**63 <= life < 2**63):
            raise UserError(f"whole_life_state {life!r}")
        if not isinstance(detail, str) or not isinstance(nodes, list) or \
                not all(isinstance(n, str) and len(n) <= 256 for n in nodes[:1000]) or len(nodes) > 1000:
            raise UserError("detail or failed_nodes")
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        return _bad_status(f"its status.json is not a supervisor's ({exc})")
    return {"stop_code": code, "detail": detail[:MAX_DETAIL], "whole_life_state": life, "failed_nodes": tuple(nodes)}


def replica_records(items: object) -> list[dict]:
    """The well-formed entries of a list in ``replicas.json`` (written by the task's account: checked as input)."""
    if not isinstance(items, list):
        return []
    kinds = {"slot": int, "start": int, "node": str, "state": str, "detail": str}
    out = []
    for item in items[:10_000]:
        if isinstance(item, dict) and all(isinstance(item.get(k, "" if k == "state" else None), kind)
                                          and not isinstance(item.get(k), bool) for k, kind in kinds.items()):
            out.append(item)
    return out


def timestamp(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _bad_status(why: str) -> dict:
    return {"stop_code": int(StopCode.FAILED), "detail": why[:MAX_DETAIL], "whole_life_state": None,
            "failed_nodes": ()}


def last_log_line(adir: AttemptDir) -> str:
    """The last line the attempt's supervisor logged (why it died without a status), if any."""
    try:
        fd = open_owned(adir.logs / "supervisor.log", adir.owner)
    except OSError:
        return ""
    try:
        size = os.fstat(fd).st_size
        os.lseek(fd, max(0, size - 4096), os.SEEK_SET)
        lines = os.read(fd, 4096).decode(errors="replace").strip().splitlines()
    finally:
        os.close(fd)
    return lines[-1][:MAX_DETAIL] if lines else ""
