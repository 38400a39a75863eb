"""kind="sharded" in one process: who writes each tensor, how skeletons merge, and a one-rank round trip."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fireflyer.checkpoint import CheckpointManager
from fireflyer.checkpoint.codec import TensorRef
from fireflyer.checkpoint.manager import _share, step_dir
from fireflyer.checkpoint.sharding import merge_skeletons, plan_owners
from fireflyer.errors import UsageError


@settings(max_examples=150, deadline=None)
@given(data=st.data(), world=st.integers(1, 6), n=st.integers(1, 25))
def test_every_name_is_written_by_exactly_one_of_its_holders(data, world, n):
    sizes = data.draw(st.lists(st.integers(0, 64), min_size=n, max_size=n))
    holders = [data.draw(st.sets(st.integers(0, world - 1), min_size=1)) for _ in range(n)]
    holdings = [{f"t{i}": ("F32", (sizes[i],)) for i in range(n) if r in holders[i]} for r in range(world)]
    owner = plan_owners(holdings)
    assert sorted(owner) == sorted(f"t{i}" for i in range(n))
    for i in range(n):
        assert owner[f"t{i}"] in holders[i]
    assert plan_owners(holdings) == owner  # a pure function: every rank computes the same


def test_a_fully_replicated_state_is_shared_out_as_replicated_does():
    tensors = {f"w{i}": torch.zeros(10 * (i % 4) + 1) for i in range(12)}
    holdings = [{n: ("F32", tuple(t.shape)) for n, t in tensors.items()}] * 3
    owner = plan_owners(holdings)
    for rank in range(3):
        assert sorted(n for n, r in owner.items() if r == rank) == sorted(_share(tensors, rank, 3))


def test_a_name_held_with_two_shapes_or_dtypes_is_an_error():
    with pytest.raises(ValueError, match=r"'e.5' is held with different shapes or dtypes: rank 0 has F32 \(2,\), "
                                         r"rank 2 has F32 \(3,\)"):
        plan_owners([{"e.5": ("F32", (2,))}, {}, {"e.5": ("F32", (3,))}])
    with pytest.raises(ValueError, match="rank 1 has BF16"):
        plan_owners([{"x": ("F32", (2,))}, {"x": ("BF16", (2,))}])


def test_skeletons_unite_their_dicts_and_must_agree_elsewhere():
    a = {"model": {"dense": TensorRef("model/dense"), "experts.0": TensorRef("model/experts.0")}, "step": 3,
         "rng": (1, [2.5, float("nan")]), "np": np.arange(3)}
    b = {"model": {"dense": TensorRef("model/dense"), "experts.4": TensorRef("model/experts.4")}, "step": 3,
         "rng": (1, [2.5, float("nan")]), "np": np.arange(3), "extra": {"rank1": 1}}
    merged = merge_skeletons([a, b])
    assert list(merged["model"]) == ["dense", "experts.0", "experts.4"] and merged["extra"] == {"rank1": 1}
    assert merge_skeletons([a]) is a
    for key, other in (("step", 4), ("rng", (1, [2.5, 1.0])), ("np", np.arange(3.0)), ("rng", (1, [2.5]))):
        with pytest.raises(ValueError, match=f"differs between ranks at '{key}"):
            merge_skeletons([a, {**b, key: other}])
    with pytest.raises(ValueError, match="at 'model/dense'"):
        merge_skeletons([a, {**b, "model": {"dense": 1.0}}])


def test_one_rank_round_trip_records_the_kind(tmp_path):
    state = {"model": {"experts.3.w1": torch.arange(6.0).reshape(2, 3)}, "step": 2}
    mgr = CheckpointManager(tmp_path, kind="sharded", rank=0, world_size=1)
    mgr.save(2, state, blocking=True)
    manifest = json.loads(open(f"{step_dir(str(tmp_path), 2)}/manifest.json").read())
    assert manifest["kind"] == "sharded" and list(manifest["parts"][0]["entries"]) == ["model/experts.3.w1"]
    got = mgr.load()
    assert got["step"] == 2 and torch.equal(got["model"]["experts.3.w1"], state["model"]["experts.3.w1"])


def test_several_ranks_without_torch_distributed_is_a_usage_error(tmp_path):
    mgr = CheckpointManager(tmp_path, kind="sharded", rank=1, world_size=2)
    with pytest.raises(UsageError, match="needs torch.distributed"):
        mgr.save(1, {"x": torch.zeros(2)})
    with pytest.raises(ValueError, match="kind must be one of"):
        CheckpointManager(tmp_path, kind="shards")
