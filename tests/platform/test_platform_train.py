"""The main job under the platform: ``fireflyer train`` is preempted by a higher-priority task,
saves a checkpoint through the suspend handshake, is requeued, resumes, and ends with exactly
the losses of a run that was never interrupted."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from fireflyer.testing.live_platform import LivePlatform, run_cli
from fireflyer.train.config import builtin_config

pytestmark = pytest.mark.multiproc

STEPS = 300


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
