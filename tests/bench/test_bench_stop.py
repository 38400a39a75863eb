"""Stopping a benchmark stops everything it started: ``fireflyer bench ddp`` (torchrun agents and their ranks)
stopped by a Ctrl-C to its process group or killed outright leaves no process of its run (found by the run's mark)
and no /dev/shm segment within the ranks' grace plus 5 s."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from fireflyer import lifetime

pytestmark = pytest.mark.multiproc

GRACE = lifetime.DEFAULT_GRACE


@pytest.mark.parametrize("how", ["sigint", "sigkill"])
def test_a_stopped_bench_leaves_nothing_behind(how, tmp_path):
    mark = lifetime.child_mark()
    shm_before = set(os.listdir("/dev/shm"))
    # a bench that runs for minutes: many rounds of a small model on 2 emulated nodes x 2 ranks
    p = subprocess.Popen([sys.executable, "-m", "fireflyer.cli", "bench", "ddp", "--layouts", "2x2", "--weak", "none",
                          "--layers", "1", "--d-model", "64", "--rounds", "1000", "--out", str(tmp_path)],
                         env={**os.environ, lifetime.MARK: mark}, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 180
    while len(lifetime.marked(mark)) < 7:  # the bench, 2 agents and 4 ranks
        assert p.poll() is None, p.stderr.read()[-2000:]
        assert time.monotonic() < deadline, "the ranks never started"
        time.sleep(0.05)
    time.sleep(1.0)  # into the rounds
    t0 = time.monotonic()
    if how == "sigint":
        os.killpg(p.pid, signal.SIGINT)  # a terminal's Ctrl-C
    else:
        p.kill()
    code = p.wait(timeout=GRACE + 30)
    while lifetime.marked(mark) and time.monotonic() < t0 + GRACE + 5:
        time.sleep(0.1)
    assert lifetime.marked(mark) == [], "left running"
    assert not {f for f in set(os.listdir("/dev/shm")) - shm_before if f.startswith(("fireflyer", "torch"))}
    if how == "sigint":
        err = p.stderr.read()
        assert code == 130 and err.strip().splitlines()[-1] == "fireflyer bench: stopped by SIGINT", err[-2000:]
        assert "Traceback" not in err
    else:
        assert code == -signal.SIGKILL
