"""Where the platform keeps things on disk: its home, and one directory per attempt.

Import-light on purpose: ranks import this (through the client) on every start.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from pathlib import Path
from typing import Any

from fireflyer.errors import NotPermitted
from fireflyer.fsutil import durable_replace, open_beneath, read_owned, write_json  # noqa: F401 - writers import it here
from fireflyer.platform import env


def default_home() -> Path:
    return Path(os.environ.get(env.HOME) or Path.home() / ".fireflyer" / "platform")


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
        self._runs: Path | None = None

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

    @property
    def runs(self) -> Path:
        """Where the attempt folders are: ``runs_dir`` from ``platform.json``, else ``HOME/tasks``."""
        if self._runs is None:
            settings = read_json(self.config) if self.config.exists() else None
            runs_dir = settings.get("runs_dir") if isinstance(settings, dict) else None
            self._runs = Path(runs_dir) if runs_dir else self.root / "tasks"
        return self._runs

    def attempt(self, task_id: int) -> "AttemptDir":
        return AttemptDir(self.runs / str(task_id))


def open_runs_dir(path: Path) -> None:
    """Make the folder of an isolating platform's attempts: the daemon's, open to enter but not to list (0711).

    Each attempt folder in it belongs to its task's account (0700), so a user reaches their
    own attempts by name and sees nobody else's. A folder that is already there must be the
    daemon's and writable by nobody else, or an attacker could swap attempts under it.
    """
    path.mkdir(parents=True, exist_ok=True)
    st = os.lstat(path)
    if not os.path.isdir(path) or os.path.islink(path) or st.st_uid != os.geteuid():
        raise NotPermitted(f"runs_dir {path} must be a folder of the platform's own account")
    if st.st_mode & 0o7777 != 0o711:
        os.chmod(path, 0o711)


class AttemptDir:
    """One attempt's files; see :mod:`fireflyer.platform.executors.base` for who writes what."""

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

    def prepare(self, spec: dict[str, Any], uid: int | None = None, gid: int | None = None) -> None:
        """Make the attempt's folder with its spec, as the daemon, before its supervisor starts.

        ``uid``/``gid``: the account the task runs as, when not the daemon's. The folder is
        then made afresh (one left by a crash is moved aside), filled while only the daemon
        can enter it, and handed to that account (0700), so no file in it was ever open to
        anybody else and nothing the account did before lies in it.
        """
        if uid is None:
            self.create()
            write_json(self.spec, spec, sort_keys=True)
            return
        if os.path.lexists(self.root):
            durable_replace(str(self.root), str(self.root.with_name(f"{self.root.name}.stale.{time.time():.0f}")))
        os.mkdir(self.root, 0o700)
        self.create()
        write_json(self.spec, spec, sort_keys=True)
        os.close(os.open(self.logs / "supervisor.log", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        for folder, dirs, files in os.walk(self.root):
            for name, mode in [(d, 0o700) for d in dirs] + [(f, 0o600) for f in files]:
                os.chmod(os.path.join(folder, name), mode)
                os.lchown(os.path.join(folder, name), uid, gid if gid is not None else -1)
        os.lchown(self.root, uid, gid if gid is not None else -1)

    @property
    def owner(self) -> int:
        """The uid the attempt's folder belongs to: its task's account. Files in it are trusted as theirs only."""
        return os.lstat(self.root).st_uid

    def open_new(self, relative: str, mode: int = 0o644) -> int:
        """Create ``relative`` in the folder (it must not exist), following no link; a descriptor to write.

        Safe for the daemon in a folder its task's account owns; the file is handed to that account.
        """
        fd = open_beneath(self.root, relative, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        st = os.lstat(self.root)
        if st.st_uid != os.geteuid():
            os.fchown(fd, st.st_uid, st.st_gid)
        return fd

    def raise_flag(self, name: str, text: str = "") -> bool:
        """Create a control file if it is not there yet; True when this call created it."""
        self.control.mkdir(parents=True, exist_ok=True)
        try:
            fd = self.open_new(f"control/{name}")
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return True

    def has_flag(self, name: str) -> bool:
        return os.path.lexists(self.flag(name))

    def read_json(self, path: Path, *, limit: int = 1 << 20) -> Any | None:
        """A JSON file of the folder as its owner wrote it; None when absent. Raises ``ValueError``
        when it is not JSON, and ``PermissionError`` when it is a link, too large, or not the owner's."""
        try:
            data = read_owned(path, self.owner, limit=limit)
        except FileNotFoundError:
            return None
        return json.loads(data)

    def rank_logs(self) -> list[Path]:
        if not self.logs.is_dir():
            return []
        return sorted(self.logs.glob("rank*.log"), key=lambda p: int(p.stem[4:]) if p.stem[4:].isdigit() else 0)
