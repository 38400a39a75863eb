"""One rank of ``fireflyer bench moe``: ``python -m fireflyer.bench.moe_worker SPEC.json``.

Started under torchrun by :mod:`fireflyer.bench.moe` (through :func:`fireflyer.launch.run_local`).
It joins hfreduce as the default group and gloo as a second group (barriers and the result
gather), builds the expert-parallel groups from the nodes it finds, and trains the same
:class:`~fireflyer.train.moe_model.MoEGPT` two ways, in alternating rounds so drift in the
machine's load hits both alike:

* ``ep``: the routed experts sharded over the ranks of a node (EP = ranks per node), data
  parallel across nodes; haiscale DDP averages the dense gradients over the whole world and
  the expert gradients over the expert group (the ranks holding the same experts, one per node);
* ``replicated``: every rank holds every expert (``ep_group=None``), plain DDP over the world.

A step is the whole training step: forward, backward (with DDP's reduction), AdamW, the
balancing-bias update. Each step records its phases, the MoE layers' all-to-all seconds, bytes
and calls, DDP's exposed wait and the load imbalance; the rank writes ``rank{RANK}.json`` into
the spec's ``out_dir`` for the parent to collect.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from fireflyer.bench.skeleton import rank_groups, worker_main
from fireflyer.errors import UserError
from fireflyer.haiscale.ddp import DistributedDataParallel
from fireflyer.hfreduce.config import node_key
from fireflyer.train.model import synthetic_batch
from fireflyer.train.moe_model import MoEGPT, MoEShape
from fireflyer.train.records import load_corpus, tokenize

CONFIGS = ("ep", "replicated")
"""ep: experts sharded over each node's ranks x data parallel across nodes; replicated: every expert on every
rank, data parallel over the world."""
SEED = 0
PHASES = ("forward", "backward", "optimizer", "bias")


@dataclass
class Groups:
    """This rank's expert-parallel groups (hfreduce)."""

    ep: dist.ProcessGroup
    """The ranks of this rank's node: they split the routed experts between them."""
    expert: dist.ProcessGroup
    """The ranks at this rank's position in every node: they hold the same experts (its data-parallel group)."""
    ep_size: int


def expert_parallel_groups(local_size: int, timeout: timedelta) -> Groups:
    """EP inside each node (``local_size`` ranks), DP across nodes: :func:`fireflyer.haiscale.layout`'s
    ``ep_group`` and ``expert_group``."""
    from fireflyer.haiscale.layout_mesh import layout

    lay = layout(ep=local_size, timeout=timeout.total_seconds())
    return Groups(ep=lay.ep_group, expert=lay.expert_group, ep_size=local_size)


@dataclass
class Setup:
    """One configuration's model, its DDP wrapper and its optimizer."""

    model: MoEGPT
    ddp: DistributedDataParallel
    optimizer: torch.optim.Optimizer


def build(name: str, shape: MoEShape, groups: Groups, lr: float) -> Setup:
    """A fresh model for configuration ``name``, seeded alike, so both train the same network.

    Buffers are not broadcast each forward: the only one, the balancing bias, is kept identical on every
    rank by :meth:`MoEGPT.update_bias` over the whole world.
    """
    if name == "ep":
        model = MoEGPT(shape, ep_group=groups.ep, seed=SEED)
        ddp = DistributedDataParallel(model, expert_process_group=groups.expert, broadcast_buffers=False)
    elif name == "replicated":
        model = MoEGPT(shape, seed=SEED)
        ddp = DistributedDataParallel(model, broadcast_buffers=False)
    else:
        raise UserError(f"unknown configuration {name!r}; choose from {', '.join(CONFIGS)}")
    return Setup(model=model, ddp=ddp, optimizer=torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1))


Batches = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]


def batches(data: str, shape: MoEShape, size: int) -> Batches:
    """``(rank, step) -> (inputs, targets)``, seeded by (rank, step) so both configurations see the same tokens.

    ``"corpus"``: windows of the shipped text at seeded random offsets, one token per character. Real
    text gives the router something to tell tokens apart by; uniform ``"random"`` tokens carry nothing to
    learn, so training drives every hidden state to the same point and routes every token to the same
    top-k experts (the worst case for EP).
    """
    if data == "random":
        return lambda rank, step: synthetic_batch(shape.dense_shape(), rank=rank, step=step, size=size)
    if data != "corpus":
        raise UserError(f"unknown data {data!r}; choose corpus or random")
    vocab, ids = tokenize(load_corpus())
    if len(vocab) > shape.vocab_size:
        raise UserError(f"the corpus has {len(vocab)} characters but the model's vocabulary is {shape.vocab_size}")
    tokens = torch.from_numpy(ids.astype(np.int64))
    span = torch.arange(shape.context + 1)

    def window(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(7919 * step + rank)
        starts = torch.randint(0, len(tokens) - shape.context - 1, (size, 1), generator=g)
        w = tokens[starts + span]
        return w[:, :-1], w[:, 1:]

    return window


def train_step(s: Setup, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    """One full step; its phases' seconds, the all-to-all totals over the MoE layers, DDP's wait."""
    wait0 = s.ddp.stats()["wait_seconds"]
    t0 = time.perf_counter()
    s.optimizer.zero_grad(set_to_none=True)
    loss = s.ddp(x, y)
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    s.optimizer.step()
    t3 = time.perf_counter()
    stats = s.model.expert_stats()  # read before update_bias: the stats of this step's forward and backward
    s.model.update_bias(dist.group.WORLD)
    t4 = time.perf_counter()
    a2a = [st.all_to_all for st in stats if st is not None]
    return {"step": t4 - t0, "forward": t1 - t0, "backward": t2 - t1, "optimizer": t3 - t2, "bias": t4 - t3,
            "a2a_s": sum(a.seconds for a in a2a), "a2a_calls": sum(a.calls for a in a2a),
            "a2a_bytes": sum(a.bytes_sent + a.bytes_received for a in a2a),
            "ddp_wait_s": s.ddp.stats()["wait_seconds"] - wait0,
            "imbalance": max((st.imbalance for st in stats if st is not None), default=1.0),
            "dropped": sum(st.dropped for st in stats if st is not None), "loss": loss.item()}


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """This rank's results: each configuration's sizes and every round's steps."""
    with rank_groups(spec["timeout_s"]) as gloo:
        rank = dist.get_rank()
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        groups = expert_parallel_groups(int(os.environ["LOCAL_WORLD_SIZE"]),
                                        timedelta(seconds=spec["timeout_s"]))
        shape = MoEShape(**spec["shape"])
        batch_of = batches(spec["data"], shape, spec["batch"])
        setups = {name: build(name, shape, groups, spec["lr"]) for name in spec["configs"]}
        result: dict[str, Any] = {"rank": rank, "node": node_key(), "threads": torch.get_num_threads(),
                                  "ep_size": groups.ep_size, "configs": {}}
        for name, s in setups.items():
            moe = s.model.moe_layers()
            result["configs"][name] = {
                "expert_params": sum(p.numel() for p in s.model.expert_parameters()),
                "params": s.model.num_parameters(),
                "ep_size": moe[0].ep_size if moe else 1,
                "experts_held": [list(m.global_experts) for m in moe],
                "rounds": [],
            }
        step = 0
        for name, s in setups.items():  # warm-up: allocations, thread pools, bucket rebuild
            for _ in range(spec["warmup"]):
                train_step(s, *batch_of(rank, step))
                step += 1
        for _ in range(spec["rounds"]):
            for name, s in setups.items():
                dist.barrier(group=gloo)
                steps = []
                for i in range(spec["steps"]):  # the same batches for both configurations
                    steps.append(train_step(s, *batch_of(rank, step + i)))
                result["configs"][name]["rounds"].append(steps)
            step += spec["steps"]
        for s in setups.values():
            s.ddp.close()
        return result


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:], "python -m fireflyer.bench.moe_worker", run))
