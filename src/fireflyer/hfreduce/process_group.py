"""``torch.distributed`` backend ``"hfreduce"``: a Python ProcessGroup over the HFReduce engine.

After ``import fireflyer.hfreduce``, ``dist.init_process_group("hfreduce")`` under torchrun
(or any launcher that sets the usual environment) gives a default group whose
collectives run on the engine and return async Work objects, so ``async_op=True``
overlaps them with compute. DDP, FSDP2 (``fully_shard`` on a DeviceMesh) and
``dist.new_group(backend="hfreduce")`` work on it.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

from fireflyer.hfreduce import collectives
from fireflyer.hfreduce.engine import Communicator, HFReduceConfig
from fireflyer.hfreduce.reduce import Op

BACKEND = "hfreduce"

_OPS = {
    dist.ReduceOp.SUM: Op.SUM,
    dist.ReduceOp.AVG: Op.AVG,
    dist.ReduceOp.MIN: Op.MIN,
    dist.ReduceOp.MAX: Op.MAX,
    dist.ReduceOp.PRODUCT: Op.PRODUCT,
    dist.ReduceOp.BAND: Op.BAND,
    dist.ReduceOp.BOR: Op.BOR,
    dist.ReduceOp.BXOR: Op.BXOR,
}


def _op(opts) -> Op:
    red = getattr(opts, "reduceOp", dist.ReduceOp.SUM)
    for torch_op, op in _OPS.items():
        if red == torch_op:
            return op
    raise ValueError(f"hfreduce does not support reduce op {red}; supported: SUM, AVG, MIN, MAX")


def _one(tensors: list[torch.Tensor], what: str) -> torch.Tensor:
    if len(tensors) != 1:
        raise ValueError(f"hfreduce {what} takes exactly one tensor per rank, got {len(tensors)}")
    return tensors[0]


class HFReduceProcessGroup(dist.ProcessGroup):
    """A process group whose collectives run on :class:`~fireflyer.hfreduce.engine.Communicator`."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, config: HFReduceConfig | None = None) -> None:
        super().__init__(rank, world_size)
        self._name = ""
        self.comm = Communicator(store, rank, world_size, config=config)

    # -- identity ---------------------------------------------------------------------
    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND

    def name(self) -> str:
        return BACKEND

    @property
    def group_name(self) -> str:
        if not self._name:
            raise ValueError("ProcessGroup name not set")
        return self._name

    def _set_group_name(self, name: str) -> None:
        self._name = name

    # -- plumbing -----------------------------------------------------------------------
    def _work(self, plans: list, result) -> dist.Work:
        futures = [self.comm.submit(p) for p in plans]
        if len(futures) == 1:
            fut = futures[0]
        else:
            fut = torch.futures.collect_all(futures)
        out: torch.futures.Future = fut.then(lambda f: _value(f, result))
        return _create_work_from_future(out)

    # -- collectives ----------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        op = _op(opts)
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        return self._work([collectives.allreduce(_one(tensors, "allreduce"), op, self.size())], tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        op = _op(opts)
        return self._work([collectives.allreduce(t, op, self.size()) for t in tensors], tensors)

    def broadcast(self, tensors, opts=None):
        root = getattr(opts, "rootRank", 0)
        t = _one(tensors, "broadcast")
        return self._work([collectives.broadcast(t, root, self.rank(), self.size())], tensors)

    def reduce(self, tensors, opts=None):
        t = _one(tensors, "reduce")
        root = getattr(opts, "rootRank", 0)
        return self._work([collectives.reduce(t, _op(opts), root, self.rank(), self.size())], tensors)

    def allgather(self, output_tensors, input_tensors, opts=None):
        inp = _one(input_tensors, "allgather")
        outs = output_tensors[0]
        if len(output_tensors) != 1 or len(outs) != self.size():
            raise ValueError(f"hfreduce allgather needs one output list of {self.size()} tensors")
        for o in outs:
            if o.numel() != inp.numel() or o.dtype != inp.dtype:
                raise ValueError("hfreduce allgather needs every output tensor to match the input's size and dtype")
        flat = torch.empty(inp.numel() * self.size(), dtype=inp.dtype, device=inp.device)
        plan = collectives.allgather(flat, inp, self.rank(), self.size())

        def scatter_back() -> None:
            for i, o in enumerate(outs):
                o.copy_(flat[i * inp.numel() : (i + 1) * inp.numel()].view(o.shape))

        plan.on_done.append(scatter_back)
        return self._work([plan], output_tensors)

    def all_gather_single(self, output, input, opts=None):
        return self._work([collectives.allgather(output, input, self.rank(), self.size())], [output])

    _allgather_base = all_gather_single

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        plans = [collectives.allgather(o, i, self.rank(), self.size()) for o, i in zip(outputs, inputs, strict=True)]
        return self._work(plans, outputs)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        out = _one(output_tensors, "reduce_scatter")
        ins = input_tensors[0]
        if len(input_tensors) != 1 or len(ins) != self.size():
            raise ValueError(f"hfreduce reduce_scatter needs one input list of {self.size()} tensors")
        flat = torch.cat([t.reshape(-1) for t in ins])
        plan = collectives.reduce_scatter(out, flat, _op(opts), self.rank(), self.size())
        return self._work([plan], output_tensors)

    def reduce_scatter_single(self, output, input, opts=None):
        return self._work([collectives.reduce_scatter(output, input, _op(opts), self.rank(), self.size())], [output])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        op = _op(opts)
        plans = [collectives.reduce_scatter(o, i, op, self.rank(), self.size()) for o, i in zip(outputs, inputs, strict=True)]
        return self._work(plans, outputs)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def barrier(self, opts=None):
        return self._work([collectives.barrier(self.size())], [])

    def shutdown(self) -> None:
        self.comm.close()

    def abort(self) -> None:
        self.comm.close()


def _value(fut: torch.futures.Future, result):
    value = fut.value()  # re-raises the engine's error
    if isinstance(value, list):
        for f in value:
            f.value()
    return result


def _create(dist_opts, backend_options=None) -> HFReduceProcessGroup:
    timeout = getattr(dist_opts, "timeout", None)
    config = HFReduceConfig.from_env(timeout=timeout if isinstance(timeout, timedelta) else None)
    return HFReduceProcessGroup(dist_opts.store, dist_opts.group_rank, dist_opts.group_size, config)


def register() -> None:
    """Register backend ``"hfreduce"`` with torch.distributed (idempotent)."""
    if BACKEND.upper() in dist.Backend.__dict__ or BACKEND in getattr(dist.Backend, "_plugins", {}):
        return
    dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])
