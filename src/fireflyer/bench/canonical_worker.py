"""One rank of ``fireflyer bench allreduce --order canonical``: ``python -m fireflyer.bench.canonical_worker SPEC.json``.

Started under torchrun by :mod:`fireflyer.bench.canonical` (through :func:`fireflyer.launch.run_local`),
with ``FIREFLYER_HFREDUCE_ORDER=fast``. It joins hfreduce as the default group (the fast order), a
second hfreduce group over the same ranks made with ``HFReduceConfig(order="canonical")``, and gloo
for barriers. It measures the host's copy bandwidth first (for the roofline; the allreduce bench's
:func:`~fireflyer.bench.allreduce_worker.measure_copy`). Then, in rounds whose order alternates, so
drift in the machine's load hits both alike:

* **allreduce**: ``dist.all_reduce`` (SUM) of each size and dtype on each group. Before every op the
  buffer is refilled and the ranks meet at a gloo barrier, both untimed; an op's time is its own.
  The first canonical op of every round is checked bit for bit against one process summing every
  rank's input in the canonical tree (each rank rebuilds every input from its seed):
  ``wrong_bytes``, which must be 0. The first fast op is compared with the same bits only to
  show that the order matters (``fast_differs_bytes``: not an error; 0 where the layout's order
  happens to be the tree, as on two ranks, where both add a + b).
* **ddp**: one training step of haiscale DDP on the main job's GPT, ``m`` micro-batches per rank,
  both through ``ddp.accumulate(micro_batches, loss_fn)``: ``fast``, the usual way (``no_sync`` for
  all but the last micro-batch, each loss divided by ``m``, the last backward's buckets reduced as
  backward runs), against ``canonical``, ``DistributedDataParallel(order="canonical")`` on the
  canonical group (each micro-batch's gradient alone, summed pairwise). Both return the global
  mean loss; both models start from the same weights and see the same micro-batches; AdamW's
  step is inside the time.

The rank writes ``rank{RANK}.json`` into the spec's ``out_dir`` for the parent to collect.
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from fireflyer.bench.allreduce_worker import measure_copy
from fireflyer.bench.skeleton import rank_groups, worker_main
from fireflyer.haiscale.ddp import DistributedDataParallel
from fireflyer.hfreduce import HFReduceConfig
from fireflyer.hfreduce.plans.canonical import canonical_sum
from fireflyer.train.model import GPT, ModelShape, lm_loss, synthetic_batch

ORDERS = ("fast", "canonical")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def term(rank: int, numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rank ``rank``'s input: values over many magnitudes, so an order other than the canonical one
    shows in the bits (the check would catch it)."""
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    x = torch.randn(numel, generator=g)
    return x.mul_(torch.pow(10.0, torch.randint(-3, 4, (numel,), generator=g).float())).to(dtype)


def differing_bytes(got: torch.Tensor, want: torch.Tensor) -> int:
    """How many bytes of ``got`` differ from ``want`` (same shape and dtype): 0 when bitwise equal."""
    return int((got.view(torch.uint8) != want.view(torch.uint8)).sum())


def allreduce_part(spec: dict[str, Any], rank: int, world: int, groups: dict[str, Any],
                   barrier: Callable[[], Any]) -> list[dict[str, Any]]:
    """Per dtype and size: every timed op's seconds per order, and the checks of the first op of each round."""
    rows = []
    for d_index, dtype_name in enumerate(spec["dtypes"]):
        dtype = DTYPES[dtype_name]
        for s_index, nbytes in enumerate(spec["sizes"]):
            numel = nbytes // dtype.itemsize
            seed = 101 * d_index + s_index
            source = term(rank, numel, dtype, seed)
            want = canonical_sum([term(r, numel, dtype, seed) for r in range(world)]) if world > 1 else source
            buf = torch.empty_like(source)
            times: dict[str, list[float]] = {o: [] for o in ORDERS}
            differs: dict[str, int] = {o: 0 for o in ORDERS}
            for k in range(spec["rounds"]):
                for order in (ORDERS if k % 2 == 0 else ORDERS[::-1]):
                    group = groups[order]
                    for i in range(spec["warmup"] + spec["iters"]):
                        buf.copy_(source)
                        barrier()
                        t0 = time.perf_counter()
                        dist.all_reduce(buf, group=group)
                        t1 = time.perf_counter()
                        if i == 0:
                            differs[order] += differing_bytes(buf, want)
                        if i >= spec["warmup"]:
                            times[order].append(t1 - t0)
            rows.append({"dtype": dtype_name, "bytes": nbytes, "times": times, "wrong_bytes": differs["canonical"],
                         "fast_differs_bytes": differs["fast"], "checked": spec["rounds"]})
            del source, want, buf
    return rows


def ddp_part(spec: dict[str, Any], rank: int, groups: dict[str, Any], barrier: Callable[[], Any]) -> dict[str, Any]:
    """Seconds of each timed DDP step per order (forward, backward, reduction, AdamW), and the model's size."""
    d = spec["ddp"]
    shape = ModelShape(**d["shape"])
    m, size = d["micro_batches"], d["micro_batch_size"]
    setups = {}
    for order in ORDERS:
        torch.manual_seed(0)
        model = GPT(shape)
        ddp = DistributedDataParallel(model, process_group=groups[order],
                                      **({"order": "canonical"} if order == "canonical" else {}))
        setups[order] = (ddp, torch.optim.AdamW(model.parameters(), lr=1e-3))

    def step(order: str, n: int) -> float:
        ddp, opt = setups[order]
        micro = [synthetic_batch(shape, rank=rank * m + j, step=n, size=size) for j in range(m)]
        barrier()
        t0 = time.perf_counter()
        ddp.accumulate(micro, lm_loss)  # fast: no_sync for m-1 micro-batches; canonical: the pairwise tree
        opt.step()
        return time.perf_counter() - t0

    times: dict[str, list[float]] = {o: [] for o in ORDERS}
    n = 0
    for k in range(spec["rounds"]):
        for order in (ORDERS if k % 2 == 0 else ORDERS[::-1]):
            for i in range(d["warmup"] + d["steps"]):
                dt = step(order, n + i)
                if i >= d["warmup"]:
                    times[order].append(dt)
        n += d["warmup"] + d["steps"]
    params = sum(p.numel() for p in setups["fast"][0].module.parameters())
    for ddp, _ in setups.values():
        ddp.close()
    return {"times": times, "params": params}


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """This rank's results: the copy bandwidth, and the allreduce and DDP parts the spec asks for."""
    from fireflyer.launch import this_rank

    me = this_rank()
    rank, world = me.rank, me.world_size
    torch.set_num_threads(1)
    with rank_groups(spec["timeout_s"]) as gloo:
        canonical = dist.new_group(backend="hfreduce", timeout=timedelta(seconds=spec["timeout_s"]),
                                   pg_options=HFReduceConfig.from_env(order="canonical", timeout=spec["timeout_s"]))
        groups = {"fast": dist.group.WORLD, "canonical": canonical}

        def barrier() -> None:
            dist.barrier(group=gloo)

        result: dict[str, Any] = {"rank": rank, "threads": torch.get_num_threads(), "copies": measure_copy(gloo)}
        if spec["sizes"]:
            result["allreduce"] = allreduce_part(spec, rank, world, groups, barrier)
        if spec.get("ddp"):
            result["ddp"] = ddp_part(spec, rank, groups, barrier)
        return result


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:], "python -m fireflyer.bench.canonical_worker", run))
