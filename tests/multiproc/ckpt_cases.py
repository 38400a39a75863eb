"""Rank-side functions for the multi-rank checkpoint tests."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

from fireflyer.checkpoint import CheckpointManager


def _pg(ctx) -> None:
    if not dist.is_initialized():
        import fireflyer.hfreduce  # noqa: F401

        dist.init_process_group("hfreduce", store=dist.PrefixStore("pg", ctx.store), rank=ctx.rank,
                                world_size=ctx.world_size)


def ddp_save_and_load(ctx, root: str) -> dict:
    """haiscale DDP trains two steps; every rank saves its share; everyone loads it back, all ranks equal."""
    from fireflyer.haiscale import DistributedDataParallel

    _pg(ctx)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)])
    ddp = DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    for step in range(2):
        x = torch.randn(8, 256, generator=torch.Generator().manual_seed(ctx.rank * 10 + step))
        opt.zero_grad()
        ddp(x).square().mean().backward()
        opt.step()
    mgr = CheckpointManager(root, every=timedelta(seconds=0.001), commit_timeout=60)
    assert (mgr.rank, mgr.world_size) == (ctx.rank, ctx.world_size)  # taken from torch.distributed
    import time

    time.sleep(0.01)
    saved = mgr.maybe_save(2, {"model": model, "optimizer": opt, "rank_of_saver": ctx.rank})
    mgr.wait()
    dist.barrier()
    state = mgr.load()
    ddp.close()
    ok = all(torch.equal(state["model"][k], v) for k, v in model.state_dict().items())
    return {"saved": saved, "same": ok, "rank_of_saver": state["rank_of_saver"],
            "entries": len(state["optimizer"]["state"])}


def per_rank_save(ctx, root: str) -> bool:
    _pg(ctx)
    mgr = CheckpointManager(root, kind="per_rank", commit_timeout=60)
    mgr.save(5, {"shard": torch.full((1000,), float(ctx.rank))}, blocking=True)
    dist.barrier()
    return torch.equal(mgr.load()["shard"], torch.full((1000,), float(ctx.rank)))
