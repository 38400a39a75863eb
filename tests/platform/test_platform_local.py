"""The platform end to end on the local executor: a real daemon, real supervisors and ranks, the CLI."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from fireflyer.platform.scheduler.pidlock import daemon_pid
from fireflyer.platform.layout import Home
from fireflyer.testing.live_platform import LivePlatform

pytestmark = pytest.mark.multiproc


@pytest.fixture
def make_platform(tmp_path):
    made = []

    def make(*flags: str) -> LivePlatform:
        p = LivePlatform(tmp_path / f"home{len(made)}", *flags)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


def steps_run(state: Path) -> list[tuple[int, int]]:
    return [tuple(map(int, line.split())) for line in state.with_name(state.name + ".log").read_text().split("\n")
            if line]


def test_preemption_suspends_saves_requeues_and_resumes(make_platform, tmp_path):
    p = make_platform("--nodes", "1")
    low_state = tmp_path / "low"
    low = p.job(low_state, 60, "--step-s", "0.05", name="low")
    p.wait("the low task to make progress", lambda: low_state.with_name("low.log").exists() and
           len(steps_run(low_state)) >= 5)
    high = p.job(tmp_path / "high", 5, priority="HIGH", name="high")
    done_high = p.wait_state(high, "finished", timeout=60)
    assert done_high["stop"] == "STOP" and done_high["attempts"][0]["assigned"] == ["node0"]
    done_low = p.wait_state(low, "finished", timeout=90)
    attempts = done_low["attempts"]
    assert [a["stop"] for a in attempts] == ["INTERRUPT", "STOP"], attempts
    assert "go_suspend" in attempts[0]["detail"]
    # every step ran exactly once, in order, across the two attempts, and nothing ran while 'high' did
    ran = steps_run(low_state)
    assert [s for _, s in ran] == list(range(60))
    assert {a for a, _ in ran} == {0, 1}
    assert int((tmp_path / "low.done").read_text()) == 60
    assert attempts[1]["started_at"] >= done_high["attempts"][0]["finished_at"]
    kinds = [e["kind"] for e in done_low["events"]]
    assert kinds.index("suspending") < kinds.index("requeued") and kinds.count("started") == 2


def test_user_suspend_holds_until_resume_and_stop_is_final(make_platform, tmp_path):
    p = make_platform("--nodes", "2", "--ranks-per-node", "2")
    state = tmp_path / "job"
    task = p.job(state, 400, "--step-s", "0.02", nodes=2)
    p.wait("progress", lambda: state.with_name("job.log").exists())
    logs = p.cli("logs", str(task)).stdout
    assert "starts at step 0 on node0 (world 4)" in logs
    p.cli("suspend", str(task))
    held = p.wait_state(task, "held")
    assert held["attempts"][0]["stop"] == "INTERRUPT" and held["attempt"] == 1
    saved = int(state.read_text())
    time.sleep(0.5)
    assert p.describe(task)["state"] == "held"  # held chains are not scheduled
    bad = p.cli("suspend", str(task), check=False)
    assert bad.returncode == 2 and "not running" in bad.stderr
    p.cli("resume", str(task))
    p.wait_state(task, "running")
    p.wait("the resumed attempt to make progress", lambda: any(a == 1 for a, _ in steps_run(state)))
    assert min(s for a, s in steps_run(state) if a == 1) == saved
    p.cli("stop", str(task))
    stopped = p.wait_state(task, "finished")
    assert stopped["attempts"][-1]["stop"] == "MANUAL_STOP" and len(stopped["attempts"]) == 2
    time.sleep(0.5)
    assert len(p.describe(task)["attempts"]) == 2  # a user's stop is never requeued
    again = p.cli("stop", str(task), check=False)
    assert again.returncode == 2 and "already finished" in again.stderr


def test_a_task_that_ignores_a_suspend_is_stopped_after_the_ack_timeout(make_platform, tmp_path):
    p = make_platform("--nodes", "1", "--suspend-ack", "1")
    state = tmp_path / "deaf"
    task = p.job(state, 100000, "--ignore-suspend", "--step-s", "0.02")
    p.wait("progress", lambda: state.with_name("deaf.log").exists())
    p.cli("suspend", str(task))
    t0 = time.monotonic()
    held = p.wait_state(task, "held", timeout=30)
    assert time.monotonic() - t0 < 20
    first = held["attempts"][0]
    assert first["stop"] == "INTERRUPT" and "without acknowledgement in 1 s" in first["detail"]


def test_a_failing_task_restarts_up_to_the_limit(make_platform, tmp_path):
    p = make_platform("--nodes", "1", "--max-restarts", "2")
    recovers = p.job(tmp_path / "a", 3, "--fail-attempts", "2")
    done = p.wait_state(recovers, "finished")
    assert [a["stop"] for a in done["attempts"]] == ["FAILED|HOOK_RESTART", "FAILED|HOOK_RESTART", "STOP"]
    assert "rank0 exited with code 3" in done["attempts"][0]["detail"]
    assert done["whole_life_state"] == 2
    gives_up = p.job(tmp_path / "b", 3, "--fail-attempts", "9")
    done = p.wait_state(gives_up, "finished")
    assert [a["stop"] for a in done["attempts"]] == ["FAILED|HOOK_RESTART", "FAILED|HOOK_RESTART", "FAILED"]
    assert "no restarts left" in done["attempts"][-1]["detail"]


def test_the_watchdog_stops_a_silent_task(make_platform, tmp_path):
    p = make_platform("--nodes", "1", "--watchdog", "1", "--max-restarts", "0")
    task = p.job(tmp_path / "quiet", 1000, "--silent", "--ignore-suspend", "--step-s", "0.05")
    done = p.wait_state(task, "finished", timeout=30)
    assert done["stop"] == "FAILED|TIMEOUT" and "watchdog" in done["detail"]


def test_a_node_that_fails_its_health_check_is_drained_and_the_task_moves(make_platform, tmp_path):
    check = tmp_path / "check.sh"
    check.write_text('#!/bin/sh\nif [ "$FIREFLYER_NODE_ID" = node0 ]; then echo "ECC errors on node0"; exit 1; fi\n')
    check.chmod(0o755)
    p = make_platform("--nodes", "2", "--prolog", str(check))
    task = p.job(tmp_path / "j", 3)
    done = p.wait_state(task, "finished")
    first, second = done["attempts"]
    assert first["assigned"] == ["node0"] and first["stop"] == "HOOK_RESTART"
    assert "node node0 failed its health check" in first["detail"] and "ECC errors" in first["detail"]
    assert second["assigned"] == ["node1"] and second["stop"] == "STOP"
    nodes = {n["name"]: n for n in p.json("nodes")}
    assert nodes["node0"]["state"] == "drained" and "health check" in nodes["node0"]["reason"]


def test_a_task_whose_ranks_never_start_is_unschedulable_and_requeued(make_platform, tmp_path):
    slow = tmp_path / "slow.sh"
    flag = tmp_path / "slow-once"
    slow.write_text(f'#!/bin/sh\nif [ ! -e {flag} ]; then touch {flag}; sleep 30; fi\n')
    slow.chmod(0o755)
    p = make_platform("--nodes", "1", "--prolog", str(slow), "--unschedulable-after", "1")
    task = p.job(tmp_path / "u", 2)
    done = p.wait_state(task, "finished", timeout=60)
    assert [a["stop"] for a in done["attempts"]] == ["UNSCHEDULABLE", "STOP"]
    assert "did not finish in 1 s" in done["attempts"][0]["detail"]


def test_draining_a_node_mid_task_moves_the_task(make_platform, tmp_path):
    p = make_platform("--nodes", "2")
    state = tmp_path / "d"
    task = p.job(state, 80, "--step-s", "0.05")
    running = p.wait_state(task, "running")
    node = running["assigned"][0]
    p.wait("progress", lambda: state.with_name("d.log").exists() and len(steps_run(state)) >= 3)
    p.cli("drain", node, "--reason", "fan failure")
    done = p.wait_state(task, "finished", timeout=90)
    first, second = done["attempts"]
    assert first["stop"] == "INTERRUPT" and second["stop"] == "STOP"
    assert second["assigned"] != [node]
    assert [s for _, s in steps_run(state)] == list(range(80))
    assert {n["name"]: n["reason"] for n in p.json("nodes")}[node] == "fan failure"


def test_killing_the_daemon_loses_and_duplicates_nothing(make_platform, tmp_path):
    p = make_platform("--nodes", "2")
    states = [tmp_path / f"k{i}" for i in range(3)]
    go = tmp_path / "go"  # the tasks end only once the daemon is back, however slow the host
    tasks = [p.job(s, 40, "--step-s", "0.05", "--hold", str(go)) for s in states]
    p.wait("two tasks running", lambda: sum(p.describe(t)["state"] == "running" for t in tasks) == 2)
    home = Home(p.home)
    pid = daemon_pid(home)
    os.kill(pid, signal.SIGKILL)
    p.wait("the lock to be free", lambda: daemon_pid(home) is None, timeout=10)
    time.sleep(1.0)  # tasks keep running with no scheduler
    p.cli("platform", "start")
    go.touch()
    for t, s in zip(tasks, states):
        done = p.wait_state(t, "finished", timeout=90)
        assert [a["stop"] for a in done["attempts"]] == ["STOP"]
        assert [step for _, step in steps_run(s)] == list(range(40))


def test_a_lost_supervisor_kills_its_ranks_and_restarts_the_chain(make_platform, tmp_path):
    import json as _json

    p = make_platform("--nodes", "1")
    state = tmp_path / "lost"
    task = p.job(state, 60, "--step-s", "0.05")
    p.wait("progress", lambda: state.with_name("lost.log").exists() and len(steps_run(state)) >= 3)
    attempt_dir = Path(p.describe(task)["logs"]).parent
    supervisor = _json.loads((attempt_dir / "supervisor.json").read_text())["pid"]
    rank_pid = int((attempt_dir / "started" / "rank0").read_text().split()[0])
    os.kill(supervisor, signal.SIGKILL)
    done = p.wait_state(task, "finished", timeout=90)
    first, second = done["attempts"]
    assert "supervisor ended without a status" in first["detail"] and "restart 1 of 3" in first["detail"]
    assert second["stop"] == "STOP"
    with pytest.raises(ProcessLookupError):
        os.kill(rank_pid, 0)


def test_logs_follow_the_chain_across_attempts(make_platform, tmp_path):
    import subprocess
    import sys

    p = make_platform("--nodes", "1")
    state = tmp_path / "f"
    task = p.job(state, 30, "--step-s", "0.05")
    p.wait("progress", lambda: state.with_name("f.log").exists())
    follow = subprocess.Popen([sys.executable, "-m", "fireflyer", "logs", str(task), "-f"], stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "FIREFLYER_PLATFORM_HOME": str(p.home)})
    p.job(tmp_path / "urgent", 2, priority="HIGH")  # preempts; the chain comes back queued, then runs on
    out, _ = follow.communicate(timeout=90)
    assert follow.returncode == 0
    assert "attempt 0 of task" in out and "suspending at step" in out
    assert "--- task 1: attempt 1 on node0" in out and "attempt 1 of task" in out and "step 30" in out
    # a chain its user suspended is held: following ends there and says so
    again = p.job(tmp_path / "g", 1000, "--step-s", "0.05")
    p.wait("progress", lambda: state.with_name("g.log").exists())
    p.cli("suspend", str(again))
    p.wait_state(again, "held")
    assert p.cli("logs", str(again), "-f", timeout=30).stdout.endswith(f"--- task {again}: attempt 1 is held\n")


def test_users_at_the_same_priority_take_turns(make_platform, tmp_path):
    p = make_platform("--nodes", "1", "--time-share-after", "1")
    alice = p.job(tmp_path / "alice", 100, "--step-s", "0.05", user="alice")
    p.wait_state(alice, "running")
    bob = p.job(tmp_path / "bob", 3, user="bob")
    assert p.wait_state(bob, "finished", timeout=60)["stop"] == "STOP"
    done = p.wait_state(alice, "finished", timeout=90)
    assert done["attempts"][0]["stop"] == "INTERRUPT" and done["attempts"][-1]["stop"] == "STOP"
    assert [s for _, s in steps_run(tmp_path / "alice")] == list(range(100))
