"""Pipeline parallel training on real processes matches single-process training step for step."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fireflyer.haiscale.pipeline import (
    Pipeline,
    PipelineConfig,
    forward_backward,
    make_subgroups,
    partition,
    stage_indices,
)
from fireflyer.testing.cluster import LocalCluster, RankFailed

pytestmark = pytest.mark.multiproc

ENV = {"FIREFLYER_TEST_COMM": "0", "FIREFLYER_PP_TIMEOUT": "30", "GLOO_SOCKET_IFNAME": "lo"}
STEPS = 3
LR = 0.1

# -- what the ranks run (module level, so spawned ranks can import it) ---------------

_GROUPS: dict[int, tuple[Any, Any]] = {}


def _init(ctx) -> None:
    if not dist.is_initialized():
        import fireflyer.hfreduce  # noqa: F401  registers the backend

        dist.init_process_group("hfreduce", store=dist.PrefixStore("pp", ctx.store), rank=ctx.rank,
                                world_size=ctx.world_size, timeout=timedelta(seconds=30))


def _subgroups(pp_size: int) -> tuple[Any, Any]:
    if pp_size not in _GROUPS:
        _GROUPS[pp_size] = make_subgroups(pp_size)
    return _GROUPS[pp_size]


def build_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def batches(rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, 6, generator=g), torch.randn(rows, 3, generator=g)) for _ in range(STEPS)]


def train_pp(ctx, schedule: str, n_mb: int, stages_per_rank: int) -> dict[str, Any]:
    """K steps of SGD through each pipeline of two ranks; every pipeline sees the same batches."""
    _init(ctx)
    _, pp_group = _subgroups(2)
    return train_on(pp_group, schedule, n_mb, stages_per_rank)


def train_on(pp_group, schedule: str, n_mb: int, stages_per_rank: int) -> dict[str, Any]:
    """K steps of SGD through the pipeline of ``pp_group``."""
    pp_rank, pp_size = dist.get_rank(pp_group), dist.get_world_size(pp_group)
    model = build_model()
    idx = stage_indices(pp_rank, pp_size, stages_per_rank)
    mods = [partition(model, i, pp_size * stages_per_rank) for i in idx]
    pipe = Pipeline(mods if stages_per_rank > 1 else mods[0], pp_group, loss_fn=F.mse_loss,
                    config=PipelineConfig(schedule=schedule, n_microbatches=n_mb))
    opt = torch.optim.SGD([p for m in mods for p in m.parameters()], lr=LR)
    losses = []
    for x, y in batches(8):
        opt.zero_grad()
        losses.append(pipe.forward_backward(x, y))
        opt.step()
    return {"stages": idx, "last": pipe.is_last, "pp": dist.get_process_group_ranks(pp_group),
            "backend": dist.get_backend(pp_group),
            "losses": [[t.item() for t in step] for step in losses] if pipe.is_last else None,
            "params": {k: v.clone() for m in mods for k, v in m.state_dict().items()}}


def train_pp_dp(ctx, n_mb: int, haiscale: bool = False) -> dict[str, Any]:
    """Two pipelines of two stages (the paper's placement on 2 nodes x 2 ranks), DDP per stage."""
    _init(ctx)
    dp_group, pp_group = _subgroups(2)
    pp_rank, dp_rank = dist.get_rank(pp_group), dist.get_rank(dp_group)
    model = build_model()
    stage = partition(model, pp_rank, 2)
    if haiscale:
        from fireflyer.haiscale import DistributedDataParallel

        ddp = DistributedDataParallel(stage, process_group=dp_group)
    else:
        ddp = torch.nn.parallel.DistributedDataParallel(stage, process_group=dp_group)
    pipe = Pipeline(ddp, pp_group, loss_fn=F.mse_loss, config=PipelineConfig(schedule="1F1B", n_microbatches=n_mb))
    opt = torch.optim.SGD(stage.parameters(), lr=LR)
    losses = []
    for x, y in batches(16):
        shard = slice(8 * dp_rank, 8 * dp_rank + 8)
        opt.zero_grad()
        losses.append(pipe.forward_backward(x[shard], y[shard]))
        opt.step()
    return {"pp": dist.get_process_group_ranks(pp_group), "dp": dist.get_process_group_ranks(dp_group),
            "losses": [[t.item() for t in s] for s in losses] if pipe.is_last else None,
            "params": {k: v.clone() for k, v in stage.state_dict().items()},
            "syncs": ddp.stats()["steps"] if haiscale else None}


class Steps:
    """Micro-batch hooks that fold each backward into a :class:`CanonicalSteps` (how a caller runs a pipeline in
    the canonical order)."""

    def __init__(self, steps) -> None:
        self.steps, self.seen = steps, []

    def before_backward(self, index: int) -> None:
        self.steps.begin_micro_batch()

    def after_backward(self, index: int, loss) -> None:
        self.seen.append(index)
        self.steps.end_micro_batch(loss)


def canonical_groups() -> Any:
    """Each node's two ranks (a stage's replicas) in a group that sums in the canonical order."""
    from fireflyer.hfreduce import HFReduceConfig

    mine = None
    for ranks in ([0, 1], [2, 3]):
        g = dist.new_group(ranks, backend="hfreduce", pg_options=HFReduceConfig(order="canonical"))
        if dist.get_rank() in ranks:
            mine = g
    return mine


def train_pp_canonical(ctx) -> dict[str, Any]:
    """Two pipelines of two stages in the canonical order: each stage's micro-batches folded by the hooks, the
    two replicas of a stage summed in the tree; a global batch of 4 micro-batches, 2 per pipeline."""
    from fireflyer.haiscale.moe_steps import CanonicalSteps

    _init(ctx)
    _, pp_group = _subgroups(2)
    dense = canonical_groups()
    pp_rank, replica = dist.get_rank(pp_group), dist.get_rank(dense)
    stage = partition(build_model(), pp_rank, 2)
    steps = CanonicalSteps(stage, dense_group=dense)
    hooks = Steps(steps)
    pipe = Pipeline(stage, pp_group, loss_fn=F.mse_loss, hooks=hooks,
                    config=PipelineConfig(schedule="1F1B", n_microbatches=2, scale_grads=False))
    opt = torch.optim.SGD(stage.parameters(), lr=LR)
    means = []
    for x, y in batches(16):
        shard = slice(8 * replica, 8 * replica + 8)
        opt.zero_grad()
        steps.begin(2)
        pipe.forward_backward(x[shard], y[shard])
        means.append(steps.finish())
        opt.step()
    return {"last": pipe.is_last, "seen": hooks.seen, "means": means,
            "params": {k: v.clone() for k, v in stage.state_dict().items()}}


def one_step(ctx) -> dict[str, Any]:
    """The one-call helper: a pipeline step's losses and the gradients it leaves in .grad."""
    _init(ctx)
    _, pp_group = _subgroups(2)
    stage = partition(build_model(), dist.get_rank(pp_group), 2)
    x, y = batches(8)[0]
    losses = forward_backward(stage, pp_group, schedule="PipeDream", n_microbatches=2, loss_fn=F.mse_loss,
                              inputs=x, targets=y)
    return {"losses": None if losses is None else [t.item() for t in losses],
            "grads": {k: p.grad.clone() for k, p in stage.named_parameters()}}


def bad_pp_size(ctx, pp_size: int) -> None:
    _init(ctx)
    make_subgroups(pp_size)


def bad_pp_backend(ctx) -> None:
    _init(ctx)
    make_subgroups(2, pp_backend="nccl")  # this CPU build of torch has no NCCL


def bad_step(ctx, what: str) -> None:
    """Errors every rank of a pipeline raises before sending anything."""
    _init(ctx)
    _, pp_group = _subgroups(2)
    stage = partition(build_model(), dist.get_rank(pp_group), 2)
    if what == "microbatches":
        Pipeline(stage, pp_group, loss_fn=F.mse_loss, config=PipelineConfig(schedule="1F1B", n_microbatches=1))
    elif what == "modules":
        Pipeline([stage, stage], pp_group, loss_fn=F.mse_loss, config=PipelineConfig(n_microbatches=2))
    elif what == "missing":
        pipe = Pipeline(stage, pp_group, loss_fn=F.mse_loss, config=PipelineConfig(n_microbatches=2))
        pipe.forward_backward(None, None)
    elif what == "hooks":
        Pipeline(stage, pp_group, loss_fn=F.mse_loss, hooks=object(), config=PipelineConfig(n_microbatches=2))
    elif what == "interleaved hooks":
        Pipeline([stage, stage], pp_group, loss_fn=F.mse_loss, hooks=Steps(None),
                 config=PipelineConfig(schedule="Interleaved1F1B", n_microbatches=2))
    elif what == "uneven":
        pipe = Pipeline(stage, pp_group, loss_fn=F.mse_loss, config=PipelineConfig(n_microbatches=3))
        pipe.forward_backward(torch.randn(4, 6), torch.randn(4, 3))


# -- the single-process reference -------------------------------------------------------


def reference(rows: int, n_mb: int) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    """The same steps in one process: per-micro-batch losses, and the parameters after them."""
    model = build_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for x, y in batches(rows):
        opt.zero_grad()
        with torch.no_grad():
            losses.append([F.mse_loss(model(xc), yc).item() for xc, yc in zip(x.chunk(n_mb), y.chunk(n_mb))])
        F.mse_loss(model(x), y).backward()
        opt.step()
    return losses, model.state_dict()


def assert_matches(results: list[dict[str, Any]], rows: int, n_mb: int) -> None:
    """Every rank's stage parameters and every last stage's losses equal the reference's."""
    ref_losses, ref_params = reference(rows, n_mb)
    for pipeline in {tuple(r["pp"]) for r in results}:
        covered = [k for r in pipeline for k in results[r]["params"]]
        assert sorted(covered) == sorted(ref_params), f"pipeline {pipeline} does not hold the whole model"
    for rank, r in enumerate(results):
        for k, v in r["params"].items():
            where = f"rank {rank}, parameter {k} after {STEPS} steps"
            torch.testing.assert_close(v, ref_params[k], rtol=1e-5, atol=1e-6, msg=lambda m, w=where: f"{w}: {m}")
        if r["last"]:
            torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    assert sum(r["last"] for r in results) == len({tuple(r["pp"]) for r in results})


# -- tests --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_nodes_two_ranks():
    """2 emulated nodes x 2 ranks: two pipelines of two stages, one stage per node."""
    with LocalCluster([2, 2], env=ENV) as c:
        yield c


@pytest.mark.parametrize("schedule, n_mb, per_rank", [("GPipe", 4, 1), ("1F1B", 4, 1), ("Interleaved1F1B", 4, 2)])
def test_pipeline_matches_single_process(two_nodes_two_ranks, schedule, n_mb, per_rank):
    results = two_nodes_two_ranks.run(train_pp, schedule, n_mb, per_rank, timeout=90)
    # ranks 0,2 and 1,3 form the pipelines; the lower rank of each holds stage 0
    assert [r["stages"] for r in results] == [stage_indices(r // 2, 2, per_rank) for r in range(4)]
    assert [r["last"] for r in results] == [False, False, True, True]
    assert_matches(results, 8, n_mb)


def test_one_call_helper(two_nodes_two_ranks):
    results = two_nodes_two_ranks.run(one_step, timeout=60)
    model = build_model()
    x, y = batches(8)[0]
    F.mse_loss(model(x), y).backward()
    ref = {k: p.grad for k, p in model.named_parameters()}
    for r in results:
        for k, g in r["grads"].items():
            torch.testing.assert_close(g, ref[k], rtol=1e-5, atol=1e-6)
    ref_losses, _ = reference(8, 2)
    assert [r["losses"] is None for r in results] == [True, True, False, False]
    for r in results[2:]:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses[0]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("haiscale", [False, True], ids=["torch-ddp", "haiscale-ddp"])
def test_paper_placement_with_ddp_per_stage(two_nodes_two_ranks, haiscale):
    results = two_nodes_two_ranks.run(train_pp_dp, 2, haiscale, timeout=90)
    if haiscale:  # one reduction per step, not one per micro-batch
        assert all(r["syncs"] == len(batches(16)) for r in results)
    # node0 = ranks 0,1 and node1 = ranks 2,3: each pipeline spans both nodes,
    # and each stage's DP group is one whole node
    assert [r["pp"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [r["dp"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    _, ref_params = reference(16, 2)
    for r in results:
        for k, v in r["params"].items():
            torch.testing.assert_close(v, ref_params[k], rtol=1e-5, atol=1e-6)
    # each pipeline saw its own half of the batch: micro-batches 0,1 and 2,3 of the reference's 4
    ref4, _ = reference(16, 4)
    for rank, half in ((2, slice(0, 2)), (3, slice(2, 4))):
        torch.testing.assert_close(torch.tensor(results[rank]["losses"]),
                                   torch.tensor([step[half] for step in ref4]), rtol=1e-5, atol=1e-6)


def test_a_pipeline_in_the_canonical_order_has_the_bits_of_one_process(two_nodes_two_ranks):
    """Hooks around each backward and CanonicalSteps: 2 pipelines x 2 stages give exactly what one process
    accumulating the 4 micro-batches in the canonical tree gives (torch.equal, not a tolerance)."""
    from fireflyer.haiscale.moe_steps import CanonicalSteps

    results = two_nodes_two_ranks.run(train_pp_canonical, timeout=90)
    model = build_model()
    steps = CanonicalSteps(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    means = []
    for x, y in batches(16):
        opt.zero_grad()
        means.append(steps.accumulate(list(zip(x.chunk(4), y.chunk(4))), lambda m, b: F.mse_loss(m(b[0]), b[1])))
        opt.step()
    ref = model.state_dict()
    for r in results:
        assert r["seen"] == [0, 1] * len(batches(16))  # every backward, in micro-batch order
        for k, v in r["params"].items():
            assert torch.equal(v, ref[k]), k
        if r["last"]:
            assert [m.item() for m in r["means"]] == [m.item() for m in means]


def test_bad_subgroups_say_what_to_do(two_nodes_two_ranks):
    with pytest.raises(RankFailed) as err:
        two_nodes_two_ranks.run(bad_pp_size, 3, timeout=30)
    assert len(err.value.errors) == 4
    assert all(("ValueError" in e or "UserError" in e) and "Choose pp_size from 1, 2, 4" in e for e in err.value.errors.values())
    with pytest.raises(RankFailed) as err:
        two_nodes_two_ranks.run(bad_pp_backend, timeout=30)
    assert all("needs NCCL" in e for e in err.value.errors.values())


@pytest.mark.parametrize("what, words", [
    ("microbatches", "1F1B needs n_microbatches >= pp_size"),
    ("modules", "runs one stage per rank"),
    ("missing", "holds the (first|last) stage"),
    ("uneven", "does not split into n_microbatches=3"),
    ("hooks", r"hooks must have before_backward\(index\) and after_backward\(index, loss\), got object"),
    ("interleaved hooks", "micro-batch hooks run with GPipe or 1F1B"),
])
def test_bad_pipeline_input(two_nodes_two_ranks, what, words):
    with pytest.raises(RankFailed) as err:
        two_nodes_two_ranks.run(bad_step, what, timeout=30)
    assert len(err.value.errors) == 4
    for e in err.value.errors.values():
        assert "ValueError" in e or "UserError" in e or "UserTypeError" in e  # fireflyer's UserError is a ValueError
        assert re.search(words, e), e
