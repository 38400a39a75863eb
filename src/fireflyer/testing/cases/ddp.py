"""Rank-side functions for the haiscale DDP tests (run inside LocalCluster ranks)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn


def ensure_pg(ctx) -> None:
    if not dist.is_initialized():
        import fireflyer.hfreduce  # noqa: F401 - registers the backend

        dist.init_process_group("hfreduce", store=dist.PrefixStore("pg", ctx.store), rank=ctx.rank, world_size=ctx.world_size)


class Net(nn.Module):
    """Registration order differs from use order (``head`` is registered first), with a tied weight."""

    def __init__(self, width: int = 48) -> None:
        super().__init__()
        self.head = nn.Linear(width, 5)
        self.embed = nn.Linear(12, width)
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(3)])
        self.side = nn.Linear(width, width)  # used only on some ranks
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor, use_side: bool = False) -> torch.Tensor:
        h = self.blocks(self.embed(x))
        if use_side:
            h = h + self.side(h)
        return self.head(self.norm(h))


def batch(rank: int, step: int, n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7919 * step + rank)
    return torch.randn(n, 12, generator=g), torch.randn(n, 5, generator=g)


def _train(model: nn.Module, rank: int, steps: int, *, use_side=lambda rank, step: False, accumulate: int = 1, dtype=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        for micro in range(accumulate):
            x, y = batch(rank, step * accumulate + micro)
            if dtype is not None:
                x, y = x.to(dtype), y.to(dtype)
            sync = micro == accumulate - 1
            ctx = model.no_sync() if (not sync and hasattr(model, "no_sync")) else _null()
            with ctx:
                out = model(x, use_side(rank, step))
                loss = nn.functional.mse_loss(out.float(), y.float()) / accumulate
            loss.backward()
            losses.append(loss.item())
        opt.step()
    return losses


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone().float() for p in model.parameters()]


def haiscale_vs_torch(ctx, steps: int, accumulate: int) -> dict:
    """haiscale DDP on hfreduce and torch DDP on gloo, same data, same seeds; unused 'side' on odd steps of rank 0."""
    from fireflyer.haiscale import DistributedDataParallel

    ensure_pg(ctx)
    gloo = dist.new_group(backend="gloo")
    side = lambda rank, step: rank == 0 and step % 2 == 1  # noqa: E731 - rank-dependent unused parameters
    torch.manual_seed(ctx.rank)  # different init per rank: DDP must broadcast rank 0's
    ours = DistributedDataParallel(Net(), bucket_cap_mb=0.01, first_bucket_mb=0.004)
    order_before = [list(b) for b in _bucket_params(ours)]
    ours_losses = _train(ours, ctx.rank, steps, use_side=side, accumulate=accumulate)
    order_after = [list(b) for b in _bucket_params(ours)]
    torch.manual_seed(0)
    ref = Net()
    ref.load_state_dict(ours.module.state_dict())  # start from the same parameters
    # torch DDP over gloo from that same start; it needs find_unused_parameters for 'side'
    torch.manual_seed(ctx.rank)
    ref_init = Net()
    ref_init.load_state_dict(_initial_state(ctx))
    ref_ddp = nn.parallel.DistributedDataParallel(ref_init, process_group=gloo, find_unused_parameters=True)
    ref_losses = _train(ref_ddp, ctx.rank, steps, use_side=side, accumulate=accumulate)
    ours_p, ref_p = _params(ours.module), _params(ref_ddp.module)
    stats = ours.stats()
    ours.close()
    return {
        "max_diff": max((a - b).abs().max().item() for a, b in zip(ours_p, ref_p)),
        "loss_diff": max(abs(a - b) for a, b in zip(ours_losses, ref_losses)),
        "digest": _digest(ours_p),
        "order_changed": order_before != order_after,
        "stats": stats,
    }


def _initial_state(ctx) -> dict:
    torch.manual_seed(0)
    return Net().state_dict()


def _bucket_params(ddp) -> list[tuple[int, ...]]:
    return [b.params for b in ddp._buckets]


def _digest(params: list[torch.Tensor]) -> str:
    import hashlib

    h = hashlib.sha256()
    for p in params:
        h.update(p.numpy().tobytes())
    return h.hexdigest()


def single_process_reference(steps: int, world: int) -> list[torch.Tensor]:
    """What DDP must compute: the same model trained on the mean loss over every rank's batch."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        opt.zero_grad()
        loss = sum(nn.functional.mse_loss(model(batch(r, step)[0]), batch(r, step)[1]) for r in range(world)) / world
        loss.backward()
        opt.step()
    return _params(model)


def haiscale_plain(ctx, steps: int, group_backend: str | None = None, reduce_dtype=None, dtype=None) -> list[torch.Tensor]:
    """haiscale DDP from rank 0's seed-0 model; returns the parameters after ``steps``."""
    from fireflyer.haiscale import DistributedDataParallel

    ensure_pg(ctx)
    group = dist.new_group(backend=group_backend) if group_backend else None
    torch.manual_seed(0 if ctx.rank == 0 else 100 + ctx.rank)
    net = Net()
    if dtype is not None:
        net = net.to(dtype)
    ddp = DistributedDataParallel(net, process_group=group, reduce_dtype=reduce_dtype)
    _train(ddp, ctx.rank, steps, dtype=dtype)
    ddp.close()
    return _params(ddp.module)


def mismatched(ctx) -> str:
    from fireflyer.haiscale import DistributedDataParallel

    ensure_pg(ctx)
    net = Net(width=48 if ctx.rank != 2 else 40)
    try:
        DistributedDataParallel(net)
    except ValueError as exc:
        return str(exc)
    return "no error"


def bad_input_and_close(ctx) -> dict:
    """Config errors name the field; a closed wrapper refuses to run and leaves the module usable."""
    from fireflyer.haiscale import DistributedDataParallel

    ensure_pg(ctx)
    out = {}
    for name, kw in (("cap", {"bucket_cap_mb": 0}), ("dtype", {"reduce_dtype": torch.int32}), ("timeout", {"timeout": -1})):
        try:
            DistributedDataParallel(Net(), **kw)
            out[name] = "no error"
        except ValueError as exc:
            out[name] = str(exc)
    try:
        DistributedDataParallel(nn.ReLU())
        out["empty"] = "no error"
    except ValueError as exc:
        out["empty"] = str(exc)
    torch.manual_seed(0)
    ddp = DistributedDataParallel(Net())
    _train(ddp, ctx.rank, 1)
    ddp.close()
    ddp.close()
    try:
        ddp(batch(ctx.rank, 0)[0])
        out["closed"] = "no error"
    except RuntimeError as exc:
        out["closed"] = str(exc)
    x, y = batch(ctx.rank, 1)
    nn.functional.mse_loss(ddp.module(x), y).backward()  # plain local backward, no hooks left
    out["local_grad_differs"] = ctx.rank  # gradients are now per rank; nothing hung
    return out


def cuda_matches_cpu(ctx, steps: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The same training with the model on CUDA (grads reduced by the CPU engine via D2H/H2D) and on CPU."""
    from fireflyer.haiscale import DistributedDataParallel

    ensure_pg(ctx)
    results = []
    for device in ("cuda", "cpu"):
        torch.manual_seed(0)
        net = Net().to(device)
        ddp = DistributedDataParallel(net)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        for step in range(steps):
            x, y = batch(ctx.rank, step)
            opt.zero_grad()
            nn.functional.mse_loss(ddp(x.to(device)), y.to(device)).backward()
            opt.step()
        ddp.close()
        results.append([p.detach().cpu().float() for p in ddp.module.parameters()])
    return results[0], results[1]


def bitwise_average(ctx) -> bool:
    """One backward: every gradient equals ((g0 + g1) + (g2 + g3)) / 4 bit for bit.

    That is the engine's order on 2 nodes x 2 ranks: local ranks summed in order on each
    node, the two node partials added (IEEE addition is commutative, so which node is the
    tree's root does not matter), divided once.
    """
    from fireflyer.haiscale import DistributedDataParallel

    ensure_pg(ctx)
    assert ctx.world_size == 4
    torch.manual_seed(0)
    ddp = DistributedDataParallel(Net())
    x, y = batch(ctx.rank, 0)
    nn.functional.mse_loss(ddp(x), y).backward()
    got = [None if p.grad is None else p.grad.clone() for p in ddp.module.parameters()]  # 'side' is unused: None
    ddp.close()
    per_rank = []
    for r in range(4):
        torch.manual_seed(0)
        local = Net()
        xr, yr = batch(r, 0)
        nn.functional.mse_loss(local(xr), yr).backward()
        per_rank.append([p.grad for p in local.parameters()])
    want = [None if g0 is None else ((g0 + g1) + (g2 + g3)) / 4 for g0, g1, g2, g3 in zip(*per_rank)]
    assert sum(w is not None for w in want) > 1
    return all(a is None and b is None or a is not None and b is not None and torch.equal(a, b)
               for a, b in zip(got, want))


class Mixed(nn.Module):
    """BatchNorm buffers (float and int64), a frozen layer, a bf16 layer and a module used twice."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(12, 24)
        self.bn = nn.BatchNorm1d(24)
        self.frozen = nn.Linear(24, 24)
        self.frozen.requires_grad_(False)
        self.twice = nn.Linear(24, 24)
        self.lowp = nn.Linear(24, 24).to(torch.bfloat16)
        self.out = nn.Linear(24, 5)

    def forward(self, x: torch.Tensor, use_side: bool = False) -> torch.Tensor:
        h = torch.tanh(self.bn(self.inp(x)))
        h = self.twice(torch.tanh(self.twice(self.frozen(h))))
        h = h + self.lowp(h.bfloat16()).float()
        return self.out(h)


def mixed_model_vs_torch(ctx, steps: int) -> dict:
    from fireflyer.haiscale import DistributedDataParallel

    ensure_pg(ctx)
    gloo = dist.new_group(backend="gloo")
    results = {}
    for name in ("ours", "torch"):
        torch.manual_seed(ctx.rank)  # different on every rank: wrapping must broadcast rank 0's
        net = Mixed()
        if name == "ours":
            model = DistributedDataParallel(net)
        else:
            torch.manual_seed(0)
            ref = Mixed()
            net.load_state_dict(results["ours_init"])
            model = nn.parallel.DistributedDataParallel(net, process_group=gloo)
            del ref
        if name == "ours":
            results["ours_init"] = {k: v.clone() for k, v in net.state_dict().items()}
        opt = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.05)
        for step in range(steps):
            x, y = batch(ctx.rank, step)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        results[name] = {k: v.detach().clone().float() for k, v in net.state_dict().items()}
        if name == "ours":
            model.close()
    diffs = {k: (results["ours"][k] - results["torch"][k]).abs().max().item() for k in results["ours"]}
    return {"max_diff": max(diffs.values()), "worst": max(diffs, key=diffs.get),
            "bn_batches": results["ours"]["bn.num_batches_tracked"].item()}
