"""Where the platform keeps things on disk: its home, and one directory per attempt.

Import-light on purpose: ranks import this (through the client) on every start.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any

from fireflyer.fsutil import write_json_atomic  # noqa: F401 - the platform's writers import it from here

HOME_ENV = "FIREFLYER_PLATFORM_HOME"
TASK_DIR_ENV = "FIREFLYER_TASK_DIR"


def default_home() -> Path:
    return Path(os.environ.get(HOME_ENV) or Path.home() / ".fireflyer" / "platform")


def read_json(path: Path) -> Any | None:
    """The file's JSON, or None when it does not exist (yet)."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


class Home:
    """The platform's directory: ``state.db``, the daemon's pid and log, and ``tasks/ID/``."""

    def __init__(self, root: str | Path | None = None) -> None:
        self.root = Path(root) if root is not None else default_home()

    @property
    def db(self) -> Path:
        return self.root / "state.db"

    @property
    def config(self) -> Path:
        return self.root / "platform.json"

    @property
    def pidfile(self) -> Path:
        return self.root / "daemon.pid"

    @property
    def heartbeat(self) -> Path:
        return self.root / "daemon.heartbeat"

    @property
    def log(self) -> Path:
        return self.root / "daemon.log"

    def attempt(self, task_id: int) -> "AttemptDir":
        return AttemptDir(self.root / "tasks" / str(task_id))


class AttemptDir:
    """One attempt's files; see :mod:`fireflyer.platform.executor` for who writes what."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    spec = property(lambda self: self.root / "spec.json")
    supervisor = property(lambda self: self.root / "supervisor.json")
    status = property(lambda self: self.root / "status.json")
    control = property(lambda self: self.root / "control")
    logs = property(lambda self: self.root / "logs")
    started = property(lambda self: self.root / "started")

    def rank_log(self, rank: int) -> Path:
        return self.logs / f"rank{rank}.log"

    def started_marker(self, rank: int) -> Path:
        return self.started / f"rank{rank}"

    def flag(self, name: str) -> Path:
        """A control file: ``suspend``, ``stop``, ``received``, ``can_suspend``, ``whole_life_state``."""
        return self.control / name

    secret_file = property(lambda self: self.root / "secret")

    def job_secret(self) -> str:
        """The attempt's job secret (FIREFLYER_JOB_SECRET for its ranks), made once, readable by its owner only.

        Every node of an attempt reads the same file (the attempt folder is shared), so all
        ranks key hfreduce's links alike and nothing secret goes through the rendezvous store.
        """
        try:
            return self.secret_file.read_text().strip()
        except FileNotFoundError:
            pass
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".secret.{os.getpid()}.{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, self.secret_file)  # atomic, and never over another node's secret
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
        return self.secret_file.read_text().strip()

    def create(self) -> None:
        for d in (self.control, self.logs, self.started):
            d.mkdir(parents=True, exist_ok=True)

    def raise_flag(self, name: str, text: str = "") -> bool:
        """Create a control file if it is not there yet; True when this call created it."""
        self.control.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(self.flag(name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return True

    def has_flag(self, name: str) -> bool:
        return self.flag(name).exists()

    def rank_logs(self) -> list[Path]:
        if not self.logs.is_dir():
            return []
        return sorted(self.logs.glob("rank*.log"), key=lambda p: int(p.stem[4:]) if p.stem[4:].isdigit() else 0)
