"""Rank-side functions for the canonical-order DDP tests: ``DistributedDataParallel(order="canonical")``
and its ``accumulate`` on a group made with ``HFReduceConfig(order="canonical")``.

Micro-batch ``g`` of step ``s`` is a function of ``(g, s)`` alone, and rank ``r`` of ``R`` with ``m``
micro-batches each takes ``g = r*m .. r*m+m-1``: every layout trains on the same global batch."""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fireflyer.haiscale.ddp import DistributedDataParallel
from fireflyer.hfreduce import HFReduceConfig
from fireflyer.testing.cases.canonical import Refusals
from fireflyer.testing.cases.ddp import Net


def micro_batch(g: int, step: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
    gen = torch.Generator().manual_seed(104729 * step + g)
    x = torch.randn(6, 12, generator=gen) * 10.0 ** torch.randint(-2, 3, (6, 1), generator=gen)
    return x, torch.randn(6, 5, generator=gen), g % 3 == 1  # the side branch: used by some micro-batches only


def loss_fn(model, micro) -> torch.Tensor:
    x, y, side = micro
    return F.mse_loss(model(x, use_side=side), y)


def _groups(ctx, order: str):
    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.PrefixStore("pg", ctx.store), rank=ctx.rank,
                                world_size=ctx.world_size)
    return dist.new_group(backend="hfreduce", pg_options=HFReduceConfig(order=order, chunk_bytes=16384))


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def train(ctx, m: int, steps: int, order: str = "canonical", dtype: str = "float32") -> dict:
    """``steps`` AdamW steps of :class:`Net` with ``m`` micro-batches per rank: each step's mean loss
    and the digests of the gradients and of the final weights."""
    group = _groups(ctx, order)
    torch.manual_seed(0)
    model = Net().to(getattr(torch, dtype))
    ddp = DistributedDataParallel(model, process_group=group, order=order, bucket_cap_mb=0.01, first_bucket_mb=0.004)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], []
    for step in range(steps):
        batches = [micro_batch(ctx.rank * m + j, step) for j in range(m)]
        batches = [(x.to(model.head.weight.dtype), y.to(model.head.weight.dtype), s) for x, y, s in batches]
        loss = ddp.accumulate(batches, loss_fn)
        losses.append(loss.item())
        grads.append(_digest([p.grad for p in model.parameters()]))
        opt.step()
    out = {"losses": losses, "grads": grads, "weights": _digest(model.parameters()),
           "buckets": len(ddp.bucket_sizes), "stats": ddp.stats()}
    ddp.close()
    dist.destroy_process_group(group)
    return out


def refusals(ctx) -> dict[str, str]:
    """What each misuse gets, as ``"ErrorType: message"``."""
    group = _groups(ctx, "canonical")
    fast = dist.new_group(backend="hfreduce", pg_options=HFReduceConfig(order="fast"))
    gloo = dist.new_group(backend="gloo")
    out = Refusals()
    attempt = out.attempt

    torch.manual_seed(0)
    model = Net()
    attempt("order", lambda: DistributedDataParallel(model, process_group=group, order="tree"))
    attempt("fast group", lambda: DistributedDataParallel(model, process_group=fast, order="canonical"))
    attempt("gloo group", lambda: DistributedDataParallel(model, process_group=gloo, order="canonical"))
    attempt("reduce_dtype", lambda: DistributedDataParallel(model, process_group=group, order="canonical",
                                                            reduce_dtype=torch.float32))
    ddp = DistributedDataParallel(model, process_group=group, order="canonical")
    batches = [micro_batch(ctx.rank * 2 + j, 0) for j in range(2)]
    attempt("plain forward", lambda: ddp(batches[0][0]))
    attempt("three each", lambda: ddp.accumulate([micro_batch(j, 0) for j in range(3)], loss_fn))
    attempt("unequal", lambda: ddp.accumulate(batches[: 1 + ctx.rank % 2], loss_fn))
    attempt("none", lambda: ddp.accumulate([], loss_fn))
    attempt("not a list", lambda: ddp.accumulate(iter(batches), loss_fn))
    attempt("vector loss", lambda: ddp.accumulate(batches, lambda mdl, b: (mdl(b[0]) - b[1]).pow(2).mean(0)))
    before = _digest([p.grad for p in model.parameters() if p.grad is not None])
    with ddp.no_sync():  # local accumulation outside accumulate() stays allowed
        loss_fn(ddp, batches[0]).backward()
    attempt("after refusals", lambda: ddp.accumulate(batches, loss_fn))
    out["grads changed"] = str(before != _digest([p.grad for p in model.parameters()]))
    ddp.close()
    for g in (group, fast, gloo):
        dist.destroy_process_group(g)
    return out
