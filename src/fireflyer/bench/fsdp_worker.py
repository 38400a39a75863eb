"""One rank of ``fireflyer bench fsdp``: ``python -m fireflyer.bench.fsdp_worker SPEC.json``.

Started under torchrun by :mod:`fireflyer.bench.fsdp` (through
:func:`fireflyer.launch.run_local`). It joins hfreduce as the default group and gloo
as a second group, then trains the same GPT with each variant in turn, on the same
batches: a fresh model per variant, warm-up steps, timed steps (after one unreported
step that absorbs one-time costs). For each variant it
records the step times, the losses, the tensor bytes it holds by category and the
growth of its resident set, and at the end writes ``rank{RANK}.json`` into the
spec's ``out_dir`` for the parent to collect.
"""

from __future__ import annotations

import functools
import gc
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from fireflyer.bench.skeleton import rank_groups, worker_main
from fireflyer.hfreduce.config import node_key
from fireflyer.train.model import GPT, Block, ModelShape, synthetic_batch
from fireflyer.errors import UserError

VARIANTS = ("haiscale", "haiscale-optbwd", "fsdp2-gloo", "fsdp2-hfreduce", "ddp")
"""haiscale: fully_shard on hfreduce (prefetch, overlapped reduce-scatter) with a normal AdamW step;
haiscale-optbwd: the same with the optimizer step inside backward; fsdp2-gloo / fsdp2-hfreduce: torch
FSDP2 as documented (fully_shard per block, then the root) on a gloo / hfreduce mesh; ddp: torch DDP on
hfreduce (the memory baseline)."""


@dataclass
class Variant:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    in_backward: bool
    """The optimizer steps inside backward: the loop calls neither step() nor zero_grad()."""
    stats: Callable[[], dict[str, int]] = dict


def _torch_fsdp2(model: nn.Module, group: dist.ProcessGroup) -> nn.Module:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(group, "cpu")
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def make_variant(name: str, cfg: ModelShape, gloo: dist.ProcessGroup, lr: float) -> Variant:
    """A fresh, identically initialised model trained the way ``name`` says."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from fireflyer.haiscale.fsdp import fully_shard, sharding_info

    adamw = functools.partial(torch.optim.AdamW, lr=lr, weight_decay=0.1)
    model = GPT.seeded(cfg)
    if name == "haiscale":
        model = fully_shard(model, shard_types=(Block,))
    elif name == "haiscale-optbwd":
        model = fully_shard(model, shard_types=(Block,), optimizer=adamw)
        info = sharding_info(model)
        assert info.stepper is not None
        return Variant(model=model, optimizer=info.stepper.optimizer, in_backward=True,
                       stats=lambda: {**info.backlog.stats, "optimizer_steps": info.stepper.calls})
    elif name == "fsdp2-gloo":
        model = _torch_fsdp2(model, gloo)
    elif name == "fsdp2-hfreduce":
        model = _torch_fsdp2(model, dist.group.WORLD)
    elif name == "ddp":
        model = DDP(model, process_group=dist.group.WORLD, gradient_as_bucket_view=True)
    else:
        raise UserError(f"unknown variant {name!r}; choose from {', '.join(VARIANTS)}")
    variant = Variant(model=model, optimizer=adamw(model.parameters()), in_backward=False)
    if name == "haiscale":
        variant.stats = lambda: dict(sharding_info(model).backlog.stats)
    return variant


def run_variant(name: str, spec: dict[str, Any], gloo: dist.ProcessGroup) -> dict[str, Any]:
    from fireflyer.haiscale.fsdp_memory import PeakRSS, tensor_bytes

    cfg = ModelShape(**spec["model"])
    rank = dist.get_rank()
    rss = PeakRSS()
    v = make_variant(name, cfg, gloo, spec["lr"])
    rss.restart_peak()  # the full model each rank builds before sharding is not training memory
    times, losses = [], []
    for step in range(spec["warmup"] + spec["steps"]):
        x, y = synthetic_batch(cfg, rank=rank, step=step, size=spec["batch"])
        if step == spec["warmup"]:
            dist.barrier(group=gloo)
        t0 = time.perf_counter()
        if not v.in_backward:
            v.optimizer.zero_grad(set_to_none=True)
        loss = v.model(x, y)
        loss.backward()
        if not v.in_backward:
            v.optimizer.step()
        elapsed = time.perf_counter() - t0
        if step >= spec["warmup"]:
            times.append(elapsed)
        losses.append(loss.item())
    held = tensor_bytes(v.model, v.optimizer)  # after a step: gradients still held, except in backward
    out = {"step_s": times, "losses": losses, "params_bytes": held.params, "grads_bytes": held.grads,
           "optimizer_bytes": held.optimizer, "rss_growth_bytes": rss.growth_bytes(), "rss_peak_reset": rss.reset,
           "stats": v.stats()}
    del v
    gc.collect()
    dist.barrier(group=gloo)
    return out


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """This rank's results: each variant's step times, memory and losses."""
    with rank_groups(spec["timeout_s"]) as gloo:
        result: dict[str, Any] = {"rank": dist.get_rank(), "node": node_key(),
                                  "threads": torch.get_num_threads(), "variants": {}}
        # One unreported step first: one-time costs (lazy imports, sharding-propagation caches,
        # communication buffers) would otherwise land in the first variant's time and memory.
        run_variant(spec["variants"][0], {**spec, "warmup": 0, "steps": 1}, gloo)
        for name in spec["variants"]:
            result["variants"][name] = run_variant(name, spec, gloo)
        return result


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:], "python -m fireflyer.bench.fsdp_worker", run))
