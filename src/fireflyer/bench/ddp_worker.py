"""One rank of ``fireflyer bench ddp``: ``python -m fireflyer.bench.ddp_worker SPEC.json`` under torchrun,
started by :mod:`fireflyer.bench.ddp`.

Every rank builds the same ~25M-parameter model several times: bare (compute alone),
wrapped in haiscale DDP on hfreduce, in torch DDP on gloo (the baseline) and in torch
DDP on the hfreduce process group (torch's reducer instead of haiscale's hooks). Rounds alternate
between the variants so drift in machine load hits both alike. Besides step times it
measures each backend's allreduce of the very same buckets with no compute running,
which gives the fraction of communication hidden behind backward.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from fireflyer.bench.skeleton import rank_groups, worker_main
from fireflyer.train.model import GPT, ModelShape
from fireflyer.haiscale.ddp import DistributedDataParallel
from fireflyer.hfreduce.plans.plan import Op


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """This rank's median step time per variant, each backend's allreduce alone, and (in ``run``) the run's
    sizes."""
    with rank_groups(spec["timeout_s"]) as gloo:
        rank, world = dist.get_rank(), dist.get_world_size()
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        variants = spec["variants"]
        batch, context, rounds = spec["batch"], spec["context"], spec["rounds"]

        cfg = ModelShape(vocab_size=spec["vocab"], context=context, layers=spec["layers"], d_model=spec["d_model"],
                         heads=max(1, spec["d_model"] // 64))
        models: dict[str, nn.Module] = {"compute": GPT.seeded(cfg)}
        if "haiscale" in variants:
            models["haiscale"] = DistributedDataParallel(GPT.seeded(cfg), bucket_cap_mb=spec["bucket_mb"])
        if "gloo" in variants:
            models["gloo"] = nn.parallel.DistributedDataParallel(GPT.seeded(cfg), process_group=gloo,
                                                                 bucket_cap_mb=spec["bucket_mb"])
        if "torch-hfreduce" in variants:  # torch's own DDP reducer on the hfreduce process group
            models["torch-hfreduce"] = nn.parallel.DistributedDataParallel(GPT.seeded(cfg),
                                                                           bucket_cap_mb=spec["bucket_mb"])
        opts = {k: torch.optim.SGD(m.parameters(), lr=1e-4) for k, m in models.items()}
        g = torch.Generator().manual_seed(rank)
        data = [torch.randint(0, spec["vocab"], (batch, context + 1), generator=g) for _ in range(4)]

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
        for _ in range(rounds):
            for name in models:
                dist.barrier(group=gloo)
                before = models["haiscale"].stats() if name == "haiscale" else None
                t0 = time.perf_counter()
                for i in range(spec["steps"]):
                    step(name, i)
                times[name].append((time.perf_counter() - t0) / spec["steps"])
                if before is not None:
                    after = models["haiscale"].stats()
                    waits.append((after["wait_seconds"] - before["wait_seconds"]) / (after["steps"] - before["steps"]))

        params = sum(p.numel() for p in models["compute"].parameters())
        grad_bytes = params * 4
        comm = {}
        if "haiscale" in models:
            comm["haiscale"] = _comm_alone_haiscale(models["haiscale"], gloo, rounds)
        if "gloo" in models:
            comm["gloo"] = _comm_alone_gloo(models["haiscale"].bucket_sizes if "haiscale" in models else [grad_bytes],
                                            gloo, rounds)
        result = {
            "rank": rank,
            "step_s": {k: statistics.median(v) for k, v in times.items()},
            "comm_alone_s": comm,
            "haiscale_wait_s": statistics.median(waits) if waits else None,
            "run": {
                "world": world,
                "nodes": dist.group.WORLD.comm.num_nodes,
                "params": params,
                "grad_bytes": grad_bytes,
                "tokens_per_rank": batch * context,
                "threads_per_rank": torch.get_num_threads(),
                "buckets": len(models["haiscale"].bucket_sizes) if "haiscale" in models else None,
            },
        }
        if "haiscale" in models:
            models["haiscale"].close()
        return result


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
    sys.exit(worker_main(sys.argv[1:], "python -m fireflyer.bench.ddp_worker", run))
