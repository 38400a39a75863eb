"""Pipeline parallelism with its point-to-point on hfreduce, the same as single-process training.

torch's schedules (GPipe, 1F1B, Interleaved1F1B) send activations and gradients with
batch_isend_irecv; here they run on an all-hfreduce group: through the node's
mailboxes (one node) and over TCP (two nodes), and make_subgroups gives a pipeline group
on hfreduce by default.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch.distributed as dist
from test_pipeline import ENV, _init, assert_matches, train_on

from fireflyer.haiscale.pipeline import make_subgroups
from fireflyer.testing.cluster import LocalCluster

pytestmark = pytest.mark.multiproc


def train_on_world(ctx, schedule: str, n_mb: int, stages_per_rank: int) -> dict[str, Any]:
    """test_pipeline.train_pp's steps, with the default (hfreduce) group as the pipeline group."""
    _init(ctx)
    return train_on(dist.group.WORLD, schedule, n_mb, stages_per_rank)


def default_subgroup_backend(ctx) -> str:
    _init(ctx)
    _, pp_group = make_subgroups(ctx.world_size)
    return dist.get_backend(pp_group)


@pytest.fixture(scope="module", params=[[2], [1, 1]], ids=["1x2", "2x1"])
def cluster(request):
    with LocalCluster(request.param, env=ENV) as c:
        yield c


@pytest.mark.parametrize("schedule, n_mb, per_rank", [("GPipe", 4, 1), ("1F1B", 4, 1), ("Interleaved1F1B", 4, 2)])
def test_schedules_on_an_all_hfreduce_group_match_single_process(cluster, schedule, n_mb, per_rank):
    results = cluster.run(train_on_world, schedule, n_mb, per_rank, timeout=120)
    assert {r["backend"] for r in results} == {"hfreduce"}
    assert [r["last"] for r in results] == [False, True]
    assert_matches(results, 8, n_mb)


def test_make_subgroups_puts_the_pipeline_on_hfreduce(cluster):
    assert cluster.run(default_subgroup_backend, timeout=60) == ["hfreduce"] * cluster.world_size
