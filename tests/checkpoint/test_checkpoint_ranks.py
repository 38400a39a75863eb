"""The checkpoint manager on real ranks (2 emulated nodes x 2) with haiscale DDP, loaded on other world sizes."""

from __future__ import annotations

import os

import pytest
import torch

from fireflyer.checkpoint import CheckpointError, CheckpointManager
from fireflyer.testing.cases import ckpt as ckpt_cases
from fireflyer.testing.cluster import LocalCluster

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster([2, 2], env={"FIREFLYER_TEST_COMM": "0"}) as c:
        yield c


def test_ddp_state_is_shared_out_committed_once_and_loads_anywhere(cluster, tmp_path):
    results = cluster.run(ckpt_cases.ddp_save_and_load, str(tmp_path))
    assert all(r["saved"] and r["same"] for r in results)  # rank 0's time decision reached everyone
    assert {r["rank_of_saver"] for r in results} == {0}  # the replicated skeleton is rank 0's
    step = tmp_path / "step_0000000002"
    assert sorted(p for p in os.listdir(step) if p.endswith(".safetensors")) == [
        f"rank{r:05d}.safetensors" for r in range(4)]
    for world in (1, 3):
        state = CheckpointManager(tmp_path, rank=0, world_size=world).load()
        assert len(state["model"]) == 12 and results[0]["entries"] == len(state["optimizer"]["state"])


def test_per_rank_state_round_trips_and_needs_the_same_world(cluster, tmp_path):
    assert cluster.run(ckpt_cases.per_rank_save, str(tmp_path)) == [True] * 4
    with pytest.raises(CheckpointError, match="saved per rank by 4 ranks"):
        CheckpointManager(tmp_path, kind="per_rank", rank=0, world_size=2).load()
    assert torch.equal(CheckpointManager(tmp_path, kind="per_rank", rank=3, world_size=4).load()["shard"],
                       torch.full((1000,), 3.0))


def test_fsdp_shards_resume_with_the_same_losses(cluster, tmp_path):
    for after, again in cluster.run(ckpt_cases.fsdp_resume_matches, str(tmp_path)):
        assert after == again
