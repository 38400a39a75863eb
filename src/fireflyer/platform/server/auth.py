"""Who may use the platform's HTTP API: users, their bearer tokens, and a limit on failed logins.

Users live in a ``users`` table of the platform's own SQLite database (``Home.db``),
next to the scheduler's tables, so one file holds the whole platform. A token is
``ff_`` followed by 43 URL-safe characters (256 random bits). It is shown once, when
it is made, and only its SHA-256 is kept: whoever reads the database cannot use
what they read.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import sqlite3
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from fireflyer.errors import FireflyerError, UserError

TOKEN_PREFIX = "ff_"
_TOKEN_RE = re.compile(r"^ff_[A-Za-z0-9_-]{43}$")
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$")
RESERVED_NAMES = frozenset({"public"})
"""``public`` is the quota table's name for everyone's default; a user by that name would be ambiguous."""

_SCHEMA = """
CREATE TABLE IF NOT EXISTS users (
    name TEXT PRIMARY KEY, admin INTEGER NOT NULL DEFAULT 0, token_hash TEXT NOT NULL,
    created REAL NOT NULL, revoked REAL, unix TEXT);
"""


class UserProblem(FireflyerError, ValueError):
    """A bad user name, an unknown user, or one that exists already; the message says which."""


@dataclass(frozen=True)
class User:
    name: str
    admin: bool
    created: float
    revoked: float | None = None
    unix: str | None = None
    """The Unix account the user's tasks run as (see :mod:`fireflyer.platform.accounts`)."""

    @property
    def active(self) -> bool:
        return self.revoked is None


def check_name(name: str) -> str:
    """A user name: a letter or ``_`` first, then letters, digits, ``_``, ``.`` or ``-``; 64 at most."""
    if not _NAME_RE.match(name):
        raise UserProblem(f"bad user name {name!r}: use a letter or '_' first, then letters, digits, '_', '.' "
                          "or '-' (64 characters at most)")
    if name in RESERVED_NAMES:
        raise UserProblem(f"{name!r} is reserved (the quotas' name for every user); pick another name")
    return name


def new_token() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def well_formed(token: str) -> bool:
    """Whether ``token`` looks like one of ours (a cheap check before any lookup)."""
    return bool(_TOKEN_RE.match(token))


def token_hash(token: str) -> str:
    # A plain SHA-256 suffices: a token carries 256 random bits, so there is no dictionary
    # to try and no brute force that could finish. Slow, salted hashes (bcrypt, scrypt)
    # exist to protect low-entropy passwords, and would only make every request slower.
    return hashlib.sha256(token.encode("ascii")).hexdigest()


class Users:
    """The ``users`` table of one platform database. One instance per thread (SQLite's rule)."""

    def __init__(self, db: str | Path, *, timeout: float = 10.0, clock: Callable[[], float] = time.time,
                 create: bool = True) -> None:
        """``create=False`` skips making the table (the server made it at start; a request only reads)."""
        self._clock = clock
        self._db = sqlite3.connect(str(db), timeout=timeout, isolation_level=None)
        if create:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.executescript(_SCHEMA)
            columns = {row[1] for row in self._db.execute("PRAGMA table_info(users)")}
            if "unix" not in columns:  # a platform made before users had Unix accounts
                self._db.execute("ALTER TABLE users ADD COLUMN unix TEXT")

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> "Users":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def add(self, name: str, *, admin: bool = False, unix: str | None = None) -> str:
        """Create a user; returns their token (the only time it is seen).

        ``unix``: the Unix account their tasks run as; it must exist on this machine.
        """
        check_name(name)
        if unix is not None:
            _check_account(unix)
        token = new_token()
        try:
            self._db.execute("INSERT INTO users(name, admin, token_hash, created, unix) VALUES (?,?,?,?,?)",
                             (name, int(admin), token_hash(token), self._clock(), unix))
        except sqlite3.IntegrityError:
            raise UserProblem(f"user {name!r} exists already; 'user token {name}' gives them a new token") from None
        return token

    def rotate(self, name: str) -> str:
        """A new token for ``name`` (the old one stops working); also re-enables a revoked user."""
        token = new_token()
        if self._db.execute("UPDATE users SET token_hash=?, revoked=NULL WHERE name=?",
                            (token_hash(token), name)).rowcount != 1:
            raise self._unknown(name)
        return token

    def revoke(self, name: str) -> None:
        """The user's token stops working at once; ``rotate`` gives them a new one."""
        if self._db.execute("UPDATE users SET revoked=COALESCE(revoked, ?) WHERE name=?",
                            (self._clock(), name)).rowcount != 1:
            raise self._unknown(name)

    def set_unix(self, name: str, unix: str | None) -> None:
        """Map ``name`` to a Unix account (None: to none; their next tasks run as the platform decides)."""
        if unix is not None:
            _check_account(unix)
        if self._db.execute("UPDATE users SET unix=? WHERE name=?", (unix, name)).rowcount != 1:
            raise self._unknown(name)

    def list(self) -> list[User]:
        return [User(n, bool(a), c, r, x) for n, a, c, r, x in
                self._db.execute("SELECT name, admin, created, revoked, unix FROM users ORDER BY name")]

    def count(self, *, active: bool = True) -> int:
        where = " WHERE revoked IS NULL" if active else ""
        return int(self._db.execute(f"SELECT COUNT(*) FROM users{where}").fetchone()[0])

    def authenticate(self, token: str) -> User | None:
        """The user whose token this is (revoked ones too: check ``active``), or None.

        Every stored hash is compared with ``hmac.compare_digest`` and the loop never stops
        early, so the time taken says nothing about which user, if any, matched.
        """
        if not well_formed(token):
            return None
        wanted = token_hash(token).encode()
        found = None
        try:
            rows = self._db.execute("SELECT name, admin, created, revoked, token_hash FROM users").fetchall()
        except sqlite3.OperationalError as exc:
            if "no such table" in str(exc):  # no user was ever added
                return None
            raise
        for name, admin, created, revoked, stored in rows:
            if hmac.compare_digest(wanted, stored.encode()):
                found = User(name, bool(admin), created, revoked)
        return found

    def _unknown(self, name: str) -> UserProblem:
        known = [u.name for u in self.list()][:8]
        return UserProblem(f"no user {name!r}; users are {', '.join(known) or 'none yet'}")


def _check_account(unix: str) -> None:
    from fireflyer.platform.accounts import Account, AccountProblem

    try:
        Account.lookup(unix)
    except AccountProblem as exc:
        raise UserProblem(str(exc)) from None


class FailedLogins:
    """Failed logins per client address in a sliding window; past ``limit`` the address waits.

    A token carries 256 random bits, so guessing one is hopeless at any rate: this limit
    is against clients that hammer the server with bad tokens (a misconfigured script, a
    scanner), and it keeps their noise out of the logs. A request with a valid token is
    never refused, so one address shared by many users (loopback, a proxy) cannot be used
    to lock the others out. Memory is bounded: at most ``max_addresses`` are tracked.
    """

    def __init__(self, *, limit: int = 10, window: float = 60.0, max_addresses: int = 10_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if limit < 1 or window <= 0:
            raise UserError(f"FailedLogins needs limit >= 1 and window > 0, got {limit} and {window}")
        self.limit, self.window, self.max_addresses = limit, window, max_addresses
        self._clock = clock
        self._failures: dict[str, deque[float]] = {}
        self._lock = threading.Lock()

    def _recent(self, address: str, now: float) -> deque[float] | None:
        times = self._failures.get(address)
        if times is None:
            return None
        while times and times[0] <= now - self.window:
            times.popleft()
        if not times:
            del self._failures[address]
            return None
        return times

    def retry_after(self, address: str) -> float | None:
        """Seconds until ``address`` may fail again, or None when it is not blocked."""
        with self._lock:
            now = self._clock()
            times = self._recent(address, now)
            if times is None or len(times) < self.limit:
                return None
            return max(0.0, times[-self.limit] + self.window - now)

    def fail(self, address: str) -> None:
        with self._lock:
            now = self._clock()
            times = self._recent(address, now)
            if times is None:
                if len(self._failures) >= self.max_addresses:
                    self._prune(now)
                times = self._failures.setdefault(address, deque(maxlen=self.limit))
            times.append(now)

    def _prune(self, now: float) -> None:
        for address in list(self._failures):
            self._recent(address, now)
        while len(self._failures) >= self.max_addresses:  # still full: forget the oldest offender
            oldest = min(self._failures, key=lambda a: self._failures[a][-1])
            del self._failures[oldest]
