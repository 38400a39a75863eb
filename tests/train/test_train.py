"""``fireflyer train`` end to end on the tiny config: real CLI, real torchrun, haiscale DDP over hfreduce.

Three launches cover four claims. Run A goes straight through. Run B is the same config
stopped at the halfway save, as a preemption would stop it; its losses must equal A's
bit for bit (determinism across processes). Run C resumes B; the combined history must
equal A's bit for bit (resume == uninterrupted). A's files and loss curve cover the rest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from fireflyer import cli
from fireflyer.train.config import TrainConfig, builtin_config

pytestmark = pytest.mark.multiproc

TINY = builtin_config("tiny")
CFG = TrainConfig.from_toml(TINY)
HALF = CFG.save_every
assert 0 < HALF < CFG.steps


def train(*args: str, timeout: float = 150) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fireflyer.cli", "train", *args],
                          capture_output=True, text=True, timeout=timeout)


def ok(done: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert done.returncode == 0, f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    a, b = root / "a", root / "b"
    done_a = ok(train(str(TINY), "--out", str(a)))
    done_b = ok(train(str(TINY), "--out", str(b), "--stop-at", str(HALF)))
    stopped = json.loads((b / "run.json").read_text())
    done_c = ok(train("--out", str(b), "--resume"))
    return {
        "a": json.loads((a / "run.json").read_text()), "a_dir": a, "a_out": done_a.stdout,
        "stopped": stopped, "b_out": done_b.stdout,
        "c": json.loads((b / "run.json").read_text()), "c_out": done_c.stdout, "b_dir": b,
    }


def test_end_to_end_the_loss_falls_and_the_files_exist(runs):
    run, out = runs["a"], runs["a_dir"]
    loss = run["history"]["loss"]
    assert run["finished"] and len(loss) == CFG.steps
    assert loss[0] > 3.9  # ln(63) = 4.14: an untrained character model
    assert sum(loss[-5:]) / 5 < loss[0] - 0.5
    val = run["history"]["val"]
    assert val[0][0] == 0 and val[-1][0] == CFG.steps and val[-1][1] < val[0][1] - 0.5
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "config.json").exists() and (out / "ckpt" / f"step_{CFG.steps:010d}" / "COMMIT").exists()
    assert run["world"]["world_size"] == CFG.nodes * CFG.ranks_per_node
    assert run["allreduce"]["bytes_per_rank"] > 0 and run["timing"]["tokens_per_s"] > 0
    assert run["sample"]["text"].startswith(run["sample"]["prompt"])
    summary = runs["a_out"]
    for needle in ("fireflyer train: finished", "parameters", "tokens/s", "allreduce", "GB/s", "val", "loss.png"):
        assert needle in summary


def test_progress_prints_plain_lines_when_not_a_terminal(runs):
    lines = [ln for ln in runs["a_out"].splitlines() if ln.startswith("step ") and "loss" in ln]
    assert lines and f"{CFG.steps}/{CFG.steps}" in lines[-1] and "tok/s" in lines[-1] and "GB/s" in lines[-1]


def test_same_config_same_losses_bitwise(runs):
    stopped = runs["stopped"]
    assert not stopped["finished"] and stopped["step"] == HALF
    assert stopped["history"]["loss"] == runs["a"]["history"]["loss"][:HALF]
    assert "continue with --resume" in runs["b_out"]


def test_resumed_run_equals_uninterrupted_run(runs):
    resumed, straight = runs["c"], runs["a"]
    assert resumed["resumed_from"] == HALF and resumed["finished"]
    assert resumed["history"]["loss"] == straight["history"]["loss"]
    assert resumed["history"]["lr"] == straight["history"]["lr"]
    assert resumed["history"]["val"][-1] == straight["history"]["val"][-1]
    assert resumed["sample"] == straight["sample"]
    assert f"resumed at step {HALF}" in runs["c_out"]


def one_error_line(done: subprocess.CompletedProcess) -> str:
    assert done.returncode != 0
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    return lines[0]


@pytest.mark.parametrize("args,needle", [
    ([str(TINY), "--d-model", "48"], "d_model 32 -> 48"),
    ([str(TINY), "--nodes", "3"], "world size 2 -> 3"),
    ([], "already at step"),
])
def test_resume_with_another_model_shape_or_world_is_refused(runs, capsys, args, needle):
    # Refused before anything is launched, so the CLI runs in this process.
    assert cli.main(["train", *args, "--out", str(runs["b_dir"]), "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


def test_a_rank_that_fails_stops_the_job_with_its_error_on_one_line(tmp_path):
    # Rank 1 (alone on node 1) dies mid-run; rank 0 is then waiting for it in an allreduce.
    env = dict(os.environ, FIREFLYER_TRAIN_FAIL_AT="1:3")
    done = subprocess.run([sys.executable, "-m", "fireflyer.cli", "train", str(TINY), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=150, env=env)
    line = one_error_line(done)
    assert "RuntimeError: injected failure on rank 1 at step 3" in line, "the cause, not a peer's symptom"
    assert not (tmp_path / "run.json").exists()


def test_a_job_past_its_timeout_is_stopped(tmp_path):
    line = one_error_line(train(str(TINY), "--out", str(tmp_path), "--timeout", "1"))
    assert "did not finish within 1s and was stopped" in line
