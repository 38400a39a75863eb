"""Collectives as plans over one flat buffer: what each rank contributes and what it gets back.

Every collective is a reduction of a flat buffer of ``numel`` elements:

* allreduce       each rank contributes the whole buffer and gets the whole result;
* reduce_scatter  each rank contributes the whole buffer and gets its own segment;
* allgather       each rank contributes its own segment (one owner per element) and gets the whole;
* broadcast       the root contributes the whole buffer, the others receive it;
* barrier         an empty allreduce that still passes every handoff.

Non-contiguous tensors are staged through a contiguous copy and written back.
"""

from __future__ import annotations

import torch

from fireflyer.hfreduce.reduce import Descriptor, Kind, Op, Plan, check_dtype, check_op


def _flat(t: torch.Tensor, plan_done: list, write_back: bool) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"hfreduce collectives take torch.Tensor, got {type(t).__name__}")
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"hfreduce supports cpu and cuda tensors, got a tensor on {t.device}")
    if t.is_sparse:
        raise ValueError("hfreduce does not support sparse tensors")
    check_dtype(t.dtype)
    if t.is_contiguous():
        return t.view(-1)
    tmp = t.contiguous()
    if write_back:
        plan_done.append(lambda: t.copy_(tmp.view(t.shape)))
    return tmp.view(-1)


def _same_dtype(*tensors: torch.Tensor) -> torch.dtype:
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1:
        raise TypeError(f"hfreduce needs one dtype per collective, got {sorted(map(str, dtypes))}")
    return tensors[0].dtype


def allreduce(tensor: torch.Tensor, op: Op, world_size: int) -> Plan:
    done: list = []
    flat = _flat(tensor, done, write_back=True)
    check_op(op, tensor.dtype)
    desc = Descriptor(Kind.ALLREDUCE, tensor.dtype, flat.numel(), op)
    return Plan(desc, sources=[(0, flat)], sinks=[(0, flat)], world_size=world_size, on_done=done)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: Op, rank: int, world_size: int) -> Plan:
    dtype = _same_dtype(output, input)
    check_op(op, dtype)
    if input.numel() != output.numel() * world_size:
        raise ValueError(
            f"reduce_scatter needs input.numel() == output.numel() * world_size ({output.numel()} * {world_size}), "
            f"got {input.numel()}"
        )
    done: list = []
    src = _flat(input, done, write_back=False)
    dst = _flat(output, done, write_back=True)
    desc = Descriptor(Kind.REDUCE_SCATTER, dtype, src.numel(), op)
    return Plan(desc, sources=[(0, src)], sinks=[(rank * dst.numel(), dst)], world_size=world_size, on_done=done)


def allgather(output: torch.Tensor, input: torch.Tensor, rank: int, world_size: int) -> Plan:
    dtype = _same_dtype(output, input)
    if output.numel() != input.numel() * world_size:
        raise ValueError(
            f"allgather needs output.numel() == input.numel() * world_size ({input.numel()} * {world_size}), "
            f"got {output.numel()}"
        )
    done: list = []
    src = _flat(input, done, write_back=False)
    dst = _flat(output, done, write_back=True)
    k = src.numel()
    desc = Descriptor(Kind.ALLGATHER, dtype, dst.numel(), Op.COPY)
    owners = [(r * k, (r + 1) * k, r) for r in range(world_size)]
    return Plan(desc, sources=[(rank * k, src)], sinks=[(0, dst)], owners=owners, world_size=world_size, on_done=done)


def broadcast(tensor: torch.Tensor, root: int, rank: int, world_size: int) -> Plan:
    if not 0 <= root < world_size:
        raise ValueError(f"broadcast root must be in 0..{world_size - 1}, got {root}")
    done: list = []
    flat = _flat(tensor, done, write_back=rank != root)
    desc = Descriptor(Kind.BROADCAST, tensor.dtype, flat.numel(), Op.COPY, root)
    sources = [(0, flat)] if rank == root else []
    sinks = [] if rank == root else [(0, flat)]
    return Plan(desc, sources, sinks, owners=[(0, flat.numel(), root)], world_size=world_size, on_done=done)


def barrier(world_size: int) -> Plan:
    desc = Descriptor(Kind.BARRIER, torch.int32, 0, Op.SUM)
    return Plan(desc, sources=[], sinks=[], world_size=world_size)
