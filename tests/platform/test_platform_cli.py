"""The platform's commands in-process, on a configured home with no daemon: output and bad input."""

from __future__ import annotations

import json

import pytest

from fireflyer.cli import main
from fireflyer.platform import config as platform_config
from fireflyer.platform.config import PlatformConfig
from fireflyer.platform.layout import Home
from fireflyer.platform.state.policy import PolicyConfig
from fireflyer.platform.state.store import Store


@pytest.fixture
def home(tmp_path, monkeypatch):
    h = Home(tmp_path / "home")
    cfg = PlatformConfig(nodes=3, zones=1)
    store = Store(h.db)
    store.add_nodes(cfg.emulated_nodes())
    store.close()
    platform_config.save(h, cfg)
    monkeypatch.setenv("FIREFLYER_PLATFORM_HOME", str(h.root))
    return h


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_submit_queue_describe(home, capsys):
    code, out, err = run(capsys, "submit", "-n", "2", "-p", "HIGH", "--name", "big", "--user", "alice", "--json",
                         "--", "true")
    assert code == 0 and "no daemon runs" in err
    task = json.loads(out)
    assert task["id"] == 1 and task["priority"] == "HIGH" and task["nodes"] == 2 and task["state"] == "queued"
    code, out, _ = run(capsys, "queue")
    assert code == 0 and "big" in out and "alice" in out and "queued" in out
    assert json.loads(run(capsys, "queue", "--json")[1])[0]["name"] == "big"
    code, out, _ = run(capsys, "describe", "1")
    assert code == 0 and "task 1 (big): queued" in out and "submitted" in out
    described = json.loads(run(capsys, "describe", "1", "--json")[1])
    assert described["attempts"][0]["attempt"] == 0 and described["events"][0]["kind"] == "submitted"


def test_a_resubmitted_request_id_is_one_task(home, capsys):
    ids = {json.loads(run(capsys, "submit", "-n", "1", "--request-id", "r1", "--json", "--", "true")[1])["id"]
           for _ in range(3)}
    assert ids == {1}


def test_stop_of_a_queued_task_finishes_it_and_resume_needs_a_held_task(home, capsys):
    run(capsys, "submit", "-n", "1", "--", "true")
    code, out, _ = run(capsys, "stop", "1")
    assert code == 0 and "stopped" in out
    code, _, err = run(capsys, "resume", "1")
    assert code == 2 and "nothing to resume" in err
    code, _, err = run(capsys, "suspend", "1")
    assert code == 2 and "not running" in err


def test_nodes_drain_and_quota(home, capsys):
    code, out, _ = run(capsys, "nodes")
    assert code == 0 and out.count("idle") == 3
    assert run(capsys, "drain", "node1", "--reason", "bad DIMM")[0] == 0
    nodes = {n["name"]: n for n in json.loads(run(capsys, "nodes", "--json")[1])}
    assert nodes["node1"]["state"] == "drained" and nodes["node1"]["reason"] == "bad DIMM"
    assert run(capsys, "undrain", "node1")[0] == 0
    assert json.loads(run(capsys, "nodes", "--json")[1])[1]["state"] == "idle"
    assert run(capsys, "platform", "quota", "alice", "default", "HIGH", "2")[0] == 0
    quotas = json.loads(run(capsys, "platform", "quota", "--json")[1])
    assert quotas == [{"user": "alice", "group": "default", "priority": "HIGH", "nodes": 2}]


def test_status_without_a_daemon(home, capsys):
    run(capsys, "submit", "-n", "1", "--", "true")
    status = json.loads(run(capsys, "platform", "status", "--json")[1])
    assert status["running"] is False and status["nodes"] == 3 and status["tasks"] == {"queued": 1}


@pytest.mark.parametrize("argv, needle", [
    (["describe", "99"], "no task 99"),
    (["describe", "abc"], "a task id is a number"),
    (["stop", "0"], "a task id is a number from 1 to"),
    (["logs", "7"], "no task 7"),
    (["submit", "-n", "4", "--", "true"], "asks for 4 nodes but the platform has 3"),
    (["submit", "-n", "0", "--", "true"], "at least 1"),
    (["submit", "-n", "1", "-p", "urgent", "--", "true"], "unknown priority 'urgent'"),
    (["submit", "-n", "1", "--", "no-such-command-here"], "not found on PATH"),
    (["submit", "-n", "1", "--", "./missing.sh"], "not an executable file"),
    (["submit", "-n", "1", "true"], "after '--'"),
    (["submit", "-n", "1", "--"], "no command after '--'"),
    (["submit", "-n", "1", "-e", "NOEQUALS", "--", "true"], "-e takes KEY=VALUE"),
    # numbers and strings out of range (issue 14): one line, never a traceback, never exit 0
    (["describe", "99999999999999999999999"], "a task id is a number from 1 to"),
    (["stop", "99999999999999999999999"], "a task id is a number from 1 to"),
    (["logs", "99999999999999999999999"], "a task id is a number from 1 to"),
    (["queue", "--offset", "1e23"], "invalid int value"),
    (["submit", "-n", "1", "--ranks-per-node", "1e23", "--", "true"], "invalid int value"),
    (["submit", "-n", "1", "--ranks-per-node", "0", "--", "true"], "ranks_per_node must be 1.."),
    (["submit", "-n", "1", "--ranks-per-node", "1000000", "--", "true"], "the slots of a node"),
    (["submit", "-n", "1", "-g", "", "--", "true"], "group must be a string of 1 to 64"),
    (["submit", "-n", "1", "--request-id", "", "--", "true"], "request_id must be a string of 1 to 128"),
    (["submit", "-n", "1", "--name", "x" * 100_000, "--", "true"], "name must be a string of at most 200"),
    (["platform", "group", "vision", "invite", "alice"], "GROUP add|remove USER"),
    (["platform", "group", "default", "add", "alice"], "everyone is in group 'default'"),
    (["platform", "group", "", "add", "alice"], "group must be a string of 1 to 64"),
    (["drain", "node9"], "unknown node 'node9'"),
    (["platform", "quota", "alice", "default", "HIGH"], "USER GROUP PRIORITY NODES"),
    (["platform", "quota", "alice", "default", "HIGH", "-1"], "non-negative"),
    (["platform", "start", "--zones", "5"], "5 zones need at least as many nodes"),
    (["platform", "start", "--nodes", "0"], "nodes must be a positive integer"),
    (["platform", "start", "--nodes", "2"], "already has nodes node2"),
    (["platform", "bogus"], "invalid choice"),
])
def test_bad_input_is_one_line_and_non_zero(home, capsys, argv, needle):
    code, out, err = run(capsys, *argv)
    assert code != 0 and needle in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_logs_of_a_task_that_has_not_run(home, capsys):
    run(capsys, "submit", "-n", "1", "--", "true")
    code, _, err = run(capsys, "logs", "1")
    assert code == 2 and "no log for rank 0 yet" in err
    code, _, err = run(capsys, "logs", "1", "--rank", "5")
    assert code == 2 and "ranks 0..0" in err


def test_no_platform_here(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FIREFLYER_PLATFORM_HOME", str(tmp_path / "none"))
    code, _, err = run(capsys, "queue")
    assert code == 2 and "no platform in" in err and "fireflyer platform start" in err


def test_groups_are_kept_by_an_admin(home, capsys):
    code, out, _ = run(capsys, "platform", "group", "vision", "add", "alice", "bob")
    assert code == 0 and "vision" in out and "alice bob" in out
    code, out, _ = run(capsys, "platform", "group", "vision", "remove", "bob", "--json")
    assert code == 0 and json.loads(out) == [{"group": "vision", "users": ["alice"]}]


def test_quota_says_what_a_user_without_a_row_gets(home, capsys):
    code, out, _ = run(capsys, "platform", "quota")
    assert code == 0 and "no quota rows: a user without a row holds half the nodes for sure" in out
    platform_config.save(home, PlatformConfig(nodes=3, policy=PolicyConfig(default_quota=None)))
    assert "every user may hold every node" in run(capsys, "platform", "quota")[1]


@pytest.mark.parametrize("value", ["-1", "all", "1.5"])
def test_a_bad_default_quota_is_one_line(home, capsys, value):
    code, _, err = run(capsys, "platform", "start", "--default-quota", value)
    assert code == 2 and "default_quota must be a node count" in err and err.count("\n") == 1
