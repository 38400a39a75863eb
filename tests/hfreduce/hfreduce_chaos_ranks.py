"""Rank-side functions of ``test_chaos.py`` (run inside LocalCluster ranks; importable there because pytest puts
this folder on ``sys.path`` before the cluster's fork server starts).

Every cell makes a fresh ``"hfreduce"`` default group on its own store prefix, then meets one fault through
``torch.distributed``: a rank SIGKILLed as a collective starts or in the middle of one, or a rank that stays
alive but never calls it. A survivor reports the exception's class and message and the wall-clock time it
raised, so the test can measure detection from the moment of the kill, which the victim writes to the store
just before it dies.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from fireflyer.testing.cases.torch_faults import cell_name, join  # noqa: F401 - join: the rank's first call

KINDS = ("broadcast", "all_gather", "all_gather_list", "reduce_scatter", "reduce_scatter_list", "all_to_all",
         "all_to_all_list", "all_reduce", "gather", "scatter", "send_recv")


def call(kind: str, n: int, root: int = 0, async_op: bool = False):
    """One collective of ``kind`` on ``n`` floats per rank through ``torch.distributed``; its Work when async."""
    me, world = dist.get_rank(), dist.get_world_size()
    x = torch.full((n,), float(me + 1))
    if kind == "broadcast":
        return dist.broadcast(x, src=root, async_op=async_op)
    if kind == "all_gather":
        return dist.all_gather_into_tensor(torch.empty(n * world), x, async_op=async_op)
    if kind == "all_gather_list":
        return dist.all_gather([torch.empty(n) for _ in range(world)], x, async_op=async_op)
    if kind == "reduce_scatter":
        return dist.reduce_scatter_tensor(torch.empty(n), torch.ones(n * world), async_op=async_op)
    if kind == "reduce_scatter_list":
        return dist.reduce_scatter(torch.empty(n), [torch.ones(n) for _ in range(world)], async_op=async_op)
    if kind == "all_to_all":
        return dist.all_to_all_single(torch.empty(n * world), torch.ones(n * world), async_op=async_op)
    if kind == "all_to_all_list":
        return dist.all_to_all([torch.empty(n) for _ in range(world)], [torch.ones(n) for _ in range(world)],
                               async_op=async_op)
    if kind == "all_reduce":
        return dist.all_reduce(x, async_op=async_op)
    if kind == "gather":
        return dist.gather(x, [torch.empty(n) for _ in range(world)] if me == root else None, dst=root,
                           async_op=async_op)
    if kind == "scatter":
        return dist.scatter(x, [torch.ones(n) for _ in range(world)] if me == root else None, src=root,
                            async_op=async_op)
    if kind == "send_recv":  # a ring: each rank sends to the next and receives from the one before
        ops = [dist.P2POp(dist.isend, x, (me + 1) % world), dist.P2POp(dist.irecv, torch.empty(n), (me - 1) % world)]
        works = dist.batch_isend_irecv(ops)
        if async_op:
            return works
        for w in works:
            w.wait()
        return None
    raise ValueError(kind)


def _finish(work) -> None:
    """Wait for what ``call`` returned (nothing for a synchronous call, a Work, or a list of Works)."""
    for w in work if isinstance(work, list) else [work] if work is not None else []:
        w.wait()


def _leave(report: dict) -> dict:
    dist.destroy_process_group()
    return report


def _outcome(fn) -> dict:
    t0 = time.monotonic()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - what the survivor saw is the result
        return {"raised": type(exc).__name__, "msg": str(exc), "at": time.time(), "elapsed": time.monotonic() - t0}
    return {"raised": None, "msg": "", "at": time.time(), "elapsed": time.monotonic() - t0}


def killed(ctx, kind: str, victim: int, n: int, when: str, rounds: int = 50) -> dict:
    """``victim`` dies at the start of the first ``kind`` (``when="start"``: it posts the call, then dies) or
    in the middle of back-to-back ones (``"mid"``); the others call ``kind`` until one raises (a call whose
    bytes had all arrived before the death may return, its result whole: the next one raises)."""
    me = ctx.rank
    if me == victim:
        if when == "start":
            ctx.store.set(f"{cell_name()}/killed_at", repr(time.time()))
            call(kind, n, async_op=True)
            os.kill(os.getpid(), signal.SIGKILL)

        def die() -> None:
            ctx.store.set(f"{cell_name()}/killed_at", repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Timer(0.05, die).start()
    report: dict = {"raised": None}
    for _ in range(rounds):
        report = _outcome(lambda: _finish(call(kind, n, async_op=True)))
        if report["raised"] is not None:
            break
    ctx.store.wait([f"{cell_name()}/killed_at"], timedelta(seconds=60))
    report["killed_at"] = float(ctx.store.get(f"{cell_name()}/killed_at").decode())
    return _leave(report)


def absent(ctx, kind: str, victim: int, n: int) -> dict:
    """``victim`` stays alive and in the group but never calls ``kind``, until the test releases it."""
    if ctx.rank == victim:
        ctx.store.wait([f"{cell_name()}/release"], timedelta(seconds=120))
        return _leave({"victim": True})
    return _leave(_outcome(lambda: _finish(call(kind, n))))


def record_everything(ctx, rounds: int, sizes: list[int]) -> dict:
    """Every kind of collective ``rounds`` times at each size, through ``torch.distributed``; returns how many
    calls of each op name this rank made, and the flight recorder's entries of the group."""
    pg = dist.distributed_c10d._get_default_group()
    made: dict[str, int] = {}
    names = {"broadcast": ["broadcast"], "all_gather": ["allgather"], "all_gather_list": ["allgather"],
             "reduce_scatter": ["reduce_scatter"], "reduce_scatter_list": ["reduce_scatter"],
             "all_to_all": ["all_to_all"], "all_to_all_list": ["all_to_all"], "all_reduce": ["allreduce"],
             "gather": ["gather"], "scatter": ["scatter"], "send_recv": ["send", "recv"]}
    for n in sizes:
        for _ in range(rounds):
            for kind in KINDS:
                _finish(call(kind, n, root=(n + 1) % ctx.world_size, async_op=kind in ("broadcast", "gather")))
                for name in names[kind]:
                    made[name] = made.get(name, 0) + 1
            dist.barrier()
            made["barrier"] = made.get("barrier", 0) + 1
    entries = pg.comm.flight.entries()
    return _leave({"made": made, "entries": [{k: e[k] for k in ("op", "state", "collective_seq_id", "is_p2p",
                                                                  "p2p_seq_id", "profiling_name")}
                                             for e in entries]})
