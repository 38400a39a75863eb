"""``fireflyer train --fault-tolerant``: a lost node costs seconds, and the run keeps the bits of one that never failed.

Through the CLI with torchft's real Lighthouse and Manager, one torchrun agent per emulated node
(3 nodes x 2 ranks): every rank of a node is SIGKILLed while the run trains (its agent restarts
them, they heal from a live replica), or two nodes one after another; each run finishes, and
with the canonical order its weights' sha256, losses and validation losses equal those of a
plain canonical run that never failed. Without the canonical order the summary counts the
micro-batches the lost node's absence dropped. The layouts ``--fault-tolerant`` cannot serve are
refused in one line. The pure core (which rank sums which micro-batches) is checked bit for
bit against one process's canonical sum.
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
import torch

pytest.importorskip("torchft", reason="torchft is an optional extra: pip install 'fireflyer[ft]'")

from fireflyer import cli, lifetime  # noqa: E402
from fireflyer.checkpoint.manager import committed_steps  # noqa: E402
from fireflyer.hfreduce.canonical import canonical_sum  # noqa: E402
from fireflyer.testing.cli import fireflyer  # noqa: E402
from fireflyer.train.fault_tolerant import (micro_blocks, node_ranks, own_blocks, tree_blocks,  # noqa: E402
                                            tree_over_blocks)

RUN = ["--preset", "tiny", "--steps", "400", "--save-every", "25", "--eval-interval", "100",
       "--nodes", "3", "--ranks-per-node", "2"]


# --- the pure core ------------------------------------------------------------------------------------

@pytest.mark.parametrize("total", [1, 2, 3, 4, 5, 6, 8, 12, 16])
@pytest.mark.parametrize("parts", [1, 2, 3, 4, 5, 6])
def test_blocks_cover_the_batch_as_subtrees_and_sum_to_one_processs_bits(total, parts):
    blocks, shares = micro_blocks(total, parts)
    assert [s for s, _ in blocks] == [sum(n for _, n in blocks[:i]) for i in range(len(blocks))]
    assert sum(n for _, n in blocks) == total
    assert len(shares) == parts and [b for r in shares for b in r] == list(range(len(blocks)))
    g = torch.Generator().manual_seed(total * 31 + parts)
    terms = [torch.randn(257, generator=g) * 10 ** torch.randint(-3, 4, (257,), generator=g) for _ in range(total)]
    sums = [canonical_sum(terms[s:s + n]) for s, n in blocks]
    assert torch.equal(tree_over_blocks(total, blocks, sums), canonical_sum(terms))


def test_the_split_is_the_issues_example():
    assert tree_blocks(4, 2) == [(0, 2), (2, 2)]
    assert [b for b in tree_blocks(8, 3)] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    # without the canonical order a lost rank's micro-batches are dropped, the others keep their own
    blocks, shares = own_blocks(12, 6, [0, 1, 4, 5])
    assert blocks == [(0, 2), (2, 2), (8, 2), (10, 2)] and [list(r) for r in shares] == [[0], [1], [2], [3]]


# --- the refusals ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("flags, says", [
    (["--nodes", "1"], "at least 2 nodes"),
    (["--nodes", "2", "--pp", "2", "--layers", "2", "--microbatches", "2"], "cannot run a pipeline across nodes"),
    (["--model", "moe", "--ep", "1"], "moe"),
])
def test_layouts_without_a_replica_are_refused_in_one_line(flags, says, tmp_path, capsys):
    assert cli.main(["train", "--preset", "tiny", "--fault-tolerant", *flags, "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err, err
    assert not (tmp_path / "r" / "ckpt").exists()


# --- through the CLI, with real torchft ---------------------------------------------------------------

def wait_committed(out: Path, step: int, proc: subprocess.Popen, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (out / "ckpt").is_dir() and any(s >= step for s in committed_steps(str(out / "ckpt"))):
            return
        assert proc.poll() is None, f"the run ended (code {proc.returncode}) before step {step}"
        time.sleep(0.01)
    raise AssertionError(f"step {step} was not committed within {timeout:.0f}s")


def ft_run(out: Path, kills: list[tuple[int, str]], *extra: str) -> tuple[dict, str]:
    """A fault-tolerant run with the ranks of node ``n`` SIGKILLed once step ``s`` is committed, for each (s, n)."""
    mark = lifetime.child_mark()
    p = subprocess.Popen([sys.executable, "-m", "fireflyer.cli", "train", *RUN, "--fault-tolerant", *extra,
                          "--out", str(out)], env={**os.environ, lifetime.MARK: mark}, stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        for step, node in kills:
            wait_committed(out, step, p)
            victims = node_ranks(node, mark)
            assert len(victims) == 2, f"{node}'s ranks not found: {victims}"
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
    return json.loads((out / "run.json").read_text()), printed


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> dict:
    """The plain canonical run on the same layout, never interrupted."""
    out = tmp_path_factory.mktemp("ft") / "straight"
    done = fireflyer("train", *RUN, "--order", "canonical", "--out", str(out), timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads((out / "run.json").read_text())


def same_bits(run: dict, straight: dict) -> None:
    assert run["model"]["weights_sha256"] == straight["model"]["weights_sha256"]
    assert run["history"]["loss"] == straight["history"]["loss"]
    assert run["history"]["val"] == straight["history"]["val"]




@pytest.mark.multiproc
def test_a_node_killed_mid_run_leaves_the_bits_of_a_run_that_never_failed(straight, tmp_path):
    run, printed = ft_run(tmp_path / "one", [(50, "node1")], "--order", "canonical")
    same_bits(run, straight)
    ft = run["fault_tolerance"]
    assert len(ft["failures"]) == 1 and ft["failures"][0]["lost"] == ["node1"], ft["failures"]
    assert ft["failures"][0]["replicas_before"] == 3 and ft["failures"][0]["replicas_after"] == 2
    assert ft["failures"][0]["recovered_s"] is not None
    rejoined = [q for q in ft["quorums"] if q["step"] > ft["failures"][0]["step"] and "node1" in q["replicas"]]
    assert rejoined, "the restarted node never rejoined"
    assert any(h["replica"] == "node1" and h["step"] >= 50 and h["bytes"] > 0 for h in ft["heals"]), ft["heals"]
    assert ft["dropped_micro_batches"] == 0
    assert "node1 lost, 3 -> 2 replicas" in printed


@pytest.mark.multiproc
def test_two_nodes_lost_one_after_another_keep_the_bits(straight, tmp_path):
    run, _ = ft_run(tmp_path / "two", [(25, "node2"), (100, "node1")], "--order", "canonical")
    same_bits(run, straight)
    lost = [f["lost"] for f in run["fault_tolerance"]["failures"]]
    assert ["node2"] in lost and ["node1"] in lost, lost


@pytest.mark.multiproc
def test_without_the_canonical_order_the_summary_counts_the_dropped_micro_batches(tmp_path):
    run, printed = ft_run(tmp_path / "fast", [(50, "node1")], "--order", "fast")
    ft = run["fault_tolerance"]
    # every committed step drops the micro-batches of the replicas missing from its quorum
    changes = ft["quorums"]
    expected = 0
    for i, q in enumerate(changes):
        first = q["step"]
        last = changes[i + 1]["step"] - 1 if i + 1 < len(changes) else run["step"]
        expected += max(0, last - first + 1) * (3 - len(q["replicas"])) * 2
    assert ft["dropped_micro_batches"] == expected > 0
    assert f"{expected} micro-batches dropped (order fast)" in printed
