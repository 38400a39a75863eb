"""Fault-tolerant tasks (``fireflyer submit --fault-tolerant``): a lost node is replaced, the task goes on.

Through the platform's HTTP API, with a real daemon, supervisor, torchft Lighthouse and ``fireflyer train``:
a task of 3 replicas on a 4-node platform loses one node's ranks (SIGKILL) mid-run; the task is not failed
nor restarted as a whole (one attempt), the platform starts the lost replica on the free node (its health
check passed first), the attempt's record names the loss and the replacement, and the run ends with the
weights of a plain canonical run that never failed. The policy's rules for such tasks, the store's
migration and the refusals are checked without processes.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import sys
from typing import Any

import pytest

from fireflyer.platform.state.policy import Node, Priority, Task, schedule
from fireflyer.platform.state.store import Store
from fireflyer.testing.live_platform import LivePlatform, run_cli
from fireflyer.testing.server import Server
from fireflyer.testing.waiting import wait_until

STEPS = int(os.environ.get("FIREFLYER_FT_TEST_STEPS", "150"))
"""Few steps keep the test short; the lost replica's replacement then usually starts after the survivors have
finished (it says so and exits 0). With more (``FIREFLYER_FT_TEST_STEPS=1200``) it rejoins and heals mid-run."""
RUN = ["--preset", "tiny", "--order", "canonical", "--nodes", "3", "--ranks-per-node", "1", "--global-batch", "24",
       "--steps", str(STEPS),
       "--save-every", "25", "--eval-interval", "50"]


# --- the policy -----------------------------------------------------------------------------------------

def ft(assigned: tuple[str, ...], *, nodes: int = 3, lost: tuple[str, ...] = (), tid: int = 1, **kw: Any) -> Task:
    return Task(tid, "alice", nodes, state="running", assigned=assigned, fault_tolerant=True, lost=lost, **kw)


def test_a_fault_tolerant_task_keeps_its_usable_nodes_and_is_granted_a_free_one():
    nodes = [Node("node0"), Node("node1", drained=True), Node("node2"), Node("node3")]
    d = schedule(nodes, [ft(("node0", "node1", "node2"))])
    assert d.suspends == [] and [(g.task_id, g.nodes) for g in d.grants] == [(1, ("node3",))]
    # a plain task on the drained node is suspended, as before
    plain = Task(1, "alice", 3, state="running", assigned=("node0", "node1", "node2"))
    assert [s.task_id for s in schedule(nodes, [plain]).suspends] == [1]


def test_a_lost_node_is_granted_again_only_when_no_other_is_free():
    nodes = [Node(f"node{i}") for i in range(4)]
    assert schedule(nodes, [ft(("node0", "node2"), lost=("node1",))]).grants[0].nodes == ("node3",)
    busy = Task(2, "bob", 1, state="running", assigned=("node3",))
    assert schedule(nodes, [ft(("node0", "node2"), lost=("node1",)), busy]).grants[0].nodes == ("node1",)


def test_grants_never_preempt_and_a_task_that_lost_every_node_is_suspended():
    nodes = [Node("node0"), Node("node1"), Node("node2", drained=True)]
    low = Task(2, "bob", 1, priority=Priority.LOW, state="running", assigned=("node1",))
    d = schedule(nodes, [ft(("node0", "node2"), nodes=2, priority=Priority.HIGH), low])
    assert d.grants == [] and d.suspends == []
    gone = [Node("node0", drained=True), Node("node1", drained=True), Node("node2")]
    assert [s.task_id for s in schedule(gone, [ft(("node0", "node1"), nodes=2)]).suspends] == [1]


# --- the store and the refusals ---------------------------------------------------------------------------

def test_a_store_from_before_fault_tolerant_tasks_is_migrated(tmp_path):
    db = tmp_path / "state.db"
    old = sqlite3.connect(db)
    old.executescript("CREATE TABLE tasks (id INTEGER PRIMARY KEY AUTOINCREMENT, chain_first_id INTEGER, "
                      "attempt INTEGER NOT NULL DEFAULT 0, name TEXT NOT NULL, user TEXT NOT NULL, grp TEXT NOT NULL, "
                      "priority INTEGER NOT NULL, nodes INTEGER NOT NULL, command TEXT NOT NULL, state TEXT NOT NULL, "
                      "assigned TEXT NOT NULL DEFAULT '[]', submitted_at REAL NOT NULL, started_at REAL, "
                      "finished_at REAL, stop_code INTEGER NOT NULL DEFAULT 0, whole_life_state INTEGER NOT NULL "
                      "DEFAULT 0, request_id TEXT UNIQUE, ranks_per_node INTEGER NOT NULL DEFAULT 1, cwd TEXT NOT NULL "
                      "DEFAULT '', env TEXT NOT NULL DEFAULT '{}', handle TEXT, stop_requested INTEGER NOT NULL "
                      "DEFAULT 0, hold INTEGER NOT NULL DEFAULT 0, detail TEXT NOT NULL DEFAULT '');"
                      "INSERT INTO tasks(chain_first_id, name, user, grp, priority, nodes, command, state, submitted_at) "
                      "VALUES (1, 'old', 'alice', 'default', 10, 1, '[\"true\"]', 'queued', 0);")
    old.close()
    store = Store(db)
    try:
        assert store.task(1).fault_tolerant is False
        new = store.submit(user="alice", nodes=2, command=["true"], fault_tolerant=True)
        assert store.task(new).fault_tolerant is True
        with pytest.raises(ValueError, match="at least 2 nodes"):
            store.submit(user="alice", nodes=1, command=["true"], fault_tolerant=True)
    finally:
        store.close()


@pytest.mark.multiproc
def test_the_cli_refuses_a_fault_tolerant_task_of_one_node_in_one_line(tmp_path):
    p = LivePlatform(tmp_path / "home", "--nodes", "2")
    try:
        done = p.cli("submit", "-n", "1", "--fault-tolerant", "--", "true", check=False)
    finally:
        p.close()
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "fault-tolerant task needs at least 2 nodes" in done.stderr


# --- through the HTTP API, for real -----------------------------------------------------------------------

def call(server: Server, method: str, path: str, token: str, body: Any = None) -> tuple[int, Any]:
    conn = server.connection()
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body).encode(),
                     headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read().decode() or "null")
    finally:
        conn.close()


@pytest.mark.heavy  # a whole fault-tolerant run; the scheduler's side is tested above without one
@pytest.mark.multiproc
@pytest.mark.timeout(420)
def test_a_fault_tolerant_task_keeps_running_when_a_node_is_killed_and_records_the_replacement(tmp_path):
    pytest.importorskip("torchft", reason="torchft is an optional extra: pip install 'fireflyer[ft]'")
    from fireflyer.platform.server.auth import Users

    straight = tmp_path / "straight"
    run_cli("train", *RUN, "--out", str(straight), timeout=300)
    p = LivePlatform(tmp_path / "home", "--nodes", "4", "--default-quota", "none", timeout=120)
    server = None
    try:
        with Users(p.home / "state.db") as users:
            token = users.add("root", admin=True)
        server = Server(p.home, tmp_path / "server.log")
        base = {"nodes": 1, "command": ["true"], "cwd": str(tmp_path)}
        for bad, says in (({**base, "fault_tolerant": True}, "at least 2 nodes"),
                          ({**base, "nodes": 2, "fault_tolerant": "yes"}, "bool")):
            status, answer = call(server, "POST", "/api/tasks", token, bad)
            assert status in (400, 422) and says in json.dumps(answer), answer
        out = tmp_path / "managed"
        status, task = call(server, "POST", "/api/tasks", token, {
            "nodes": 3, "fault_tolerant": True, "name": "ft", "cwd": str(tmp_path),
            "env": {k: os.environ[k] for k in ("PATH", "PYTHONPATH", "HOME") if k in os.environ},
            "command": [sys.executable, "-m", "fireflyer", "train", *RUN, "--out", str(out)]})
        assert status == 201 and task["fault_tolerant"], task
        chain = task["id"]

        def describe() -> dict:
            status, d = call(server, "GET", f"/api/tasks/{chain}", token)
            assert status == 200, d
            return d

        from fireflyer.checkpoint.manager import committed_steps

        def saved() -> bool:
            assert describe()["attempt"] == 0, "the task failed before its first checkpoint"
            return (out / "ckpt").is_dir() and bool(committed_steps(str(out / "ckpt")))

        wait_until(saved, 240, "a committed checkpoint", poll=0.2)
        d = describe()
        assert d["state"] == "running" and [r["node"] for r in d["replicas"]] == ["node0", "node1", "node2"], d
        marker = p.home / "tasks" / str(d["task_id"]) / "started" / "rank1"
        victim = int(marker.read_text().split()[0])
        os.killpg(victim, signal.SIGKILL)  # replica 1's ranks: its node "dies"

        def replaced() -> dict | None:
            d = describe()
            assert d["outcome"] not in ("failed", "stopped"), d
            r = d["replicas"][1]
            return d if r["restarts"] >= 1 and r["node"] == "node3" else None

        during = wait_until(replaced, 120, "the replacement of replica 1", poll=0.2)
        assert during["state"] == "running" and during["attempt"] == 0, during
        seen_quorum = during["quorum"]
        done = wait_until(lambda: (d := describe())["state"] == "finished" and d, 300, "the task to finish", poll=0.2)
    finally:
        if server is not None:
            server.close()
        p.close()
    assert done["outcome"] == "succeeded" and len(done["attempts"]) == 1, done["attempts"]
    kinds = [(e["kind"], e["detail"]) for e in done["events"]]
    assert any(k == "replica lost" and d.startswith("replica 1 on node1: ") and "SIGKILL" in d for k, d in kinds), kinds
    assert ("replica replaced", "replica 1: node1 -> node3") in kinds, kinds
    lost_at = next(e["at"] for e in done["events"] if e["kind"] == "replica lost")
    assert lost_at >= done["attempts"][0]["started_at"]
    assert [(r["name"], r["node"], r["restarts"]) for r in done["replicas"]] == \
        [("node0", "node0", 0), ("node1", "node3", 1), ("node2", "node2", 0)]
    assert seen_quorum is None or set(seen_quorum["replicas"]) <= {"node0", "node1", "node2"}
    log = (p.home / "tasks" / str(done["task_id"]) / "logs" / "rank1.log").read_text()
    assert "replica node1 of 3 on node3, started again (start 1)" in log, log[-2000:]
    managed = json.loads((out / "run.json").read_text())
    if os.environ.get("FIREFLYER_FT_TEST_STEPS"):  # long enough to see the replacement rejoin and heal
        ft = managed["fault_tolerance"]
        after = ft["failures"][0]["step"]
        assert any(q["step"] > after and "node1" in q["replicas"] for q in ft["quorums"]), ft["quorums"]
        assert any(h["replica"] == "node1" and h["step"] >= after for h in ft["heals"]), ft["heals"]
    plain = json.loads((straight / "run.json").read_text())
    assert managed["model"]["weights_sha256"] == plain["model"]["weights_sha256"]
    assert managed["history"]["loss"] == plain["history"]["loss"]
