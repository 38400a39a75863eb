"""``fireflyer train --preset moe --fault-tolerant``: the MoE model survives a lost node.

Each node (2 x 2, experts split over a node's ranks) is a torchft replica. Until the failure the
run's losses and validation loss are the plain MoE run's; the node's ranks are SIGKILLed once step
10 is committed, the survivor redoes the step and trains on alone, the restarted node heals from
it (weights, experts, router biases, optimizer state) and rejoins, and the summary counts the
micro-batches its absence dropped (expert parallel has no canonical order: the run goes on as
torchft's data parallel does).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torchft", reason="torchft is an optional extra: pip install 'fireflyer[ft]'")

from fireflyer import lifetime  # noqa: E402
from fireflyer.checkpoint.manager import committed_steps  # noqa: E402
from fireflyer.testing.cli import fireflyer  # noqa: E402
from fireflyer.train.fault_tolerant import node_ranks  # noqa: E402

RUN = ["--preset", "moe", "--steps", "120", "--save-every", "10", "--eval-interval", "60", "--layers", "1"]


@pytest.mark.heavy
@pytest.mark.multiproc
def test_a_moe_run_loses_a_node_heals_it_and_counts_what_its_absence_dropped(tmp_path):
    plain = tmp_path / "plain"
    done = fireflyer("train", *RUN, "--stop-at", "10", "--out", str(plain), timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    out, mark = tmp_path / "ft", lifetime.child_mark()
    p = subprocess.Popen([sys.executable, "-m", "fireflyer.cli", "train", *RUN, "--fault-tolerant", "--out", str(out)],
                         env={**os.environ, lifetime.MARK: mark}, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not ((out / "ckpt").is_dir() and any(s >= 10 for s in committed_steps(str(out / "ckpt")))):
            assert p.poll() is None and time.monotonic() < deadline, "step 10 was never committed"
            time.sleep(0.02)
        victims = node_ranks("node1", mark)
        assert len(victims) == 2, victims
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        printed, _ = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == 0, printed[-3000:]
    deadline = time.monotonic() + 10
    while lifetime.marked(mark) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert lifetime.marked(mark) == [], "a process of the run is left"
    run, base = json.loads((out / "run.json").read_text()), json.loads((plain / "run.json").read_text())
    # before the failure, the plain MoE run's steps (the loss is carried in float32 across replicas)
    assert run["history"]["val"][0] == base["history"]["val"][0]
    assert run["history"]["loss"][:10] == pytest.approx(base["history"]["loss"][:10], rel=1e-6, abs=0)
    assert [e["layers"] for e in run["history"]["experts"][:10]] == [e["layers"] for e in base["history"]["experts"]]
    ft = run["fault_tolerance"]
    assert [f["lost"] for f in ft["failures"]] == [["node1"]], ft["failures"]
    # node1's first start took its whole share (experts, router biases, AdamW) from node0 over the network; its
    # restart either rejoins and heals the same way, or comes back after node0 finished (a busy host)
    assert any(h["replica"] == "node1" and h["step"] == 0 and h["bytes"] > 0 for h in ft["heals"]), ft["heals"]
    rejoined = any(h["replica"] == "node1" and h["step"] >= 10 and h["bytes"] > 0 for h in ft["heals"]) and \
        any(q["step"] > ft["failures"][0]["step"] and "node1" in q["replicas"] for q in ft["quorums"])
    came_late = "node1: the run finished (step 120 is committed) while this node restarted" in \
        (out / "logs" / "node1.log").read_text(errors="replace")
    assert rejoined or came_late, (ft["heals"], ft["quorums"], printed[-2000:])
    # every committed step drops the micro-batches (one per rank) of the replicas missing from its quorum
    expected, changes = 0, ft["quorums"]
    for i, q in enumerate(changes):
        last = changes[i + 1]["step"] - 1 if i + 1 < len(changes) else run["step"]
        expected += max(0, last - q["step"] + 1) * (2 - len(q["replicas"])) * 2
    assert ft["dropped_micro_batches"] == expected
    assert run["step"] == 120 and len(run["history"]["loss"]) == 120
    assert "node1 lost, 2 -> 1 replicas" in printed
