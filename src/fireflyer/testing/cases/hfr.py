"""Rank-side functions and references for the multi-process collective tests."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from fireflyer.errors import UserError

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]
INTS = [torch.int32, torch.int64]
DTYPES = FLOATS + INTS
# Reducible too; kept out of DTYPES, which the CUDA and per-dtype tests sweep.
SMALL_INTS = [torch.int8, torch.int16, torch.uint8, torch.bool]
ALL_INTS = INTS + SMALL_INTS  # exact: integers wrap in their own dtype, bool is any/all
ALL_DTYPES = DTYPES + SMALL_INTS
BITWISE = ("band", "bor", "bxor")


def ops_for(dtype: torch.dtype) -> list[str]:
    """Every op hfreduce takes on ``dtype``: AVG needs floats, the bitwise ops integers or bool."""
    if dtype.is_floating_point:
        return ["sum", "avg", "min", "max", "product"]
    return ["sum", "min", "max", "product", *BITWISE]


@dataclass(frozen=True)
class Case:
    kind: str  # allreduce | reduce_scatter | allgather | broadcast
    dtype: torch.dtype
    numel: int  # per-rank input elements (allgather, reduce_scatter: per-rank segment)
    op: str = "sum"
    root: int = 0
    seed: int = 0
    noncontig: bool = False


def make_input(case: Case, rank: int, world: int) -> torch.Tensor:
    n = case.numel * (world if case.kind == "reduce_scatter" else 1)
    g = torch.Generator().manual_seed(case.seed * 1009 + rank)
    if case.dtype == torch.bool:
        # even elements are True often enough that "all" is a coin flip, odd ones rarely enough for "any"
        p = 0.5 ** (1.0 / world)
        threshold = torch.where(torch.arange(n) % 2 == 0, p, 1 - p)
        return torch.rand(n, generator=g, dtype=torch.float64) < threshold
    if case.dtype in INTS:
        return torch.randint(-1000, 1000, (n,), generator=g, dtype=case.dtype)
    if case.dtype in SMALL_INTS:
        info = torch.iinfo(case.dtype)
        return torch.randint(info.min, info.max + 1, (n,), generator=g, dtype=case.dtype)  # sums and products wrap
    if case.op == "product":
        # factors of magnitude 1/2..2, either sign: products over 8 ranks stay in fp8's range
        mag = 2.0 ** (torch.rand(n, generator=g, dtype=torch.float64) * 2 - 1)
        return (mag * (torch.randint(0, 2, (n,), generator=g) * 2 - 1)).to(case.dtype)
    return (torch.randn(n, generator=g, dtype=torch.float64) * 3).to(case.dtype)


def _noncontig(x: torch.Tensor) -> torch.Tensor:
    """A non-contiguous view holding the same values in the same logical order."""
    n = x.numel()
    base = torch.empty(n, 2, dtype=x.dtype)
    base[:, 0] = x
    view = base[:, 0]
    assert not view.is_contiguous() or n <= 1
    return view


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy with unit strides (a 1-element or empty view counts as contiguous with any stride)."""
    return torch.empty(t.shape, dtype=t.dtype).copy_(t)


def run_case(ctx, case: Case) -> torch.Tensor:
    comm, rank, world = ctx.comm, ctx.rank, ctx.world_size
    x = make_input(case, rank, world)
    if case.noncontig:
        x = _noncontig(x)
    if case.kind == "allreduce":
        comm.allreduce(x, case.op).wait()
        return _plain(x)
    if case.kind == "reduce_scatter":
        out = torch.full((case.numel,), 7, dtype=case.dtype) if case.dtype in INTS else torch.zeros(case.numel).to(case.dtype)
        comm.reduce_scatter(out, x, case.op).wait()
        return out
    if case.kind == "allgather":
        out = torch.zeros(case.numel * world, dtype=torch.float32).to(case.dtype)
        if case.noncontig:
            out = _noncontig(out)
        comm.allgather(out, x).wait()
        return _plain(out)
    if case.kind == "broadcast":
        comm.broadcast(x, case.root).wait()
        return _plain(x)
    if case.kind == "reduce":
        before = _plain(x)
        comm.reduce(x, case.root, case.op).wait()
        if rank == case.root:
            return _plain(x)
        same = torch.equal(before.view(torch.uint8), _plain(x).view(torch.uint8))
        return torch.tensor([0.0 if same else 1.0], dtype=torch.float64)
    raise UserError(case.kind)


# numpy, independently of torch, in the input dtype: integers wrap as in C, torch and gloo.
_NP_OPS = {
    "sum": np.add, "product": np.multiply, "min": np.minimum, "max": np.maximum,
    "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor,
}
# bool is a flag: any for sum/max/bor, all for product/min/band, parity for bxor.
_NP_BOOL_OPS = {
    "sum": np.logical_or, "max": np.logical_or, "bor": np.logical_or,
    "product": np.logical_and, "min": np.logical_and, "band": np.logical_and, "bxor": np.logical_xor,
}


def _exact(case: Case, inputs: list[torch.Tensor]) -> torch.Tensor:
    fn = (_NP_BOOL_OPS if case.dtype == torch.bool else _NP_OPS)[case.op]
    acc = inputs[0].numpy().copy()
    with np.errstate(over="ignore"):
        for x in inputs[1:]:
            acc = fn(acc, x.numpy())
    return torch.from_numpy(acc).to(torch.int64)


def reference(case: Case, world: int) -> list[torch.Tensor]:
    """Expected per-rank results in float64 (or int64), from every rank's input."""
    inputs = [make_input(case, r, world) for r in range(world)]
    wide = [x.to(torch.float64) if case.dtype in FLOATS else x.to(torch.int64) for x in inputs]
    if case.kind in ("allreduce", "reduce_scatter", "reduce"):
        stacked = torch.stack(wide) if wide[0].numel() else torch.zeros(world, 0, dtype=wide[0].dtype)
        if case.dtype in ALL_INTS:
            full = _exact(case, inputs)
        elif case.op in ("sum", "avg"):
            full = stacked.sum(0)
            if case.op == "avg":
                full = full / world
        elif case.op == "product":
            full = stacked.prod(0)
        elif case.op == "min":
            full = stacked.min(0).values if stacked.shape[1] else stacked[0]
        else:
            full = stacked.max(0).values if stacked.shape[1] else stacked[0]
        if case.kind == "allreduce":
            return [full] * world
        if case.kind == "reduce":  # the root gets the result; every other rank's tensor is untouched
            return [full if r == case.root else torch.zeros(1, dtype=torch.float64) for r in range(world)]
        k = case.numel
        return [full[r * k : (r + 1) * k] for r in range(world)]
    if case.kind == "allgather":
        return [torch.cat(wide)] * world
    if case.kind == "broadcast":
        return [wide[case.root]] * world
    raise UserError(case.kind)


def tolerance(case: Case, world: int) -> float:
    """Error allowed against the float64 reference: one rounding of the result plus fp32 accumulation.

    Absolute, except for products, where it is relative (to max(1, |exact|)).
    """
    if case.dtype in ALL_INTS or case.op in ("min", "max") or case.kind in ("allgather", "broadcast"):
        return 0.0
    scale = 1.0 if case.op == "product" else 3.0 * 4 * world  # |inputs| stay well below 4 sigma; the sum below world * that
    eps = {
        torch.float64: 2.0**-52,
        torch.float32: 2.0**-23,
        torch.float16: 2.0**-10,
        torch.bfloat16: 2.0**-7,
        torch.float8_e4m3fn: 2.0**-3,
        torch.float8_e5m2: 2.0**-2,
    }[case.dtype]
    return scale * (eps + world * 2.0**-23)


def run_cases(ctx, cases: list[Case]) -> list[torch.Tensor]:
    """Several cases in one call, one after another: one round trip to the ranks for all of them."""
    return [run_case(ctx, case) for case in cases]


def ping(ctx) -> int:
    return ctx.rank


def layout_info(ctx) -> tuple[int, int, int, int]:
    c = ctx.comm
    return c.node, c.local_rank, c.local_size, c.num_nodes


# ---- fault injection -------------------------------------------------------------------
def allreduce_until_failure(ctx, n: int, rounds: int, die_rank: int = -1, die_after: float = 0.0):
    """Run allreduces; ``die_rank`` SIGKILLs itself ``die_after`` seconds into its first one.

    Returns (exception type, message, seconds from the start of the failing call to the error).
    """
    import os
    import signal
    import time

    x = torch.ones(n)
    for _ in range(rounds):
        t0 = time.monotonic()
        fut = ctx.comm.allreduce(x)
        if ctx.rank == die_rank:
            time.sleep(die_after)
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            fut.wait()
        except Exception as exc:  # noqa: BLE001
            return type(exc).__name__, str(exc), time.monotonic() - t0
    return None, None, 0.0


def skip_collective(ctx, skipper: int):
    """Every rank but ``skipper`` calls allreduce; returns (type, message, seconds)."""
    import time

    if ctx.rank == skipper:
        time.sleep(0.2)
        return None, None, 0.0
    t0 = time.monotonic()
    try:
        ctx.comm.allreduce(torch.ones(1000)).wait()
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__, str(exc), time.monotonic() - t0
    return None, None, 0.0


def mismatched(ctx, what: str):
    """Run one deliberately mismatched allreduce on a fresh communicator (the old one would be broken)."""
    import torch.distributed as dist

    from fireflyer.hfreduce import Communicator, HFReduceConfig

    comm = Communicator(dist.PrefixStore(f"mismatch-{what}", ctx.store), ctx.rank, ctx.world_size, config=HFReduceConfig.from_env())
    try:
        return _mismatched(comm, ctx, what)
    finally:
        comm.close()


def _mismatched(comm, ctx, what: str):
    # "node_size": every rank of the last node calls another size, so the node agrees with itself
    # and only the trees' frames (a descriptor digest that differs) can see it.
    last_node = ctx.node == comm.num_nodes - 1
    x = torch.ones(1000 + (ctx.rank == ctx.world_size - 1 and what == "size") + (last_node and what == "node_size"))
    if what == "dtype" and ctx.rank == ctx.world_size - 1:
        x = x.double()
    op = "max" if what == "op" and ctx.rank == ctx.world_size - 1 else "sum"
    try:
        comm.allreduce(x, op).wait()
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__, str(exc)
    return None, x[:3].tolist()


def after_failure(ctx):
    """Once broken, a communicator fails fast; close() leaves no engine threads behind."""
    import threading

    try:
        ctx.comm.allreduce(torch.ones(4)).wait()
        outcome = "worked"
    except Exception as exc:  # noqa: BLE001
        outcome = type(exc).__name__
    ctx.comm.close()
    # the watch thread ends within a tick, or once a store call it is in returns: on a busy host that can
    # outlast close()'s own join, so the threads get a bounded while to go
    deadline = time.monotonic() + 15.0
    while True:
        left = [t.name for t in threading.enumerate() if t.name.startswith("hfreduce") and t.is_alive()]
        if not left or time.monotonic() > deadline:
            return outcome, left
        time.sleep(0.05)


def intrude(ctx, target: int):
    """From this rank, connect to ``target``'s listener with a wrong secret; report what happened."""
    import datetime
    import json
    import socket

    key = f"test/hfreduce/{ctx.comm.incarnation}/addr/{target}"
    ctx.store.wait([key], datetime.timedelta(seconds=5))
    host, port = json.loads(ctx.store.get(key))
    from fireflyer.hfreduce.transport.links import connect

    try:
        connect(host, port, my_rank=ctx.rank, peer_rank=target, tag=0, secret=b"not the job secret", deadline=__import__("time").monotonic() + 3)
        return "accepted"
    except Exception as exc:  # noqa: BLE001
        junk = socket.create_connection((host, port), timeout=3)
        junk.sendall(b"GET / HTTP/1.0\r\n\r\n" * 10)
        junk.close()
        return type(exc).__name__


def capture_refusals(ctx, seconds: float):
    """Collect fireflyer.hfreduce warnings for a while, then return them and the refusal count."""
    import logging
    import time

    records: list[str] = []

    class Grab(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    h = Grab()
    logging.getLogger("fireflyer.hfreduce").addHandler(h)
    time.sleep(seconds)
    logging.getLogger("fireflyer.hfreduce").removeHandler(h)
    return ctx.comm.refused_connections, records


def arena_files(ctx):
    import os

    return sorted(f for f in os.listdir("/dev/shm") if f.startswith("fireflyer-hfr-"))


# ---- CUDA -------------------------------------------------------------------------------
def run_case_cuda(ctx, case: Case) -> torch.Tensor:
    """``run_case`` with the rank's tensors on its GPU (ranks share GPUs round-robin)."""
    device = torch.device("cuda", ctx.rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    comm, rank, world = ctx.comm, ctx.rank, ctx.world_size
    x = make_input(case, rank, world).to(device)
    stream = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        x.mul_(1)  # queued work on a side stream that the collective must wait for
        if case.kind == "allreduce":
            comm.allreduce(x, case.op).wait()
            out = x
        elif case.kind == "reduce_scatter":
            out = torch.zeros(case.numel, dtype=case.dtype, device=device)
            comm.reduce_scatter(out, x, case.op).wait()
        elif case.kind == "allgather":
            out = torch.zeros(case.numel * world, dtype=case.dtype, device=device)
            comm.allgather(out, x).wait()
        else:
            comm.broadcast(x, case.root).wait()
            out = x
        result = out.cpu()
    return result


def registered_allreduce(ctx, numel: int, dtype: torch.dtype, op: str, who: str, rounds: int) -> list[torch.Tensor]:
    """Allreduce on registered (shared) buffers: 'all' ranks, 'odd' ranks only, or 'none'; several rounds."""
    comm, rank = ctx.comm, ctx.rank
    use = who == "all" or (who == "odd" and rank % 2 == 1)
    # Allocation is collective per node, so every rank allocates; only some use the buffer.
    buf = comm.shared_empty(numel, dtype)
    out = []
    for r in range(rounds):
        x = make_input(Case("allreduce", dtype, numel, op, seed=r), rank, ctx.world_size)
        t = buf if use else torch.empty(numel, dtype=dtype)
        t.copy_(x)
        comm.allreduce(t, op).wait()
        out.append(t.clone())
    comm.shared_release(buf)
    return out


def keyed(ctx, odd_secret: bool):
    """A fresh communicator where rank 1's launcher handed it another job secret; returns what each rank saw."""
    import os

    import torch.distributed as dist

    from fireflyer.hfreduce import Communicator, HFReduceConfig

    saved = os.environ.get("FIREFLYER_JOB_SECRET")
    if odd_secret and ctx.rank == 1:
        os.environ["FIREFLYER_JOB_SECRET"] = "another job's secret, 32 chars.."
    try:
        comm = Communicator(dist.PrefixStore(f"keyed-{odd_secret}", ctx.store), ctx.rank, ctx.world_size,
                            config=HFReduceConfig.from_env())
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__, str(exc)
    finally:
        if saved is not None:
            os.environ["FIREFLYER_JOB_SECRET"] = saved
    try:
        x = torch.ones(8)
        comm.allreduce(x).wait()
        return "ok", x[0].item()
    finally:
        comm.close()
