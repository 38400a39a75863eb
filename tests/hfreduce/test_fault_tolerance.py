"""hfreduce as torchft's process group (issue 29's first part), with torchft's real Lighthouse and Manager.

Replica groups are processes (``fireflyer/testing/jobs/ft_replica.py``), one rank each, that train
the same small model through ``torchft.Manager(pg=ProcessGroupHFReduce())``: a replica that starts
late heals from the live one over the network; one that is SIGKILLed leaves the survivor
training in smaller quorums, and its restart heals and rejoins. The quorum's abort ends a
collective waiting on a dead peer at once and leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

torchft = pytest.importorskip("torchft", reason="torchft is an optional extra: pip install 'fireflyer[ft]'")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from fireflyer import lifetime  # noqa: E402
from fireflyer.hfreduce.errors import HFReduceError  # noqa: E402
from fireflyer.hfreduce.backend.fault_tolerance import ProcessGroupHFReduce  # noqa: E402
from fireflyer.ports import free_port  # noqa: E402
from fireflyer.testing import shm  # noqa: E402
from fireflyer.testing.waiting import wait_until  # noqa: E402
from fireflyer.lighthouse import lighthouse_binary  # noqa: E402

pytestmark = pytest.mark.multiproc

JOB = Path(__file__).parents[2] / "src" / "fireflyer" / "testing" / "jobs" / "ft_replica.py"
STEPS = 30


@pytest.fixture
def lighthouse():
    port = free_port()
    proc = subprocess.Popen([lighthouse_binary(), "--min_replicas", "1", "--join_timeout_ms", "2000",
                             "--heartbeat_timeout_ms", "2000", "--bind", f"127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            preexec_fn=lifetime.tied_to_me(signal.SIGKILL))
    yield f"http://127.0.0.1:{port}"
    proc.kill()
    proc.wait()


def replica(name: str, lighthouse: str, out: Path, steps: int = STEPS, sleep: float = 0.15, *extra: str
            ) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(JOB), name, lighthouse, str(steps), str(out / f"{name}.jsonl"),
                             "--step-sleep", str(sleep), *extra], stdout=subprocess.DEVNULL,
                            stderr=open(out / f"{name}.log", "ab"), stdin=subprocess.DEVNULL)


def join_while_held(name: str, lighthouse: str, out: Path, hold: Path) -> subprocess.Popen:
    """Start replica ``name`` while the live one waits at its next step (``hold``), and let it go on once the
    newcomer is about to ask for its first quorum: however slowly this host starts a process, the live replica
    cannot finish the run alone before the newcomer joins."""
    ready = out / f"{name}.ready"
    ready.unlink(missing_ok=True)
    newcomer = replica(name, lighthouse, out, STEPS, 0.15, "--ready", str(ready))
    try:
        wait_until(ready.exists, timeout=120)
    finally:
        hold.unlink(missing_ok=True)
    return newcomer


def rows(out: Path, name: str) -> list[dict]:
    path = out / f"{name}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def finish(*procs: subprocess.Popen, timeout: float = 180.0) -> None:
    for p in procs:
        try:
            assert p.wait(timeout=timeout) == 0
        finally:
            if p.poll() is None:
                p.kill()


def straight_sha(tmp_path: Path, lighthouse: str) -> str:
    alone = tmp_path / "alone"
    alone.mkdir()
    finish(replica("solo", lighthouse, alone, sleep=0))
    return rows(alone, "solo")[-1]["sha"]


@pytest.mark.heavy  # the default tier heals a restarted replica from a live one (the kill test below)
def test_a_late_replica_heals_from_a_live_one_and_both_end_with_the_same_weights(tmp_path, lighthouse):
    hold = tmp_path / "hold"
    a = replica("a", lighthouse, tmp_path, STEPS, 0.15, "--hold", str(hold))
    wait_until(lambda: len(rows(tmp_path, "a")) >= 3, timeout=120)
    hold.touch()
    b = join_while_held("b", lighthouse, tmp_path, hold)
    finish(a, b)
    ra, rb = rows(tmp_path, "a"), rows(tmp_path, "b")
    assert ra[-1]["step"] == rb[-1]["step"] == STEPS
    assert rb[0]["step"] > 1, "b started behind and took the live state instead of training from step 0"
    assert max(r["participants"] for r in rb) == 2, "b joined the quorum"
    assert ra[-1]["sha"] == rb[-1]["sha"]


def test_a_replica_killed_mid_run_leaves_the_survivor_training_and_its_restart_heals(tmp_path, lighthouse):
    hold = tmp_path / "hold"
    a, b = replica("a", lighthouse, tmp_path, STEPS, 0.15, "--hold", str(hold)), replica("b", lighthouse, tmp_path)
    wait_until(lambda: any(r["participants"] == 2 for r in rows(tmp_path, "a")), timeout=120)
    b.kill()
    b.wait()
    killed_at = time.time()
    # the survivor goes on in a quorum of one: the kill costs seconds, not a restart
    after = wait_until(lambda: [r for r in rows(tmp_path, "a") if r["t"] > killed_at and r["participants"] == 1], timeout=120)
    assert after[0]["t"] - killed_at < 30
    hold.touch()
    b2 = join_while_held("b", lighthouse, tmp_path, hold)  # restarted: it heals from a over the network
    finish(a, b2)
    ra, rb = rows(tmp_path, "a"), [r for r in rows(tmp_path, "b") if r["pid"] == b2.pid]
    assert ra[-1]["step"] == rb[-1]["step"] == STEPS and ra[-1]["sha"] == rb[-1]["sha"]
    assert rb[0]["step"] > 1
    # every replica sees the same global batch here, so losing one changes nothing: an uninterrupted run's bits
    assert ra[-1]["sha"] == straight_sha(tmp_path, lighthouse)


PEER = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
from fireflyer.hfreduce.backend.fault_tolerance import ProcessGroupHFReduce
pg = ProcessGroupHFReduce(timeout=timedelta(seconds=30))
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=timedelta(seconds=30))
pg.configure(f"127.0.0.1:{sys.argv[1]}/quorum-1", "replica-1", 1, 2, quorum_id=1)
print("configured", flush=True)
time.sleep(120)  # never joins the collective: rank 0 waits on it
"""


def test_the_quorums_abort_ends_a_waiting_collective_at_once_and_leaves_nothing_behind(monkeypatch):
    monkeypatch.setenv("FIREFLYER_NODE_ID", "node-0")
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    peer = subprocess.Popen([sys.executable, "-c", PEER, str(port)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "FIREFLYER_NODE_ID": "node-1"})
    threads_before = set(threading.enumerate())
    shm_before = shm.segments()
    pg = ProcessGroupHFReduce(timeout=timedelta(seconds=30))
    try:
        pg.configure(f"127.0.0.1:{port}/quorum-1", "replica-0", 0, 2, quorum_id=1)
        assert peer.stdout.readline().strip() == "configured"
        assert pg.getBackendName() == "torchft-hfreduce" and pg.errored() is None
        x = torch.ones(1 << 16)
        opts = dist.AllreduceOptions()
        opts.asyncOp = True
        work = pg.allreduce([x], opts)
        time.sleep(0.5)  # waiting on the peer, well inside the 30 s timeout
        t0 = time.monotonic()
        threading.Timer(0.0, pg.abort).start()
        with pytest.raises(HFReduceError, match="aborted"):
            work.wait()
        assert time.monotonic() - t0 < 1.0, "the abort ends the wait at once, not at the timeout"
    finally:
        peer.kill()
        peer.wait()
    deadline = time.monotonic() + 10
    while {t for t in threading.enumerate() if t.is_alive()} - threads_before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert {t.name for t in set(threading.enumerate()) - threads_before if t.is_alive()} == set()
    assert not shm.left_behind(shm_before, ("fireflyer",))
    del store
