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
