"""Collectives as plans over one flat buffer: what each rank contributes and what it gets back.

Every collective is a reduction of a flat buffer of ``numel`` elements:

* allreduce       each rank contributes the whole buffer and gets the whole result;
* reduce          like allreduce, but only the root gets the result;
* reduce_scatter  each rank contributes the whole buffer and gets its own segment;
* allgather       each rank contributes its own segment (one owner per element) and gets the whole;
* broadcast       the root contributes the whole buffer, the others receive it;
* barrier         an empty allreduce that still passes every handoff.

Non-contiguous tensors are staged through a contiguous copy and written back.
"""

from __future__ import annotations

import torch

from fireflyer.hfreduce.plans.plan import Descriptor, Kind, Op, Plan, check_dtype, check_op
from fireflyer.errors import UserError, UserTypeError


def _flat(t: torch.Tensor, plan_done: list, write_back: bool, as_bytes: bool = False) -> torch.Tensor:
    """A flat contiguous view of ``t`` (or of a staging copy written back when the plan is done).

    ``as_bytes`` reinterprets any dtype as raw bytes, for collectives that only move data.
    """
    if not isinstance(t, torch.Tensor):
        raise UserTypeError(f"hfreduce collectives take torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise UserError(f"hfreduce supports dense (strided) tensors, got layout {t.layout}")
    if t.device.type not in ("cpu", "cuda"):
        raise UserError(f"hfreduce supports cpu and cuda tensors, got a tensor on {t.device}")
    if not as_bytes:
        check_dtype(t.dtype)
    if t.is_contiguous():
        flat = t.view(-1)
        if flat.numel() == 1 and flat.stride(0) != 1:
            # One element counts as contiguous whatever its stride, but a byte view needs stride 1.
            flat = flat.as_strided((1,), (1,))
    else:
        flat = t.contiguous().view(-1)
        if write_back:
            tmp = flat
            plan_done.append(lambda: t.copy_(tmp.view(t.shape)))
    if as_bytes and flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8, device=flat.device)
    return flat


def _same_dtype(*tensors: torch.Tensor) -> torch.dtype:
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise UserTypeError(f"hfreduce collectives take torch.Tensor, got {type(t).__name__}")
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1:
        raise UserTypeError(f"hfreduce needs one dtype per collective, got {sorted(map(str, dtypes))}")
    return tensors[0].dtype


def allreduce(tensor: torch.Tensor, op: Op, world_size: int) -> Plan:
    done: list = []
    flat = _flat(tensor, done, write_back=True)
    check_op(op, flat.dtype)
    desc = Descriptor(Kind.ALLREDUCE, tensor.dtype, flat.numel(), op)
    return Plan(desc, sources=[(0, flat)], sinks=[(0, flat)], world_size=world_size, on_done=done)


def reduce(tensor: torch.Tensor, op: Op, root: int, rank: int, world_size: int) -> Plan:
    """Like allreduce, but only ``root`` takes the result; the other ranks' tensors are left as they were."""
    if not 0 <= root < world_size:
        raise UserError(f"reduce root must be in 0..{world_size - 1}, got {root}")
    done: list = []
    flat = _flat(tensor, done, write_back=rank == root)
    check_op(op, flat.dtype)
    desc = Descriptor(Kind.REDUCE, tensor.dtype, flat.numel(), op, root)
    sinks = [(0, flat)] if rank == root else []
    return Plan(desc, sources=[(0, flat)], sinks=sinks, world_size=world_size, on_done=done)


def _check_whole(what: str, whole: tuple[str, torch.Tensor], part: tuple[str, torch.Tensor], world_size: int) -> None:
    """The ``whole`` tensor holds one ``part`` per rank."""
    (wname, w), (pname, p) = whole, part
    if w.numel() != p.numel() * world_size:
        raise UserError(
            f"{what} needs {wname}.numel() == {pname}.numel() * world_size ({p.numel()} * {world_size}), "
            f"got {w.numel()}"
        )


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: Op, rank: int, world_size: int) -> Plan:
    dtype = _same_dtype(output, input)
    check_dtype(dtype)
    check_op(op, dtype)
    _check_whole("reduce_scatter", ("input", input), ("output", output), world_size)
    done: list = []
    src = _flat(input, done, write_back=False)
    dst = _flat(output, done, write_back=True)
    desc = Descriptor(Kind.REDUCE_SCATTER, dtype, src.numel(), op)
    return Plan(desc, sources=[(0, src)], sinks=[(rank * dst.numel(), dst)], world_size=world_size, on_done=done)


def allgather(output: torch.Tensor, input: torch.Tensor, rank: int, world_size: int) -> Plan:
    _same_dtype(output, input)
    _check_whole("allgather", ("output", output), ("input", input), world_size)
    done: list = []
    src = _flat(input, done, write_back=False, as_bytes=True)
    dst = _flat(output, done, write_back=True, as_bytes=True)
    k = src.numel()
    desc = Descriptor(Kind.ALLGATHER, torch.uint8, dst.numel(), Op.COPY)
    owners = [(r * k, (r + 1) * k, r) for r in range(world_size)]
    return Plan(desc, sources=[(rank * k, src)], sinks=[(0, dst)], owners=owners, world_size=world_size, on_done=done)


def broadcast(tensor: torch.Tensor, root: int, rank: int, world_size: int) -> Plan:
    if not 0 <= root < world_size:
        raise UserError(f"broadcast root must be in 0..{world_size - 1}, got {root}")
    done: list = []
    flat = _flat(tensor, done, write_back=rank != root, as_bytes=True)
    desc = Descriptor(Kind.BROADCAST, torch.uint8, flat.numel(), Op.COPY, root)
    sources = [(0, flat)] if rank == root else []
    sinks = [] if rank == root else [(0, flat)]
    return Plan(desc, sources, sinks, owners=[(0, flat.numel(), root)], world_size=world_size, on_done=done)


def barrier(world_size: int) -> Plan:
    desc = Descriptor(Kind.BARRIER, torch.int32, 0, Op.SUM)
    return Plan(desc, sources=[], sinks=[], world_size=world_size)
