"""A full disk at the store boundary: SQLite's own "database or disk is full" on every COMMIT, in-process.

Nothing a cycle could not record happens (no launch, no kill recorded as a failure), an end the
store could not take is recorded as it was once the disk has room, the API answers 503, the CLI
one line, and the daemon's heartbeat says it is unhealthy. tests/platform/test_platform_full_disk.py
does the same on a real full tmpfs.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
import time

import pytest

from fireflyer.cli import main
from fireflyer.platform import config as platform_config
from fireflyer.platform.scheduler import daemon as daemon_module
from fireflyer.platform.state import store as store_module
from fireflyer.platform.scheduler.api import PlatformApi, Unavailable
from fireflyer.platform.config import PlatformConfig
from fireflyer.platform.scheduler.daemon import Daemon
from fireflyer.platform.scheduler.health import Health, read_heartbeat, why_unhealthy, write_heartbeat
from fireflyer.platform.scheduler.pidlock import lock
from fireflyer.platform.scheduler.service import serve
from fireflyer.platform.layout import Home, write_json
from fireflyer.platform.state.store import StopCode, Store, StoreUnavailable


def disk_full_error() -> sqlite3.OperationalError:
    """The error SQLite itself raises when a write does not fit (a database capped at its own size)."""
    db = sqlite3.connect(":memory:")
    db.execute("CREATE TABLE t(x)")
    db.execute("PRAGMA max_page_count = 2")
    try:
        db.execute("INSERT INTO t VALUES (zeroblob(100000))")
    except sqlite3.OperationalError as exc:
        return exc
    finally:
        db.close()
    raise AssertionError("SQLite wrote past max_page_count")


class Disk:
    full = False


class _Filling:
    """A store connection on a disk that may be full: then every COMMIT fails as SQLite's does."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def execute(self, sql: str, *args):
        if Disk.full and sql.strip().upper() == "COMMIT":
            raise disk_full_error()
        return self.db.execute(sql, *args)

    def __getattr__(self, name: str):
        return getattr(self.db, name)


@pytest.fixture
def disk(monkeypatch):
    Disk.full = False
    monkeypatch.setattr(Store, "_tx", lambda self: store_module._Transaction(_Filling(self._db)))
    yield Disk
    Disk.full = False


class StandIn:
    name = "stand-in"

    def __init__(self) -> None:
        self.launched: list[int] = []
        self.dead: set[str] = set()
        self.killed: list[str] = []

    def launch(self, launch, attempt_dir):
        self.launched.append(launch.task_id)
        return f"h{launch.task_id}"

    def alive(self, handle):
        return handle not in self.dead

    def kill(self, handle):
        self.killed.append(handle)
        self.dead.add(handle)

    def find(self, task_id, attempt_dir):
        return None


@pytest.fixture
def daemon(tmp_path, disk):
    home = Home(tmp_path)
    cfg = PlatformConfig(nodes=1, max_restarts=3)
    store = Store(home.db)
    store.add_nodes(cfg.emulated_nodes())
    platform_config.save(home, cfg)
    d = Daemon(home, cfg, executor=StandIn(), store=store)
    yield d
    store.close()


def test_a_failed_commit_changes_nothing_and_leaves_no_transaction_open(tmp_path, disk):
    store = Store(tmp_path / "state.db")
    disk.full = True
    with pytest.raises(StoreUnavailable, match="database or disk is full; free space on its disk"):
        store.submit(user="alice", nodes=1, command=["true"])
    assert not store._db.in_transaction and store.tasks() == []
    disk.full = False
    task = store.submit(user="alice", nodes=1, command=["true"])
    assert [t.id for t in store.tasks()] == [task]
    store.close()


def test_other_sqlite_errors_are_not_taken_for_a_full_disk(tmp_path):
    store = Store(tmp_path / "state.db")
    store._db.execute("DROP TABLE events")
    with pytest.raises(sqlite3.OperationalError, match="no such table"):
        store.event(1, "x")
    store.close()


def test_a_cycle_that_cannot_commit_launches_nothing_and_the_next_one_does(daemon, disk):
    task = daemon.store.submit(user="alice", nodes=1, command=["true"])
    disk.full = True
    with pytest.raises(StoreUnavailable):
        daemon.tick()
    assert daemon.executor.launched == [] and daemon.store.task(task).state == "queued"
    assert not daemon.home.attempt(task).spec.exists()
    disk.full = False
    assert daemon.tick().started == [task] and daemon.executor.launched == [task]


def test_an_end_the_store_could_not_take_is_recorded_once_it_can(daemon, disk):
    task = daemon.store.submit(user="alice", nodes=1, command=["true"])
    daemon.tick()
    write_json(daemon.home.attempt(task).status, {"stop_code": int(StopCode.STOP),
                                                           "detail": "all ranks exited 0"}, sort_keys=True)
    queued = daemon.store.submit(user="alice", nodes=1, command=["true"])
    disk.full = True
    with pytest.raises(StoreUnavailable):
        daemon.tick()
    assert daemon.store.task(task).state == "running" and daemon.executor.launched == [task]  # queued waits
    disk.full = False
    cycle = daemon.tick()
    done = daemon.store.task(task)
    assert done.state == "finished" and done.stop_code == StopCode.STOP and len(daemon.store.chain(task)) == 1
    assert cycle.started == [queued]


def test_a_kill_the_store_could_not_record_is_recorded_as_it_was_not_as_a_lost_attempt(daemon, disk):
    task = daemon.store.submit(user="alice", nodes=1, command=["true"])
    daemon.tick()  # launched; its supervisor never writes supervisor.json
    late = time.time() + daemon.cfg.timeouts.unschedulable + 60
    disk.full = True
    with pytest.raises(StoreUnavailable):
        daemon.tick(now=late)
    assert daemon.executor.killed == [f"h{task}"]  # killed, but not recorded yet
    disk.full = False
    daemon.tick(now=late)
    first = daemon.store.chain(task)[0]
    assert first.stop_code == StopCode.UNSCHEDULABLE and "did not start within" in first.detail
    assert not first.stop_code & StopCode.FAILED


def test_an_attempt_whose_end_could_not_be_written_is_not_counted_as_a_failure(daemon, monkeypatch):
    task = daemon.store.submit(user="alice", nodes=1, command=["true"])
    daemon.tick()
    daemon.executor.dead.add(f"h{task}")  # its supervisor died without a status.json
    monkeypatch.setattr(daemon_module, "unwritable", lambda folder: f"No space left on device in {folder}")
    daemon.tick()
    chain = daemon.store.chain(task)
    assert chain[0].stop_code == StopCode.UNSCHEDULABLE and "could not be recorded" in chain[0].detail
    assert "No space left on device" in chain[0].detail and "restart" not in chain[0].detail
    assert len(chain) == 2 and chain[1].state in ("queued", "running")


def test_without_a_full_disk_a_lost_attempt_is_still_a_failure(daemon):
    task = daemon.store.submit(user="alice", nodes=1, command=["true"])
    daemon.tick()
    daemon.executor.dead.add(f"h{task}")
    daemon.tick()
    first = daemon.store.chain(task)[0]
    assert first.stop_code == StopCode.FAILED | StopCode.HOOK_RESTART and "restart 1 of 3" in first.detail


def test_the_api_answers_503_for_a_full_disk(daemon, disk):
    task = daemon.store.submit(user="alice", nodes=1, command=["true"])
    disk.full = True
    with PlatformApi(daemon.home, user="alice", admin=False) as api:
        assert api.describe(task)["state"] == "queued"  # reads still work
        with pytest.raises(Unavailable, match="database or disk is full") as refused:
            api.submit(nodes=1, command=["true"], cwd="/")
        assert refused.value.status == 503
        with pytest.raises(Unavailable):
            api.stop(task)
    disk.full = False
    assert daemon.store.task(task).state == "queued" and len(daemon.store.tasks()) == 1


def test_cli_submit_and_stop_say_one_line_and_exit_1(daemon, disk, capsys, monkeypatch):
    monkeypatch.setenv("FIREFLYER_PLATFORM_HOME", str(daemon.home.root))
    task = daemon.store.submit(user="alice", nodes=1, command=["true"])
    disk.full = True
    for argv in (["submit", "-n", "1", "--", "true"], ["stop", str(task)],
                 ["platform", "quota", "alice", "default", "NORMAL", "1"]):
        code = main(argv)
        err = capsys.readouterr().err
        assert code == 1, argv
        assert err.count("\n") == 1 and "database or disk is full" in err and "Traceback" not in err, err


def test_status_says_the_daemon_is_unhealthy_and_why(daemon, capsys, monkeypatch):
    monkeypatch.setenv("FIREFLYER_PLATFORM_HOME", str(daemon.home.root))
    fd = lock(daemon.home)  # this process stands for the daemon
    try:
        write_heartbeat(daemon.home, {"pid": 1, "at": time.time(), "healthy": False,
                                      "problem": "its cycles cannot be recorded: database or disk is full",
                                      "since": time.time() - 5})
        assert main(["platform", "status"]) == 1
        out = capsys.readouterr().out
        assert "daemon unhealthy: its cycles cannot be recorded: database or disk is full" in out
        assert main(["platform", "status", "--json"]) == 1
        status = json.loads(capsys.readouterr().out)
        assert status["healthy"] is False and "disk is full" in status["problem"]
        write_heartbeat(daemon.home, {"pid": 1, "at": time.time(), "healthy": True, "problem": None, "since": None})
        assert main(["platform", "status"]) == 0 and "daemon up" in capsys.readouterr().out
    finally:
        os.close(fd)


def test_a_heartbeat_is_rewritten_in_place_and_a_stale_one_is_unhealthy(tmp_path):
    home = Home(tmp_path)
    write_heartbeat(home, {"pid": 1, "at": 100.0, "healthy": False, "problem": "x" * 5000, "since": 90.0})
    size = home.heartbeat.stat().st_size
    write_heartbeat(home, {"pid": 1, "at": 101.0, "healthy": True, "problem": None, "since": None})
    assert home.heartbeat.stat().st_size == size  # never shorter, so never truncated
    beat = read_heartbeat(home)
    assert beat["at"] == 101.0 and why_unhealthy(beat, tick=1.0, now=102.0) is None
    assert "no cycle for" in why_unhealthy(beat, tick=1.0, now=101.0 + 3600)


def test_health_logs_one_line_when_it_turns_and_when_it_recovers(caplog):
    h = Health()
    with caplog.at_level(logging.INFO, logger="fireflyer.platform"):
        for now in (1.0, 2.0, 3.0):
            h.update("its cycles cannot be recorded: disk full", now)
        h.update(None, 4.0)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["daemon unhealthy: its cycles cannot be recorded: disk full", "daemon healthy again after 3 s"]


def test_serve_keeps_cycling_on_a_full_disk_and_its_heartbeat_says_why(tmp_path, disk, caplog, monkeypatch):
    executor = StandIn()
    monkeypatch.setattr(daemon_module, "make_executor", lambda cfg: executor)
    home = Home(tmp_path)
    cfg = PlatformConfig(nodes=1, tick=0.05)
    store = Store(home.db)
    store.add_nodes(cfg.emulated_nodes())
    store.submit(user="alice", nodes=1, command=["true"])  # the first cycle would start it
    store.close()
    platform_config.save(home, cfg)
    disk.full = True
    stop = threading.Event()
    thread = threading.Thread(target=serve, args=(home, stop), daemon=True)
    with caplog.at_level(logging.INFO, logger="fireflyer.platform"):
        thread.start()
        try:
            deadline = time.monotonic() + 20
            beat = None
            while time.monotonic() < deadline:
                beat = read_heartbeat(home)
                if beat and beat.get("healthy") is False:
                    break
                time.sleep(0.05)
            assert beat and beat["healthy"] is False and "database or disk is full" in beat["problem"], beat
            assert executor.launched == []  # nothing launched that it could not record
            disk.full = False
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not (read_heartbeat(home) or {}).get("healthy"):
                time.sleep(0.05)
            assert read_heartbeat(home)["healthy"] is True and executor.launched == [1]
        finally:
            stop.set()
            thread.join(timeout=20)
    assert not thread.is_alive()
    text = caplog.text
    assert text.count("daemon unhealthy") == 1 and "Traceback" not in text and "healthy again" in text


def test_no_attempt_starts_while_a_disk_is_full(daemon, monkeypatch):
    task = daemon.store.submit(user="alice", nodes=1, command=["true"])
    monkeypatch.setattr(daemon_module, "low_space", lambda *folders: [f"the disk of {folders[0]} is full (0 KiB free)"])
    cycle = daemon.tick()
    assert cycle.started == [] and daemon.executor.launched == [] and daemon.store.task(task).state == "queued"
    assert cycle.problems and "is full" in cycle.problems[0]
    monkeypatch.setattr(daemon_module, "low_space", lambda *folders: [])
    assert daemon.tick().started == [task]


def test_a_database_held_past_the_timeout_is_unavailable_too(tmp_path):
    store = Store(tmp_path / "state.db", timeout=0.2)
    other = sqlite3.connect(tmp_path / "state.db", isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # another process writing, and not letting go
    try:
        with pytest.raises(StoreUnavailable, match="database is locked; another process held it too long"):
            store.submit(user="alice", nodes=1, command=["true"])
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert store.submit(user="alice", nodes=1, command=["true"]) == 1
    store.close()
