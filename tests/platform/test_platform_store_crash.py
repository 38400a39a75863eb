"""kill -9 of the process writing the platform's state at random moments loses and duplicates nothing."""

from __future__ import annotations

import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from fireflyer.platform.state.store import Store
from fireflyer.testing import jobs

pytestmark = pytest.mark.multiproc

WRITER = Path(jobs.__file__).with_name("store_writer.py")


def test_kill_9_while_scheduling_loses_and_duplicates_nothing(tmp_path):
    db = tmp_path / "state.db"
    rng = random.Random(7)
    confirmed: list[int] = []
    next_i = 0
    for _ in range(6):
        proc = subprocess.Popen([sys.executable, str(WRITER), str(db), str(next_i)], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip(), "the writer never started"
        time.sleep(rng.uniform(0.05, 0.5))
        os.kill(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=10)
        got = [int(x) for x in out.split()]
        confirmed += got
        # the client retries from the first unconfirmed request (its submit may or may not have committed)
        next_i = (confirmed[-1] + 1) if confirmed else next_i
    con = sqlite3.connect(db)
    assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    # request ids are stored under their user ("user\x1fkey"): each user's keys are their own
    keys = con.execute("SELECT request_id FROM tasks WHERE request_id IS NOT NULL")
    ids = Counter(r.split("\x1f", 1)[1] for (r,) in keys)
    assert all(n == 1 for n in ids.values())  # no duplicate submits
    assert all(f"r{i}" in ids for i in confirmed)  # nothing confirmed was lost
    # every chain has at most one unfinished attempt, and attempts number 0, 1, 2, ...
    for chain, unfinished in con.execute("SELECT chain_first_id, SUM(state != 'finished') FROM tasks GROUP BY 1"):
        assert unfinished <= 1, chain
    store = Store(db)
    for (chain,) in con.execute("SELECT DISTINCT chain_first_id FROM tasks"):
        assert [t.attempt for t in store.chain(chain)] == list(range(len(store.chain(chain))))
    # no node is held by two live tasks
    held = [n for t in store.tasks() for n in t.assigned]
    assert len(held) == len(set(held))
    store.close()
    assert len(confirmed) > 10
