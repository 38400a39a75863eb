"""Who a task runs as, and how the root daemon handles the files a task's account owns.

The rules are tested with the accounts every Debian machine has (root and nobody); the
file checks chown to nobody, so they need root and are skipped otherwise. Tasks run as
real, freshly made accounts in tests/platform/test_platform_isolation.py.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time

import pytest

from fireflyer.fsutil import open_beneath, read_owned
from fireflyer.platform import accounts
from fireflyer.platform.accounts import Account, AccountProblem, run_as
from fireflyer.platform.scheduler.reports import read_status
from fireflyer.platform.layout import AttemptDir, open_runs_dir
from fireflyer.platform.executors.local import LocalExecutor, kill_ranks
from fireflyer.platform.server.auth import UserProblem, Users
from fireflyer.platform.state.store import StopCode
from fireflyer.testing.users import NOBODY

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (to give files to another account)")
ROOT = 0


# ---------------------------------------------------------------------- the rules
def test_no_mapping_runs_tasks_as_the_daemon():
    assert run_as("alice", {}, daemon_uid=ROOT) is None
    assert run_as("alice", {"alice": "root"}, daemon_uid=ROOT) is None  # root's own account: nothing to isolate


def test_a_mapped_user_runs_as_their_account():
    got = run_as("alice", {"alice": "nobody"}, daemon_uid=ROOT)
    assert got is not None and got.uid == NOBODY and got.name == "nobody" and NOBODY in (got.gid, *got.groups)


@pytest.mark.parametrize("owner, mapping, says", [
    ("carol", {"alice": "nobody"}, "carol has none"),
    ("alice", {"alice": "root", "bob": "nobody"}, "maps to root"),
    ("alice", {"alice": "no-such-account-x"}, "no Unix account 'no-such-account-x'"),
    ("alice", {"alice": "a/b"}, "bad Unix account name"),
])
def test_tasks_that_cannot_run_say_why(owner, mapping, says):
    with pytest.raises(AccountProblem, match=says):
        run_as(owner, mapping, daemon_uid=ROOT)


def test_root_needs_the_flag_and_the_daemons_own_account_is_refused():
    assert run_as("alice", {"alice": "root"}, isolate=True, allow_root=True, daemon_uid=ROOT).uid == 0
    with pytest.raises(AccountProblem, match="platform's own account"):
        run_as("alice", {"alice": "nobody"}, isolate=True, daemon_uid=NOBODY)  # a service account's daemon
    with pytest.raises(AccountProblem, match="has none"):
        run_as("alice", {}, isolate=True, daemon_uid=ROOT)  # isolating with no mapping yet


def test_a_daemon_that_cannot_switch_users_says_so(monkeypatch):
    monkeypatch.setattr(accounts, "can_switch_users", lambda: False)
    with pytest.raises(AccountProblem, match="needs the platform's daemon to run as root"):
        run_as("alice", {"alice": "nobody"}, daemon_uid=12345)


def test_the_environment_is_built_from_scratch(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "the daemon's")
    monkeypatch.setenv("LANG", "C.UTF-8")
    env = Account.lookup("nobody").env({"EXTRA": "1"})
    assert "AWS_SECRET_ACCESS_KEY" not in env and env["LANG"] == "C.UTF-8" and env["EXTRA"] == "1"
    assert env["USER"] == "nobody" and env["PATH"] == accounts.DEFAULT_PATH and env["HOME"]
    assert Account.from_json(json.loads(json.dumps(Account.lookup("nobody").to_json()))) == Account.lookup("nobody")


# ---------------------------------------------------------------------- users and their accounts
def test_users_map_to_accounts_that_exist(tmp_path):
    db = tmp_path / "state.db"
    with Users(db) as users:
        users.add("alice", unix="nobody")
        users.add("bob")
        with pytest.raises(UserProblem, match="no Unix account"):
            users.add("carol", unix="no-such-account-x")
        assert [u.name for u in users.list()] == ["alice", "bob"]  # nothing half-made
        users.set_unix("bob", "root")
        users.set_unix("alice", None)
        assert {u.name: u.unix for u in users.list()} == {"alice": None, "bob": "root"}
        with pytest.raises(UserProblem, match="no user 'dave'"):
            users.set_unix("dave", "nobody")


def test_a_users_table_from_before_accounts_gains_the_column(tmp_path):
    db = tmp_path / "state.db"
    old = sqlite3.connect(db)
    old.execute("CREATE TABLE users (name TEXT PRIMARY KEY, admin INTEGER NOT NULL DEFAULT 0, "
                "token_hash TEXT NOT NULL, created REAL NOT NULL, revoked REAL)")
    old.execute("INSERT INTO users VALUES ('alice', 0, 'x', 1.0, NULL)")
    old.commit()
    old.close()
    with Users(db) as users:
        users.set_unix("alice", "nobody")
        assert users.list()[0].unix == "nobody"


@pytest.mark.parametrize("argv, says", [
    (["user", "add", "carol", "--unix", "no-such-account-x"], "no Unix account 'no-such-account-x'"),
    (["user", "unix", "nobody-here", "nobody"], "no user 'nobody-here'"),
])
def test_the_cli_refuses_bad_mappings_in_one_line(tmp_path, argv, says):
    from fireflyer.platform.layout import Home
    from fireflyer.platform.state.store import Store

    Store(Home(tmp_path).db).close()
    done = subprocess.run([sys.executable, "-m", "fireflyer", "platform", *argv, "--home", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and says in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


# ---------------------------------------------------------------------- files a task's account owns
def test_open_beneath_follows_no_link(tmp_path):
    root = tmp_path / "attempt"
    (root / "control").mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, root / "logs")
    with pytest.raises(OSError):
        open_beneath(root, "logs/new", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    os.symlink(elsewhere / "target", root / "control" / "stop")
    with pytest.raises(FileExistsError):  # an exclusive create never goes through a link
        open_beneath(root, "control/stop", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    assert list(elsewhere.iterdir()) == []
    with pytest.raises(ValueError):
        open_beneath(root, "../escape", os.O_RDONLY)


def test_a_flag_is_never_raised_through_a_link(tmp_path):
    adir = AttemptDir(tmp_path / "attempt")
    adir.root.mkdir()
    target = tmp_path / "etc"
    target.mkdir()
    os.symlink(target, adir.control)  # the task swapped its control folder for a link
    with pytest.raises(OSError):
        adir.raise_flag("suspend", "preempted")
    assert list(target.iterdir()) == []


def test_read_owned_reads_only_the_owners_regular_files(tmp_path):
    mine = tmp_path / "mine"
    mine.write_bytes(b"x" * 10)
    assert read_owned(mine, os.getuid()) == b"x" * 10
    with pytest.raises(PermissionError):
        read_owned(mine, os.getuid() + 1)
    with pytest.raises(PermissionError):
        read_owned(mine, os.getuid(), limit=9)
    os.symlink(mine, tmp_path / "link")
    with pytest.raises(PermissionError, match="link"):
        read_owned(tmp_path / "link", os.getuid())
    os.mkfifo(tmp_path / "fifo")  # would block a plain open for read
    with pytest.raises(PermissionError):
        read_owned(tmp_path / "fifo", os.getuid())
    with pytest.raises(FileNotFoundError):
        read_owned(tmp_path / "absent", os.getuid())


@as_root
def test_prepare_hands_a_fresh_folder_to_the_account(tmp_path):
    runs = tmp_path / "runs"
    open_runs_dir(runs)
    assert os.stat(runs).st_mode & 0o7777 == 0o711
    adir = AttemptDir(runs / "7")
    adir.root.mkdir()
    (adir.root / "left-by-a-crash").write_text("?")
    adir.prepare({"task_id": 7}, NOBODY, NOBODY)
    assert not (adir.root / "left-by-a-crash").exists() and list(runs.glob("7.stale.*"))
    for path in (adir.root, adir.spec, adir.control, adir.logs, adir.logs / "supervisor.log"):
        st = os.lstat(path)
        assert st.st_uid == NOBODY and not st.st_mode & 0o077, path
    assert adir.owner == NOBODY and json.loads(read_owned(adir.spec, NOBODY)) == {"task_id": 7}
    assert adir.raise_flag("stop", "by its user") and os.stat(adir.flag("stop")).st_uid == NOBODY


@as_root
def test_a_runs_dir_of_somebody_else_is_refused(tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    os.chown(runs, NOBODY, NOBODY)
    with pytest.raises(PermissionError, match="platform's own account"):
        open_runs_dir(runs)


def _give(adir: AttemptDir, uid: int) -> None:
    for folder, dirs, files in os.walk(adir.root):
        for name in dirs + files:
            os.lchown(os.path.join(folder, name), uid, uid)
    os.lchown(adir.root, uid, uid)


@as_root
@pytest.mark.parametrize("content, says", [
    (b"not json", "unreadable"),
    (b'{"stop_code": "STOP"}', "not a supervisor's"),
    (b'{"stop_code": 1, "whole_life_state": 1e400}', "not a supervisor's"),
    (b'{"stop_code": 4}', "not a supervisor's"),  # a bit no stop code has
    (b'{"stop_code": 1, "failed_nodes": "node0"}', "not a supervisor's"),
])
def test_a_forged_or_broken_status_fails_the_attempt_and_says_why(tmp_path, content, says):
    adir = AttemptDir(tmp_path / "attempt")
    adir.create()
    adir.status.write_bytes(content)
    _give(adir, NOBODY)
    got = read_status(adir)
    assert got["stop_code"] == StopCode.FAILED and says in got["detail"]


@as_root
def test_a_status_that_is_not_the_accounts_file_is_not_read(tmp_path):
    adir = AttemptDir(tmp_path / "attempt")
    adir.create()
    secret = tmp_path / "roots.json"
    secret.write_text('{"stop_code": 1, "detail": "root\'s secret"}')
    os.symlink(secret, adir.status)
    _give(adir, NOBODY)
    got = read_status(adir)
    assert got["stop_code"] == StopCode.FAILED and "root's secret" not in got["detail"] and "link" in got["detail"]
    os.unlink(adir.status)
    os.link(secret, adir.status)  # a hard link to root's file (root can make one; a user cannot, on Debian)
    got = read_status(adir)
    assert got["stop_code"] == StopCode.FAILED and "root's secret" not in got["detail"]
    os.unlink(adir.status)
    adir.status.write_text('{"stop_code": 1, "detail": "fine", "whole_life_state": 3}')
    os.chown(adir.status, NOBODY, NOBODY)
    assert read_status(adir) == {"stop_code": 1, "detail": "fine", "whole_life_state": 3, "failed_nodes": ()}


@as_root
def test_a_pid_the_task_wrote_never_kills_another_accounts_process(tmp_path):
    adir = AttemptDir(tmp_path / "attempt")
    adir.create()
    # root's process, with the attempt's folder in its environment: still not the account's
    victim = subprocess.Popen(["sleep", "60"], env={"FIREFLYER_TASK_DIR": str(adir.root)},
                              start_new_session=True)
    try:
        adir.started_marker(0).write_text(f"{victim.pid} host 0\n")
        (adir.root / "supervisor.json").write_text(json.dumps({"pid": victim.pid}))
        _give(adir, NOBODY)
        assert kill_ranks(adir) == 0
        assert LocalExecutor().find(1, str(adir.root)) is None
        time.sleep(0.1)
        assert victim.poll() is None, "root's process was killed on the word of the task's files"
    finally:
        os.killpg(victim.pid, signal.SIGKILL)
        victim.wait(10)
