"""``fireflyer train --order canonical``: one global batch of 4 micro-batches of 4 sequences, run on 1 rank,
as tensor parallel (1x2, TP=2), as FSDP (1x4), as data x tensor parallel (2x2, DP=2 x TP=2), as data
parallel (2x2), as two pipelines of two stages (2x2, PP=2 x DP=2) and as one pipeline of two TP=2 stages (2x2,
PP=2 x TP=2), through the real CLI and torchrun: the
same losses, validation losses and weights, bit for bit; runs stopped on DP x TP and on PP x DP and resumed
as FSDP and as TP equal them too; and what would break the guarantee is refused with one line."""

from __future__ import annotations

import json
import subprocess

import pytest

from fireflyer.testing.cli import fireflyer, one_error_line
from fireflyer.train.config import builtin_config

# The module's runs are set up in the first test's fixture: several whole jobs, each with its own time limit, so the
# test's limit only has to catch a hang, on a busy host too.
pytestmark = [pytest.mark.multiproc, pytest.mark.heavy, pytest.mark.timeout(1800)]

TINY = str(builtin_config("tiny"))
STEPS = 8
LAYOUTS = {"1x1": ("1", "1"), "1x2-tp": ("1", "2", "--tp", "2"), "1x4-fsdp": ("1", "4", "--fsdp"),
           "2x2-tp": ("2", "2", "--tp", "2"), "2x2": ("2", "2"), "2x2-pp": ("2", "2", "--pp", "2"),
           "2x2-pp-tp": ("2", "2", "--pp", "2", "--tp", "2")}
"""name: nodes, ranks per node, the parallelism; every layout runs the global batch of 4 micro-batches of 4 (4, 2 or
1 per data-parallel replica)."""
BATCH = ["--global-batch", "16", "--micro-batch-size", "4", "--linear-blocks", "2", "--layers", "2"]
"""Every linear in 2 blocks of its weight: what TP=2 computes, so the other layouts compute it too; two blocks, one
per pipeline stage."""


def train(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return fireflyer("train", *args, timeout=timeout)


def layout(name: str) -> list[str]:
    nodes, per, *parallel = LAYOUTS[name]
    return ["--nodes", nodes, "--ranks-per-node", per, *parallel]


def canonical_run(out, name: str, *extra: str) -> dict:
    done = train(TINY, "--order", "canonical", "--steps", str(STEPS), "--eval-interval", "4", "--save-every", "4",
                 "--sample-tokens", "0", "--out", str(out), *BATCH, *layout(name), *extra)
    assert done.returncode == 0, f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}"
    return json.loads((out / "run.json").read_text())


def bits(run: dict) -> tuple:
    return run["history"]["loss"], run["history"]["val"], run["model"]["weights_sha256"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("canonical")
    out = {name: canonical_run(root / name, name) for name in LAYOUTS}
    canonical_run(root / "moved", "2x2-tp", "--stop-at", "4")
    resume = train("--out", str(root / "moved"), "--resume", "--tp", "1", *layout("1x4-fsdp"))
    assert resume.returncode == 0, resume.stderr[-3000:]
    out["moved"] = json.loads((root / "moved" / "run.json").read_text())
    out["moved_stdout"] = resume.stdout
    canonical_run(root / "unpiped", "2x2-pp", "--stop-at", "4")
    resume = train("--out", str(root / "unpiped"), "--resume", "--pp", "1", *layout("1x2-tp"))
    assert resume.returncode == 0, resume.stderr[-3000:]
    out["unpiped"] = json.loads((root / "unpiped" / "run.json").read_text())
    fast = train(TINY, "--steps", str(STEPS), "--eval-interval", "4", "--sample-tokens", "0",
                 "--out", str(root / "fast"), *BATCH, *layout("1x1"))
    assert fast.returncode == 0, fast.stderr[-3000:]
    out["fast"] = json.loads((root / "fast" / "run.json").read_text())
    out["dirs"] = root
    return out


def test_every_layout_trains_the_same_bits(runs):
    alone = bits(runs["1x1"])
    assert len(alone[0]) == STEPS and alone[0][-1] < alone[0][0]
    for name in LAYOUTS:
        assert bits(runs[name]) == alone, name


def test_run_json_records_the_order_and_the_global_batch(runs):
    for name in LAYOUTS:
        run = runs[name]
        assert run["config"]["parallelism"]["order"] == "canonical"
        assert run["data"]["micro_batches_per_step"] == 4 and run["data"]["micro_batch_size"] == 4
        assert run["world"]["threads_per_rank"] == 1


def test_a_run_stopped_as_dp_x_tp_and_resumed_as_fsdp_equals_the_uninterrupted_run(runs):
    moved = runs["moved"]
    assert moved["resumed_from"] == 4 and moved["world"]["world_size"] == 4 and moved["config"]["parallelism"]["fsdp"]
    assert bits(moved) == bits(runs["1x1"])


def test_a_run_stopped_as_pipelines_and_resumed_as_tensor_parallel_equals_the_uninterrupted_run(runs):
    unpiped = runs["unpiped"]
    assert unpiped["resumed_from"] == 4 and unpiped["config"]["parallelism"]["pp"] == 1 and unpiped["config"]["parallelism"]["tp"] == 2
    assert bits(unpiped) == bits(runs["1x1"])


def test_the_fast_order_learns_the_same_but_not_in_the_same_bits(runs):
    """The control: one rank accumulating 4 micro-batches one after another ((g0 + g1) + g2) + g3 differs
    from the pairwise tree, so the tests above can fail."""
    fast, canon = runs["fast"]["history"]["loss"], runs["1x1"]["history"]["loss"]
    assert runs["fast"]["model"]["weights_sha256"] != runs["1x1"]["model"]["weights_sha256"]
    assert abs(fast[0] - canon[0]) < 1e-4  # the first step's loss, before any update: the same data


@pytest.mark.parametrize("args,needle", [
    (["--global-batch", "24", "--micro-batch-size", "4"],
     "needs a power-of-two count of micro-batches per replica (1, 2, 4, ...), but each gets 3 (24 sequences = 6 "
     "micro-batches of 4)"),
    (["--micro-batch-size", "3"], "micro_batch_size (3) must divide global_batch (16)"),
    (["--ranks-per-node", "3", "--global-batch", "48"],
     "across 2 nodes needs a power-of-two ranks_per_node (1, 2, 4, ...), got 3"),
    (["--pp", "2", "--layers", "2", "--global-batch", "4", "--micro-batch-size", "4"],
     "a pipeline of 2 stages needs at least 2 micro-batches per step for the 1F1B schedule, but each of its 1 "
     "pipeline gets 1"),
    (["--model", "moe", "--experts", "6", "--ep", "3", "--ranks-per-node", "3", "--global-batch", "48"],
     "with ep = 3 on 2 data-parallel copies of each expert needs a power-of-two ep"),
    (["--nodes", "1", "--ranks-per-node", "2", "--tp", "2"],
     "with tp = 2 needs linear_blocks a multiple of 2 (got 1)"),
    (["--nodes", "1", "--ranks-per-node", "3", "--global-batch", "48", "--fsdp"],
     "with fsdp needs a power-of-two count of ranks, got 3"),
    (["--fsdp", "--tp", "2", "--ranks-per-node", "2", "--linear-blocks", "2"], "fsdp shards the dense model over data "
     "parallel only so far"),
    (["--linear-blocks", "3"], "linear_blocks must be a power of two"),
    (["--model", "moe", "--experts", "4", "--ep", "2", "--tp", "2", "--ranks-per-node", "2", "--linear-blocks", "2"],
     "ep x tp (2 x 2) does not divide ranks_per_node (2)"),
    (["--order", "tree"], "invalid choice: 'tree'"),
])
def test_what_would_break_the_guarantee_is_refused(tmp_path, args, needle):
    line = one_error_line(train(TINY, "--order", "canonical", "--out", str(tmp_path / "x"), *args))
    assert needle in line


def test_a_resume_on_another_layout_with_another_global_batch_is_refused(runs):
    line = one_error_line(train("--out", str(runs["dirs"] / "1x2-tp"), "--resume", "--steps", "12", "--nodes", "2",
                                "--ranks-per-node", "2", "--global-batch", "32"))
    assert "world size 2 -> 4" in line and "16 of 4 -> 32 of 4" in line
