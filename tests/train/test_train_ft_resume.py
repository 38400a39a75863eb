"""``fireflyer train --fault-tolerant --resume``: a checkpoint of another layout continues only in the canonical order.

A plain canonical run on 1 node x 4 ranks, stopped half way, goes on as a fault-tolerant run
on 2 nodes x 2 ranks with the bits of the plain run that never stopped. A run saved without
the canonical order on another layout is refused in one line, before any rank starts, and its
checkpoint is left as it was.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torchft", reason="torchft is an optional extra: pip install 'fireflyer[ft]'")

from fireflyer.checkpoint.manager import committed_steps  # noqa: E402
from fireflyer.testing.cli import fireflyer, one_error_line  # noqa: E402

TINY = ["--preset", "tiny", "--steps", "12", "--save-every", "3", "--eval-interval", "6", "--micro-batch-size", "4"]


def run_json(out: Path) -> dict:
    return json.loads((out / "run.json").read_text())


@pytest.mark.heavy
@pytest.mark.multiproc
def test_a_canonical_run_goes_on_fault_tolerant_on_another_layout_with_the_same_bits(tmp_path):
    straight, moved = tmp_path / "straight", tmp_path / "moved"
    done = fireflyer("train", *TINY, "--order", "canonical", "--nodes", "1", "--ranks-per-node", "4",
                     "--out", str(straight), timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    done = fireflyer("train", *TINY, "--order", "canonical", "--nodes", "1", "--ranks-per-node", "4",
                     "--stop-at", "6", "--out", str(moved), timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    done = fireflyer("train", "--out", str(moved), "--resume", "--fault-tolerant", "--nodes", "2",
                     "--ranks-per-node", "2", timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "resumed at step 6" in done.stdout
    a, b = run_json(straight), run_json(moved)
    assert b["fault_tolerance"]["replicas"] == 2 and b["step"] == 12
    assert b["model"]["weights_sha256"] == a["model"]["weights_sha256"]
    assert b["history"]["loss"] == a["history"]["loss"]


@pytest.mark.multiproc
def test_a_run_saved_without_the_canonical_order_on_another_layout_is_refused(tmp_path):
    out = tmp_path / "fast"
    done = fireflyer("train", *TINY, "--nodes", "2", "--ranks-per-node", "1", "--stop-at", "3", "--out", str(out),
                     timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    before = committed_steps(str(out / "ckpt"))
    done = fireflyer("train", "--out", str(out), "--resume", "--fault-tolerant", "--nodes", "4", timeout=120)
    assert done.returncode == 2
    line = one_error_line(done)
    assert "cannot resume" in line and "world size 2 -> 4" in line, line
    assert committed_steps(str(out / "ckpt")) == before
