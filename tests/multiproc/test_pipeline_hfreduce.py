"""Pipeline parallelism with its point-to-point on hfreduce, the same as single-process training.

torch's schedules (GPipe, 1F1B, Interleaved1F1B) send activations and gradients with
batch_isend_irecv; here they run on an all-hfreduce group: through the node's
mailboxes (one node) and over TCP (two nodes), and make_subgroups gives a pipeline group
on hfreduce by default.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from test_pipeline import ENV, LR, _init, assert_matches, batches, build_model

from fireflyer.haiscale.pipeline import Pipeline, PipelineConfig, make_subgroups, partition, stage_indices
from fireflyer.testing.cluster import LocalCluster


def train_on_world(ctx, schedule: str, n_mb: int, stages_per_rank: int) -> dict[str, Any]:
    """The steps of test_pipeline.train_pp, with the default (hfreduce) group as the pipeline group."""
    _init(ctx)
    group = dist.group.WORLD
    pp_rank, pp_size = dist.get_rank(group), dist.get_world_size(group)
    model = build_model()
    idx = stage_indices(pp_rank, pp_size, stages_per_rank)
    mods = [partition(model, i, pp_size * stages_per_rank) for i in idx]
    pipe = Pipeline(mods if stages_per_rank > 1 else mods[0], group, loss_fn=F.mse_loss,
                    config=PipelineConfig(schedule=schedule, n_microbatches=n_mb))
    opt = torch.optim.SGD([p for m in mods for p in m.parameters()], lr=LR)
    losses = []
    for x, y in batches(8):
        opt.zero_grad()
        losses.append(pipe.forward_backward(x, y))
        opt.step()
    return {"backend": dist.get_backend(group), "last": pipe.is_last, "pp": list(range(pp_size)),
            "losses": [[t.item() for t in step] for step in losses] if pipe.is_last else None,
            "params": {k: v.clone() for m in mods for k, v in m.state_dict().items()}}


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
