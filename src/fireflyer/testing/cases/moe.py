"""Rank-side functions for the expert-parallel MoE tests (run inside LocalCluster ranks, 2 nodes x 2).

The EP groups are the nodes ({0, 1} and {2, 3}); the ranks that hold the same experts (the
expert groups) are {0, 2} and {1, 3}. :func:`reference` is the same training in one process on
the concatenated batch, which the test runs itself.
"""

from __future__ import annotations

import importlib
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fireflyer.haiscale.moe import MoE, MoEConfig, is_expert_param
from fireflyer.haiscale.moe_dispatch import exchange_rows

CONFIG = MoEConfig(d_model=32, n_routed=8, n_shared=1, expert_hidden=16, top_k=2, init_std=0.2,
                   bias_update_speed=0.02, aux_loss_alpha=0.01)
SEED = 11
BATCH, TIME = 2, 4
LR = 0.2
_GROUPS: dict = {}


def init(ctx, backend: str) -> dict:
    """The hfreduce default group, and the EP and expert groups on ``backend`` (made once per backend)."""
    if not dist.is_initialized():
        importlib.import_module("fireflyer.hfreduce")  # registers the backend
        dist.init_process_group("hfreduce", store=dist.PrefixStore("moe", ctx.store), rank=ctx.rank,
                                world_size=ctx.world_size, timeout=timedelta(seconds=60))
    if backend not in _GROUPS:
        half = ctx.world_size // 2
        mine = {}
        for ranks in ([r for r in range(half)], [r for r in range(half, ctx.world_size)]):  # EP: a node each
            g = dist.new_group(ranks, backend=backend, timeout=timedelta(seconds=60))
            if ctx.rank in ranks:
                mine["ep"] = g
        for ranks in ([r for r in range(0, ctx.world_size, half)], [r for r in range(1, ctx.world_size, half)]):
            g = dist.new_group(ranks, backend=backend, timeout=timedelta(seconds=60))
            if ctx.rank in ranks:
                mine["expert"] = g
        mine["world"] = dist.new_group(backend=backend, timeout=timedelta(seconds=60))
        _GROUPS[backend] = mine
    return _GROUPS[backend]


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1009 * step + rank)
    return torch.randn(BATCH, TIME, CONFIG.d_model, generator=g), torch.randn(BATCH, TIME, CONFIG.d_model, generator=g)


def _loss(moe: MoE, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = F.mse_loss(moe(x), y)
    return loss + moe.aux_loss if moe.aux_loss is not None else loss


def _sgd(moe: MoE) -> None:
    with torch.no_grad():
        for p in moe.parameters():
            p -= LR * p.grad
            p.grad = None


def train_ep(ctx, steps: int, backend: str) -> dict:
    """EP=2 inside each node x DP=2 across: outputs, input gradients, losses, parameters and biases."""
    groups = init(ctx, backend)
    moe = MoE(CONFIG, ep_group=groups["ep"], seed=SEED)
    world, replicas = dist.get_world_size(groups["world"]), dist.get_world_size(groups["expert"])
    out: dict = {"losses": [], "outputs": [], "input_grads": [], "loads": [], "tokens": [], "global": list(moe.global_experts)}
    for step in range(steps):
        x, y = batch(ctx.rank, step)
        x.requires_grad_(True)
        yhat = moe(x)
        loss = F.mse_loss(yhat, y) + moe.aux_loss
        loss.backward()
        out["losses"].append(loss.item())
        out["outputs"].append(yhat.detach().clone())
        out["input_grads"].append(x.grad.clone())
        out["tokens"].append(moe.stats.tokens)
        out["a2a"] = moe.stats.as_dict()["all_to_all"]  # forward's three exchanges and backward's two
        for p in moe.parameters():  # dense grads over all 4 ranks, expert grads over the ranks with the same experts
            group, n = (groups["expert"], replicas) if is_expert_param(p) else (groups["world"], world)
            dist.all_reduce(p.grad, group=group)
            p.grad /= n
        _sgd(moe)
        out["loads"].append(moe.update_bias(groups["world"]))
    out["params"] = {k: v.clone() for k, v in moe.state_dict().items()}
    return out


def reference(steps: int, world: int) -> dict:
    """The same MoE, every expert in one process, on the concatenated batch of all ``world`` ranks."""
    moe = MoE(CONFIG, seed=SEED)
    out: dict = {"losses": [], "outputs": [], "input_grads": [], "loads": [], "tokens": []}
    for step in range(steps):
        xs, ys = zip(*(batch(r, step) for r in range(world)))
        x = torch.cat(xs).requires_grad_(True)
        yhat = moe(x)
        loss = F.mse_loss(yhat, torch.cat(ys)) + moe.aux_loss
        loss.backward()
        out["losses"].append(loss.item())
        out["outputs"].append(yhat.detach().split(BATCH))
        out["input_grads"].append((x.grad * world).split(BATCH))  # each rank's loss is a 1/world share of this one
        out["tokens"].append(moe.stats.tokens)
        _sgd(moe)
        out["loads"].append(moe.update_bias())
    out["params"] = {k: v.clone() for k, v in moe.state_dict().items()}
    return out


def _rows(src: int, dst: int) -> int:
    """Rows rank ``src`` sends rank ``dst`` (uneven, zeros included)."""
    return (src * 3 + dst * 5 + 1) % 4


def _data(rank: int, n: int, what: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 * rank + 101 * n + (100003 if what == "g" else 0))
    return torch.randn(n, 3, generator=g, dtype=torch.float64)


def dispatch_backward(ctx, backend: str, scope: str) -> list[str]:
    """``exchange_rows`` forward moves the rows where they belong, and its autograd backward equals
    the reverse exchange (checked against every rank's seeded gradient, rebuilt here)."""
    groups = init(ctx, backend)
    group = groups["ep"] if scope == "ep" else groups["world"]
    ranks = dist.get_process_group_ranks(group)
    me, size = dist.get_rank(group), len(ranks)
    send = [_rows(me, d) for d in range(size)]
    recv = [_rows(s, me) for s in range(size)]
    x = _data(me, sum(send), "x").requires_grad_(True)
    y = exchange_rows(x, send, recv, group)
    problems = []
    want_y = torch.cat([_data(s, sum(_rows(s, d) for d in range(size)), "x")[
        sum(_rows(s, d) for d in range(me)):sum(_rows(s, d) for d in range(me + 1))] for s in range(size)])
    if not torch.equal(y.detach(), want_y):
        problems.append("forward rows differ from the seeded inputs' rows")
    g = _data(me, sum(recv), "g")
    (y * g).sum().backward()
    # x's rows for rank d got d's gradient rows from me: block `me` of d's g (d receives from every source in order)
    want_grad = torch.cat([_data(d, sum(_rows(s, d) for s in range(size)), "g")[
        sum(_rows(s, d) for s in range(me)):sum(_rows(s, d) for s in range(me + 1))] for d in range(size)])
    if not torch.equal(x.grad, want_grad):
        problems.append("autograd backward differs from the rows of every rank's gradient")
    reverse = exchange_rows(g, recv, send, group)
    if not torch.equal(x.grad, reverse):
        problems.append("autograd backward differs from the reverse exchange")
    return problems


def bad_ep(ctx) -> str:
    """The error a layer of 7 experts gets on an EP group of 2."""
    groups = init(ctx, "hfreduce")
    try:
        MoE(MoEConfig(d_model=8, n_routed=7, expert_hidden=4), ep_group=groups["ep"])
    except ValueError as exc:
        return str(exc)
    return "no error"
