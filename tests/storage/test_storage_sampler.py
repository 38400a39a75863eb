"""The resumable distributed sampler, RecordDataset under a DataLoader, and resuming through a checkpoint."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fireflyer.checkpoint import CheckpointManager
from fireflyer.storage.dataset import RecordDataset
from fireflyer.storage.records import from_numpy
from fireflyer.storage.sampler import ResumableSampler


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 200), world=st.integers(1, 4), batch=st.integers(1, 8), seed=st.integers(0, 99),
       shuffle=st.booleans(), stop=st.integers(0, 60))
def test_resume_at_any_step_continues_exactly(n, world, batch, seed, shuffle, stop):
    if n < world * batch:
        with pytest.raises(ValueError):
            ResumableSampler(n, batch_size=batch, world_size=world)
        return
    for rank in range(world):
        full = ResumableSampler(n, batch_size=batch, rank=rank, world_size=world, seed=seed, shuffle=shuffle)
        stream = list(full) + list(full)  # two epochs
        spe = full.steps_per_epoch
        step = stop % (2 * spe)
        resumed = ResumableSampler(n, batch_size=batch, rank=rank, world_size=world, seed=seed, shuffle=shuffle)
        resumed.set_step(step)
        rest = list(resumed)
        if step < spe:
            rest += list(resumed)
        assert rest == stream[step * batch:]
        assert resumed.batch(step) == stream[step * batch:(step + 1) * batch]


def test_ranks_partition_an_epoch():
    world, n = 3, 100
    seen = [list(ResumableSampler(n, batch_size=4, rank=r, world_size=world, seed=7)) for r in range(world)]
    flat = [i for s in seen for i in s]
    assert len(flat) == len(set(flat)) == 96  # 100 // 3 = 33 per rank, 8 whole batches of 4
    s = ResumableSampler(n, batch_size=4, rank=0, world_size=world, seed=7)
    assert list(s) != list(ResumableSampler(n, batch_size=4, rank=0, world_size=world, seed=8))
    e0, e1 = s.epoch_ids(0), s.epoch_ids(1)
    assert sorted(e0.tolist()) != e0.tolist() or sorted(e1.tolist()) != e1.tolist()
    assert e0.tolist() != e1.tolist()  # each epoch has its own order


def test_padding_without_drop_last_covers_every_sample():
    seen = [list(ResumableSampler(10, batch_size=2, rank=r, world_size=3, drop_last=False)) for r in range(3)]
    assert set(i for s in seen for i in s) == set(range(10)) and all(len(s) == 4 for s in seen)


def test_bad_input():
    with pytest.raises(ValueError):
        ResumableSampler(0)
    with pytest.raises(ValueError):
        ResumableSampler(10, rank=2, world_size=2)
    s = ResumableSampler(10)
    with pytest.raises(ValueError):
        s.set_step(-1)
    other = ResumableSampler(10, seed=3)
    with pytest.raises(ValueError, match="seed"):
        s.load_state_dict(other.state_dict())


def test_dataloader_resumes_through_the_checkpoint_manager(tmp_path):
    data = np.arange(64 * 3, dtype=np.float32).reshape(64, 3)
    from_numpy(data, tmp_path / "ds", records_per_shard=10)
    ds = RecordDataset(tmp_path / "ds")
    assert len(ds) == 64 and torch.equal(ds[5], torch.from_numpy(data[5]))

    def run(steps, sampler):
        loader = torch.utils.data.DataLoader(ds, batch_size=4, sampler=sampler)
        out = []
        for batch in loader:
            out.append(batch[:, 0].tolist())
            if len(out) == steps:
                break
        return out

    whole = run(12, ResumableSampler(64, batch_size=4, seed=1))
    sampler = ResumableSampler(64, batch_size=4, seed=1)
    first = run(5, sampler)
    sampler.set_step(5)  # the trainer tells the sampler the step it is at when it saves
    mgr = CheckpointManager(tmp_path / "ckpt", rank=0, world_size=1, every=1)
    mgr.save(5, {"sampler": sampler.state_dict(), "w": torch.zeros(2)}, blocking=True)
    mgr.close()
    state = CheckpointManager(tmp_path / "ckpt", rank=0, world_size=1).load()
    again = ResumableSampler(64, batch_size=4, seed=1)
    again.load_state_dict(state["sampler"])
    assert first + run(7, again) == whole


def test_dataset_with_workers_and_transform(tmp_path):
    data = np.arange(40, dtype=np.int64).reshape(20, 2)
    from_numpy(data, tmp_path, records_per_shard=6)
    ds = RecordDataset(tmp_path, transform=lambda t: t * 10)
    loader = torch.utils.data.DataLoader(ds, batch_size=5, num_workers=2,
                                         sampler=ResumableSampler(20, batch_size=5, shuffle=False))
    got = torch.cat(list(loader))
    assert torch.equal(got, torch.from_numpy(data) * 10)
