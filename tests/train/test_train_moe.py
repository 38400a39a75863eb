"""``fireflyer train`` with a DeepSeekMoE, end to end: the real CLI, torchrun, hfreduce, the sharded checkpoint.

Seven launches of a tiny MoE (2 blocks, 4 routed experts of hidden 16 + 1 shared, top-2):
A trains 2 nodes x 2 ranks as EP=2 inside each node x DP=2 across; B is A stopped at the
halfway save and C resumes it (C's history must be A's bit for bit); P is the same global
batch as 2 pipeline stages (one per node) with EP=2 inside each; S is one process holding
every expert; Q is P stopped at step 5 and resumed (from the state saved at the end of step 5).
Every layout trains the same model on the same global batches, so their
losses agree to rounding.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fireflyer import cli
from fireflyer.train.config import builtin_config

# The module's runs are set up in the first test's fixture: several whole jobs, each with its own time limit, so the
# test's limit only has to catch a hang, on a busy host too.
pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(900)]
# The module's runs are heavy (about 100 s): the default tier trains the MoE model over a TP group
# (test_train_parallel.py) and its experts in tests/haiscale.
heavy_runs = pytest.mark.heavy

TINY = str(builtin_config("tiny"))
MOE = ["--model", "moe", "--experts", "4", "--expert-hidden", "16", "--shared-experts", "1", "--top-k", "2",
       "--layers", "2", "--steps", "8", "--save-every", "4", "--eval-interval", "4", "--bias-update-speed", "0.01",
       "--sample-tokens", "16"]
GRID = ["--nodes", "2", "--ranks-per-node", "2", "--ep", "2", "--global-batch", "32", "--micro-batch-size", "8"]
PIPE = ["--nodes", "2", "--ranks-per-node", "2", "--ep", "2", "--pp", "2", "--global-batch", "32",
        "--micro-batch-size", "4"]
ONE = ["--nodes", "1", "--ranks-per-node", "1", "--global-batch", "32", "--micro-batch-size", "8"]
"""One process accumulating the 4 micro-batches the grid runs one per rank."""


def train(*args: str, timeout: float = 240) -> dict:
    done = subprocess.run([sys.executable, "-m", "fireflyer.cli", "train", *args], capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}"
    return {"stdout": done.stdout}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    out = {}
    for name, extra in (("a", GRID), ("p", PIPE), ("s", ONE)):
        out[f"{name}_out"] = train(TINY, *MOE, *extra, "--out", str(root / name))["stdout"]
        out[name] = json.loads((root / name / "run.json").read_text())
    train(TINY, *MOE, *GRID, "--out", str(root / "b"), "--stop-at", "4")
    out["c_out"] = train("--out", str(root / "b"), "--resume")["stdout"]
    out["c"] = json.loads((root / "b" / "run.json").read_text())
    out["root"] = root
    return out


@heavy_runs
def test_the_moe_run_reports_its_layout_experts_and_all_to_all(runs):
    run = runs["a"]
    assert run["finished"] and len(run["history"]["loss"]) == 8
    assert run["layout"]["pp"] == 1 and run["layout"]["dp"] == 2 and run["layout"]["ep"] == 2
    assert run["layout"]["nodes"] == [[0, 1], [2, 3]]
    e = run["experts"]
    assert len(e["imbalance"]) == len(e["tokens"]) == len(e["all_to_all_bytes"]) == 8
    per_step = 4 * 8 * 32 * 2  # replicas x batch x context x top_k assignments per layer
    for step in e["tokens"]:
        assert sorted(step) == ["0", "1"] and all(sum(v) == per_step and len(v) == 4 for v in step.values())
    assert all(i >= 1.0 for i in e["imbalance"]) and all(b > 0 for b in e["all_to_all_bytes"])
    m = run["model"]
    assert m["kind"] == "moe" and m["experts_per_rank"] == 2
    # each rank holds half the routed experts: 2 layers x 2 experts x 3 matrices of 16 x 32
    assert all(m["parameters"] - n == 2 * 2 * 3 * 16 * 32 for n in m["parameters_per_rank"])
    assert "experts imbalance" in runs["a_out"]
    assert "layout     pp 1 x dp 2 x ep 2 x tp 1" in runs["a_out"]
    assert "experts    4 routed experts (hidden 16 each) + 1 shared, top-2, 2 per rank; imbalance" in runs["a_out"]
    assert run["sample"]["text"].startswith(run["sample"]["prompt"])


@heavy_runs
def test_a_resumed_moe_run_equals_the_uninterrupted_one_bitwise(runs):
    a, c = runs["a"], runs["c"]
    assert c["resumed_from"] == 4 and c["finished"]
    assert c["history"]["loss"] == a["history"]["loss"]
    assert c["history"]["val"] == a["history"]["val"]
    def counts(run: dict) -> list:  # everything but the seconds
        return [{k: v for k, v in e.items() if k != "all_to_all_s"} for e in run["history"]["experts"]]

    assert counts(c) == counts(a)
    assert c["sample"]["text"] == a["sample"]["text"]


@heavy_runs  # two more whole jobs
def test_a_resumed_pipeline_run_equals_the_uninterrupted_one_bitwise(runs):
    root = runs["root"]
    train(TINY, *MOE, *PIPE, "--out", str(root / "q"), "--stop-at", "5")  # off the save interval: resumes at 4
    train("--out", str(root / "q"), "--resume")
    p, q = runs["p"], json.loads((root / "q" / "run.json").read_text())
    assert q["resumed_from"] == 5 and q["finished"]
    assert q["history"]["loss"] == p["history"]["loss"]
    # the stopped run also measured val at its last step (5): the rest are the uninterrupted run's
    assert [v for v in q["history"]["val"] if v[0] != 5] == p["history"]["val"]
    assert q["experts"]["tokens"] == p["experts"]["tokens"]


@heavy_runs
def test_the_sharded_checkpoint_holds_every_expert_under_its_global_name(runs):
    from fireflyer.train import state as saved

    state = saved.load_state(runs["root"] / "a")
    names = state["model"]
    for layer in (0, 1):
        for g in range(4):
            for w in ("w1", "w2", "w3"):
                assert f"blocks.{layer}.moe.experts.{g}.{w}" in names
                assert f"blocks.{layer}.moe.experts.{g}.{w}" in state["optimizer"]["state"]
    assert sorted(state["rng"]) == [f"rank{r}" for r in range(4)]


@heavy_runs
@pytest.mark.parametrize("other", ["p", "s"])
def test_pipeline_x_experts_and_one_process_train_the_same_model(runs, other):
    """pp=2 x ep=2 and one process holding every expert reach the losses of ep=2 x dp=2 to rounding."""
    a, o = runs["a"], runs[other]
    assert len(o["history"]["loss"]) == 8
    for step, (x, y) in enumerate(zip(a["history"]["loss"], o["history"]["loss"]), 1):
        assert abs(x - y) < 2e-4, (other, step, x, y)
    for (s1, v1), (s2, v2) in zip(a["history"]["val"], o["history"]["val"]):
        assert s1 == s2 and abs(v1 - v2) < 2e-4
    assert a["experts"]["tokens"][0] == o["experts"]["tokens"][0]  # the same routing on the first step


@heavy_runs
def test_the_pipeline_run_places_one_stage_per_node(runs):
    lay = runs["p"]["layout"]
    assert lay["pp"] == 2 and lay["ep"] == 2 and lay["dp"] == 1
    stage0 = [r for dp in lay["mesh"][0] for ep in dp for r in ep]
    stage1 = [r for dp in lay["mesh"][1] for ep in dp for r in ep]
    assert sorted(stage0) == [0, 1] and sorted(stage1) == [2, 3]
    tokens = runs["p"]["experts"]["tokens"][0]
    assert sorted(tokens) == ["0", "1"], "each stage's MoE layer is reported"


@pytest.mark.parametrize("args,needle", [
    (["--model", "moe", "--experts", "6", "--ep", "4", "--ranks-per-node", "4"],
     "ep (4) does not divide experts (6)"),
    (["--ep", "2"], "ep=2 needs experts: expert parallel is for model = 'moe'"),
    (["--model", "moe", "--ep", "2", "--ranks-per-node", "3"], "ep (2) does not divide ranks_per_node (3)"),
    (["--pp", "3"], "pp x ep = 3 x 1 does not divide the world size 2"),
    (["--pp", "2", "--layers", "2", "--micro-batch-size", "16"],
     "a pipeline of 2 stages needs at least 2 micro-batches per step for the 1F1B schedule, but each of its "
     "1 pipeline gets 1 (16 sequences = 1 micro-batch of 16)"),
    (["--micro-batch-size", "3"], "micro_batch_size (3) must divide global_batch (16)"),
    (["--global-batch", "8", "--micro-batch-size", "8"], "the global batch's 8 sequences = 1 micro-batch of 8 "
     "cannot be shared evenly among 2 data-parallel replicas (2 nodes x 1 rank)"),
    (["--batch-per-rank", "8"], "unrecognized arguments: --batch-per-rank"),
    (["--model", "moe", "--top-k", "9"], "top_k (9) must be at most experts (8)"),
    (["--model", "mixture"], "invalid choice: 'mixture'"),
    (["--preset", "moe", "{cfg}"], "give CONFIG or --preset, not both"),
])
def test_a_layout_that_cannot_be_placed_is_one_line_before_any_rank_starts(args, needle, tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", *[a.format(cfg=TINY) for a in args], "--out", str(out)]
    if "{cfg}" not in args and "--preset" not in args:
        argv.insert(1, TINY)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[-1], err
    assert not (out / "logs").exists()
