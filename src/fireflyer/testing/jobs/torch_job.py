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
        "uint16": lambda: dist.all_reduce(torch.ones(3, dtype=torch.uint16)),
        "band_float": lambda: dist.all_reduce(torch.ones(3), op=dist.ReduceOp.BAND),
        "avg_int": lambda: dist.all_reduce(torch.ones(3, dtype=torch.int8), op=dist.ReduceOp.AVG),
        "avg_bool": lambda: dist.all_reduce(torch.ones(3, dtype=torch.bool), op=dist.ReduceOp.AVG),
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

    # The rest of torch's contract: coalesced forms, the Work API, per-call timeouts, what is refused.
    report["contract"] = dist_gather_objects(api_contract(pg, gloo))

    # Every op on every dtype, against gloo on the same inputs.
    report["vs_gloo"] = dist_gather_objects(compare_with_gloo(pg, gloo))

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


OPS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]
GLOO_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int32, torch.int64,
               torch.uint8, torch.bool]
NOT_IN_GLOO = [torch.float8_e4m3fn, torch.float8_e5m2, torch.int16]  # gloo: "Invalid scalar type"
_EPS = {torch.float32: 2.0**-23, torch.float64: 2.0**-52, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7,
        torch.float8_e4m3fn: 2.0**-3, torch.float8_e5m2: 2.0**-2}


def _ops(dtype: torch.dtype) -> list[str]:
    if dtype.is_floating_point:
        return ["SUM", "AVG", "PRODUCT", "MIN", "MAX"]
    return ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]


def _input(dtype: torch.dtype, op: str, rank: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 * rank + 31 * OPS.index(op) + n)
    if dtype == torch.bool:
        return torch.rand(n, generator=g) < 0.7
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)  # the whole range: sums and products wrap
        return torch.randint(info.min, info.max, (n,), generator=g, dtype=dtype)
    if op == "PRODUCT":
        mag = 2.0 ** (torch.rand(n, generator=g, dtype=torch.float64) * 2 - 1)
        return (mag * (torch.randint(0, 2, (n,), generator=g) * 2 - 1)).to(dtype)
    return (torch.randn(n, generator=g, dtype=torch.float64) * 3).to(dtype)


def _reference(dtype: torch.dtype, op: str, world: int, n: int) -> torch.Tensor:
    """float64 result from every rank's input, which each rank can make for itself."""
    stack = torch.stack([_input(dtype, op, r, n).double() for r in range(world)])
    return {"SUM": lambda: stack.sum(0), "AVG": lambda: stack.mean(0), "PRODUCT": lambda: stack.prod(0),
            "MIN": lambda: stack.min(0).values, "MAX": lambda: stack.max(0).values}[op]()


def _exact(dtype: torch.dtype, op: str, world: int, n: int) -> torch.Tensor:
    """Integers: numpy in the dtype itself, wrapping like C (and torch, and gloo)."""
    import numpy as np

    fn = {"SUM": np.add, "PRODUCT": np.multiply, "MIN": np.minimum, "MAX": np.maximum,
          "BAND": np.bitwise_and, "BOR": np.bitwise_or, "BXOR": np.bitwise_xor}[op]
    acc = _input(dtype, op, 0, n).numpy().copy()
    with np.errstate(over="ignore"):
        for r in range(1, world):
            acc = fn(acc, _input(dtype, op, r, n).numpy())
    return torch.from_numpy(acc)


def _float_error(got: torch.Tensor, want: torch.Tensor, op: str) -> float:
    diff = (got.double() - want).abs()
    return (diff / want.abs().clamp(min=1.0) if op == "PRODUCT" else diff).max().item()


def compare_with_gloo(pg, gloo, n: int = 20_011) -> dict:
    """Each op on each dtype: hfreduce against gloo (exact for integers, bool, MIN and MAX; floats against
    float64 within a rounding of the result) and against the float64 reference where gloo refuses the dtype.

    Returns {"checked": count, "failures": [...]} for this rank.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    failures, checked = [], 0
    for dtype in GLOO_DTYPES + NOT_IN_GLOO:
        for op in _ops(dtype):
            name = f"{str(dtype).replace('torch.', '')}-{op}"
            ours = _input(dtype, op, rank, n)
            dist.all_reduce(ours, op=getattr(dist.ReduceOp, op), group=pg)
            checked += 1
            theirs = None
            if dtype in GLOO_DTYPES:
                theirs = _input(dtype, op, rank, n)
                dist.all_reduce(theirs, op=getattr(dist.ReduceOp, op), group=gloo)
            if dtype == torch.bool:
                if ours.view(torch.uint8).max().item() > 1:
                    failures.append(f"{name}: a bool that is not a 0/1 byte")
                # gloo adds bools as bytes (a SUM can be 2, 3, ...); as a flag that is "any"
                if not torch.equal(ours, theirs.view(torch.uint8) != 0):
                    failures.append(f"{name}: differs from gloo")
            elif not dtype.is_floating_point:
                if theirs is not None and not torch.equal(ours, theirs):
                    failures.append(f"{name}: differs from gloo in {(ours != theirs).sum().item()} elements")
                if not torch.equal(ours, _exact(dtype, op, world, n)):
                    failures.append(f"{name}: differs from numpy's wrapping arithmetic")
            elif op in ("MIN", "MAX"):
                want = _reference(dtype, op, world, n).to(dtype)
                if not torch.equal(ours, want) or (theirs is not None and not torch.equal(ours, theirs)):
                    failures.append(f"{name}: differs from the exact answer or from gloo")
            else:
                want = _reference(dtype, op, world, n)
                scale = 1.0 if op == "PRODUCT" else 12.0 * world
                tol = scale * (_EPS[dtype] + world * 2.0**-23)  # one rounding of the result, fp32 accumulation
                err = _float_error(ours, want, op)
                if err > tol:
                    failures.append(f"{name}: error {err:.3g} > {tol:.3g} against float64")
                # gloo rounds in the dtype at every step, so it may be off by up to world roundings
                if theirs is not None and _float_error(ours, theirs.double(), op) > world * tol:
                    failures.append(f"{name}: {_float_error(ours, theirs.double(), op):.3g} from gloo")
    return {"checked": checked, "failures": failures}


def dist_gather_objects(value):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out



def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))


def p2p_contract(pg, gloo) -> dict:
    """send/recv, isend/irecv, batch_isend_irecv, all_to_all(_single), gather, scatter: hfreduce == gloo."""
    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    out = {}
    got = {}
    for name, g in (("hfreduce", pg), ("gloo", gloo)):
        r: dict = {}
        x = torch.arange(5, dtype=torch.float64) + 10 * rank
        y = torch.empty(5, dtype=torch.float64)
        if rank % 2 == 0:
            dist.send(x, dst=right, group=g)
            dist.recv(y, src=left, group=g)
        else:
            dist.recv(y, src=left, group=g)
            dist.send(x, dst=right, group=g)
        r["send_recv"] = y.clone()
        y2 = torch.empty(5, dtype=torch.float64)
        for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, right, g), dist.P2POp(dist.irecv, y2, left, g)]):
            w.wait()
        r["batch"] = y2
        rows = [(rank + p) % 3 for p in range(world)]  # uneven, zeros included
        back = [(p + rank) % 3 for p in range(world)]
        a = torch.arange(sum(rows) * 2, dtype=torch.float32).view(-1, 2) + 100 * rank
        b = torch.empty(sum(back), 2)
        dist.all_to_all_single(b, a, back, rows, group=g)
        r["a2a_single"] = b
        outs = [torch.empty(3, dtype=torch.int64) for _ in range(world)]
        dist.all_to_all(outs, [torch.full((3,), 10 * rank + p) for p in range(world)], group=g)
        r["a2a"] = torch.cat(outs)
        gl = [torch.empty(2) for _ in range(world)] if rank == world - 1 else None
        dist.gather(torch.full((2,), float(rank)), gl, dst=world - 1, group=g)
        r["gather"] = torch.cat(gl) if gl else torch.empty(0)
        sc = torch.empty(2)
        dist.scatter(sc, [torch.full((2,), float(p)) for p in range(world)] if rank == 0 else None, src=0, group=g)
        r["scatter"] = sc
        got[name] = r
    for k, v in got["hfreduce"].items():
        out[f"p2p_{k}"] = torch.equal(v, got["gloo"][k])
    return out


def api_contract(pg, gloo) -> dict:
    """This rank's view of the collective contract: {check: True} where it holds, errors where refused."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict = {}
    g = torch.Generator().manual_seed(rank)
    xs = [torch.randn(n, generator=g) for n in (5, 1000, 70_000)]

    # all_reduce_coalesced == one all_reduce per tensor (on hfreduce, and on gloo)
    mine = [x.clone() for x in xs]
    dist.all_reduce_coalesced(mine, group=pg)
    single = [x.clone() for x in xs]
    for t in single:
        dist.all_reduce(t, group=pg)
    ref = [x.clone() for x in xs]
    dist.all_reduce_coalesced(ref, group=gloo)
    out["all_reduce_coalesced"] = _same(mine, single) and all(torch.allclose(a, b, atol=1e-5) for a, b in zip(mine, ref))

    # all_gather_coalesced == one all_gather per tensor, and == gloo's
    lists = [[torch.empty_like(x) for x in xs] for _ in range(world)]  # lists[r][i]: input i of rank r
    dist.all_gather_coalesced(lists, xs, group=pg)
    singles = [[torch.empty_like(x) for _ in range(world)] for x in xs]
    for outs, x in zip(singles, xs):
        dist.all_gather(outs, x, group=pg)
    glo = [[torch.empty_like(x) for x in xs] for _ in range(world)]
    dist.all_gather_coalesced(glo, xs, group=gloo)
    by_input = [[lists[r][i] for r in range(world)] for i in range(len(xs))]
    out["all_gather_coalesced"] = _same(by_input, singles) and _same(lists, glo)

    # _coalescing_manager fast paths: all_reduce, all_gather_into_tensor, reduce_scatter_tensor; sync and async
    from torch.distributed.distributed_c10d import _coalescing_manager

    for async_ops in (False, True):
        tag = "async" if async_ops else "sync"
        batch = [x.clone() for x in xs]
        with _coalescing_manager(group=pg, async_ops=async_ops) as cm:
            for t in batch:
                dist.all_reduce(t, group=pg)
        if async_ops:
            cm.wait()
        out[f"coalescing_all_reduce_{tag}"] = _same(batch, single)
        gathered = [torch.empty(x.numel() * world) for x in xs]
        with _coalescing_manager(group=pg, async_ops=async_ops) as cm:
            for o, x in zip(gathered, xs):
                dist.all_gather_into_tensor(o, x, group=pg)
        if async_ops:
            cm.wait()
        out[f"coalescing_all_gather_{tag}"] = all(torch.equal(o, torch.cat(ls)) for o, ls in zip(gathered, singles))
        big = [torch.randn(n * world, generator=torch.Generator().manual_seed(rank + 9)) for n in (5, 1000)]
        scattered = [torch.empty(b.numel() // world) for b in big]
        with _coalescing_manager(group=pg, async_ops=async_ops) as cm:
            for o, b in zip(scattered, big):
                dist.reduce_scatter_tensor(o, b, group=pg)
        if async_ops:
            cm.wait()
        one_by_one = [torch.empty(b.numel() // world) for b in big]
        for o, b in zip(one_by_one, big):
            dist.reduce_scatter_tensor(o, b, group=pg)
        out[f"coalescing_reduce_scatter_{tag}"] = _same(scattered, one_by_one)

    # reduce_scatter with a list of inputs == reduce_scatter_tensor on their concatenation
    parts = [torch.randn(7, generator=g) for _ in range(world)]
    got = torch.empty(7)
    dist.reduce_scatter(got, parts, group=pg)
    want = torch.empty(7)
    dist.reduce_scatter_tensor(want, torch.cat(parts), group=pg)
    out["reduce_scatter_list"] = torch.equal(got, want)

    # objects ride on all_gather and broadcast
    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank}, group=pg)
    sent = [f"from {world - 1}"] if rank == world - 1 else [None]
    dist.broadcast_object_list(sent, src=world - 1, group=pg)
    out["objects"] = objs == [{"rank": r} for r in range(world)] and sent == [f"from {world - 1}"]

    # the Work API on success
    t = torch.ones(100)
    work = dist.all_reduce(t, async_op=True, group=pg)
    waited = work.wait(timeout=timedelta(seconds=30))
    fut = work.get_future().wait()
    out["work_api"] = (waited is True and work.is_completed() and work.is_success() and work.exception() is None
                       and torch.equal(work.result()[0], t) and torch.equal(fut[0], t) and t[0].item() == world)
    opts = dist.AllreduceOptions()
    opts.timeout = timedelta(seconds=30)
    t = torch.ones(10)
    pg.allreduce([t], opts).wait()
    out["per_call_timeout"] = t[0].item() == world
    pg.monitored_barrier(timedelta(seconds=30))
    out["monitored_barrier"] = True

    # point to point, all to all, gather and scatter: the same bytes as gloo's
    out.update(p2p_contract(pg, gloo))

    # what torch offers and hfreduce does not implement: NotImplementedError naming it, never a wrong answer
    x = torch.ones(4)
    refused = {
        "recv_anysource": lambda: dist.recv(x, group=pg),
        "premul_sum": lambda: dist.all_reduce(x, op=dist._make_nccl_premul_sum(2.0), group=pg),
        "monitored_barrier_via_dist": lambda: dist.monitored_barrier(group=pg),
    }
    errors = {}
    for name, fn in refused.items():
        try:
            fn()
            errors[name] = None
        except Exception as exc:  # noqa: BLE001 - what the user sees is the result
            errors[name] = f"{type(exc).__name__}: {exc}"
    out["refused"] = errors
    t = torch.ones(3)
    dist.all_reduce(t, group=pg)  # a refusal never breaks the group
    out["usable_after_refusals"] = t[0].item() == world
    return out


if __name__ == "__main__":
    main()
