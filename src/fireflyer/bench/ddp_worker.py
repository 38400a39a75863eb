"""One rank of ``fireflyer bench ddp``, run under torchrun by :mod:`fireflyer.bench.ddp`.

Every rank builds the same ~25M-parameter model several times: bare (compute alone),
wrapped in haiscale DDP on hfreduce, in torch DDP on gloo (the baseline) and in torch
DDP on the hfreduce process group (torch's reducer instead of haiscale's hooks). Rounds alternate
between the variants so drift in machine load hits both alike. Besides step times it
measures each backend's allreduce of the very same buckets with no compute running,
which gives the fraction of communication hidden behind backward.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

import fireflyer.hfreduce  # noqa: F401 - registers backend "hfreduce"
from fireflyer.bench.harness import write_rank_json
from fireflyer.train.model import GPT, ModelShape
from fireflyer.haiscale.ddp import DistributedDataParallel
from fireflyer.hfreduce.plans.plan import Op


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--batch", type=int, default=1, help="sequences per rank per step")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--variants", default="compute,haiscale,gloo,torch-hfreduce")
    return p.parse_args(argv)


def main() -> None:
    args = parse()
    dist.init_process_group("hfreduce", timeout=timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo", timeout=timedelta(seconds=300))
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    variants = args.variants.split(",")

    cfg = ModelShape(vocab_size=args.vocab, context=args.context, layers=args.layers, d_model=args.d_model,
                     heads=max(1, args.d_model // 64))
    models: dict[str, nn.Module] = {"compute": GPT.seeded(cfg)}
    if "haiscale" in variants:
        models["haiscale"] = DistributedDataParallel(GPT.seeded(cfg), bucket_cap_mb=args.bucket_mb)
    if "gloo" in variants:
        models["gloo"] = nn.parallel.DistributedDataParallel(GPT.seeded(cfg), process_group=gloo, bucket_cap_mb=args.bucket_mb)
    if "torch-hfreduce" in variants:  # torch's own DDP reducer on the hfreduce process group
        models["torch-hfreduce"] = nn.parallel.DistributedDataParallel(GPT.seeded(cfg), bucket_cap_mb=args.bucket_mb)
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-4) for k, m in models.items()}
    g = torch.Generator().manual_seed(rank)
    data = [torch.randint(0, args.vocab, (args.batch, args.context + 1), generator=g) for _ in range(4)]

    def step(name: str, i: int) -> None:
        model, opt = models[name], opts[name]
        x = data[i % len(data)]
        opt.zero_grad()
        model(x[:, :-1], x[:, 1:]).backward()
        opt.step()

    times: dict[str, list[float]] = {k: [] for k in models}
    waits: list[float] = []
    for name in models:  # warm-up: allocations, bucket rebuild, thread pools
        for i in range(2):
            step(name, i)
    for _ in range(args.rounds):
        for name in models:
            dist.barrier(group=gloo)
            before = models["haiscale"].stats() if name == "haiscale" else None
            t0 = time.perf_counter()
            for i in range(args.steps):
                step(name, i)
            times[name].append((time.perf_counter() - t0) / args.steps)
            if before is not None:
                after = models["haiscale"].stats()
                waits.append((after["wait_seconds"] - before["wait_seconds"]) / (after["steps"] - before["steps"]))

    params = sum(p.numel() for p in models["compute"].parameters())
    grad_bytes = params * 4
    comm = {}
    if "haiscale" in models:
        comm["haiscale"] = _comm_alone_haiscale(models["haiscale"], gloo, args.rounds)
    if "gloo" in models:
        comm["gloo"] = _comm_alone_gloo(models["haiscale"].bucket_sizes if "haiscale" in models else [grad_bytes],
                                        gloo, args.rounds)
    mine = {
        "rank": rank,
        "step_s": {k: statistics.median(v) for k, v in times.items()},
        "comm_alone_s": comm,
        "haiscale_wait_s": statistics.median(waits) if waits else None,
    }
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine, group=gloo)
    if rank == 0:
        report = {
            "world": world,
            "nodes": dist.group.WORLD.comm.num_nodes,
            "params": params,
            "grad_bytes": grad_bytes,
            "tokens_per_rank": args.batch * args.context,
            "threads_per_rank": torch.get_num_threads(),
            "buckets": len(models["haiscale"].bucket_sizes) if "haiscale" in models else None,
            "ranks": everyone,
        }
        write_rank_json(args.out, report)
    if "haiscale" in models:
        models["haiscale"].close()
    dist.barrier(group=gloo)
    dist.destroy_process_group()


def _comm_alone_haiscale(ddp: DistributedDataParallel, gloo, rounds: int) -> float:
    """Allreduce the DDP's own (registered) buckets back to back, as DDP launches them, with nothing else running."""
    comm = dist.group.WORLD.comm
    buffers = [b.comm for b in ddp._buckets]  # their contents are gradients no longer needed by now
    samples = []
    for _ in range(rounds + 1):
        dist.barrier(group=gloo)
        t0 = time.perf_counter()
        for fut in [comm.allreduce(b, Op.AVG) for b in buffers]:
            fut.wait()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples[1:])


def _comm_alone_gloo(bucket_bytes: list[int], gloo, rounds: int) -> float:
    buffers = [torch.zeros(n // 4) for n in bucket_bytes]
    samples = []
    for _ in range(rounds + 1):
        dist.barrier(group=gloo)
        t0 = time.perf_counter()
        for work in [dist.all_reduce(b, group=gloo, async_op=True) for b in buffers]:
            work.wait()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples[1:])


if __name__ == "__main__":
    main()
