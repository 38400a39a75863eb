"""Rank functions for test_cpp_door.py: ``dist.all_reduce`` through the C++ door and the Python door."""

from __future__ import annotations

import hashlib
import logging
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from fireflyer.testing.cases.node_a2a import init

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.uint8,
          torch.bool)
FLOAT_OPS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX")
INT_OPS = ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")
SHAPES = ((1,), (7, 3), (1024,), (64, 256))


def _input(rank: int, dtype: torch.dtype, shape: tuple, case: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * case + rank)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 3).to(dtype)
    return torch.randint(0, 7, shape, generator=g).to(dtype)


def every_allreduce(ctx, prefix: str) -> dict:
    """Every dtype, op and shape the door takes, synchronous ``dist.all_reduce``; the sha256 of each result,
    the door the group took and how many calls it ran."""
    init(ctx, prefix)
    group = dist.group.WORLD
    digests = {}
    case = 0
    for dtype in DTYPES:
        for op in FLOAT_OPS if dtype.is_floating_point else INT_OPS:
            if dtype == torch.bool and op in ("SUM", "PRODUCT"):
                continue
            for shape in SHAPES:
                case += 1
                t = _input(ctx.rank, dtype, shape, case)
                dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
                digests[f"{dtype}-{op}-{shape}"] = hashlib.sha256(t.contiguous().view(torch.uint8).numpy()).hexdigest()
    # the same through the options torch's own callers build, with a per-call timeout
    opts = dist.AllreduceOptions()
    opts.asyncOp = False
    opts.timeout = timedelta(seconds=30)
    t = torch.full((5,), float(ctx.rank + 1))
    group.allreduce([t], opts).wait()
    digests["per-call-timeout"] = t.tolist()
    # an async call is the Python door's, with its Work
    t = torch.ones(3)
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    digests["async"] = t.tolist()
    return {"door": group.door, "calls": group.door_calls, "digests": digests, "cases": case}


def late_peer(ctx, prefix: str, late_rank: int, timeout_s: float) -> dict:
    """Rank ``late_rank`` comes ``3 * timeout_s`` late to an allreduce with a per-call timeout of ``timeout_s``:
    what each other rank got, and how long it took, then what a second allreduce gets."""
    init(ctx, prefix)
    group = dist.group.WORLD
    t = torch.ones(16)
    dist.all_reduce(t)
    if ctx.rank == late_rank:
        time.sleep(3 * timeout_s)
        return {"door": group.door, "late": True}
    opts = dist.AllreduceOptions()
    opts.asyncOp = False
    opts.timeout = timedelta(seconds=timeout_s)
    start = time.monotonic()
    error = again = None
    try:
        group.allreduce([t], opts).wait()
    except Exception as exc:  # noqa: BLE001 - the test reads its class and message
        error = f"{type(exc).__name__}: {exc}"
    took = time.monotonic() - start
    try:
        dist.all_reduce(torch.ones(16))
    except Exception as exc:  # noqa: BLE001
        again = f"{type(exc).__name__}: {exc}"
    flight = group.comm.flight
    records = {e["collective_seq_id"]: {k: e[k] for k in ("state", "error", "time_failed_ns", "record_id")}
               for e in flight.entries()}
    return {"door": group.door, "late": False, "error": error, "took": took, "again": again,
            "calls": group.door_calls, "records": records, "in_flight": flight.in_flight(), "settled": flight.settled}


def unbuildable_door(ctx, prefix: str, folder: str) -> dict:
    """This rank's door sources replaced by ones that do not compile (built into ``folder``), then a group made and
    used through ``dist``: the door it took, the sum it got and the warning lines it logged."""
    from pathlib import Path

    from fireflyer.hfreduce.backend import cpp_door

    broken = Path(folder) / f"door-{ctx.rank}.cpp"
    broken.write_text('#include "no_such_header_anywhere.h"\n')
    cpp_door.SOURCE, cpp_door.ROOT = broken, Path(folder) / f"built-{ctx.rank}"
    cpp_door._loaded.clear()
    cpp_door._warned.clear()
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    log = logging.getLogger("fireflyer.hfreduce")
    log.addHandler(handler)
    try:
        init(ctx, prefix)
        t = torch.ones(8)
        dist.all_reduce(t)
        dist.all_reduce(t)
    finally:
        log.removeHandler(handler)
    group = dist.group.WORLD
    return {"door": group.door, "calls": group.door_calls, "sum": t.tolist(),
            "warnings": [line for line in lines if "C++ door" in line]}
