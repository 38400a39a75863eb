"""The checkpoint manager through a storage backend: stage locally, upload, commit on the backend, load anywhere."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

from fireflyer.checkpoint import CheckpointError, CheckpointManager, NoCheckpoint
from fireflyer.storage.backends.memory import MemoryBackend


def _state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g)},
            "opt": {"m": torch.randn(2000, generator=g)}, "step": seed, "note": f"seed {seed}"}


def _equal(a, b):
    assert a["step"] == b["step"] and a["note"] == b["note"]
    for k in ("w", "b"):
        assert torch.equal(a["model"][k], b["model"][k])
    assert torch.equal(a["opt"]["m"], b["opt"]["m"])


def test_save_to_backend_and_load_on_a_fresh_node(tmp_path):
    store = MemoryBackend()
    mgr = CheckpointManager(tmp_path / "node-a", rank=0, world_size=1, backend=store, every=1)
    for step in (1, 2, 3):
        mgr.save(step, _state(step), blocking=True)
    mgr.close()
    assert sorted({k.split("/")[0] for k in store.objects}) == ["step_0000000002", "step_0000000003"]  # keep_last=2
    assert "step_0000000003/COMMIT" in store.objects
    fresh = CheckpointManager(tmp_path / "node-b", rank=0, world_size=1, backend=store)
    assert fresh.latest() == 3
    _equal(fresh.load(), _state(3))
    _equal(fresh.load(2), _state(2))
    with pytest.raises(NoCheckpoint, match="step 1 in MemoryBackend"):
        fresh.load(1)
    with pytest.raises(NoCheckpoint, match="no committed checkpoint in MemoryBackend"):
        CheckpointManager(tmp_path / "node-c", rank=0, world_size=1, backend=MemoryBackend()).load()


def test_two_ranks_on_two_nodes_commit_through_the_backend(tmp_path):
    store = MemoryBackend()
    state = _state(7)
    errors = []

    def rank(r):
        try:
            m = CheckpointManager(tmp_path / f"node{r}", rank=r, world_size=2, backend=store, commit_timeout=20)
            m.save(10, state, blocking=True)
            m.close()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    assert {"step_0000000010/rank00000.json", "step_0000000010/rank00001.json"} <= set(store.objects)
    _equal(CheckpointManager(tmp_path / "node9", rank=0, world_size=1, backend=store).load(), state)


def test_commit_times_out_when_a_rank_never_uploads(tmp_path):
    store = MemoryBackend()
    m = CheckpointManager(tmp_path / "n0", rank=0, world_size=2, backend=store, commit_timeout=0.3)
    m.save(1, _state(), blocking=False)
    with pytest.raises(CheckpointError, match="rank 1's part of step 1 did not reach"):
        m.wait(10)
    assert "step_0000000001/COMMIT" not in store.objects


def test_damaged_object_falls_back_to_the_previous_checkpoint(tmp_path):
    store = MemoryBackend()
    m = CheckpointManager(tmp_path / "a", rank=0, world_size=1, backend=store)
    m.save(1, _state(1), blocking=True)
    m.save(2, _state(2), blocking=True)
    m.close()
    key = "step_0000000002/rank00000.safetensors"
    blob = bytearray(store.objects[key])
    blob[-5] ^= 0xFF
    store.objects[key] = bytes(blob)
    fresh = CheckpointManager(tmp_path / "b", rank=0, world_size=1, backend=store)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _equal(fresh.load(), _state(1))
    assert any("step 2" in str(w.message) for w in caught)


def test_transient_backend_failures_are_retried_during_save(tmp_path):
    store = MemoryBackend()
    store.fail_next = 2
    m = CheckpointManager(tmp_path / "a", rank=0, world_size=1, backend=store)
    m.save(1, _state(1), blocking=True)
    m.close()
    assert store.retries >= 2
    _equal(CheckpointManager(tmp_path / "b", rank=0, world_size=1, backend=store).load(), _state(1))


def test_backend_url(tmp_path):
    m = CheckpointManager(tmp_path / "stage", rank=0, world_size=1, backend=f"file://{tmp_path}/remote")
    m.save(4, _state(4), blocking=True)
    m.close()
    assert (tmp_path / "remote" / "step_0000000004" / "COMMIT").exists()
    _equal(CheckpointManager(tmp_path / "other", rank=0, world_size=1, backend=str(tmp_path / "remote")).load(),
           _state(4))
