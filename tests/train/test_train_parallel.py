"""``fireflyer train --tp`` and ``--fsdp`` in the fast order, through the CLI and torchrun: tensor parallel
(DP=2 x TP=2, and PP=2 x TP=2: a pipeline whose stages are TP groups) and FSDP (1 x 4) train the model one process trains on the same global batch, to rounding, and
save a state any layout can resume (the bits, in the canonical order: ``test_train_canonical.py``)."""

from __future__ import annotations

import json

import pytest

from fireflyer.testing.cli import fireflyer
from fireflyer.train.config import builtin_config

# The module's runs are set up in the first test's fixture: several whole jobs, each with its own time limit, so the
# test's limit only has to catch a hang, on a busy host too.
pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(900)]

RUN = [str(builtin_config("tiny")), "--steps", "6", "--eval-interval", "3", "--save-every", "3", "--sample-tokens",
       "8", "--global-batch", "16", "--micro-batch-size", "4", "--layers", "2"]
LAYOUTS = {"one": ["--nodes", "1", "--ranks-per-node", "1"],
           "tp": ["--nodes", "2", "--ranks-per-node", "2", "--tp", "2"],
           "pp-tp": ["--nodes", "2", "--ranks-per-node", "2", "--pp", "2", "--tp", "2"],
           "fsdp": ["--nodes", "1", "--ranks-per-node", "4", "--fsdp"]}


def train(out, *args: str) -> dict:
    done = fireflyer("train", *args, "--out", str(out), timeout=300)
    assert done.returncode == 0, f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}"
    return {**json.loads((out / "run.json").read_text()), "stdout": done.stdout}


class Runs:
    """The module's runs by name, each trained the first time a test asks for it: a heavy test's run is trained
    only in the heavy tier."""

    def __init__(self, root) -> None:
        self.root, self.done = root, {}

    def __getitem__(self, name: str) -> dict:
        if name not in self.done:
            if name == "moved":  # stopped as TP, resumed as FSDP
                train(self.root / name, *RUN, *LAYOUTS["tp"], "--stop-at", "3")
                self.done[name] = train(self.root / name, "--resume", "--tp", "1", *LAYOUTS["fsdp"])
            else:
                self.done[name] = train(self.root / name, *RUN, *LAYOUTS[name])
        return self.done[name]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("parallel"))


# PP x TP is heavy: the default tier has pipelines against one process in test_train_moe.py and tests/haiscale, and
# the heavy layout matrix (test_train_canonical.py) checks PP x TP's bits.
@pytest.mark.parametrize("name", ["tp", pytest.param("pp-tp", marks=pytest.mark.heavy), "fsdp",
                                  pytest.param("moved", marks=pytest.mark.heavy)])
def test_tensor_parallel_and_fsdp_train_the_model_of_one_process(runs, name):
    one, other = runs["one"]["history"], runs[name]["history"]
    assert len(other["loss"]) == 6 and other["loss"][-1] < other["loss"][0]
    for step, (x, y) in enumerate(zip(one["loss"], other["loss"], strict=True), 1):
        assert abs(x - y) < 1e-4, (name, step, x, y)
    for (s1, v1), (s2, v2) in zip(one["val"], other["val"], strict=True):
        assert s1 == s2 and abs(v1 - v2) < 1e-4
    if name == "moved":
        assert runs["moved"]["resumed_from"] == 3


def test_the_runs_say_how_the_layout_divides_the_batch(runs):
    assert "2 micro-batches per TP group x 2 TP groups" in runs["tp"]["stdout"]
    assert "1 micro-batch per rank x 4 ranks" in runs["fsdp"]["stdout"]
    assert runs["tp"]["layout"]["tp"] == 2 and runs["fsdp"]["config"]["parallelism"]["fsdp"]
    assert runs["fsdp"]["sample"]["text"]


def test_the_moe_model_with_its_attention_over_a_tp_group_trains_the_model_of_one_process(tmp_path):
    """EP=2 x TP=2 on one node: each TP group splits the attention, each EP group shares the experts."""
    moe = [*RUN, "--model", "moe", "--experts", "4", "--expert-hidden", "16", "--top-k", "2"]
    one = train(tmp_path / "one", *moe, *LAYOUTS["one"])["history"]
    split = train(tmp_path / "split", *moe, "--nodes", "1", "--ranks-per-node", "4", "--ep", "2", "--tp", "2")
    assert split["layout"]["tp"] == 2 and split["layout"]["ep"] == 2
    for step, (x, y) in enumerate(zip(one["loss"], split["history"]["loss"], strict=True), 1):
        assert abs(x - y) < 1e-4, (step, x, y)


@pytest.mark.heavy  # FSDP's bits against one process are in the default tier above
def test_fsdp_after_an_evaluation_with_no_save_between_trains_the_bits_of_ddp(tmp_path):
    """Two micro-batches per rank, an evaluation at step 2 and no save until the end: a step after an evaluation
    starts from FSDP's shards (an evaluation's forward leaves the root unit gathered), so canonical FSDP gives
    canonical DDP's weights."""
    run = [str(builtin_config("tiny")), "--steps", "4", "--eval-interval", "2", "--save-every", "4", "--sample-tokens",
           "0", "--global-batch", "16", "--micro-batch-size", "4", "--layers", "2", "--order", "canonical",
           "--nodes", "1", "--ranks-per-node", "2"]
    ddp = train(tmp_path / "ddp", *run)
    fsdp = train(tmp_path / "fsdp", *run, "--fsdp")
    assert fsdp["history"]["loss"] == ddp["history"]["loss"]
    assert fsdp["model"]["weights_sha256"] == ddp["model"]["weights_sha256"]
