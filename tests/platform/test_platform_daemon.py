"""The daemon's cycle with a stand-in executor (the process boundary): launches, statuses, failing checks."""

from __future__ import annotations

import os

import pytest

from fireflyer.platform.config import PlatformConfig
from fireflyer.platform.scheduler.daemon import Daemon
from fireflyer.platform.layout import Home, write_json
from fireflyer.platform.state.store import StopCode, Store
from fireflyer.testing.users import NOBODY


class StandIn:
    """Records launches; ``broken`` handles raise as a Slurm controller that does not answer would."""

    name = "stand-in"

    def __init__(self) -> None:
        self.launched: dict[str, int] = {}
        self.broken: set[str] = set()
        self.dead: set[str] = set()
        self.killed: list[str] = []

    def launch(self, launch, attempt_dir):
        handle = f"h{launch.task_id}"
        self.launched[handle] = launch.task_id
        return handle

    def alive(self, handle):
        if handle in self.broken:
            raise RuntimeError("squeue timed out")
        return handle not in self.dead

    def kill(self, handle):
        self.killed.append(handle)

    def find(self, task_id, attempt_dir):
        return next((h for h, t in self.launched.items() if t == task_id), None)


@pytest.fixture
def daemon(tmp_path):
    home = Home(tmp_path)
    cfg = PlatformConfig(nodes=2, max_restarts=1)
    store = Store(home.db)
    store.add_nodes(cfg.emulated_nodes())
    d = Daemon(home, cfg, executor=StandIn(), store=store)
    yield d
    store.close()


def test_a_cycle_launches_and_a_status_finishes(daemon):
    a = daemon.store.submit(user="u", nodes=1, command=["true"])
    b = daemon.store.submit(user="u", nodes=1, command=["true"])
    cycle = daemon.tick()
    assert sorted(cycle.started) == [a, b] and set(daemon.executor.launched.values()) == {a, b}
    spec = daemon.home.attempt(a).spec
    assert spec.exists() and '"master_port"' in spec.read_text()
    write_json(daemon.home.attempt(a).status, {"stop_code": int(StopCode.STOP), "detail": "all ranks exited 0"}, sort_keys=True)
    daemon.tick()
    assert daemon.store.task(a).state == "finished" and daemon.store.task(b).state == "running"


def test_an_attempt_whose_handle_was_lost_is_found_again_or_finished(daemon):
    """The daemon stopped between launching an attempt and recording its handle: the executor finds it by its
    attempt directory and the daemon watches it on; one it cannot find ends as unschedulable."""
    a = daemon.store.submit(user="u", nodes=1, command=["true"])
    b = daemon.store.submit(user="u", nodes=1, command=["true"])
    daemon.tick()
    for task in (a, b):
        daemon.store.set_handle(task, None)
    del daemon.executor.launched[f"h{b}"]  # b's launch never reached the executor
    daemon.tick()
    assert daemon.store.task(a).state == "running" and daemon.store.task(a).handle == f"h{a}"
    assert daemon.store.task(b).state == "finished" and daemon.store.task(b).stop_code == StopCode.UNSCHEDULABLE
    assert "before the attempt was launched" in daemon.store.task(b).detail


def test_one_task_whose_check_fails_does_not_stop_the_cycle(daemon):
    a = daemon.store.submit(user="u", nodes=1, command=["true"])
    daemon.tick()
    daemon.executor.broken.add(f"h{a}")
    b = daemon.store.submit(user="u", nodes=1, command=["true"])
    cycle = daemon.tick()
    assert cycle.started == [b] and daemon.store.task(a).state == "running"


def test_a_vanished_attempt_restarts_then_gives_up(daemon):
    a = daemon.store.submit(user="u", nodes=2, command=["true"])
    daemon.tick()
    daemon.executor.dead.add(f"h{a}")
    daemon.tick()
    chain = daemon.store.chain(a)
    assert chain[0].stop_code == StopCode.FAILED | StopCode.HOOK_RESTART and "restart 1 of 1" in chain[0].detail
    daemon.tick()
    daemon.executor.dead.add(f"h{chain[1].id}")
    daemon.tick()
    chain = daemon.store.chain(a)
    assert len(chain) == 2 and chain[1].stop_code == StopCode.FAILED and "no restarts left" in chain[1].detail


def test_a_failed_health_check_drains_the_node(daemon):
    a = daemon.store.submit(user="u", nodes=1, command=["true"])
    daemon.tick()
    node = daemon.store.task(a).assigned[0]
    write_json(daemon.home.attempt(a).status, {"stop_code": int(StopCode.HOOK_RESTART),
                                                      "detail": "ECC", "failed_nodes": [node]}, sort_keys=True)
    cycle = daemon.tick()
    assert {n.name: n.drained for n in daemon.store.nodes()}[node]
    restarted = daemon.store.latest(a)
    assert cycle.started == [restarted.id] and node not in restarted.assigned


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (to give the attempt's folder to another account)")
def test_a_health_check_failure_reported_by_the_tasks_own_account_drains_nothing(daemon):
    """A supervisor that ran as the task's account could have written any status: it can end its own
    task, but not take nodes away from everybody else."""
    a = daemon.store.submit(user="u", nodes=1, command=["true"])
    daemon.tick()
    node = daemon.store.task(a).assigned[0]
    adir = daemon.home.attempt(a)
    write_json(adir.status, {"stop_code": int(StopCode.HOOK_RESTART), "detail": "ECC", "failed_nodes": [node]}, sort_keys=True)
    for path in (adir.root, adir.status):
        os.chown(path, NOBODY, NOBODY)
    daemon.tick()
    assert not {n.name: n.drained for n in daemon.store.nodes()}[node]
    first = daemon.store.chain(a)[0]
    assert first.stop_code & StopCode.FAILED and "not drained" in first.detail and "restart 1 of 1" in first.detail


def test_an_unreadable_status_fails_the_attempt_with_the_reason(daemon):
    a = daemon.store.submit(user="u", nodes=1, command=["true"])
    daemon.tick()
    daemon.home.attempt(a).status.write_text("{half a status")
    daemon.tick()
    first = daemon.store.chain(a)[0]
    assert first.stop_code & StopCode.FAILED and "status.json is unreadable" in first.detail
