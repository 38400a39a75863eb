"""Rank-side functions for the layout tests (run inside LocalCluster ranks, 2 nodes x 2).

Each builds a layout through :func:`fireflyer.haiscale.layout` on the hfreduce default group
and reports what a rank sees: its coordinates, its groups' ranks, the mesh's view, and the
sum an ``all_reduce`` of ``rank + 1`` gives on each group.
"""

from __future__ import annotations

import importlib
from datetime import timedelta

import torch
import torch.distributed as dist

from fireflyer.haiscale.layout_plan import GROUP_KINDS, MESH_DIMS


def init(ctx) -> None:
    """The hfreduce default group (made once per rank process)."""
    if not dist.is_initialized():
        importlib.import_module("fireflyer.hfreduce")  # registers the backend
        dist.init_process_group("hfreduce", store=dist.PrefixStore("layout", ctx.store), rank=ctx.rank,
                                world_size=ctx.world_size, timeout=timedelta(seconds=60))


def describe(ctx, degrees: dict) -> dict:
    """Build ``layout(**degrees)``; report the groups, the mesh and an all_reduce on every group."""
    import fireflyer.haiscale as hs

    init(ctx)
    lay = hs.layout(**degrees, timeout=60)
    out: dict = {"coords": lay.coords, "notes": list(lay.plan.notes), "groups": {}, "sums": {}}
    for kind in GROUP_KINDS:
        group = lay.group(kind)
        out["groups"][kind] = dist.get_process_group_ranks(group)
        t = torch.tensor([float(ctx.rank + 1)])
        dist.all_reduce(t, group=group)
        out["sums"][kind] = t.item()
    mesh = lay.mesh
    out["mesh_dims"] = list(mesh.mesh_dim_names)
    out["mesh_shape"] = list(mesh.shape)
    out["mesh"] = mesh.mesh.tolist()
    out["mesh_local"] = {d: mesh.get_local_rank(d) for d in MESH_DIMS}
    out["mesh_groups"] = {d: dist.get_process_group_ranks(mesh[d].get_group()) for d in MESH_DIMS}
    out["mesh_same_group"] = all(mesh[d].get_group() is lay.group(d) for d in MESH_DIMS)
    out["rank_in_group"] = {d: dist.get_rank(lay.group(d)) for d in MESH_DIMS}
    return out


def bad_degrees(ctx, degrees: dict) -> str:
    """The error message ``layout(**degrees)`` raises on this rank (or '' if it did not)."""
    import fireflyer.haiscale as hs

    init(ctx)
    try:
        hs.layout(**degrees, timeout=60)
    except ValueError as e:
        return f"{type(e).__name__}: {e}"
    return ""


def moe_ddp_step(ctx) -> dict:
    """``layout(ep=2)``'s groups in the MoE layer and in DDP: one step's averaged gradients, and the
    same averages taken by hand (dense over the dense group, experts over the expert group)."""
    import torch.nn.functional as F

    import fireflyer.haiscale as hs
    from fireflyer.testing.cases import moe as moe_cases

    init(ctx)
    lay = hs.layout(ep=2, timeout=60)
    x, y = moe_cases.batch(ctx.rank, 0)

    def loss_of(module, moe) -> torch.Tensor:
        return F.mse_loss(module(x), y) + moe.aux_loss

    moe = hs.MoE(moe_cases.CONFIG, ep_group=lay.ep_group, seed=moe_cases.SEED)
    ddp = hs.DistributedDataParallel(moe, process_group=lay.dense_group, expert_process_group=lay.expert_group)
    loss_of(ddp, moe).backward()
    by_hand = hs.MoE(moe_cases.CONFIG, ep_group=lay.ep_group, seed=moe_cases.SEED)
    loss_of(by_hand, by_hand).backward()
    for p in by_hand.parameters():
        group = lay.expert_group if hs.is_expert_param(p) else lay.dense_group
        dist.all_reduce(p.grad, group=group)
        p.grad /= dist.get_world_size(group)
    return {"ddp": {n: p.grad.clone() for n, p in moe.named_parameters()},
            "by_hand": {n: p.grad.clone() for n, p in by_hand.named_parameters()},
            "experts": list(moe.global_experts)}
