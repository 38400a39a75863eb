"""``fireflyer train --model moe --order canonical``: a DeepSeekMoE on one global batch of 4 micro-batches, run
on 1 rank (every expert, 4 micro-batches accumulated), as expert parallel (1x2, EP=2), as EP=2 x DP=2 (2x2)
as two pipelines of two stages with EP=2 in each stage (2x2, PP=2 x EP=2) and as EP=2 x TP=2 (1x4, the attention
split over the TP group, every linear in 2 blocks on every layout), through the CLI and torchrun:
the same losses, validation losses, expert loads and weights, bit for bit; runs stopped as EP x DP and as
PP x EP and resumed on one rank and as EP=2 equal them; the fast order is the control."""

from __future__ import annotations

import json

import pytest

from fireflyer.testing.cli import fireflyer
from fireflyer.train.config import builtin_config

# The module's runs are set up in the first test's fixture: several whole jobs, each with its own time limit, so the
# test's limit only has to catch a hang, on a busy host too. Heavy: nine whole jobs; the default tier keeps expert
# parallel through the CLI (test_train_moe.py), EP x TP against one process (test_train_parallel.py) and the
# canonical expert steps' bits against one process (tests/haiscale/test_moe_canonical.py).
pytestmark = [pytest.mark.multiproc, pytest.mark.heavy, pytest.mark.timeout(900)]

RUN = [str(builtin_config("tiny")), "--model", "moe", "--experts", "4", "--expert-hidden", "16", "--top-k", "2",
       "--layers", "2", "--bias-update-speed", "0.01", "--steps", "6", "--eval-interval", "3", "--save-every", "3",
       "--sample-tokens", "0", "--global-batch", "16", "--micro-batch-size", "4", "--linear-blocks", "2"]
LAYOUTS = {"1x1": ["--nodes", "1", "--ranks-per-node", "1"],
           "1x2-ep": ["--nodes", "1", "--ranks-per-node", "2", "--ep", "2"],
           "2x2-ep": ["--nodes", "2", "--ranks-per-node", "2", "--ep", "2"],
           "2x2-pp-ep": ["--nodes", "2", "--ranks-per-node", "2", "--pp", "2", "--ep", "2"],
           "1x4-ep-tp": ["--nodes", "1", "--ranks-per-node", "4", "--ep", "2", "--tp", "2"]}


def train(out, *args: str) -> dict:
    done = fireflyer("train", *args, "--out", str(out), timeout=300)
    assert done.returncode == 0, f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}"
    return json.loads((out / "run.json").read_text())


def bits(run: dict) -> tuple:
    loads = [{layer: v["tokens"] for layer, v in step["layers"].items()} for step in run["history"]["experts"]]
    return run["history"]["loss"], run["history"]["val"], loads, run["model"]["weights_sha256"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-canonical")
    out = {name: train(root / name, *RUN, "--order", "canonical", *flags) for name, flags in LAYOUTS.items()}
    train(root / "moved", *RUN, "--order", "canonical", *LAYOUTS["2x2-ep"], "--stop-at", "3")
    out["moved"] = train(root / "moved", "--resume", "--ep", "1", *LAYOUTS["1x1"])
    train(root / "unpiped", *RUN, "--order", "canonical", *LAYOUTS["2x2-pp-ep"], "--stop-at", "3")
    out["unpiped"] = train(root / "unpiped", "--resume", "--pp", "1", *LAYOUTS["1x2-ep"])
    out["fast"] = train(root / "fast", *RUN, *LAYOUTS["1x2-ep"])
    return out


@pytest.mark.parametrize("name", ["1x2-ep", "2x2-ep", "2x2-pp-ep", "1x4-ep-tp", "moved", "unpiped"])
def test_expert_parallel_trains_the_bits_of_one_process(runs, name):
    alone = bits(runs["1x1"])
    assert len(alone[0]) == 6 and alone[0][-1] < alone[0][0] and sum(alone[2][0]["0"]) > 0
    assert bits(runs[name]) == alone


def test_the_fast_order_is_the_control(runs):
    fast, canon = runs["fast"], runs["1x1"]
    assert fast["model"]["weights_sha256"] != canon["model"]["weights_sha256"]
    assert abs(fast["history"]["loss"][0] - canon["history"]["loss"][0]) < 1e-4
