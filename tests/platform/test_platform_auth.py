"""The HTTP server's users and tokens (hashed, revocable, rotatable) and its limit on failed logins."""

from __future__ import annotations

import json
import sqlite3

import pytest

from fireflyer.errors import UserError
from fireflyer.platform.layout import Home
from fireflyer.platform.commands import serve as cli
from fireflyer.platform.server.auth import (TOKEN_PREFIX, FailedLogins, UserProblem, Users, check_name,
                                            token_hash, well_formed)
from fireflyer.platform.state.store import Store


@pytest.fixture
def home(tmp_path) -> Home:
    h = Home(tmp_path / "home")
    Store(h.db).close()
    return h


@pytest.fixture
def users(home):
    with Users(home.db) as u:
        yield u


def test_a_token_is_random_prefixed_and_only_its_hash_is_stored(home, users):
    token = users.add("alice")
    other = users.add("bob", admin=True)
    assert token.startswith(TOKEN_PREFIX) and well_formed(token) and len(token) == 46 and token != other
    rows = sqlite3.connect(home.db).execute("SELECT name, admin, token_hash FROM users ORDER BY name").fetchall()
    assert rows == [("alice", 0, token_hash(token)), ("bob", 1, token_hash(other))]
    for path in home.root.iterdir():  # not in the database, nor its write-ahead log
        assert token.encode() not in path.read_bytes()


def test_authenticate_finds_the_user_and_nothing_else(users):
    token = users.add("alice")
    admin = users.add("root", admin=True)
    assert users.authenticate(token).name == "alice" and not users.authenticate(token).admin
    assert users.authenticate(admin).admin
    assert users.authenticate(TOKEN_PREFIX + "x" * 43) is None       # well formed, unknown
    assert users.authenticate(token[:-1]) is None                     # malformed: too short
    assert users.authenticate("Bearer " + token) is None
    assert users.authenticate("") is None


def test_a_database_without_users_knows_no_token(home):
    with Users(home.db, create=False) as users:
        assert users.authenticate(TOKEN_PREFIX + "x" * 43) is None


def test_revoke_and_rotate(users):
    first = users.add("alice")
    users.revoke("alice")
    found = users.authenticate(first)
    assert found is not None and not found.active and found.revoked is not None
    assert users.count() == 0 and users.count(active=False) == 1
    second = users.rotate("alice")  # a new token re-enables the user; the old one stays dead
    assert users.authenticate(second).active
    assert users.authenticate(first) is None
    third = users.rotate("alice")
    assert users.authenticate(second) is None and users.authenticate(third).name == "alice"


def test_user_mistakes_are_one_clear_error(users):
    users.add("alice")
    with pytest.raises(UserProblem, match="exists already"):
        users.add("alice")
    with pytest.raises(UserProblem, match="no user 'carol'; users are alice"):
        users.revoke("carol")
    with pytest.raises(UserProblem, match="no user"):
        users.rotate("carol")


@pytest.mark.parametrize("name", ["", "9lives", "a b", "a/b", "x" * 65, "ali\0ce", "<script>", "public", "é"])
def test_bad_names_are_refused(name):
    with pytest.raises(UserProblem):
        check_name(name)


@pytest.mark.parametrize("name", ["alice", "_svc", "Bob.Smith", "ci-bot", "x" * 64])
def test_good_names(name):
    assert check_name(name) == name


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_failed_logins_block_an_address_for_the_rest_of_the_window():
    clock = Clock()
    limit = FailedLogins(limit=3, window=60.0, clock=clock)
    for _ in range(2):
        limit.fail("10.0.0.1")
        clock.now += 1
    assert limit.retry_after("10.0.0.1") is None
    limit.fail("10.0.0.1")  # the third, at t=1002: blocked until the first (t=1000) leaves the window
    assert limit.retry_after("10.0.0.1") == pytest.approx(58.0)
    assert limit.retry_after("10.0.0.2") is None  # other addresses are not affected
    clock.now = 1059.5
    assert limit.retry_after("10.0.0.1") == pytest.approx(0.5)
    clock.now = 1060.0
    assert limit.retry_after("10.0.0.1") is None  # a sliding window: two failures are still in it
    limit.fail("10.0.0.1")
    assert limit.retry_after("10.0.0.1") == pytest.approx(1.0)


def test_failed_logins_forget_old_addresses_and_stay_bounded():
    clock = Clock()
    limit = FailedLogins(limit=2, window=10.0, max_addresses=100, clock=clock)
    for i in range(1000):
        limit.fail(f"10.0.{i // 256}.{i % 256}")
        clock.now += 0.001
    assert len(limit._failures) <= 100
    clock.now += 11
    limit.fail("10.9.9.9")
    assert limit.retry_after("10.0.3.231") is None


def test_failed_logins_check_their_settings():
    with pytest.raises(ValueError, match="limit"):
        FailedLogins(limit=0)


# ---------------------------------------------------------------------- the commands
def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_user_commands(home, capsys):
    h = ("--home", str(home.root))
    code, out, err = run(capsys, "user", "add", "alice", *h)
    token = out.strip()
    assert code == 0 and well_formed(token) and "shown only this once" in err
    code, out, err = run(capsys, "user", "add", "root", "--admin", *h)
    admin_token = out.strip()
    assert code == 0 and "(admin)" in err
    code, out, _ = run(capsys, "user", "list", *h)
    assert code == 0 and "alice" in out and "admin" in out and "active" in out
    assert token not in out and admin_token not in out and token_hash(token) not in out
    code, out, _ = run(capsys, "user", "revoke", "alice", *h)
    assert code == 0 and "revoked" in out
    listed = json.loads(run(capsys, "user", "list", "--json", *h)[1])
    assert [(u["name"], u["admin"], u["revoked"] is not None) for u in listed] == [("alice", False, True),
                                                                                  ("root", True, False)]
    assert token not in json.dumps(listed)
    code, out, err = run(capsys, "user", "token", "alice", *h)
    new = out.strip()
    assert code == 0 and well_formed(new) and new != token
    with Users(home.db) as users:
        assert users.authenticate(new).active and users.authenticate(token) is None


def test_user_command_mistakes(home, tmp_path, capsys):
    h = ("--home", str(home.root))
    run(capsys, "user", "add", "alice", *h)
    with pytest.raises(UserError, match="exists already"):
        run(capsys, "user", "add", "alice", *h)
    with pytest.raises(UserError, match="bad user name"):
        run(capsys, "user", "add", "no body", *h)
    with pytest.raises(UserError, match="no user 'bob'"):
        run(capsys, "user", "revoke", "bob", *h)
    with pytest.raises(UserError, match="no platform in"):
        run(capsys, "user", "list", "--home", str(tmp_path / "nowhere"))
    with pytest.raises(UserError, match="unknown server command"):
        run(capsys, "users")
    assert not (tmp_path / "nowhere").exists()
