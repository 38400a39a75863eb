"""A torchrun job that exercises backend "hfreduce" through plain torch.distributed APIs.

Run by test_torch_backend.py under real torchrun. Rank 0 writes a JSON report to argv[1].
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

import fireflyer.hfreduce  # noqa: F401 - registers the backend


def model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 32, generator=g), torch.randn(16, 4, generator=g)


def _train(net: nn.Module, steps: int) -> None:
    rank = dist.get_rank()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(steps):
        x, y = batch(rank, step)
        opt.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()


def train_ddp(group, steps: int = 4) -> list[torch.Tensor]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    net = DDP(model(), process_group=group, bucket_cap_mb=0.01)  # several buckets
    _train(net, steps)
    return [p.detach().clone() for p in net.parameters()]


def train_fsdp(mesh, steps: int = 3) -> list[torch.Tensor]:
    from torch.distributed.fsdp import fully_shard

    net = model()
    for layer in net:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    _train(net, steps)
    return [p.full_tensor().detach().clone() for p in net.parameters()]


def main() -> None:
    out_path = sys.argv[1]
    dist.init_process_group("hfreduce", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    report: dict = {"backend": dist.get_backend(), "world": world}
    pg = dist.group.WORLD

    # Plain collectives, sync and async.
    x = torch.full((1000,), float(rank + 1))
    dist.all_reduce(x)
    report["allreduce"] = x[0].item()
    y = torch.full((5,), float(rank))
    work = dist.all_reduce(y, op=dist.ReduceOp.MAX, async_op=True)
    torch.randn(200, 200) @ torch.randn(200, 200)  # compute while it runs
    work.wait()
    report["async_max"] = y[0].item()
    b = torch.full((7,), float(rank))
    dist.broadcast(b, src=world - 1)
    report["broadcast"] = b.tolist()
    outs = [torch.empty(3) for _ in range(world)]
    dist.all_gather(outs, torch.full((3,), float(rank)))
    report["all_gather"] = [o[0].item() for o in outs]
    flat = torch.empty(3 * world)
    dist.all_gather_into_tensor(flat, torch.full((3,), float(rank)))
    report["all_gather_into_tensor"] = flat.tolist()
    rs = torch.empty(2)
    dist.reduce_scatter_tensor(rs, torch.arange(2 * world, dtype=torch.float32))
    report["reduce_scatter_tensor"] = dist_gather_objects(rs.tolist())
    red = torch.full((3,), float(rank + 1))
    dist.reduce(red, dst=world - 1)
    report["reduce"] = dist_gather_objects(red.tolist())
    avg = torch.full((4,), float(rank))
    dist.all_reduce(avg, op=dist.ReduceOp.AVG)
    report["avg"] = avg[0].item()
    cplx = torch.full((3,), complex(1, rank), dtype=torch.complex64)
    dist.all_reduce(cplx)  # torch hands complex tensors over as (re, im) float pairs
    report["complex"] = [cplx[0].real.item(), cplx[0].imag.item()]
    dist.barrier()

    # Errors a user can cause, with the message they get.
    errors = {}
    for name, fn in {
        "bool": lambda: dist.all_reduce(torch.ones(3, dtype=torch.bool)),
        "product": lambda: dist.all_reduce(torch.ones(3), op=dist.ReduceOp.PRODUCT),
        "uint8": lambda: dist.all_reduce(torch.ones(3, dtype=torch.uint8)),
    }.items():
        try:
            fn()
            errors[name] = None
        except (TypeError, ValueError, RuntimeError) as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
    report["errors"] = errors

    # Subgroups: hfreduce and gloo side by side.
    evens = dist.new_group(ranks=list(range(0, world, 2)), backend="hfreduce")
    if rank % 2 == 0:
        z = torch.ones(10)
        dist.all_reduce(z, group=evens)
        report["subgroup_sum"] = z[0].item()
    gloo = dist.new_group(backend="gloo")

    # torch DDP over hfreduce ends where DDP over gloo ends.
    with_hfr = train_ddp(pg)
    with_gloo = train_ddp(gloo)
    report["ddp_max_diff"] = max((a - b).abs().max().item() for a, b in zip(with_hfr, with_gloo))
    report["ddp_moved"] = max((a - b).abs().max().item() for a, b in zip(with_hfr, model().parameters()))

    # FSDP2 over a DeviceMesh of hfreduce ends where FSDP2 over gloo ends.
    from torch.distributed.device_mesh import DeviceMesh

    mesh_hfr = DeviceMesh.from_group(pg, "cpu")
    mesh_gloo = DeviceMesh.from_group(gloo, "cpu")
    f_hfr = train_fsdp(mesh_hfr)
    f_gloo = train_fsdp(mesh_gloo)
    report["fsdp_max_diff"] = max((a - b).abs().max().item() for a, b in zip(f_hfr, f_gloo))
    report["fsdp_vs_ddp_moved"] = max((a - b).abs().max().item() for a, b in zip(f_hfr, model().parameters()))

    dist.barrier()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(report, f)
    dist.destroy_process_group()


def dist_gather_objects(value):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


if __name__ == "__main__":
    main()
