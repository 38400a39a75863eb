"""The main job under the platform: ``fireflyer train`` is preempted by a higher-priority task,
saves a checkpoint through the suspend handshake, is requeued, resumes, and ends with exactly
the losses of a run that was never interrupted."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest

from fireflyer.testing import shm
from fireflyer.testing.live_platform import LivePlatform, run_cli
from fireflyer.train.config import builtin_config

pytestmark = pytest.mark.multiproc

STEPS = 300


# Both are whole training runs under a daemon (heavy); the default tier preempts, stops and resumes tasks in
# test_platform_local.py and test_platform_slurm.py, and stops and resumes training runs in tests/train.
@pytest.mark.heavy
def test_a_preempted_training_run_resumes_to_the_same_losses(tmp_path):
    tiny = str(builtin_config("tiny"))
    fireflyer = [sys.executable, "-m", "fireflyer"]
    run_cli("train", tiny, "--steps", str(STEPS), "--out", str(tmp_path / "straight"), timeout=180)
    straight = json.loads((tmp_path / "straight" / "run.json").read_text())

    p = LivePlatform(tmp_path / "home", "--nodes", "2")
    try:
        train = p.submit(*fireflyer, "train", tiny, "--steps", str(STEPS), "--out", str(tmp_path / "managed"),
                         nodes=2, name="train")
        log = Path(p.describe(train)["logs"]) / "rank0.log"

        def progressed() -> bool:
            steps = [int(s) for s in re.findall(r"^step (\d+)/", log.read_text(), re.M)] if log.exists() else []
            return bool(steps) and max(steps) >= 40

        p.wait("training to pass step 40", progressed, timeout=120)
        urgent = p.submit(sys.executable, "-c", "print('urgent work')", nodes=2, priority="HIGH", name="urgent")
        assert p.wait_state(urgent, "finished", timeout=120)["stop"] == "STOP"
        done = p.wait_state(train, "finished", timeout=180)
    finally:
        p.close()
    first, second = done["attempts"]
    assert first["stop"] == "INTERRUPT" and "go_suspend" in first["detail"], first
    assert second["stop"] == "STOP", second
    saved_at = int(re.search(r"suspend requested: saving step (\d+)", log.read_text()).group(1))
    assert 40 <= saved_at < STEPS
    resumed_log = (Path(done["logs"]) / "rank0.log").read_text()
    assert f"resumed at step {saved_at}" in resumed_log and "fireflyer train: finished" in resumed_log
    managed = json.loads((tmp_path / "managed" / "run.json").read_text())
    assert managed["history"]["loss"] == straight["history"]["loss"]  # bit for bit
    assert managed["history"]["val"] == straight["history"]["val"]


@pytest.mark.heavy
def test_a_training_task_stopped_by_its_user_leaves_nothing_and_resumes_bitwise(tmp_path, monkeypatch):
    """``fireflyer stop`` on a task running ``fireflyer train``: within the platform's kill grace plus 5 s no
    process of the task is left (by the mark every process of it carries) nor a /dev/shm segment, and the run
    then resumes with the uninterrupted run's losses bit for bit."""
    from fireflyer import lifetime
    from fireflyer.checkpoint.manager import committed_steps

    run = ["train", "--preset", "tiny", "--steps", "3000", "--save-every", "10"]
    mark = lifetime.child_mark()
    monkeypatch.setenv(lifetime.MARK, mark)  # the daemon, its supervisors and the tasks' ranks are marked below it
    shm_before = shm.segments()
    out = tmp_path / "managed"
    p = LivePlatform(tmp_path / "home", "--nodes", "2")
    try:
        platform = set(lifetime.marked(mark))  # the daemon itself
        task = p.submit(sys.executable, "-m", "fireflyer", *run, "--out", str(out), nodes=2, name="train")
        p.wait("a committed checkpoint", lambda: committed_steps(str(out / "ckpt")), timeout=180)
        t0 = time.monotonic()
        p.cli("stop", str(task))
        done = p.wait_state(task, "finished", timeout=60)
        grace = 5.0  # the platform's kill grace (Timeouts.kill_grace)
        while set(lifetime.marked(mark)) - platform and time.monotonic() < t0 + grace + 5:
            time.sleep(0.1)
        assert set(lifetime.marked(mark)) - platform == set(), "a process of the task is left"
    finally:
        p.close()
    assert "stopped by its user" in done["attempts"][-1]["detail"], done
    assert not shm.left_behind(shm_before)
    last = committed_steps(str(out / "ckpt"))[-1]
    run_cli(*run, "--out", str(tmp_path / "straight"), "--stop-at", str(last + 2), timeout=180)
    run_cli("train", "--out", str(out), "--resume", "--stop-at", str(last + 2), timeout=180)
    resumed = json.loads((out / "run.json").read_text())["history"]
    straight = json.loads((tmp_path / "straight" / "run.json").read_text())["history"]
    assert resumed["loss"] == straight["loss"] and resumed["lr"] == straight["lr"]
