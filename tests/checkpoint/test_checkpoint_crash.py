"""SIGKILL at random moments of saving never leaves load() a torn checkpoint."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fireflyer.checkpoint import CheckpointManager, committed_steps
from fireflyer.testing import jobs

pytestmark = pytest.mark.multiproc

WRITER = Path(jobs.__file__).with_name("ckpt_writer.py")


def test_kill_9_during_saves_never_tears_a_checkpoint(tmp_path):
    rng = random.Random(1234)
    next_step = 1
    loads = 0
    for round_ in range(8):
        proc = subprocess.Popen([sys.executable, str(WRITER), str(tmp_path), str(next_step)],
                                stdout=subprocess.PIPE, text=True)
        # let it start and get into its save loop, then kill it at a random moment
        first = proc.stdout.readline()
        assert first.strip(), "the writer never started"
        time.sleep(rng.uniform(0.0, 0.4))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        proc.stdout.close()
        steps = committed_steps(str(tmp_path))
        if steps:
            state = CheckpointManager(tmp_path, rank=0, world_size=1).load()
            s = state["step"]
            assert s == steps[-1]
            for t in state["tensors"].values():
                assert torch.equal(t, torch.full_like(t, float(s)))
            loads += 1
            next_step = s + 1000 * (round_ + 1)  # steps keep increasing across restarts
        else:
            next_step += 1000
    assert loads >= 4, f"only {loads} of 8 rounds had a committed checkpoint to check"
