"""The platform's SQLite state: submit, decisions, chains, requeue rules, nodes, quotas."""

from __future__ import annotations

from pathlib import Path

import pytest

from fireflyer.platform.state.policy import QUEUED, RUNNING, SUSPENDING, Decisions, Node, Priority, Start, Suspend, schedule
from fireflyer.platform.state.store import FINISHED, StopCode, Store, UnknownTask
from fireflyer.testing.users import NOBODY, refused_as


@pytest.fixture()
def store(tmp_path):
    s = Store(tmp_path / "state.db")
    s.add_nodes([Node("a", "z0"), Node("b", "z0"), Node("c", "z1")])
    yield s
    s.close()


def test_submit_is_idempotent_per_request_id(store):
    a = store.submit(user="u", nodes=1, command=["true"], request_id="r1")
    b = store.submit(user="u", nodes=1, command=["true"], request_id="r1")
    c = store.submit(user="u", nodes=1, command=["true"])
    assert a == b != c and [t.id for t in store.tasks()] == [a, c]
    with pytest.raises(ValueError, match="priority"):
        store.submit(user="u", nodes=1, command=["x"], priority="urgent")
    with pytest.raises(ValueError, match="at least one node"):
        store.submit(user="u", nodes=0, command=["x"])


def test_a_cycle_through_the_store(store):
    low = store.submit(user="u", nodes=3, command=["train"], priority="LOW", now=1)
    store.apply(schedule(store.nodes(), store.policy_tasks(2)), now=2)
    assert store.task(low).state == RUNNING and len(store.task(low).assigned) == 3
    high = store.submit(user="v", nodes=2, command=["eval"], priority="HIGH", now=3)
    dec = schedule(store.nodes(), store.policy_tasks(4))
    assert [s.task_id for s in dec.suspends] == [low]
    store.apply(dec, now=4)
    assert store.task(low).state == SUSPENDING
    again = store.finish(low, StopCode.INTERRUPT, whole_life_state=7, now=5)
    store.apply(schedule(store.nodes(), store.policy_tasks(6)), now=6)
    assert store.task(high).state == RUNNING
    resumed = store.task(again)
    assert (resumed.state, resumed.chain_first_id, resumed.attempt, resumed.whole_life_state) == (QUEUED, low, 1, 7)
    assert [t.attempt for t in store.chain(low)] == [0, 1]
    assert [k for _, k, _ in store.events(low)] == ["submitted", "started", "suspending", "finished"]


def test_requeue_rules(store):
    for code, requeued in ((StopCode.INTERRUPT, True), (StopCode.UNSCHEDULABLE, True), (StopCode.HOOK_RESTART, True),
                           (StopCode.FAILED, False), (StopCode.STOP, False),
                           (StopCode.MANUAL_STOP | StopCode.INTERRUPT, False)):
        t = store.submit(user="u", nodes=1, command=["x"])
        assert (store.finish(t, code) is not None) is requeued, code
        assert store.task(t).state == FINISHED and store.finish(t, code) is None  # finishing twice is a no-op
    with pytest.raises(UnknownTask):
        store.finish(999, StopCode.STOP)


def test_starts_apply_only_to_queued_tasks_and_suspends_only_to_running(store):
    t = store.submit(user="u", nodes=1, command=["x"])
    assert store.apply(Decisions(starts=[Start(t, ("a",))])) == [t]
    assert store.apply(Decisions(starts=[Start(t, ("b",))])) == []  # already running: no double start
    assert store.task(t).assigned == ("a",)
    store.apply(Decisions(suspends=[Suspend(t, "x")]))
    store.apply(Decisions(suspends=[Suspend(t, "y")]))
    assert [k for _, k, _ in store.events(t)].count("suspending") == 1


def test_nodes_and_quotas(store):
    store.set_drained("b", True, "failed validation")
    assert [n.name for n in store.nodes() if n.usable] == ["a", "c"]
    with pytest.raises(ValueError, match="unknown node 'zz'"):
        store.set_drained("zz", True)
    store.set_quota("public", "default", Priority.NORMAL, 2)
    assert store.quotas() == {("public", "default", Priority.NORMAL): 2}


def test_sync_nodes_takes_health_from_the_resource_manager(store):
    store.add_nodes([Node("a"), Node("b"), Node("c")])
    changed = store.sync_nodes([Node("a", zone="z1"), Node("b", drained=True), Node("d", healthy=False)],
                               reason="down in Slurm")
    assert sorted(changed) == ["b", "c", "d"]
    nodes = {n.name: n for n in store.nodes()}
    assert nodes["a"].zone == "z1" and nodes["a"].usable
    assert nodes["b"].drained and not nodes["c"].healthy and not nodes["d"].healthy
    reasons = store.node_reasons()
    assert reasons["b"] == "down in Slurm" and "not listed" in reasons["c"]
    assert store.sync_nodes([Node("a", zone="z1"), Node("b"), Node("c"), Node("d")], reason="x") == ["b", "c", "d"]
    assert all(n.usable for n in store.nodes()) and set(store.node_reasons().values()) == {""}


def test_the_home_and_the_database_are_their_owners_alone(tmp_path):
    """state.db held every task's environment at 0644 in a 0755 home: any Unix user could read it."""
    import os
    import stat

    home = tmp_path / "home"
    home.mkdir(mode=0o755)
    os.chmod(home, 0o755)  # an existing home made before this rule is narrowed on open
    Store(home / "state.db").close()
    assert stat.S_IMODE(os.stat(home).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(home / "state.db").st_mode) == 0o600
    fresh = tmp_path / "fresh" / "home"
    Store(fresh / "state.db").close()
    assert stat.S_IMODE(os.stat(fresh).st_mode) == 0o700


def test_another_unix_user_cannot_read_the_state(tmp_path):
    import os

    import pytest

    if os.geteuid() != 0:
        pytest.skip("needs root to act as another uid")
    import shutil
    import tempfile

    open_parent = tempfile.mkdtemp(prefix="fireflyer-home-test-")  # in /tmp, which every user may enter
    os.chmod(open_parent, 0o755)
    home = Path(open_parent) / "home"
    home.mkdir(mode=0o755)
    os.chmod(home, 0o755)  # as a home made before this rule was
    store = Store(home / "state.db")
    store.submit(user="bob", nodes=1, command=["true"], env={"WANDB_API_KEY": "secret"})
    store.close()
    try:
        # it read the state before: 0644 in a 0755 home
        assert refused_as(NOBODY, lambda: open(home / "state.db", "rb").read(), PermissionError)
    finally:
        shutil.rmtree(open_parent)
