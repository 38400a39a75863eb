"""The platform's API core: listing (fast path equals the full record), paging, filters, access rules."""

from __future__ import annotations

import pytest

from fireflyer.platform import config as platform_config
from fireflyer.platform.scheduler.api import Conflict, Forbidden, NotFound, PlatformApi, ApiError, task_json
from fireflyer.platform.config import PlatformConfig
from fireflyer.platform.layout import Home
from fireflyer.platform.state.policy import Decisions, PolicyConfig, Start
from fireflyer.platform.state.store import StopCode, Store


@pytest.fixture
def home(tmp_path):
    h = Home(tmp_path)
    store = Store(h.db)
    store.add_nodes(PlatformConfig(nodes=3).emulated_nodes())
    platform_config.save(h, PlatformConfig(nodes=3))
    # alice: a finished chain, a suspended-then-queued chain, a running task; bob: a queued HIGH task
    a1 = store.submit(user="alice", nodes=1, command=["true"], cwd="/tmp")
    a2 = store.submit(user="alice", nodes=1, command=["sleep", "9"], cwd="/tmp", name="<b>x</b>")
    a3 = store.submit(user="alice", nodes=1, command=["true"], cwd="/tmp", env={"K": "V"})
    b1 = store.submit(user="bob", nodes=3, command=["true"], priority="HIGH", cwd="/tmp")
    store.apply(Decisions(starts=[Start(a1, ("node0",)), Start(a2, ("node1",)), Start(a3, ("node2",))]))
    store.finish(a1, StopCode.STOP, detail="all ranks exited 0")
    store.finish(a2, StopCode.INTERRUPT, detail="preempted")
    store.close()
    return h, {"a1": a1, "a2": a2, "a3": a3, "b1": b1}


def test_the_listing_is_the_full_record_of_each_chains_newest_attempt(home):
    h, ids = home
    with PlatformApi(h) as api:
        page = api.tasks(all=True, limit=100)
        assert page["total"] == 4
        full = {i: task_json(api.store.latest(i)) for i in ids.values()}
    assert {t["id"]: t for t in page["tasks"]} == full
    # running first, then queued by priority, then finished (newest first)
    assert [t["id"] for t in page["tasks"]] == [ids["a3"], ids["b1"], ids["a2"], ids["a1"]]
    assert page["tasks"][2]["attempt"] == 1 and page["tasks"][2]["state"] == "queued"


def test_paging_and_filters(home):
    h, ids = home
    with PlatformApi(h) as api:
        active = api.tasks()
        assert active["total"] == 3 and ids["a1"] not in [t["id"] for t in active["tasks"]]
        two = api.tasks(all=True, limit=2, offset=2)
        assert [t["id"] for t in two["tasks"]] == [ids["a2"], ids["a1"]] and two["total"] == 4
        assert [t["id"] for t in api.tasks(all=True, user="bob")["tasks"]] == [ids["b1"]]
        assert [t["id"] for t in api.tasks(state="finished")["tasks"]] == [ids["a1"]]
        assert [t["id"] for t in api.tasks(priority="HIGH")["tasks"]] == [ids["b1"]]
        for bad in ({"limit": 0}, {"offset": -1}, {"state": "asleep"}, {"priority": "urgent"}):
            with pytest.raises(ApiError):
                api.tasks(**bad)


def test_a_user_sees_and_controls_only_their_own_tasks(home):
    h, ids = home
    with PlatformApi(h, user="bob", admin=False) as bob:
        assert [t["id"] for t in bob.tasks(all=True)["tasks"]] == [ids["b1"]]
        with pytest.raises(Forbidden):
            bob.tasks(user="alice")
        for act in (bob.describe, bob.suspend, bob.resume, bob.stop, bob.logs):
            with pytest.raises(Forbidden):
                act(ids["a3"])
        with pytest.raises(Forbidden):
            bob.drain("node0")
        with pytest.raises(Forbidden):
            bob.submit(nodes=1, command=["true"], user="alice", cwd="/tmp")
        assert bob.submit(nodes=1, command=["true"], cwd="/tmp")["user"] == "bob"
        assert bob.overview()["quota_use"] == []  # nothing running of bob's; alice's use is not his to see
        with pytest.raises(NotFound):
            bob.describe(999)
        with pytest.raises(Conflict):
            bob.suspend(ids["b1"])  # queued: nothing to suspend
    with PlatformApi(h, user="alice", admin=False) as alice:
        assert [q["user"] for q in alice.overview()["quota_use"]] == ["alice"]
    with PlatformApi(h, user="root", admin=True) as admin:
        assert admin.tasks(all=True)["total"] == 5
        assert admin.drain("node0", "fan")["drained"] and admin.nodes()[0]["reason"] == "fan"
        with pytest.raises(NotFound):
            admin.drain("node9")


def test_overview_counts_and_history(home):
    h, _ = home
    with PlatformApi(h) as api:
        o = api.overview(hours=1, buckets=4)
    assert o["nodes"] == {"total": 3, "busy": 1, "idle": 2, "drained": 0, "unhealthy": 0}
    assert o["queue_by_priority"]["HIGH"] == 1 and o["queue_by_priority"]["NORMAL"] == 1
    assert o["running_by_priority"]["NORMAL"] == 1 and len(o["history"]) == 4
    assert 0 < o["history"][-1]["busy"] <= 3


def test_follow_decodes_a_character_split_across_reads(home):
    h, ids = home
    with PlatformApi(h) as api:
        log = h.attempt(ids["a3"]).rank_log(0)
        log.parent.mkdir(parents=True, exist_ok=True)
        word = "naïve ✓\n".encode()
        log.write_bytes(word[:3])  # ends inside 'ï'
        stream = api.follow(ids["a3"], poll=0.01, timeout=5)
        got = next(stream)
        with open(log, "ab") as f:
            f.write(word[3:])
        while "✓" not in got:
            got += next(stream)
    assert got == "naïve ✓\n"


# ---- limits a user cannot get past (issue 14) ---------------------------------------
def test_ranks_per_node_is_bounded_by_a_nodes_slots(home):
    h, _ = home
    with PlatformApi(h, user="alice", admin=False) as api:
        slots = api._config().slots()
        for bad in (0, -1, slots + 1, 1_000_000, True, 2.0):
            with pytest.raises(ApiError, match="ranks_per_node must be 1.."):
                api.submit(nodes=1, command=["true"], ranks_per_node=bad, cwd="/tmp")
        assert api.submit(nodes=1, command=["true"], ranks_per_node=slots, cwd="/tmp")["ranks_per_node"] == slots


def test_a_platform_setting_sets_the_slots(tmp_path):
    h = Home(tmp_path)
    store = Store(h.db)
    store.add_nodes(PlatformConfig(nodes=1).emulated_nodes())
    store.close()
    platform_config.save(h, PlatformConfig(nodes=1, slots_per_node=2))
    with PlatformApi(h, user="alice", admin=False) as api:
        api.submit(nodes=1, command=["true"], ranks_per_node=2, cwd="/tmp")
        with pytest.raises(ApiError, match=r"1\.\.2"):
            api.submit(nodes=1, command=["true"], ranks_per_node=3, cwd="/tmp")
    with pytest.raises(ValueError, match="slots_per_node"):
        PlatformConfig(ranks_per_node=4, slots_per_node=2)


@pytest.mark.parametrize("field, value, needle", [
    ("name", "x" * 201, "name must be a string of at most 200"),
    ("name", "a\nb", "control characters"),
    ("group", "", "group must be a string of 1 to 64"),
    ("group", "g" * 65, "group must be a string of 1 to 64"),
    ("request_id", "", "request_id must be a string of 1 to 128"),
    ("request_id", "r" * 129, "request_id must be a string of 1 to 128"),
    ("request_id", 7, "got int"),
])
def test_strings_are_bounded(home, field, value, needle):
    h, _ = home
    with PlatformApi(h, user="alice", admin=False) as api:
        with pytest.raises(ApiError, match=needle):
            api.submit(nodes=1, command=["true"], cwd="/tmp", **{field: value})


def test_a_request_id_is_the_submitting_users_own(home):
    """bob's idempotency key never hands alice bob's task, and claiming it first blocks nobody."""
    h, _ = home
    with PlatformApi(h, user="bob", admin=False) as bob, PlatformApi(h, user="alice", admin=False) as alice:
        first = bob.submit(nodes=1, command=["true"], cwd="/tmp", request_id="nightly", name="bobs")
        again = bob.submit(nodes=1, command=["true"], cwd="/tmp", request_id="nightly")
        assert again["id"] == first["id"]  # still idempotent for its owner
        hers = alice.submit(nodes=1, command=["true"], cwd="/tmp", request_id="nightly", name="alices")
        assert hers["id"] != first["id"] and hers["user"] == "alice" and hers["name"] == "alices"


def test_a_task_id_too_large_for_sqlite_is_a_clear_error(home):
    h, _ = home
    with PlatformApi(h) as api:
        for call in (api.describe, api.stop):
            with pytest.raises(ApiError, match="a task id is a number from 1 to"):
                call(10**23)


def test_a_users_default_quota_holds_when_another_user_needs_the_nodes(tmp_path):
    from fireflyer.platform.scheduler.daemon import Daemon

    class Executor:
        name = "stand-in"

        def launch(self, launch, attempt_dir):
            return f"h{launch.task_id}"

        def alive(self, handle):
            return True

        def kill(self, handle):
            pass

        def find(self, task_id, attempt_dir):
            return None

    h = Home(tmp_path)
    cfg = PlatformConfig(nodes=2)  # the default quota: half the nodes, 1
    store = Store(h.db)
    store.add_nodes(cfg.emulated_nodes())
    platform_config.save(h, cfg)
    daemon = Daemon(h, cfg, executor=Executor(), store=store)
    with PlatformApi(h, user="alice", admin=False) as alice:
        big = alice.submit(nodes=2, command=["true"], cwd="/tmp")["id"]
        daemon.tick()
        assert alice.describe(big)["state"] == "running"  # alone, alice borrows the other node
        assert alice.overview()["quota_use"] == [{"user": "alice", "group": "default", "priority": "NORMAL",
                                                  "used": 2, "quota": 1}]
    with PlatformApi(h, user="bob", admin=False) as bob:
        small = bob.submit(nodes=1, command=["true"], cwd="/tmp")["id"]
    assert daemon.tick().suspending == [big]
    reasons = [d for _, kind, d in store.events(big) if kind == "suspending"]
    assert reasons == ["beyond alice's default quota of 1 node(s): another task needs the nodes it borrowed"]
    assert store.task(small).state == "queued"  # it starts once alice's task has saved and stopped
    store.close()


def test_no_default_quota_leaves_a_running_task_alone(tmp_path):
    from fireflyer.platform.state.policy import schedule

    h = Home(tmp_path)
    cfg = PlatformConfig(nodes=2, policy=PolicyConfig(default_quota=None))
    store = Store(h.db)
    store.add_nodes(cfg.emulated_nodes())
    big = store.submit(user="alice", nodes=2, command=["true"])
    store.apply(Decisions(starts=[Start(big, ("node0", "node1"))]))
    store.submit(user="bob", nodes=1, command=["true"])
    decisions = schedule(store.nodes(), store.policy_tasks(), store.quotas(), cfg.policy.for_nodes(len(store.nodes())))
    assert not decisions.suspends and not decisions.starts  # bob waits for turn-taking (4 h) instead
    store.close()
