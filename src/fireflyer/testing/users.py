"""Run a piece of a test as another Unix user (root only): the door a stranger on the same machine has."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

if TYPE_CHECKING:
    from fireflyer.platform.accounts import Account

NOBODY = 65534


def refused_as(uid: int, attempt: Callable[[], object], refusal: type[BaseException] | tuple) -> bool:
    """Fork, drop to ``uid`` (and the same gid), run ``attempt``; True when it raised ``refusal``.

    False when it succeeded; any other exception in the child counts as not refused either,
    so a test cannot pass by accident.
    """
    if os.geteuid() != 0:
        raise PermissionError("refused_as needs root to switch to another user")
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgid(uid)
            os.setuid(uid)
            attempt()
        except refusal:
            code = 3
        except BaseException:  # noqa: BLE001 - anything else is not the refusal the test looks for
            code = 2
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 3


# ---------------------------------------------------------------------- real accounts (root only)
ACCOUNT_TIMEOUT_S = 30.0


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=ACCOUNT_TIMEOUT_S,
                          stdin=subprocess.DEVNULL)


def accounts_unavailable() -> str | None:
    """Why this machine cannot make test accounts (a reason to skip), or None when it can."""
    if os.geteuid() != 0:
        return "needs root (to create Unix accounts with useradd)"
    for tool in ("useradd", "userdel", "setfacl"):
        if shutil.which(tool) is None:
            return f"needs {tool} ({'the acl package' if tool == 'setfacl' else 'the passwd package'})"
    return None


@contextlib.contextmanager
def unix_accounts(homes: Path, *tags: str) -> Iterator[dict[str, "Account"]]:
    """Real Unix accounts, one per tag (``ff{tag}{pid}``), each with a private home under ``homes``.

    Every process of theirs is killed and the accounts deleted afterwards.
    """
    from fireflyer.platform.accounts import Account

    homes.mkdir(parents=True, exist_ok=True)
    os.chmod(homes, 0o755)
    made: list[str] = []
    try:
        for tag in tags:
            name = f"ff{tag}{os.getpid() % 100000}"
            done = _run("useradd", "--create-home", "--home-dir", str(homes / name), "--shell", "/usr/sbin/nologin",
                        "--user-group", name)
            if done.returncode != 0:
                raise RuntimeError(f"useradd {name} failed: {done.stderr.strip()}")
            made.append(name)
            os.chmod(homes / name, 0o700)
        yield {tag: Account.lookup(name) for tag, name in zip(tags, made)}
    finally:
        for name in made:
            _run("pkill", "-KILL", "-u", name)
            _run("userdel", "--remove", "--force", name)


@contextlib.contextmanager
def reachable(paths: Iterable[str | os.PathLike], accounts: Iterable["Account"]) -> Iterator[None]:
    """Let ``accounts`` enter every folder on the way to ``paths`` (an ACL entry where the mode does not),
    as a site does when it installs the platform where every user can run it; undone afterwards."""
    granted: list[tuple[str, str]] = []
    try:
        for target in paths:
            p = Path(os.path.realpath(target))
            for folder in [*reversed(p.parents), p]:
                if not folder.is_dir() or os.stat(folder).st_mode & 0o001:
                    continue
                for account in accounts:
                    done = _run("setfacl", "-m", f"u:{account.name}:x", str(folder))
                    if done.returncode != 0:
                        raise RuntimeError(f"setfacl on {folder} failed: {done.stderr.strip()}")
                    granted.append((account.name, str(folder)))
        yield
    finally:
        for name, folder in granted:
            _run("setfacl", "-x", f"u:{name}", folder)


@contextlib.contextmanager
def account_site(*tags: str) -> Iterator[tuple[Path, dict[str, "Account"]]]:
    """A fresh folder under /tmp that every account can enter, real accounts with homes in it, and the
    interpreter and the fireflyer package reachable by them: what a site with the platform installed for
    all its users looks like. Everything is removed afterwards."""
    import sys

    import fireflyer

    base = Path(tempfile.mkdtemp(prefix="ff-accounts-", dir="/tmp"))
    os.chmod(base, 0o755)
    try:
        with unix_accounts(base / "homes", *tags) as accounts:
            with reachable([sys.executable, os.path.realpath(sys.executable), Path(fireflyer.__file__).parent],
                           accounts.values()):
                yield base, accounts
    finally:
        shutil.rmtree(base, ignore_errors=True)
