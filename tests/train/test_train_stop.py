"""Stopping ``fireflyer train`` stops it, and a new run never deletes an old one's state.

Through the CLI with real torchrun agents and ranks (the tiny config, 2 nodes x 1 rank): a
Ctrl-C to the command's process group, SIGTERM or SIGKILL to the command, and ``--timeout``,
each during training and during a checkpoint save (a save made slow by fault injection). Within
the grace plus 5 s no process of the run is left (found by the run's mark in each process's
environment, not by name), no ``/dev/shm`` segment of it is left, and ``--resume`` continues
with the uninterrupted run's losses bit for bit.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fireflyer import cli, lifetime
from fireflyer.checkpoint.manager import PERSIST_DELAY_ENV, committed_steps
from fireflyer.testing import shm
from fireflyer.testing.cli import fireflyer, one_error_line
from fireflyer.train.outdir import resolve

# The module's runs are set up in the first test's fixture: several whole jobs, each with its own time limit, so the
# test's limit only has to catch a hang, on a busy host too.
pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(900)]

RUN = ["--preset", "tiny", "--steps", "3000", "--save-every", "10", "--eval-interval", "8"]
"""A run that cannot end by itself within a test: saved every 10 steps of about 10 ms."""
GRACE = 10.0
SAVE_DELAY = "3"
"""Seconds each save's background part waits ("during a save"): well within the grace."""
BASELINE = 400
CODES = {"sigint": 130, "sigterm": 143, "sigkill": -signal.SIGKILL, "timeout": 1}


def ckpt(out: Path) -> Path:
    return out / "ckpt"


def in_flight(out: Path) -> int | None:
    """A step, newer than a committed one, that every rank holds back (the fault injection's line in both
    nodes' logs) and that is not committed yet: a save in flight on all ranks, not on the first one only."""
    done = committed_steps(str(ckpt(out)))
    if not done:
        return None
    held = []
    for node in (0, 1):
        log = out / "logs" / f"node{node}.log"
        text = log.read_text(errors="replace") if log.exists() else ""
        held.append({int(m) for m in re.findall(r"holds its part of step (\d+) back", text)})
    both = [s for s in held[0] & held[1] if s > done[-1] and s not in done]
    return min(both) if both else None


def start(out: Path, *extra: str, mark: str, env: dict[str, str] | None = None, stdout=subprocess.DEVNULL
          ) -> subprocess.Popen:
    """``fireflyer train`` in a session of its own (its process group is what a terminal's Ctrl-C reaches)."""
    return subprocess.Popen([sys.executable, "-m", "fireflyer.cli", "train", *RUN, "--out", str(out), *extra],
                            env={**os.environ, lifetime.MARK: mark, **(env or {})}, stdin=subprocess.DEVNULL,
                            stdout=stdout, stderr=subprocess.PIPE, text=True, start_new_session=True)


def wait_for(what, *, timeout: float = 180.0, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the run ended (code {proc.returncode}) first: {proc.stderr.read()[-2000:]}")
        time.sleep(0.02)
    raise AssertionError(f"not within {timeout:.0f}s")


def losses(out: Path) -> dict:
    return json.loads((out / "run.json").read_text())["history"]


class Baseline:
    """The uninterrupted run's history, as long as a comparison needs (run again, longer, when it must be)."""

    def __init__(self, root: Path, first_commit_s: float, history: dict) -> None:
        self.root, self.first_commit_s, self.history = root, first_commit_s, history

    def upto(self, step: int) -> dict:
        if len(self.history["loss"]) < step:
            out = self.root / f"baseline-{step}"
            done = fireflyer("train", *RUN, "--out", str(out), "--stop-at", str(step), timeout=300)
            assert done.returncode == 0, done.stderr[-2000:]
            self.history = losses(out)
        return self.history


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> Baseline:
    root = tmp_path_factory.mktemp("stop")
    out = root / "baseline"
    # an earlier run's leftovers in the way: --overwrite deletes them, and says what went
    (ckpt(out) / "step_0000000005").mkdir(parents=True)
    (ckpt(out) / "step_0000000005" / "COMMIT").write_text("{}")
    (out / "run.json").write_text("{}")
    t0 = time.monotonic()
    printed = root / "baseline.out"
    with open(printed, "w") as stdout:
        p = start(out, "--stop-at", str(BASELINE), "--overwrite", mark=lifetime.child_mark(), stdout=stdout)
    first_commit = wait_for(lambda: [s for s in committed_steps(str(ckpt(out))) if s != 5], proc=p)
    first_commit_s = time.monotonic() - t0
    assert first_commit[0] == 10 and not (out / "run.json").exists(), "--overwrite deleted the earlier run"
    assert p.wait(timeout=300) == 0, p.stderr.read()[-2000:]
    assert "the earlier run's ckpt/ (step 5), run.json were deleted" in printed.read_text()
    history = losses(out)
    assert len(history["loss"]) == BASELINE
    return Baseline(root, first_commit_s, history)


def stop_run(how: str, when: str, out: Path, mark: str, baseline: Baseline) -> tuple[subprocess.Popen, float, int | None]:
    """Start a run, stop it as ``how`` says at the moment ``when`` names; return it, when it was stopped, and
    the step whose save was in flight then (``saving``)."""
    env = {PERSIST_DELAY_ENV: SAVE_DELAY} if when == "saving" else {}
    extra = ["--stop-grace", f"{GRACE:g}"]
    if how == "timeout":
        # past the first save, as this machine's load lets it be: a run that saved nothing yet is tried again, longer
        # (the timeout counts from the agents' start, a second or two after the command's)
        timeout = math.ceil(baseline.first_commit_s + (float(SAVE_DELAY) if when == "saving" else 0))
        for _ in range(3):
            p = start(out, *extra, "--timeout", str(timeout), mark=mark, env=env)
            p.wait(timeout=timeout + GRACE + 60)
            if committed_steps(str(ckpt(out))):
                return p, time.monotonic(), None
            timeout *= 2
            extra.append("--overwrite")
        raise AssertionError("no save within three timeouts")
    p = start(out, *extra, mark=mark, env=env)
    target = None
    if when == "training":
        wait_for(lambda: committed_steps(str(ckpt(out))), proc=p)
    else:
        target = wait_for(lambda: in_flight(out), proc=p)
    if how == "sigint":
        os.killpg(p.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the foreground process group
    elif how == "sigterm":
        p.send_signal(signal.SIGTERM)
    else:
        p.kill()
    return p, time.monotonic(), target


# Two ways of stopping, at each moment, in the default tier (a signal handled while training, a kill while
# saving); the other 6 of the 8 in the heavy one.
CELLS = [("sigterm", "training"), ("sigkill", "saving"),
         pytest.param("sigint", "saving", marks=pytest.mark.heavy),
         pytest.param("timeout", "training", marks=pytest.mark.heavy),
         pytest.param("sigint", "training", marks=pytest.mark.heavy),
         pytest.param("sigterm", "saving", marks=pytest.mark.heavy),
         pytest.param("sigkill", "training", marks=pytest.mark.heavy),
         pytest.param("timeout", "saving", marks=pytest.mark.heavy)]


@pytest.mark.parametrize("how, when", CELLS)
def test_a_stopped_run_leaves_nothing_behind_and_resumes_bitwise(how, when, baseline, tmp_path):
    out, mark = tmp_path / "run", lifetime.child_mark()
    before = shm.segments()
    p, stopped_at, target = stop_run(how, when, out, mark, baseline)
    code = p.wait(timeout=GRACE + 30)
    err = p.stderr.read()
    # every process of the run gone within the grace plus 5 s
    while lifetime.marked(mark) and time.monotonic() < stopped_at + GRACE + 5:
        time.sleep(0.1)
    assert lifetime.marked(mark) == [], f"left running: {lifetime.marked(mark)}"
    assert not shm.left_behind(before), "a shared-memory segment is left"
    assert code == CODES[how], err[-2000:]
    if how == "timeout":
        assert "did not finish within" in one_error_line(subprocess.CompletedProcess([], code, "", err))
    elif how != "sigkill":
        assert err.strip().splitlines()[-1] == f"fireflyer train: stopped by {how.upper()}", err[-2000:]
        assert f"its ranks have {GRACE:g} s to finish a checkpoint in flight" in err and "Traceback" not in err
    committed = committed_steps(str(ckpt(out)))
    if target is not None:  # the grace let the save in flight finish
        assert target in committed, (target, committed)
    last = committed[-1]
    # --resume continues with the uninterrupted run's bits
    # (the saved config's timeout is the stopped run's: a timed-out run is resumed with a longer one)
    done = fireflyer("train", "--out", str(out), "--resume", "--stop-at", str(last + 2), "--timeout", "600",
                     timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    resumed, straight = losses(out), baseline.upto(last + 2)
    assert resumed["loss"] == straight["loss"][:last + 2]
    assert resumed["lr"] == straight["lr"][:last + 2]
    assert [v for v in resumed["val"] if v[0] <= last] == [v for v in straight["val"] if v[0] <= last]


# --- a new run never deletes another's state -----------------------------------------------------------

def fake_run(out: Path, step: int = 200) -> None:
    (ckpt(out) / f"step_{step:010d}").mkdir(parents=True)
    (ckpt(out) / f"step_{step:010d}" / "COMMIT").write_text("{}")
    (out / "config.json").write_text("{}")


def test_an_out_folder_that_holds_a_run_is_refused_and_nothing_is_deleted(tmp_path, capsys):
    out = tmp_path / "dup"
    fake_run(out)
    assert cli.main(["train", "--preset", "tiny", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "holds an earlier run (ckpt/ (step 200), config.json)" in err
    assert "--resume" in err and "--overwrite" in err
    assert (ckpt(out) / "step_0000000200" / "COMMIT").exists() and (out / "config.json").exists()


def test_resume_and_overwrite_together_are_refused(tmp_path, capsys):
    assert cli.main(["train", "--preset", "tiny", "--out", str(tmp_path), "--resume", "--overwrite"]) == 2
    assert "not both" in capsys.readouterr().err


def test_overwrite_deletes_the_earlier_run_and_says_what_went(tmp_path, capsys):
    out = tmp_path / "old"
    fake_run(out)
    (out / "logs").mkdir()
    (out / "logs" / "node0.log").write_text("x")
    (out / "mine.txt").write_text("not the run's")
    cfg, step = resolve(None, {"out": str(out)}, resume=False, overwrite=True)
    assert step is None and cfg.out_dir == out
    assert not ckpt(out).exists() and not (out / "config.json").exists() and not (out / "logs").exists()
    assert (out / "mine.txt").exists(), "only what a run writes is deleted"
    assert "ckpt/ (step 200), config.json, logs/ were deleted" in capsys.readouterr().out


@pytest.mark.heavy  # two whole demo runs
def test_the_demo_replaces_its_own_earlier_run_only(tmp_path, capsys):
    demo = ["demo", "--preset", "tiny", "--steps", "2", "--save-every", "0", "--out", str(tmp_path / "demo")]
    first = fireflyer(*demo)
    assert first.returncode == 0, first.stderr[-2000:]
    again = fireflyer(*demo)  # the same demo again: its earlier run is replaced, and the note says so
    assert again.returncode == 0, again.stderr[-2000:]
    assert "were deleted" in again.stdout and (tmp_path / "demo" / "run.json").exists()
    # another run there (a changed config): refused like any fireflyer train, nothing deleted
    assert cli.main([*demo[:4], "3", *demo[5:]]) == 2
    assert "holds an earlier run" in capsys.readouterr().err
    assert (tmp_path / "demo" / "run.json").exists()


def test_a_resume_past_a_damaged_newest_step_saves_that_step_again(baseline):
    # the newest step is damaged: --resume falls back to the one before, sets the damaged one aside and saves it anew
    out = baseline.root / "baseline"
    steps = committed_steps(str(ckpt(out)))
    newest, before = steps[-1], steps[-2]
    assert newest == BASELINE
    shard = ckpt(out) / f"step_{newest:010d}" / "rank00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    done = fireflyer("train", "--out", str(out), "--resume", "--stop-at", str(BASELINE), timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"resumed at step {before}" in done.stdout
    assert f"set aside as step_{newest:010d}.damaged" in done.stdout
    assert (ckpt(out) / f"step_{newest:010d}.damaged").is_dir()
    assert committed_steps(str(ckpt(out)))[-1] == newest
    assert losses(out)["loss"] == baseline.history["loss"][:BASELINE]
