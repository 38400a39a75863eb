"""Rank-side functions for the fault matrix through torch.distributed (run inside LocalCluster ranks).

Each cell makes a fresh "hfreduce" default group on its own store prefix, does one
good collective, then meets one fault through one door (a plain ``dist`` call in one
style, torch DDP, FSDP2, haiscale DDP or ``dist.barrier``). A survivor reports what
it saw: the exception's class and message and how long it took, or, if the call
returned, whether the tensor holds the right answer. It then checks that the group
stays failed (every style raises again at once) and destroys it.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from fireflyer.errors import UserError

BIG = 4 << 20  # elements: a collective that runs long enough to die in the middle of
_CELL = {"name": ""}


def cell_name() -> str:
    """The cell :func:`join` last made in this rank: the prefix of its keys in the store."""
    return _CELL["name"]


def join(ctx, cell: str, timeout: float, trace_dir: str | None = None) -> float:
    """Every rank: a new default group for this cell, and one good allreduce on it."""
    import fireflyer.hfreduce  # noqa: F401 - registers the backend

    if trace_dir is not None:  # read when the group's flight recorder is made
        os.environ["FIREFLYER_HFREDUCE_TRACE_DIR"] = trace_dir

    if dist.is_initialized():
        dist.destroy_process_group()
    _CELL["name"] = cell
    dist.init_process_group("hfreduce", store=dist.PrefixStore(cell, ctx.store), rank=ctx.rank,
                            world_size=ctx.world_size, timeout=timedelta(seconds=timeout))
    t = torch.ones(4)
    dist.all_reduce(t)
    return t[0].item()


def _stay_away(ctx) -> dict:
    """The absent rank: alive and in the group, but it never calls, until the test releases it."""
    ctx.store.wait([f"{_CELL['name']}/release"], timedelta(seconds=90))
    return _leave({"victim": True})


def _passed(ctx, label: str) -> None:
    """Tells the cell's store this rank is past ``label``."""
    ctx.store.set(f"{_CELL['name']}/{label}/{ctx.rank}", "1")


def _wait_passed(ctx, label: str) -> None:
    """Until every rank of the cell is past ``label`` (told by ``_passed``)."""
    keys = [f"{_CELL['name']}/{label}/{r}" for r in range(ctx.world_size)]
    ctx.store.wait(keys, timedelta(seconds=60))


def _die_now() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _die_soon(after: float) -> None:
    threading.Timer(after, _die_now).start()


def _call(style: str, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> None:
    if style == "sync":
        dist.all_reduce(tensor, op=op)
    elif style == "async":
        work = dist.all_reduce(tensor, op=op, async_op=True)
        work.wait()
    elif style == "future":
        work = dist.all_reduce(tensor, op=op, async_op=True)
        work.get_future().wait()
    elif style == "barrier":
        dist.barrier()
    elif style == "barrier-async":
        dist.barrier(async_op=True).wait()
    elif style == "funcol":  # functional collectives (DTensor's path): C++ calls the Work's wait()
        import torch.distributed._functional_collectives as funcol

        tensor.copy_(funcol.all_reduce(tensor, "sum" if op == dist.ReduceOp.SUM else "max", dist.group.WORLD))
    else:
        raise UserError(style)


def _outcome(fn, check=None) -> dict:
    t0 = time.monotonic()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - what the survivor saw is the result
        return {"raised": type(exc).__name__, "msg": str(exc), "elapsed": time.monotonic() - t0}
    return {"raised": None, "msg": "", "elapsed": time.monotonic() - t0, "correct": check() if check else None}


def _afterwards() -> dict:
    """Once failed, every style raises at once, and nothing computes with fewer ranks."""
    seen = {}
    for style in ("sync", "async", "future", "barrier"):
        t = torch.ones(8)
        t0 = time.monotonic()
        try:
            _call(style, t)
            seen[style] = ("returned", t[0].item())
        except Exception as exc:  # noqa: BLE001
            seen[style] = (type(exc).__name__, round(time.monotonic() - t0, 3))
    work = dist.all_reduce(torch.ones(8), async_op=True)
    try:
        work.wait()
    except Exception:  # noqa: BLE001
        pass
    seen["work_state"] = (work.is_completed(), work.is_success(), type(work.exception()).__name__)
    return seen


def _leave(report: dict) -> dict:
    t0 = time.monotonic()
    dist.destroy_process_group()
    report["destroy_s"] = time.monotonic() - t0
    return report


# ---- plain dist.* calls -----------------------------------------------------------
def plain(ctx, fault: str, style: str, victim: int) -> dict:
    """``fault``: between (the victim exits before the call), during (dies while the ranks run
    collectives back to back), absent (never calls), size / dtype / op (the victim calls a
    different collective), node_size (every rank of the victim's node calls another size)."""
    world = ctx.world_size
    me = ctx.rank
    if fault == "during":
        if me == victim:
            _die_soon(0.05)
        return _leave(_until_failure(style, BIG, world, rounds=200))
    x = torch.ones(1000)
    op = dist.ReduceOp.SUM
    if fault == "node_size" and ctx.node == _node_of(ctx, victim):
        x = torch.ones(1001)
    if me == victim:
        if fault == "between":
            _die_now()
        if fault == "absent":
            return _stay_away(ctx)
        if fault == "aborts":  # as a job's watchdog would: the group is torn down under the others
            dist.distributed_c10d._get_default_group().abort()
            return _leave({"victim": True})
        if fault == "size":
            x = torch.ones(1001)
        if fault == "dtype":
            x = torch.ones(1000, dtype=torch.float64)
        if fault == "op":
            op = dist.ReduceOp.MAX
    report = _outcome(lambda: _call(style, x, op), lambda: bool((x == world).all()))
    report["after"] = _afterwards()
    return _leave(report)


def abort_right_after(ctx, n: int) -> dict:
    """Rank 0 aborts the group the moment its all_reduce of ``n`` ones returns; the others report theirs.

    A collective whose result is already in place must return it: a failure that comes after
    (here a peer's abort, in a real job its next call failing) is not that collective's.
    """
    world, x = ctx.world_size, torch.ones(n)
    if ctx.rank == 0:
        dist.all_reduce(x)
        dist.distributed_c10d._get_default_group().abort()
        return _leave({"victim": True, "correct": bool((x == world).all())})
    stop = threading.Event()
    busy = threading.Thread(target=_hold_the_gil, args=(stop,), daemon=True)  # slows this rank, so rank 0 is first
    busy.start()
    try:
        report = _outcome(lambda: dist.all_reduce(x), lambda: bool((x == world).all()))
    finally:
        stop.set()
        busy.join()
    report["after"] = _afterwards()
    return _leave(report)


def _hold_the_gil(stop: threading.Event) -> None:
    """Pure-Python work until ``stop``: this rank's other threads get the interpreter only in turns."""
    n = 0
    while not stop.is_set():
        n += 1


def _node_of(ctx, rank: int) -> int:
    """The node of ``rank``, as every rank of the cell tells it on the job's store."""
    ctx.store.set(f"{_CELL['name']}/node/{ctx.rank}", str(ctx.node))
    return int(ctx.store.get(f"{_CELL['name']}/node/{rank}"))


def _until_failure(style: str, n: int, world: int, rounds: int) -> dict:
    """Collectives back to back until one raises; every one that returned must hold the right sum."""
    x = torch.ones(n)
    good = wrong = 0
    report: dict = {"raised": None, "msg": "", "elapsed": 0.0}
    for _ in range(rounds):
        x.fill_(1)
        report = _outcome(lambda: _call(style, x), lambda: bool((x == world).all()))  # noqa: B023
        if report["raised"] is not None:
            break
        good += 1
        wrong += style.startswith("barrier") is False and not report["correct"]
    report.update(good=good, wrong=wrong, after=_afterwards())
    return report


def _frames(exc: BaseException | None, seen: set | None = None) -> int:
    """Traceback frames of an exception and of everything chained to it."""
    seen = set() if seen is None else seen
    if exc is None or id(exc) in seen:
        return 0
    seen.add(id(exc))
    depth = 0
    tb = exc.__traceback__
    while tb is not None:
        depth, tb = depth + 1, tb.tb_next
    return depth + _frames(exc.__cause__, seen) + _frames(exc.__context__, seen)


def hammer(ctx, victim: int, calls: int) -> tuple[int, str, list[int]]:
    """The reported case: the victim exits; the others call all_reduce on 4 Mi ones ``calls`` times.

    Returns how many calls returned, the first error, and the traceback depth of the first and
    the last error (a shared exception object raised again and again would grow it each time).
    """
    if ctx.rank == victim:
        os._exit(3)
    t = torch.ones(4 << 20)
    returned, first, depths = 0, "", []
    for i in range(calls):
        try:
            dist.all_reduce(t)
            returned += 1
        except Exception as exc:  # noqa: BLE001
            first = first or f"{type(exc).__name__}: {exc}"
            if not depths or i == calls - 1:
                depths.append(_frames(exc))
    dist.destroy_process_group()
    return returned, first, depths


def timed(ctx, how: str, victim: int, seconds: float) -> dict:
    """Per-call timeouts: ``work.wait(timeout)`` or the options' timeout, with ``victim`` never calling."""
    if ctx.rank == victim:
        return _stay_away(ctx)
    x = torch.ones(1000)
    if how == "wait":
        fn = lambda: dist.all_reduce(x, async_op=True).wait(timeout=timedelta(seconds=seconds))  # noqa: E731
    else:
        def fn() -> None:
            opts = dist.AllreduceOptions()
            opts.timeout = timedelta(seconds=seconds)
            dist.distributed_c10d._get_default_group().allreduce([x], opts).wait()
    report = _outcome(fn)
    report["after"] = _afterwards()
    return _leave(report)


def monitored(ctx, absent: list[int], wait_all: bool, seconds: float) -> dict:
    """``monitored_barrier`` with ``absent`` ranks staying away; then the group still works for everyone."""
    pg = dist.distributed_c10d._get_default_group()
    if ctx.rank in absent:
        ctx.store.wait([f"{_CELL['name']}/release"], timedelta(seconds=90))
        report: dict = {"victim": True}
    else:
        # the present ranks meet first, so that on a loaded host none of them is late to the barrier itself
        _passed(ctx, "present")
        ctx.store.wait([f"{_CELL['name']}/present/{r}" for r in range(ctx.world_size) if r not in absent],
                       timedelta(seconds=60))
        report = _outcome(lambda: pg.monitored_barrier(timedelta(seconds=seconds), wait_all_ranks=wait_all))
        if ctx.rank == 0:  # it has given up on them: let the absent ranks go on
            ctx.store.set(f"{_CELL['name']}/release", "1")
    t = torch.ones(4)
    dist.all_reduce(t)
    report["after"] = t[0].item()
    return _leave(report)


# ---- through training wrappers ----------------------------------------------------
def _model(width: int = 1024) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 8))


def _step(model: nn.Module, width: int = 1024) -> None:
    x = torch.randn(16, width)
    loss = model(x).square().mean()
    loss.backward()
    for p in model.parameters():
        p.grad = None


def wrapped(ctx, who: str, fault: str, victim: int) -> dict:
    """A training step through torch DDP, FSDP2 or haiscale DDP while the victim dies or stays away.

    Every rank builds its model and imports its wrapper first, and the ranks meet on the store before the
    wrapper's first collective: on a loaded host a rank may take seconds to get there, and the set-up must not
    spend the group's short timeout that the absent cells test."""
    bare = _model()
    if who == "fsdp":  # imported before the meeting
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard
    elif who == "haiscale":
        from fireflyer.haiscale import DistributedDataParallel
    elif who != "ddp":
        raise UserError(who)
    _passed(ctx, "built")
    _wait_passed(ctx, "built")
    if who == "ddp":
        model = nn.parallel.DistributedDataParallel(bare)
    elif who == "fsdp":
        model = bare
        mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        model = DistributedDataParallel(bare)
    _step(model)  # one good step through the wrapper
    _passed(ctx, "good-step")
    if ctx.rank == victim:
        if fault == "between":  # between steps on every rank: not while a peer still finishes the good one
            _wait_passed(ctx, "good-step")
            _die_now()
        if fault == "during":
            _die_soon(0.05)
        if fault == "absent":
            return _stay_away(ctx)

    def steps() -> None:
        for _ in range(100 if fault == "during" else 3):
            _step(model)

    report = _outcome(steps)
    report["after"] = _afterwards()
    return _leave(report)


def store_keys(ctx) -> dict[str, bool]:
    """Which of hfreduce's rendezvous keys the default group's store holds (after ``join``)."""
    pg = dist.distributed_c10d._get_default_group()
    prefix = f"hfreduce/{pg.comm.incarnation}"
    return {k: pg._group_store.check([f"{prefix}/{k}"]) for k in ("salt", "secret")}
