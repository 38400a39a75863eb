"""Rank-side functions for the exchange tests: every point-to-point call on hfreduce and on gloo, same inputs.

Each rank makes an ``"hfreduce"`` default group and a gloo group over the same ranks,
runs a case on both and compares the bytes it received. A dtype gloo refuses runs on
gloo as a ``uint8`` view of the same bytes (the same data movement). Inputs are random
bytes (any bit pattern must arrive intact); bools are 0 or 1.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.int8, torch.int16,
          torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64]
SIZES = [0, 1, 2, 7, 13, 101, 1009, 65537]
_GROUPS: dict = {}


def init(ctx, timeout: float = 60.0, prefix: str = "xchg") -> str:
    """The hfreduce default group and a gloo twin (once per process, or again on a new prefix)."""
    if _GROUPS.get("prefix") != prefix:
        import fireflyer.hfreduce  # noqa: F401 - registers the backend

        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("hfreduce", store=dist.PrefixStore(prefix, ctx.store), rank=ctx.rank,
                                world_size=ctx.world_size, timeout=timedelta(seconds=timeout))
        _GROUPS["gloo"] = dist.new_group(backend="gloo", timeout=timedelta(seconds=60)) if prefix == "xchg" else None
        _GROUPS["prefix"] = prefix
    return dist.get_backend()


@dataclass(frozen=True)
class Case:
    kind: str  # a2a_even | a2a_uneven | a2a_list | a2a_list_uneven | gather | scatter | ring | pairs | tags | many | big | self
    dtype: torch.dtype
    numel: int
    seed: int = 0
    root: int = 0
    noncontig: bool = False
    cols: int = 1  # all_to_all_single: elements per row


def _values(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g, dtype=torch.uint8).bool()
    size = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * size,), generator=g, dtype=torch.uint8)
    return raw.view(dtype) if n else torch.empty(0, dtype=dtype)


def _piece(case: Case, src: int, dst: int, world: int) -> int:
    """Elements (rows for all_to_all_single) that ``src`` sends ``dst``: uneven cases vary them, zeros included."""
    if case.kind in ("a2a_uneven", "a2a_list_uneven"):
        return (case.numel * (src * 7 + dst * 3 + case.seed) % 11) // 5 + ((src + dst + case.seed) % 3 == 0)
    return case.numel


def _spread(t: torch.Tensor) -> torch.Tensor:
    """A non-contiguous tensor with the same values (every other element of a twice-as-long buffer)."""
    base = torch.zeros((t.numel(), 2), dtype=t.dtype)
    base[:, 0] = t.reshape(-1)
    return base[:, 0]


def _both(fn, *tensors: torch.Tensor) -> None:
    """Run ``fn(group, *tensors)`` on gloo, on uint8 views of the tensors if gloo refuses their dtype."""
    try:
        fn(_GROUPS["gloo"], *tensors)
    except RuntimeError:
        fn(_GROUPS["gloo"], *[t.view(torch.uint8) for t in tensors])


def _bytes(t: torch.Tensor) -> torch.Tensor:
    t = torch.empty(t.shape, dtype=t.dtype).copy_(t)  # unit strides (a 1-element view may have any stride)
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def _compare(name: str, got: list[torch.Tensor], want: list[torch.Tensor]) -> str | None:
    for i, (a, b) in enumerate(zip(got, want)):
        if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(_bytes(a), _bytes(b)):
            return f"{name}: tensor {i} differs from gloo's ({a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)})"
    return None


def run_case(ctx, case: Case) -> str | None:
    """None when hfreduce received exactly what gloo did; else what differs."""
    init(ctx)
    return CASES[case.kind](ctx.rank, ctx.world_size, case)


def run_cases(ctx, cases: list[Case]) -> list[str]:
    init(ctx)
    return run_named(CASES, ctx, cases)


def run_named(table: dict, ctx, cases: list) -> list[str]:
    """Run each case's function ``table[case.kind](rank, world, case)``; what went wrong, case by case."""
    out = []
    for case in cases:
        try:
            bad = table[case.kind](ctx.rank, ctx.world_size, case)
        except Exception as exc:  # noqa: BLE001 - reported with its case
            bad = f"{type(exc).__name__}: {exc}"
        if bad:
            out.append(f"{case}: {bad}")
    return out


# -- all to all ------------------------------------------------------------------------------


def _strided(shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed non-contiguous (rows, cols) tensor: every other column of one twice as wide."""
    return torch.zeros((shape[0], shape[1] * 2), dtype=dtype)[:, ::2]


def _a2a_single(me: int, world: int, case: Case) -> str | None:
    rows_in = [_piece(case, me, p, world) for p in range(world)]
    rows_out = [_piece(case, p, me, world) for p in range(world)]
    x = _values(case.dtype, sum(rows_in) * case.cols, case.seed * 31 + me).view(sum(rows_in), case.cols)
    out_shape = (sum(rows_out), case.cols)
    src, dst = x, torch.zeros(out_shape, dtype=case.dtype)
    if case.noncontig:
        src = _strided(x.shape, case.dtype)
        src.copy_(x)
        dst = _strided(out_shape, case.dtype)
    splits = {} if case.kind == "a2a_even" else {"output_split_sizes": rows_out, "input_split_sizes": rows_in}
    dist.all_to_all_single(dst, src, **splits)
    want = torch.zeros(out_shape, dtype=case.dtype)
    _both(lambda g, o, i: dist.all_to_all_single(o, i, group=g, **splits), want, x)
    return _compare("all_to_all_single", [dst], [want])


def _a2a_list(me: int, world: int, case: Case) -> str | None:
    """all_to_all on lists: equal pieces against gloo; uneven ones (which gloo refuses) against what each
    peer sent, which every rank can make itself."""
    uneven = case.kind == "a2a_list_uneven"
    size = (lambda src, dst: _piece(case, src, dst, world)) if uneven else (lambda src, dst: case.numel)
    ins = [_values(case.dtype, size(me, p), case.seed * 37 + me * 13 + p) for p in range(world)]
    if case.noncontig:
        ins = [_spread(t) for t in ins]
    outs = [torch.zeros(size(p, me), dtype=case.dtype) for p in range(world)]
    dist.all_to_all(outs, ins)
    if uneven:
        want = [_values(case.dtype, size(p, me), case.seed * 37 + p * 13 + me) for p in range(world)]
        return _compare("all_to_all (uneven)", outs, want)
    want = [torch.zeros_like(o) for o in outs]
    gloo = _GROUPS["gloo"]
    try:
        dist.all_to_all(want, [t.contiguous() for t in ins], group=gloo)
    except RuntimeError:
        views = [w.view(torch.uint8) for w in want]
        dist.all_to_all(views, [t.contiguous().view(torch.uint8) for t in ins], group=gloo)
    return _compare("all_to_all", outs, want)


# -- gather and scatter ------------------------------------------------------------------------


def _gather(me: int, world: int, case: Case) -> str | None:
    root = case.root % world
    x = _values(case.dtype, case.numel, case.seed * 41 + me)
    if case.noncontig:
        x = _spread(x)
    outs = [torch.zeros(case.numel, dtype=case.dtype) for _ in range(world)] if me == root else None
    dist.gather(x, outs, dst=root)
    want = [torch.zeros(case.numel, dtype=case.dtype) for _ in range(world)] if me == root else None
    gloo = _GROUPS["gloo"]
    try:
        dist.gather(x.contiguous(), want, dst=root, group=gloo)
    except RuntimeError:
        dist.gather(x.contiguous().view(torch.uint8), [w.view(torch.uint8) for w in want] if want else None,
                    dst=root, group=gloo)
    return _compare("gather", outs, want) if me == root else None


def _scatter(me: int, world: int, case: Case) -> str | None:
    root = case.root % world
    ins = [_values(case.dtype, case.numel, case.seed * 43 + p) for p in range(world)] if me == root else None
    out = torch.zeros(case.numel, dtype=case.dtype)
    dst = _spread(out) if case.noncontig else out
    dist.scatter(dst, ins, src=root)
    want = torch.zeros(case.numel, dtype=case.dtype)
    gloo = _GROUPS["gloo"]
    try:
        dist.scatter(want, ins, src=root, group=gloo)
    except RuntimeError:
        dist.scatter(want.view(torch.uint8), [t.view(torch.uint8) for t in ins] if ins else None, src=root, group=gloo)
    return _compare("scatter", [dst], [want])


# -- point to point ------------------------------------------------------------------------------


def _p2p(ops_for, me: int, world: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``ops_for(group)`` -> (P2POps, received tensors), run on hfreduce and on gloo."""
    got_ops, got = ops_for(None)
    for w in dist.batch_isend_irecv(got_ops):
        w.wait()
    want_ops, want = ops_for(_GROUPS["gloo"])
    for w in dist.batch_isend_irecv(want_ops):
        w.wait()
    return got, want


def _ring(me: int, world: int, case: Case) -> str | None:
    """Both directions of a ring at once, every rank sending first (batch_isend_irecv)."""
    def ops(group):
        right, left = (me + 1) % world, (me - 1) % world
        x = _values(case.dtype, case.numel + me, case.seed * 47 + me)
        y = torch.zeros(case.numel + left, dtype=case.dtype)
        x2 = _values(case.dtype, case.numel + me, case.seed * 53 + me)
        y2 = torch.zeros(case.numel + right, dtype=case.dtype)
        send = [dist.P2POp(dist.isend, x, right, group), dist.P2POp(dist.isend, x2, left, group)]
        recv = [dist.P2POp(dist.irecv, y, left, group), dist.P2POp(dist.irecv, y2, right, group)]
        return send + recv, [y, y2]

    if world == 1:
        return None
    got, want = _p2p(ops, me, world)
    return _compare("ring batch_isend_irecv", got, want)


def _pairs(me: int, world: int, case: Case) -> str | None:
    """Blocking send/recv between ranks 2k and 2k+1, several messages each way, sizes growing."""
    if world == 1:
        return None
    peer = me ^ 1
    if peer >= world:
        return None
    results = []
    for group in (None, _GROUPS["gloo"]):
        got = []
        for i in range(3):
            n = case.numel * (i + 1)
            x = _values(case.dtype, n, case.seed * 59 + me * 7 + i)
            y = torch.zeros(n, dtype=case.dtype)
            if me % 2 == 0:
                dist.send(x, dst=peer, group=group)
                dist.recv(y, src=peer, group=group)
            else:
                dist.recv(y, src=peer, group=group)
                dist.send(x, dst=peer, group=group)
            got.append(y)
        results.append(got)
    return _compare("send/recv", *results)


def _tags(me: int, world: int, case: Case) -> str | None:
    """Messages sent with tags 2, 1, 0 and received in the order 0, 1, 2: they match by tag."""
    if world == 1:
        return None
    right, left = (me + 1) % world, (me - 1) % world
    results = []
    for group in (None, _GROUPS["gloo"]):
        sends = [dist.isend(_values(case.dtype, case.numel + t, case.seed * 61 + me * 5 + t), dst=right, tag=t,
                            group=group) for t in (2, 1, 0)]
        got = [torch.zeros(case.numel + t, dtype=case.dtype) for t in (0, 1, 2)]
        recvs = [dist.irecv(g, src=left, tag=t, group=group) for g, t in zip(got, (0, 1, 2))]
        for w in recvs + sends:
            w.wait()
        results.append(got)
    return _compare("tags", *results)


def _many(me: int, world: int, case: Case) -> str | None:
    """Twenty messages in flight to one peer: the n-th send matches the n-th receive."""
    if world == 1:
        return None
    right, left = (me + 1) % world, (me - 1) % world
    results = []
    for group in (None, _GROUPS["gloo"]):
        sends = [dist.isend(_values(case.dtype, case.numel + i % 5, case.seed * 67 + me * 31 + i), dst=right,
                            group=group) for i in range(20)]
        got = [torch.zeros(case.numel + i % 5, dtype=case.dtype) for i in range(20)]
        recvs = [dist.irecv(g, src=left, group=group) for g in got]
        for w in recvs + sends:
            w.wait()
        results.append(got)
    return _compare("many", *results)


def _self(me: int, world: int, case: Case) -> str | None:
    """isend and irecv to this rank itself (torch allows it for the async forms)."""
    x = _values(case.dtype, case.numel, case.seed * 71 + me)
    y = torch.zeros(case.numel, dtype=case.dtype)
    ops = [dist.P2POp(dist.isend, x, me), dist.P2POp(dist.irecv, y, me)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    late = torch.zeros(case.numel, dtype=case.dtype)
    wr = dist.irecv(late, src=me)  # posted before the send this time
    dist.isend(x, dst=me).wait()
    wr.wait()
    return _compare("self", [y, late], [x, x])


CASES = {"a2a_even": _a2a_single, "a2a_uneven": _a2a_single, "a2a_list": _a2a_list, "a2a_list_uneven": _a2a_list,
         "gather": _gather,
         "scatter": _scatter, "ring": _ring, "pairs": _pairs, "tags": _tags, "many": _many, "self": _self}


# -- async ---------------------------------------------------------------------


def isend_returns_at_once(ctx, nbytes: int) -> dict:
    """Rank 0 isends a big tensor to the last rank, which posts its receive a second later."""
    init(ctx)
    me, last = ctx.rank, ctx.world_size - 1
    x = torch.arange(nbytes // 4, dtype=torch.float32)
    if me == 0:
        t0 = time.monotonic()
        work = dist.isend(x, dst=last)
        posted = time.monotonic() - t0
        work.wait()
        return {"posted_s": posted, "done_s": time.monotonic() - t0}
    if me == last:
        time.sleep(1.0)
        y = torch.zeros_like(x)
        dist.recv(y, src=0)
        return {"ok": bool(torch.equal(x, y))}
    return {}


# -- faults -----------------------------------------------------------------------------------------


def _die_soon(after: float) -> None:
    threading.Timer(after, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()


def _outcome(fn) -> dict:
    t0 = time.monotonic()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - what the survivor saw is the result
        return {"raised": type(exc).__name__, "msg": str(exc), "elapsed": time.monotonic() - t0}
    return {"raised": None, "msg": "", "elapsed": time.monotonic() - t0}


def _afterwards(world: int) -> dict:
    """A failed group stays failed: every kind of call raises at once."""
    seen = {}
    calls = {
        "all_reduce": lambda: dist.all_reduce(torch.ones(4)),
        "send": lambda: dist.isend(torch.ones(4), dst=(dist.get_rank() + 1) % world).wait(),
        "all_to_all_single": lambda: dist.all_to_all_single(torch.empty(4 * world), torch.ones(4 * world)),
    }
    for name, fn in calls.items():
        got = _outcome(fn)
        seen[name] = (got["raised"], round(got["elapsed"], 3))
    return seen


def fault(ctx, cell: str, what: str, victim: int, timeout: float) -> dict:
    """One fault cell on a fresh group: a good exchange, then ``what`` happens while the others wait.

    ``killed``: the victim dies while the others wait in recv from it; ``absent``: the victim
    never sends; ``size``/``dtype``: the victim sends something else than the others expect;
    ``a2a_split``: the victim's all_to_all_single splits disagree with its peers'; ``a2a_killed`` and
    ``a2a_absent``: as ``killed`` and ``absent``, with the others in a synchronous all_to_all_single.
    """
    init(ctx, timeout=timeout, prefix=cell)
    me, world = ctx.rank, ctx.world_size
    warm = torch.zeros(world)
    dist.all_to_all_single(warm, torch.full((world,), float(me)))  # every link in use once
    assert warm.tolist() == [float(r) for r in range(world)]
    # Every rank done with the warm-up before the fault: else a fast victim's fault can fail the
    # group while a slow rank's warm-up is still in flight (the group's rule), and the cell fails.
    dist.barrier()
    if what in ("a2a_killed", "a2a_absent") and me != victim:  # waiting in a synchronous all_to_all_single
        out = torch.zeros(world)
        report = _outcome(lambda: dist.all_to_all_single(out, torch.ones(world)))
    elif what == "a2a_split":
        rows = [1] * world
        if me == victim:
            rows[(victim + 1) % world] = 2
        ins = torch.ones(sum(rows))
        out = torch.zeros(world)
        report = _outcome(lambda: dist.all_to_all_single(out, ins, [1] * world, rows))
    elif me == victim:
        if what in ("killed", "a2a_killed"):
            _die_soon(0.5)
            time.sleep(30)
        if what in ("absent", "a2a_absent"):
            ctx.store.wait([f"{cell}/release"], timedelta(seconds=90))
            dist.destroy_process_group()
            _GROUPS.clear()
            return {"victim": True}
        x = torch.ones(11) if what == "size" else torch.ones(10, dtype=torch.float64) if what == "dtype" else None
        for r in range(world):
            if r != me:
                dist.send(x, dst=r)
        report = {"raised": None, "msg": "", "elapsed": 0.0}
    else:
        y = torch.zeros(10)
        report = _outcome(lambda: dist.recv(y, src=victim))
    report["after"] = _afterwards(world)
    t0 = time.monotonic()
    dist.destroy_process_group()
    _GROUPS.clear()
    report["destroy_s"] = time.monotonic() - t0
    return report


def wait_timeout(ctx, cell: str, victim: int) -> dict:
    """``work.wait(timeout)`` on an irecv whose sender never sends: the group fails with CollectiveTimeout."""
    init(ctx, timeout=60.0, prefix=cell)
    me = ctx.rank
    if me == victim:
        ctx.store.wait([f"{cell}/release"], timedelta(seconds=90))
        dist.destroy_process_group()
        _GROUPS.clear()
        return {"victim": True}
    y = torch.zeros(3)
    work = dist.irecv(y, src=victim)
    report = _outcome(lambda: work.wait(timeout=timedelta(seconds=1.5)))
    report["after"] = _afterwards(ctx.world_size)
    dist.destroy_process_group()
    _GROUPS.clear()
    return report


def threads_and_shm(ctx) -> dict:
    """After destroy_process_group: no exchange thread left, nothing of ours in /dev/shm."""
    init(ctx, prefix="leak")
    me, world = ctx.rank, ctx.world_size
    out = torch.zeros(world)
    dist.all_to_all_single(out, torch.full((world,), float(me)))
    dist.destroy_process_group()
    _GROUPS.clear()
    time.sleep(0.2)
    names = [t.name for t in threading.enumerate() if t.name.startswith("hfreduce")]
    return {"threads": names, "out": out.tolist()}
