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
from fireflyer.testing.cli import fireflyer, one_error_line
from fireflyer.train.config import TrainConfig, builtin_config

# The module's runs are set up in the first test's fixture: several whole jobs, each with its own time limit, so the
# test's limit only has to catch a hang, on a busy host too.
pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(900)]

TINY = builtin_config("tiny")
CFG = TrainConfig.from_toml(TINY)
HALF = CFG.checkpoint.save_every
assert 0 < HALF < CFG.run.steps


def train(*args: str, timeout: float = 150) -> subprocess.CompletedProcess:
    return fireflyer("train", *args, timeout=timeout)


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
    assert run["finished"] and len(loss) == CFG.run.steps
    assert loss[0] > 3.9  # ln(63) = 4.14: an untrained character model
    assert sum(loss[-5:]) / 5 < loss[0] - 0.5
    val = run["history"]["val"]
    assert val[0][0] == 0 and val[-1][0] == CFG.run.steps and val[-1][1] < val[0][1] - 0.5
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "config.json").exists() and (out / "ckpt" / f"step_{CFG.run.steps:010d}" / "COMMIT").exists()
    assert run["world"]["world_size"] == CFG.parallelism.nodes * CFG.parallelism.ranks_per_node
    assert run["allreduce"]["bytes_per_rank"] > 0 and run["timing"]["tokens_per_s"] > 0
    assert run["sample"]["text"].startswith(run["sample"]["prompt"])
    summary = runs["a_out"]
    for needle in ("fireflyer train: finished", "parameters", "tokens/s", "allreduce", "GB/s", "val", "loss.png"):
        assert needle in summary


def test_progress_prints_plain_lines_when_not_a_terminal(runs):
    lines = [ln for ln in runs["a_out"].splitlines() if ln.startswith("step ") and "loss" in ln]
    assert lines and f"{CFG.run.steps}/{CFG.run.steps}" in lines[-1] and "tok/s" in lines[-1] and "GB/s" in lines[-1]


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


@pytest.mark.parametrize("args,needle", [
    ([str(TINY), "--d-model", "48"], "d_model 32 -> 48"),
    ([str(TINY), "--nodes", "4", "--micro-batch-size", "4"], "world size 2 -> 4"),
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


# --- the data path: records built once, read through storage, resumed across an epoch's end ---------------

DATA_STEPS, DATA_SAVE, DATA_STOP = 14, 5, 7
"""Saved every 5 steps, stopped at 7 (not a save step), resumed to 14: an epoch of the small text
below is 10 steps, so the resumed run crosses into the next epoch."""


@pytest.fixture(scope="module")
def data_runs(tmp_path_factory):
    from fireflyer.train.records import load_corpus

    root = tmp_path_factory.mktemp("data-runs")
    text = root / "plays.txt"
    text.write_text(load_corpus()[:6000], encoding="utf-8")
    cache = root / "cache"
    common = [str(TINY), "--data", str(text), "--data-cache", str(cache), "--steps", str(DATA_STEPS),
              "--save-every", str(DATA_SAVE)]
    done_a = ok(train(*common, "--out", str(root / "a")))
    (dataset,) = [p for p in cache.iterdir() if not p.name.startswith(".")]
    stamp = [(p.stat().st_ino, p.stat().st_mtime_ns) for p in (dataset, dataset / "data.json")]
    done_b = ok(train(*common, "--out", str(root / "b"), "--stop-at", str(DATA_STOP)))
    done_c = ok(train("--out", str(root / "b"), "--resume"))
    return {"a": json.loads((root / "a" / "run.json").read_text()), "c": json.loads((root / "b" / "run.json").read_text()),
            "outs": [done_a.stdout, done_b.stdout, done_c.stdout], "text": text, "cache": cache, "dataset": dataset,
            "stamp": stamp}


@pytest.mark.heavy  # three runs on a text of the user's; the default tier builds and reads records in tests/storage
def test_a_run_resumed_off_the_save_interval_and_across_an_epoch_equals_an_uninterrupted_one(data_runs):
    straight, resumed = data_runs["a"], data_runs["c"]
    steps_per_epoch = straight["data"]["records"]["train"] // CFG.data.global_batch
    assert DATA_STOP < steps_per_epoch < DATA_STEPS and DATA_STOP % DATA_SAVE
    assert resumed["resumed_from"] == DATA_STOP and resumed["finished"] and len(straight["history"]["loss"]) == DATA_STEPS
    assert resumed["history"]["loss"] == straight["history"]["loss"]
    # The stopped run also measured val loss where it stopped; every other evaluation is the same, bit for bit.
    assert [v for v in resumed["history"]["val"] if v[0] != DATA_STOP] == straight["history"]["val"]
    assert resumed["sample"] == straight["sample"]


@pytest.mark.heavy  # three runs on a text of the user's; the default tier builds and reads records in tests/storage
def test_the_records_are_built_by_the_first_run_and_reused_by_the_others(data_runs):
    first, *later = data_runs["outs"]
    assert "built in" in first and all("reused" in out and "built in" not in out for out in later)
    dataset = data_runs["dataset"]
    assert [(p.stat().st_ino, p.stat().st_mtime_ns) for p in (dataset, dataset / "data.json")] == data_runs["stamp"]
    assert [p for p in data_runs["cache"].iterdir() if not p.name.startswith(".")] == [dataset]


@pytest.mark.heavy  # three runs on a text of the user's; the default tier builds and reads records in tests/storage
def test_run_json_and_the_summary_show_the_data_and_its_reader(data_runs):
    data = data_runs["c"]["data"]
    assert data["source"] == str(data_runs["text"].resolve()) and data["hash"] == data_runs["dataset"].name
    assert data["records"]["train"] > 0 and data["shards"]["train"] >= 1 and data["window"] == CFG.model.context + 1
    assert 0 < data["cache_hit_rate"] <= 1 and data["stall_s"] >= 0 and data["record_reads"] > 0
    summary = data_runs["outs"][2]
    assert "shard cache hit rate" in summary and "reader stall" in summary and data["hash"][:12] in summary


def test_a_damaged_record_stops_the_job_with_one_line_that_names_it(tmp_path):
    from fireflyer.storage.records import RecordReader
    from fireflyer.storage.sampler import ResumableSampler
    from fireflyer.train.records import load_corpus, prepare_data

    text = tmp_path / "plays.txt"
    text.write_text(load_corpus()[:6000], encoding="utf-8")
    cfg = CFG.replace(data=str(text), data_cache=str(tmp_path / "cache"))
    prepared = prepare_data(cfg)
    sampler = ResumableSampler(prepared.records("train"), batch_size=CFG.batch_per_replica, rank=0,
                               world_size=CFG.world_size, seed=CFG.run.seed)
    victim = sampler.batch(1)[0]  # rank 0 reads it at step 2
    with RecordReader(prepared.dir / "train") as r:
        shard, offset, _, _ = r.locate(victim)
    path = prepared.dir / "train" / f"shard-{shard:05d}.rec"
    raw = bytearray(path.read_bytes())
    raw[offset + 3] ^= 0x01
    path.write_bytes(bytes(raw))
    done = train(str(TINY), "--data", str(text), "--data-cache", str(tmp_path / "cache"), "--out", str(tmp_path / "o"))
    line = one_error_line(done)
    assert "CorruptRecord: the records of the train split of" in line, line
    assert f"record {victim} " in line and f"shard-{shard:05d}.rec" in line and "CRC-32" in line
    assert f"delete {prepared.dir}" in line
