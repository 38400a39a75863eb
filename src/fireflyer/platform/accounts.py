"""Who a task runs as: its owner's Unix account when the platform isolates users, else the platform's.

A platform user (a name with a token) maps to a Unix account with ``fireflyer platform
user add alice --unix alice``. The platform **isolates** its users as soon as one of them
maps to an account other than the daemon's own, or when ``isolate`` is set in
``platform.json`` (a daemon run as a service account). Then, as Slurm's slurmd does:

* every task runs as its owner's account: that uid, its primary gid and its groups, with
  an environment built from scratch (:meth:`Account.env`) and a umask of 077;
* a task whose owner has no account, or whose account is the daemon's own (which could
  read ``state.db`` and every user's tasks), does not run;
* nor does one as root, unless ``allow_root_tasks`` says so.

Switching users needs root (or the capabilities in :data:`SWITCHING_CAPS`). Without isolation (the
embedded default, ``make demo``) a task runs as whoever runs the daemon, as before.
"""

from __future__ import annotations

import os
import pwd
import subprocess
from dataclasses import asdict, dataclass
from typing import Any, Mapping

from fireflyer.errors import FireflyerError

DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"
PASSED_ON = ("LANG", "LC_ALL", "TZ", "PYTHONPATH")
"""The daemon's variables an isolated task still gets (how to find the platform's own code,
and the locale); nothing else of the daemon's environment reaches it."""
SWITCHING_CAPS = {"CAP_CHOWN": 0, "CAP_DAC_OVERRIDE": 1, "CAP_DAC_READ_SEARCH": 2, "CAP_KILL": 5, "CAP_SETGID": 6,
                  "CAP_SETUID": 7}
"""What a daemon that is not root needs to run tasks as other accounts: start them as those
accounts, hand them their folders, write and read in those folders, and stop their processes."""
CHECK_TIMEOUT_S = 10.0


class AccountProblem(FireflyerError, ValueError):
    """A task cannot run as its owner's account (none mapped, unknown, root, or the platform's own)."""


@dataclass(frozen=True)
class Account:
    """A Unix account as the platform starts processes under it."""

    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]
    home: str
    shell: str = ""

    @classmethod
    def lookup(cls, name: str) -> "Account":
        if not isinstance(name, str) or not name or len(name) > 64 or any(c in name for c in "/:\0\n"):
            raise AccountProblem(f"bad Unix account name {name!r}")
        try:
            pw = pwd.getpwnam(name)
        except KeyError:
            raise AccountProblem(f"no Unix account {name!r} on this machine (create it with useradd, or map "
                                 "the user to one that exists)") from None
        groups = tuple(sorted(set(os.getgrouplist(pw.pw_name, pw.pw_gid))))
        return cls(pw.pw_name, pw.pw_uid, pw.pw_gid, groups, pw.pw_dir, pw.pw_shell)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "Account":
        return cls(**{**data, "groups": tuple(data.get("groups", ()))})

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "groups": list(self.groups)}

    def popen(self) -> dict[str, Any]:
        """``subprocess.Popen`` arguments that start the child as this account (no shell in between)."""
        return {"user": self.uid, "group": self.gid, "extra_groups": list(self.groups), "umask": 0o077}

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """An environment from scratch: who the account is, a plain PATH, and :data:`PASSED_ON`."""
        env = {"HOME": self.home, "USER": self.name, "LOGNAME": self.name, "PATH": DEFAULT_PATH}
        env.update({k: os.environ[k] for k in PASSED_ON if k in os.environ})
        env.update(extra or {})
        return env

    def can_enter(self, path: str) -> bool:
        """Whether this account can enter the folder ``path`` (asked as the account, so ACLs count)."""
        try:
            done = subprocess.run(["test", "-d", path, "-a", "-x", path], env={"PATH": DEFAULT_PATH},
                                  stdin=subprocess.DEVNULL, capture_output=True, timeout=CHECK_TIMEOUT_S,
                                  **self.popen())
        except (OSError, subprocess.SubprocessError):
            return False
        return done.returncode == 0


def can_switch_users() -> bool:
    """Whether this process may run tasks as other users: root, or every one of :data:`SWITCHING_CAPS`."""
    if os.geteuid() == 0:
        return True
    try:
        with open("/proc/self/status") as f:
            caps = next((int(line.split()[1], 16) for line in f if line.startswith("CapEff:")), 0)
    except OSError:
        return False
    return all(caps >> bit & 1 for bit in SWITCHING_CAPS.values())


def isolating(mapping: Mapping[str, str], *, isolate: bool = False, daemon_uid: int | None = None) -> bool:
    """Whether the platform isolates its users: set so, or a user maps to an account not the daemon's."""
    if isolate:
        return True
    me = os.geteuid() if daemon_uid is None else daemon_uid
    for unix in set(mapping.values()):
        try:
            if pwd.getpwnam(unix).pw_uid != me:
                return True
        except KeyError:
            return True  # an account meant to be another one, even if it is gone now
    return False


def run_as(owner: str, mapping: Mapping[str, str], *, isolate: bool = False, allow_root: bool = False,
           daemon_uid: int | None = None) -> Account | None:
    """The account a task of ``owner`` runs as; None: the daemon's own (the platform does not isolate).

    Raises :class:`AccountProblem` with what an admin should do when the task cannot run.
    """
    me = os.geteuid() if daemon_uid is None else daemon_uid
    if not isolating(mapping, isolate=isolate, daemon_uid=me):
        return None
    unix = mapping.get(owner)
    if unix is None:
        raise AccountProblem(f"tasks run as their owner's Unix account on this platform, and {owner} has none: an "
                             f"admin maps one with 'fireflyer platform user unix {owner} ACCOUNT'")
    account = Account.lookup(unix)
    if account.uid == 0:
        if not allow_root:
            raise AccountProblem(f"{owner} maps to root, and the platform runs no task as root unless "
                                 "allow_root_tasks is set in platform.json")
    elif account.uid == me:
        raise AccountProblem(f"{owner} maps to {unix}, the platform's own account, which can read every user's "
                             f"tasks and state: map {owner} to an account of their own")
    if account.uid != me and not can_switch_users():
        raise AccountProblem(f"running tasks as {unix} needs the platform's daemon to run as root (or with "
                             f"{', '.join(SWITCHING_CAPS)}); it runs as {_name(me)}")
    return account


def _name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"
