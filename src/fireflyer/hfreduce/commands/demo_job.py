"""The demo job, run under torchrun by ``fireflyer hfreduce demo``. Rank 0 prints the report."""

from __future__ import annotations

import argparse
import hashlib
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

import fireflyer.hfreduce  # noqa: F401 - registers backend "hfreduce"
from fireflyer.cliutil import plural


def _timed_allreduce(x: torch.Tensor, group, iters: int) -> float:
    dist.all_reduce(x, group=group)  # warm-up
    dist.barrier(group=group)
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x, group=group)
    return (time.perf_counter() - t0) / iters


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=32)
    args = p.parse_args()
    dist.init_process_group("hfreduce", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    comm = dist.group.WORLD.comm
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"fireflyer hfreduce demo: hfreduce on {plural(comm.num_nodes, 'emulated node')} x {plural(comm.local_size, 'rank')} "
        f"(world {world}), chunks of {comm.config.chunk_bytes >> 10} KiB")

    # 1. Same answer as gloo, bitwise identical on every rank.
    n = args.mib << 18
    g = torch.Generator().manual_seed(rank)
    grads = torch.randn(n, generator=g)
    ours, ref = grads.clone(), grads.clone()
    dist.all_reduce(ours)
    dist.all_reduce(ref, group=gloo)
    digest = hashlib.sha256(ours.numpy().tobytes()).hexdigest()[:16]
    digests = [None] * world
    dist.all_gather_object(digests, digest)
    err = (ours - ref).abs().max().item()
    say(f"  allreduce {args.mib} MiB fp32: max |hfreduce - gloo| = {err:.2e}; "
        f"result digest identical on all {plural(world, 'rank')}: {len(set(digests)) == 1}")

    # 2. Speed, in the same processes, one after the other.
    rows = []
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        x = torch.randn(n * 4 // dtype.itemsize).to(dtype)
        t_h = _timed_allreduce(x, None, 5)
        t_g = _timed_allreduce(x, gloo, 5)
        nbytes = x.numel() * x.element_size()
        rows.append((name, nbytes / t_h / 1e9, nbytes / t_g / 1e9))
    for name, h, g_ in rows:
        say(f"  {name}: hfreduce {h:5.2f} GB/s algbw, gloo {g_:5.2f} GB/s -> {h / g_:4.1f}x")

    # 3. torch DDP over hfreduce trains a small regression model.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 1))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=3e-3)
    w = torch.randn(64, 1, generator=torch.Generator().manual_seed(7))
    losses = []
    for step in range(60):
        xb = torch.randn(128, 64, generator=torch.Generator().manual_seed(step * world + rank))
        loss = nn.functional.mse_loss(ddp(xb), torch.tanh(xb @ w))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    say(f"  DDP over hfreduce, 60 steps: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
