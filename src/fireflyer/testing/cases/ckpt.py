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


def fsdp_resume_matches(ctx, root: str) -> tuple[list[float], list[float]]:
    """FSDP2 (haiscale fully_shard): save shards after 2 steps, keep training; a fresh sharded model loads
    the shards and repeats the next steps with the same losses."""
    from fireflyer.checkpoint import load_into
    from fireflyer.haiscale import fully_shard
    from fireflyer.train.model import GPT, ModelShape, synthetic_batch

    _pg(ctx)
    cfg = ModelShape(vocab_size=64, context=16, layers=2, d_model=32, heads=2)

    def fresh():
        model = fully_shard(GPT.seeded(cfg))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step(model, opt, i):
        x, y = synthetic_batch(cfg, rank=ctx.rank, step=i, size=4)
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        opt.step()
        out = loss.detach().reshape(1)
        dist.all_reduce(out)
        return out.item()

    model, opt = fresh()
    for i in range(2):
        step(model, opt, i)
    mgr = CheckpointManager(root, kind="per_rank", commit_timeout=60)
    mgr.save(2, {"model": model, "optimizer": opt}, blocking=True)
    dist.barrier()
    after = [step(model, opt, i) for i in range(2, 4)]
    model2, opt2 = fresh()
    state = mgr.load()
    load_into(model2, state["model"])
    load_into(opt2, state["optimizer"])
    again = [step(model2, opt2, i) for i in range(2, 4)]
    return after, again
