"""Rank-side functions for the haiscale FSDP tests (run inside LocalCluster ranks)."""

from __future__ import annotations

import functools
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

from fireflyer.train.model import GPT, ModelShape, synthetic_batch

CFG = ModelShape(vocab_size=64, context=8, layers=3, d_model=64, heads=2)  # blocks of 200 KB: above hfreduce's inline size, so reduce-scatters run on the engine thread
STEPS = 3
PER_RANK = 2
LR = 1e-2
_GLOO: dict[str, dist.ProcessGroup] = {}


def no_process_group_error(ctx) -> str:
    """fully_shard before init_process_group: the error a user sees."""
    from fireflyer.haiscale import fully_shard

    try:
        fully_shard(GPT.seeded(CFG))
    except ValueError as exc:
        return str(exc)
    return "no error"


def init(ctx) -> str:
    import fireflyer.hfreduce  # noqa: F401 - registers the backend

    dist.init_process_group("hfreduce", store=dist.PrefixStore("pg", ctx.store), rank=ctx.rank,
                            world_size=ctx.world_size, timeout=timedelta(seconds=60))
    _GLOO["gloo"] = dist.new_group(backend="gloo", timeout=timedelta(seconds=60))
    return dist.get_backend()


def _schedule(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))


def _adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)


def _train(model: nn.Module, opt: torch.optim.Optimizer | None, sched, rank: int, world: int) -> list[float]:
    """STEPS steps on this rank's batches; opt None means the optimizer runs inside backward."""
    losses = []
    for step in range(STEPS):
        x, y = synthetic_batch(CFG, rank=rank, step=step, size=PER_RANK)
        if opt is not None:
            opt.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        if opt is not None:
            opt.step()
        sched.step()
        losses.append(loss.item())
    return losses


def _full(model: nn.Module) -> list[torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return [(p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for p in model.parameters()]


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


def train_all(ctx) -> dict:
    """Single process, torch DDP over gloo, haiscale FSDP on hfreduce, and FSDP with the optimizer in backward."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from fireflyer.haiscale import fully_shard
    from fireflyer.train.model import Block
    from fireflyer.haiscale.fsdp import FullyShardedDataParallel, sharding_info

    rank, world = ctx.rank, ctx.world_size
    out: dict = {}

    # Single process: one model sees every rank's batch (equal sizes: the mean of the means).
    ref = GPT.seeded(CFG)
    opt = _adamw(ref.parameters())
    sched = _schedule(opt)
    for step in range(STEPS):
        xs, ys = zip(*(synthetic_batch(CFG, rank=r, step=step, size=PER_RANK) for r in range(world)), strict=True)
        opt.zero_grad()
        ref(torch.cat(xs), torch.cat(ys)).backward()
        opt.step()
        sched.step()
    single = _full(ref)

    ddp = DDP(GPT.seeded(CFG), process_group=_GLOO["gloo"])
    opt = _adamw(ddp.parameters())
    _train(ddp, opt, _schedule(opt), rank, world)
    ddp_params = _full(ddp.module)

    fsdp = fully_shard(GPT.seeded(CFG), shard_types=(Block,))
    opt = _adamw(fsdp.parameters())
    out["fsdp_losses"] = _train(fsdp, opt, _schedule(opt), rank, world)
    fsdp_params = _full(fsdp)
    out["fsdp_stats"] = dict(sharding_info(fsdp).backlog.stats)

    wrapped = FullyShardedDataParallel(GPT.seeded(CFG), optimizer=_adamw)  # default units: the ModuleList's blocks
    out["wrapped_units"] = len(wrapped.units)
    in_bwd = wrapped.optimizer
    out["in_backward_lr_before"] = in_bwd.param_groups[0]["lr"]
    sched = _schedule(in_bwd)
    _train(wrapped, None, sched, rank, world)
    out["in_backward_lr_after"] = in_bwd.param_groups[0]["lr"]
    out["in_backward_grads_left"] = sum(p.grad is not None for p in wrapped.parameters())
    out["in_backward_step_calls"] = sharding_info(wrapped).stepper.calls
    out["in_backward_stats"] = dict(sharding_info(wrapped).backlog.stats)
    full = wrapped.full_state_dict()
    in_bwd_params = [full[name] for name, _ in fsdp.named_parameters()]

    initial = _full(GPT.seeded(CFG))
    out["moved"] = _max_diff(fsdp_params, initial)
    out["fsdp_vs_single"] = _max_diff(fsdp_params, single)
    out["fsdp_vs_ddp"] = _max_diff(fsdp_params, ddp_params)
    out["ddp_vs_single"] = _max_diff(ddp_params, single)
    out["in_backward_vs_fsdp"] = _max_diff(in_bwd_params, fsdp_params)
    return out


def memory(ctx) -> dict:
    """Per-rank tensor bytes of FSDP against torch DDP after one AdamW step each."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from fireflyer.haiscale import fully_shard
    from fireflyer.haiscale.fsdp_memory import tensor_bytes

    cfg = ModelShape(vocab_size=256, context=8, layers=2, d_model=64, heads=1)
    result = {}
    for name, model in (("ddp", DDP(GPT.seeded(cfg), process_group=_GLOO["gloo"], gradient_as_bucket_view=True)),
                        ("fsdp", fully_shard(GPT.seeded(cfg)))):
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        x, y = synthetic_batch(cfg, rank=ctx.rank, step=0, size=PER_RANK)
        model(x, y).backward()
        opt.step()
        tb = tensor_bytes(model, opt)
        result[name] = {"params": tb.params, "grads": tb.grads, "optimizer": tb.optimizer}
    result["numel"] = cfg.num_params
    return result


class RecordingAllGather:
    """A unit's allgather that logs (unit, async) before running the default collective."""

    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def allocate(self, size, *, dtype, device):
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.log.append(("allgather", self.name, async_op))
        return dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


def prefetch_order(ctx) -> list:
    """The allgathers and block forwards of one step, in order: (forward part, backward part)."""
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

    from fireflyer.haiscale import fully_shard

    class Recorder(RecordingAllGather, AllGather):
        pass

    model = fully_shard(GPT.seeded(CFG))
    log: list = []
    model.set_custom_all_gather(Recorder(log, "root"))
    for i, block in enumerate(model.blocks):
        block.set_custom_all_gather(Recorder(log, f"block{i}"))
        # Registered after FSDP2's hooks, so these run once its pre-forward (and prefetch) is done.
        block.register_forward_pre_hook(functools.partial(lambda i, *_: log.append(("forward", f"block{i}")), i))
    x, y = synthetic_batch(CFG, rank=ctx.rank, step=0, size=PER_RANK)
    model(x, y).backward()
    return log[: log.index(("forward", "block2")) + 1], log[log.index(("forward", "block2")) + 1 :]


def mixed_precision(ctx) -> dict:
    """bf16 compute with fp32 reduction: haiscale on hfreduce against torch FSDP2 over gloo (SGD)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fireflyer.haiscale import fully_shard
    from fireflyer.haiscale.fsdp import sharding_info

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    ours = fully_shard(GPT.seeded(CFG), mp_policy=mp)
    theirs = GPT.seeded(CFG)
    mesh = DeviceMesh.from_group(_GLOO["gloo"], "cpu")
    for block in theirs.blocks:
        torch_fully_shard(block, mesh=mesh, mp_policy=mp)
    torch_fully_shard(theirs, mesh=mesh, mp_policy=mp)
    # bf16 reduction: FSDP2 casts the reduce-scatter output at once, so it must run synchronously
    bf16_reduce = fully_shard(GPT.seeded(CFG), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    for model in (ours, theirs, bf16_reduce):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        _train(model, opt, _schedule(opt), ctx.rank, ctx.world_size)
    return {"diff": _max_diff(_full(ours), _full(theirs)), "moved": _max_diff(_full(ours), _full(GPT.seeded(CFG))),
            "stats": dict(sharding_info(ours).backlog.stats),
            "bf16_reduce_diff": _max_diff(_full(ours), _full(bf16_reduce)),
            "bf16_reduce_stats": dict(sharding_info(bf16_reduce).backlog.stats)}
