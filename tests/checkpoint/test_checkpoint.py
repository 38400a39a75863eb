"""The checkpoint manager in one process: round trips, async policy, corruption, retention, sharing."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.nn as nn

from fireflyer.checkpoint import (
    CheckpointError,
    CheckpointManager,
    CorruptCheckpoint,
    NoCheckpoint,
    committed_steps,
    rng_state,
)
from fireflyer.checkpoint.manager import PERSIST_DELAY_ENV, step_dir


def _state(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 16)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3)
    return {"model": model, "optimizer": opt, "scheduler": sched, "rng": rng_state(),
            "data": {"epoch": 2, "position": 1234}, "user": {"note": "hi", "bf16": torch.randn(5).bfloat16(),
                                                               "ints": torch.arange(7), "empty": torch.empty(0, 3)}}


def _plain(obj):
    """Comparable form of a state (modules and optimizers through state_dict)."""
    if hasattr(obj, "state_dict"):
        return _plain(obj.state_dict())
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


def _assert_same(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b)
    else:
        assert a == b


def test_round_trip_of_a_whole_training_state(tmp_path):
    state = _state()
    mgr = CheckpointManager(tmp_path, rank=0, world_size=1)
    assert mgr.save(10, state, blocking=True)
    assert mgr.latest() == 10
    _assert_same(_plain(state), mgr.load())
    # the shard is a real safetensors file
    from safetensors import safe_open

    with safe_open(os.path.join(step_dir(str(tmp_path), 10), "rank00000.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("model/0.weight"), state["model"][0].weight.detach())


def test_the_snapshot_is_taken_at_save_time(tmp_path):
    mgr = CheckpointManager(tmp_path, rank=0, world_size=1)
    w = torch.ones(1000)
    mgr.save(1, {"w": w})
    w.add_(5)  # training goes on while the save persists
    mgr.wait()
    assert torch.equal(mgr.load()["w"], torch.ones(1000))


def test_policy_skip_and_wait(tmp_path):
    big = {"w": torch.randn(4 << 20)}
    skip = CheckpointManager(tmp_path / "s", policy="skip", rank=0, world_size=1)
    assert skip.save(1, big)
    started = [skip.save(s, big) for s in range(2, 6)]
    skip.wait()
    assert skip.stats["skipped"] == started.count(False)
    wait = CheckpointManager(tmp_path / "w", policy="wait", rank=0, world_size=1)
    assert all(wait.save(s, big) for s in range(1, 4))
    wait.wait()
    assert committed_steps(str(tmp_path / "w"))[-1] == 3


class _Stop(Exception):
    pass


def test_a_wait_cut_short_by_a_stop_signal_still_waits_for_the_save_after(tmp_path, monkeypatch):
    """A rank's stop raises from its signal handler wherever the main thread is, also inside a wait for the save
    in flight; its unwinding waits again, and that wait must still wait (a broken Thread.join would not)."""
    monkeypatch.setenv(PERSIST_DELAY_ENV, "1.5")
    mgr = CheckpointManager(tmp_path, rank=0, world_size=1)

    def stop(_signum, _frame):
        raise _Stop

    previous = signal.signal(signal.SIGALRM, stop)
    try:
        mgr.save(1, {"x": torch.ones(3)})
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(_Stop):
            mgr.wait()  # interrupted well before the save's delay is over
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert mgr.stats["saves"] == 1 and committed_steps(str(tmp_path)) == []
    mgr.wait(timeout=60)
    assert committed_steps(str(tmp_path)) == [1]
    assert torch.equal(mgr.load()["x"], torch.ones(3))


def test_maybe_save_by_steps_and_by_time(tmp_path):
    by_steps = CheckpointManager(tmp_path / "a", every=5, rank=0, world_size=1)
    saved = [s for s in range(1, 13) if by_steps.maybe_save(s, {"x": torch.tensor(s)})]
    by_steps.wait()
    assert saved == [5, 10]
    by_time = CheckpointManager(tmp_path / "b", every=timedelta(hours=1), rank=0, world_size=1)
    assert not by_time.maybe_save(1, {"x": torch.tensor(1)})


def test_a_failed_save_surfaces_on_the_next_call(tmp_path):
    mgr = CheckpointManager(tmp_path, rank=0, world_size=1)
    os.makedirs(tmp_path, exist_ok=True)
    (tmp_path / "step_0000000007").write_text("a file where the step directory should go")
    mgr.save(7, {"x": torch.ones(3)})
    with pytest.raises(CheckpointError, match="save of step 7 failed"):
        mgr.save(8, {"x": torch.ones(3)})
    mgr.save(9, {"x": torch.ones(3)}, blocking=True)  # reported once; the manager goes on
    assert mgr.latest() == 9


def test_retention_keeps_the_last_k_committed(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2, rank=0, world_size=1)
    os.makedirs(step_dir(str(tmp_path), 1))  # an uncommitted leftover of a crashed save
    for s in (2, 3, 4, 5):
        mgr.save(s, {"x": torch.tensor(s)}, blocking=True)
    assert committed_steps(str(tmp_path)) == [4, 5]
    assert sorted(os.listdir(tmp_path)) == ["step_0000000004", "step_0000000005"]


def _flip_a_byte(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


def test_a_flipped_bit_is_named_and_load_falls_back(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=3, rank=0, world_size=1)
    for s in (1, 2):
        mgr.save(s, {"w": torch.full((1000,), float(s))}, blocking=True)
    shard_path = os.path.join(step_dir(str(tmp_path), 2), "rank00000.safetensors")
    _flip_a_byte(shard_path, os.path.getsize(shard_path) - 100)
    with pytest.warns(UserWarning, match="step 2 is damaged.*'w' fails its checksum"):
        state = mgr.load()
    assert torch.equal(state["w"], torch.full((1000,), 1.0))
    with pytest.raises(CorruptCheckpoint, match="checksum"):
        mgr.load(step=2)


@pytest.mark.parametrize("how", ["copied", "renamed"])
def test_a_step_folder_holding_another_step_is_damaged(tmp_path, how):
    """``cp -r step_0000000100/* step_0000000200/`` (or a folder renamed): the files are intact, but
    their commit marker and manifest record step 100, so step 200 is damaged, never step 100's state
    under step 200's name."""
    mgr = CheckpointManager(tmp_path, keep_last=3, rank=0, world_size=1)
    for s in (100, 200):
        mgr.save(s, {"w": torch.full((8,), float(s)), "step": s}, blocking=True)
    older, newer = step_dir(str(tmp_path), 100), step_dir(str(tmp_path), 200)
    if how == "copied":
        for name in os.listdir(older):
            shutil.copy2(os.path.join(older, name), os.path.join(newer, name))
        newest, recorded = 200, 100
    else:  # the newest folder renamed to a later step
        os.rename(newer, step_dir(str(tmp_path), 300))
        newest, recorded = 300, 200
    assert mgr.latest() == newest
    with pytest.warns(UserWarning, match=f"step {newest} is damaged.*records step {recorded}, not {newest}"):
        state = mgr.load()
    assert state["step"] == 100 and torch.equal(state["w"], torch.full((8,), 100.0))  # the intact one before
    with pytest.raises(CheckpointError, match=f"step {newest}: .* records step {recorded}, not {newest}"):
        mgr.load(step=newest)
    assert mgr.load(step=100)["step"] == 100


def test_truncation_and_missing_files_are_detected(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=3, rank=0, world_size=1)
    mgr.save(1, {"w": torch.ones(1000)}, blocking=True)
    path = os.path.join(step_dir(str(tmp_path), 1), "rank00000.safetensors")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 10)
    with pytest.warns(UserWarning), pytest.raises(NoCheckpoint, match="truncated"):
        mgr.load()
    os.remove(path)
    with pytest.warns(UserWarning), pytest.raises(NoCheckpoint, match="missing"):
        mgr.load()


def test_a_tampered_manifest_is_refused(tmp_path):
    mgr = CheckpointManager(tmp_path, rank=0, world_size=1)
    mgr.save(1, {"w": torch.ones(10)}, blocking=True)
    path = os.path.join(step_dir(str(tmp_path), 1), "manifest.json")
    doc = json.loads(open(path).read())
    doc["step"] = 2
    open(path, "w").write(json.dumps(doc))
    with pytest.raises(CorruptCheckpoint, match="does not match its commit marker"):
        mgr.load(step=1)


def test_nothing_to_load(tmp_path):
    with pytest.raises(NoCheckpoint, match="no committed checkpoint"):
        CheckpointManager(tmp_path, rank=0, world_size=1).load()


def test_replicated_state_is_shared_out_and_loads_on_any_world_size(tmp_path):
    state = {"a": torch.randn(1000), "b": torch.randn(10), "c": torch.randn(500), "meta": {"k": 1}}
    ranks = [CheckpointManager(tmp_path, rank=r, world_size=2, commit_timeout=30) for r in (1, 0)]
    for m in ranks:
        m.save(3, state)
    for m in ranks:
        m.wait()
    parts = [json.loads(open(os.path.join(step_dir(str(tmp_path), 3), f"rank0000{r}.json")).read()) for r in (0, 1)]
    assert sorted(parts[0]["entries"]) == ["a"] and sorted(parts[1]["entries"]) == ["b", "c"]  # balanced by bytes
    for world in (1, 3):
        _assert_same(state, CheckpointManager(tmp_path, rank=0, world_size=world).load())


def test_per_rank_state_needs_the_same_world_size(tmp_path):
    for r in (1, 0):
        CheckpointManager(tmp_path, kind="per_rank", rank=r, world_size=2).save(1, {"shard": torch.full((4,), r)},
                                                                                 blocking=r == 0)
    assert torch.equal(CheckpointManager(tmp_path, kind="per_rank", rank=1, world_size=2).load()["shard"],
                       torch.full((4,), 1))
    with pytest.raises(CheckpointError, match="saved per rank by 2 ranks and cannot be loaded by 1"):
        CheckpointManager(tmp_path, kind="per_rank", rank=0, world_size=1).load()


def test_a_missing_rank_means_no_commit(tmp_path):
    mgr = CheckpointManager(tmp_path, rank=0, world_size=2, commit_timeout=0.5)
    mgr.save(1, {"a": torch.ones(10), "b": torch.ones(10)})
    with pytest.raises(CheckpointError, match="rank 1 did not finish its part of step 1"):
        mgr.wait()
    assert committed_steps(str(tmp_path)) == []


@pytest.mark.parametrize("kw,needle", [
    ({"every": 0}, "every"), ({"every": timedelta(0)}, "every"), ({"keep_last": 0}, "keep_last"),
    ({"kind": "mirrored"}, "kind"), ({"policy": "later"}, "policy"), ({"threads": 0}, "threads"),
])
def test_bad_config_names_the_field(tmp_path, kw, needle):
    with pytest.raises(ValueError, match=needle):
        CheckpointManager(tmp_path, rank=0, world_size=1, **kw)


def test_rng_state_round_trips(tmp_path):
    from fireflyer.checkpoint import set_rng_state

    mgr = CheckpointManager(tmp_path, rank=0, world_size=1)
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    mgr.save(1, {"rng": rng_state()}, blocking=True)
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    set_rng_state(mgr.load()["rng"])
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_overlapped_snapshot_holds_the_next_optimizer_step_until_copied(tmp_path):
    """Large tensors are copied in the background; the next optimizer.step() waits for that copy."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(3 << 20))  # 12 MB: copied in the background
    opt = torch.optim.SGD([w], lr=1.0)
    before = w.detach().clone()
    mgr = CheckpointManager(tmp_path, rank=0, world_size=1, snapshot="overlap")
    for round_ in range(3):
        w.grad = torch.ones_like(w)
        before = w.detach().clone()
        mgr.save(round_, {"w": w, "opt": opt})
        opt.step()  # changes w in place, but only once the snapshot has it
        mgr.wait()
        assert torch.equal(mgr.load()["w"], before)
    mgr.close()
    assert mgr._hook is None


def test_sync_snapshot_copies_everything_inside_save(tmp_path):
    big = torch.zeros(3 << 20)
    mgr = CheckpointManager(tmp_path, rank=0, world_size=1, snapshot="sync")
    mgr.save(1, {"big": big})
    big.add_(1)  # an in-place change outside any optimizer: fine with snapshot="sync"
    mgr.wait()
    assert torch.equal(mgr.load()["big"], torch.zeros(3 << 20))
    with pytest.raises(ValueError, match="snapshot"):
        CheckpointManager(tmp_path, rank=0, world_size=1, snapshot="lazy")


def test_load_into_live_objects_and_a_clear_error_on_another_shape(tmp_path):
    from fireflyer.checkpoint import load_into

    state = _state(seed=1)
    mgr = CheckpointManager(tmp_path, rank=0, world_size=1)
    mgr.save(1, {"model": state["model"], "optimizer": state["optimizer"]}, blocking=True)
    saved = mgr.load()
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    load_into(model, saved["model"])
    load_into(opt, saved["optimizer"])
    _assert_same(_plain(state["model"]), _plain(model))
    _assert_same(_plain(state["optimizer"])["state"], _plain(opt)["state"])
    with pytest.raises(ValueError, match="has shape"):
        load_into(nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4)), saved["model"])
