"""Ctrl-C inside a collective: the waiting rank stops at once and its peers fail fast, never a hang.

The waits run in the compiled core with the GIL released; between futex slices the core takes
the GIL back on the main thread to run pending signal handlers (see _core/node_py.c).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fireflyer.testing import jobs

pytestmark = pytest.mark.multiproc

JOB = Path(jobs.__file__).with_name("interrupt_job.py")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _result(out: str) -> tuple[str, float]:
    # The job writes its line in one write; torch's own threads share the pipe (stderr), so its
    # warnings may sit on either side of it.
    found = re.search(r"RESULT (\S+) ([0-9.]+)\n", out)
    assert found, out
    return found.group(1), float(found.group(2))


@pytest.mark.parametrize("nbytes", [4096, 4 << 20], ids=["one-shot", "pipeline"])
def test_ctrl_c_in_a_waiting_all_reduce_stops_it_and_the_peer_fails_fast(nbytes):
    port = str(_port())
    env = {**os.environ, "STAY_AWAY_S": "4", "PYTHONUNBUFFERED": "1"}
    procs = [subprocess.Popen([sys.executable, str(JOB), str(r), port, str(nbytes)], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(2)]
    try:
        deadline = time.monotonic() + 60
        line = ""
        while "CALLING" not in line:
            assert time.monotonic() < deadline, "rank 0 never reached the collective"
            line = procs[0].stdout.readline()
            assert line or procs[0].poll() is None, "rank 0 exited early"
        time.sleep(0.5)  # well inside the core's wait (the group's timeout is 60 s)
        procs[0].send_signal(signal.SIGINT)
        out0, _ = procs[0].communicate(timeout=30)
        out1, _ = procs[1].communicate(timeout=30)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    what0, s0 = _result(out0)
    calls, _ = _result(out1)
    # The interrupt reaches the caller as itself, within a slice or two.
    assert what0 == "KeyboardInterrupt", out0
    assert s0 < 0.5 + 2.0, out0
    # The peer never hangs and never gets a wrong sum: a call may still complete with the true sum
    # (rank 0 had staged its input before it stopped), and the one after fails at once.
    outcomes = [c.split(":") for c in calls.split(",")]
    assert all(float(sec) < 5.0 for _, sec in outcomes), out1
    assert all(what == "sum-right" for what, _ in outcomes[:-1]), out1
    assert outcomes[-1][0] not in ("sum-right", "sum-WRONG"), out1
