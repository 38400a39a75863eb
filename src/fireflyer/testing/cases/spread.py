"""Rank-side functions for the spread tests: all_gather, broadcast and reduce_scatter on hfreduce across nodes.

Each rank makes an ``"hfreduce"`` default group and a gloo group over the same ranks, runs a
case on both, and compares: data movement (gathers, broadcasts) byte for byte, reductions of
integer-valued inputs exactly. Every rank can remake every rank's input from the case's seed,
so each reduction is also checked against a reference computed here (fp32 accumulation rounded
once for fp16/bf16; gloo, which rounds bf16 after every step, is no reference for those).
"""

from __future__ import annotations

import importlib
import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32, torch.int64]
HALF = (torch.bfloat16, torch.float16)
OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX,
       "product": dist.ReduceOp.PRODUCT}
_GROUPS: dict = {}


def init(ctx, timeout: float = 60.0, prefix: str = "spread") -> None:
    """The hfreduce default group and a gloo twin (once per process, or again on a new prefix)."""
    if _GROUPS.get("prefix") == prefix:
        return
    importlib.import_module("fireflyer.hfreduce")  # registers the backend

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("hfreduce", store=dist.PrefixStore(prefix, ctx.store), rank=ctx.rank,
                            world_size=ctx.world_size, timeout=timedelta(seconds=timeout))
    _GROUPS["gloo"] = dist.new_group(backend="gloo", timeout=timedelta(seconds=60))
    _GROUPS["prefix"] = prefix


@dataclass(frozen=True)
class Case:
    kind: str  # ag_tensor | ag_list | ag_inplace | ag_coalesced | bcast | rs_tensor | rs_list | rs_inplace | rs_coalesced
    dtype: torch.dtype
    numel: int  # per-rank block (allgather, reduce_scatter output) or the whole tensor (broadcast)
    op: str = "sum"
    root: int = 0
    seed: int = 0
    noncontig: bool = False
    fractions: bool = False  # bf16/fp16 values with fractions whose fp32 sums are exact: shows one rounding


def values(case: Case, rank: int, n: int, salt: int = 0) -> torch.Tensor:
    """Rank ``rank``'s input: small integers (exact in every dtype and every sum), or fractions."""
    g = torch.Generator().manual_seed(case.seed * 7919 + rank * 104729 + salt)
    if case.op == "product":
        x = torch.tensor([1, 2, -1, 1], dtype=torch.int64)[torch.randint(0, 4, (n,), generator=g)]
    elif case.fractions:
        # multiples of 2**-7 in [-4, 4): exact in bf16 and fp16, and any sum of eight of them is exact in fp32
        return (torch.randint(-512, 512, (n,), generator=g).double() / 128).to(case.dtype)
    else:
        x = torch.randint(-8, 8, (n,), generator=g)
    return x.to(case.dtype)


def _loose(t: torch.Tensor) -> torch.Tensor:
    """A non-contiguous tensor with ``t``'s values (every other element of a twice-as-long buffer)."""
    base = torch.zeros((t.numel(), 2), dtype=t.dtype)
    base[:, 0] = t.reshape(-1)
    return base[:, 0]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    t = torch.empty(t.shape, dtype=t.dtype).copy_(t)
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def _same(name: str, got: list[torch.Tensor], want: list[torch.Tensor]) -> str | None:
    for i, (a, b) in enumerate(zip(got, want)):
        if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(_bytes(a), _bytes(b)):
            diff = (a.double() - b.double()).abs().max().item() if a.shape == b.shape and a.numel() else "-"
            return f"{name}: tensor {i} differs ({a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)}, max |d| {diff})"
    return None


def reference(case: Case, world: int, me: int, inputs: list[torch.Tensor]) -> torch.Tensor:
    """``op`` over every rank of block ``me``: wide accumulation (fp32 for fp16/bf16, as hfreduce does), rounded once."""
    n = case.numel
    wide = torch.float32 if case.dtype in HALF else case.dtype
    blocks = [x[me * n : (me + 1) * n].to(wide) for x in inputs]
    acc = blocks[0].clone()
    for b in blocks[1:]:
        if case.op in ("sum", "avg"):
            acc += b
        elif case.op == "product":
            acc *= b
        elif case.op == "min":
            acc = torch.minimum(acc, b)
        else:
            acc = torch.maximum(acc, b)
    if case.op == "avg":
        acc /= world
    return acc.to(case.dtype)


def _gloo_ok(case: Case) -> bool:
    return case.op != "avg" and not (case.dtype in HALF and case.kind.startswith("rs"))


# -- the cases -----------------------------------------------------------------------------------


def _allgather(me: int, world: int, case: Case) -> str | None:
    n = case.numel
    x = values(case, me, n)
    src = _loose(x) if case.noncontig else x
    want = [values(case, r, n) for r in range(world)]
    if case.kind == "ag_tensor":
        out = torch.full((world * n,), 99, dtype=case.dtype)
        dst = _loose(out) if case.noncontig else out
        dist.all_gather_into_tensor(dst, src)
        gloo = torch.zeros(world * n, dtype=case.dtype)
        dist.all_gather_into_tensor(gloo, x, group=_GROUPS["gloo"])
        return _same("all_gather_into_tensor (gloo)", [dst], [gloo]) or \
            _same("all_gather_into_tensor", [dst], [torch.cat(want)])
    if case.kind == "ag_list":
        outs = [torch.full((n,), 99, dtype=case.dtype) for _ in range(world)]
        if case.noncontig:
            outs = [_loose(o) for o in outs]
        work = dist.all_gather(outs, src, async_op=True)
        work.wait()
        gloo = [torch.zeros(n, dtype=case.dtype) for _ in range(world)]
        dist.all_gather(gloo, x, group=_GROUPS["gloo"])
        return _same("all_gather (gloo)", outs, gloo) or _same("all_gather", outs, want)
    if case.kind == "ag_inplace":  # the input is this rank's block of the output (as FSDP passes it)
        out = torch.full((world * n,), 99, dtype=case.dtype)
        out[me * n : (me + 1) * n] = x
        dist.all_gather_into_tensor(out, out[me * n : (me + 1) * n])
        return _same("all_gather_into_tensor in place", [out], [torch.cat(want)])
    # ag_coalesced: two tensors of different sizes in one _coalescing_manager
    x2 = values(case, me, n + 3, salt=1)
    outs = [torch.zeros(world * n, dtype=case.dtype), torch.zeros(world * (n + 3), dtype=case.dtype)]
    with dist._coalescing_manager(async_ops=True) as cm:
        dist.all_gather_into_tensor(outs[0], x)
        dist.all_gather_into_tensor(outs[1], x2)
    cm.wait()
    want2 = torch.cat([values(case, r, n + 3, salt=1) for r in range(world)])
    return _same("coalesced all_gather_into_tensor", outs, [torch.cat(want), want2])


def _broadcast(me: int, world: int, case: Case) -> str | None:
    root = case.root % world
    x = values(case, root, case.numel) if me == root else torch.full((case.numel,), 99, dtype=case.dtype)
    t = _loose(x) if case.noncontig else x.clone()
    dist.broadcast(t, src=root)
    gloo = x.clone()
    dist.broadcast(gloo, src=root, group=_GROUPS["gloo"])
    return _same("broadcast (gloo)", [t], [gloo]) or _same("broadcast", [t], [values(case, root, case.numel)])


def _reduce_scatter(me: int, world: int, case: Case) -> str | None:
    n = case.numel
    op = OPS[case.op]
    inputs = [values(case, r, world * n) for r in range(world)]
    x = inputs[me]
    want = reference(case, world, me, inputs)
    if case.kind == "rs_tensor":
        out = torch.full((n,), 99, dtype=case.dtype)
        dst = _loose(out) if case.noncontig else out
        dist.reduce_scatter_tensor(dst, _loose(x) if case.noncontig else x, op=op)
        got = [dst]
        if _gloo_ok(case):
            gloo = torch.zeros(n, dtype=case.dtype)
            dist.reduce_scatter_tensor(gloo, x.clone(), op=op, group=_GROUPS["gloo"])
            bad = _same("reduce_scatter_tensor (gloo)", got, [gloo])
            if bad:
                return bad
        return _same("reduce_scatter_tensor", got, [want])
    if case.kind == "rs_list":
        out = torch.full((n,), 99, dtype=case.dtype)
        pieces = list(x.split(n)) if n else [torch.zeros(0, dtype=case.dtype) for _ in range(world)]
        work = dist.reduce_scatter(out, [p.clone() for p in pieces], op=op, async_op=True)
        work.wait()
        if _gloo_ok(case):
            gloo = torch.zeros(n, dtype=case.dtype)
            dist.reduce_scatter(gloo, [p.clone() for p in pieces], op=op, group=_GROUPS["gloo"])
            bad = _same("reduce_scatter (gloo)", [out], [gloo])
            if bad:
                return bad
        return _same("reduce_scatter", [out], [want])
    if case.kind == "rs_inplace":  # the output is this rank's block of the input
        buf = x.clone()
        dist.reduce_scatter_tensor(buf[me * n : (me + 1) * n], buf, op=op)
        return _same("reduce_scatter_tensor in place", [buf[me * n : (me + 1) * n]], [want])
    # rs_coalesced: two reduce_scatter_tensor in one _coalescing_manager
    case2 = Case(case.kind, case.dtype, n + 2, case.op, seed=case.seed + 1)
    inputs2 = [values(case2, r, world * (n + 2)) for r in range(world)]
    outs = [torch.zeros(n, dtype=case.dtype), torch.zeros(n + 2, dtype=case.dtype)]
    with dist._coalescing_manager(async_ops=True) as cm:
        dist.reduce_scatter_tensor(outs[0], x, op=op)
        dist.reduce_scatter_tensor(outs[1], inputs2[me], op=op)
    cm.wait()
    return _same("coalesced reduce_scatter_tensor", outs, [want, reference(case2, world, me, inputs2)])


CASES = {"ag_tensor": _allgather, "ag_list": _allgather, "ag_inplace": _allgather, "ag_coalesced": _allgather,
         "bcast": _broadcast, "rs_tensor": _reduce_scatter, "rs_list": _reduce_scatter, "rs_inplace": _reduce_scatter,
         "rs_coalesced": _reduce_scatter}


def run_cases(ctx, cases: list[Case]) -> list[str]:
    from fireflyer.testing.cases.exchange import run_named

    init(ctx)
    return run_named(CASES, ctx, cases)


def deterministic(ctx, case: Case, reps: int) -> list[bytes]:
    """The bits of ``reps`` runs of one reduce_scatter on the same inputs."""
    init(ctx)
    me, world, n = ctx.rank, ctx.world_size, case.numel
    x = values(case, me, world * n)
    got = []
    for _ in range(reps):
        out = torch.zeros(n, dtype=case.dtype)
        dist.reduce_scatter_tensor(out, x, op=OPS[case.op])
        got.append(bytes(_bytes(out).numpy()))
    return got


# -- what crosses between nodes ----------------------------------------------------------------------


def cross_bytes(ctx, kind: str, numel: int) -> dict:
    """Bytes this rank's spread collectives sent to other nodes during one call of ``kind``."""
    from fireflyer.hfreduce.backend import spread

    init(ctx)
    me, world = ctx.rank, ctx.world_size
    x = torch.ones(numel * (world if kind == "reduce_scatter" else 1))
    out = torch.zeros(numel * (1 if kind == "reduce_scatter" else world))
    dist.barrier()
    before = spread.cross_node_bytes()
    if kind == "reduce_scatter":
        dist.reduce_scatter_tensor(out, x)
        ok = bool(torch.equal(out, torch.full_like(out, float(world))))
    elif kind == "all_gather":
        dist.all_gather_into_tensor(out, x * me)
        ok = bool(torch.equal(out, torch.arange(world).repeat_interleave(numel).float()))
    else:
        t = x * 7 if me == 0 else torch.zeros_like(x)
        dist.broadcast(t, src=0)
        ok = bool(torch.equal(t, x * 7))
    return {"bytes": spread.cross_node_bytes() - before, "ok": ok}


# -- faults -------------------------------------------------------------------------------------------


def killed_during(ctx, cell: str, kind: str, victim: int, timeout: float, mode: str) -> dict:
    """The victim dies (``os._exit``) while the others are in a big ``kind``; they report what they saw.

    ``silent``: the victim never joins the call and dies 0.3 s into it, so every other rank
    must raise. ``mid``: the victim starts the call and dies at once, its transfers under way;
    a rank whose data had all left the victim's socket by then may finish, with the right
    result, and raises on its next call (the group has failed).
    """
    init(ctx, timeout=timeout, prefix=cell)
    me, world = ctx.rank, ctx.world_size
    warm = torch.zeros(world)
    dist.all_gather_into_tensor(warm, torch.full((1,), float(me)))  # every cross-node link in use once
    assert warm.tolist() == [float(r) for r in range(world)]
    n = 4 << 20  # float32 elements: a collective big enough to be in flight when the victim dies
    if kind == "reduce_scatter":
        x, out = torch.full((n,), float(me)), torch.zeros(n // world)
        want = torch.full((n // world,), float(sum(range(world))))
        call = lambda **kw: dist.reduce_scatter_tensor(out, x, **kw)  # noqa: E731
    else:
        x, out = torch.full((n // world,), float(me)), torch.zeros(n)
        want = torch.arange(world, dtype=torch.float32).repeat_interleave(n // world)
        call = lambda **kw: dist.all_gather_into_tensor(out, x, **kw)  # noqa: E731
    dist.barrier(group=_GROUPS["gloo"])
    if me == victim:
        if mode == "mid":
            call(async_op=True)
        else:
            time.sleep(0.3)
        os._exit(3)
    t0 = time.monotonic()
    try:
        call()
        raised, msg = None, ""
    except Exception as exc:  # noqa: BLE001 - what the survivor saw is the result
        raised, msg = type(exc).__name__, str(exc)
    elapsed = time.monotonic() - t0
    correct = raised is None and bool(torch.equal(out, want))
    t1 = time.monotonic()
    try:
        dist.all_gather_into_tensor(torch.zeros(world), torch.ones(1))
        after = None
    except Exception as exc:  # noqa: BLE001
        after = type(exc).__name__
    after_s = time.monotonic() - t1
    from fireflyer.hfreduce.errors import HFReduceError

    dist.destroy_process_group()
    _GROUPS.clear()
    return {"raised": raised, "msg": msg, "elapsed": elapsed, "correct": correct, "after": after, "after_s": after_s,
            "hfreduce_error": raised is not None and _is_hfreduce(raised, HFReduceError)}


def _is_hfreduce(name: str, base: type) -> bool:
    from fireflyer.hfreduce import errors

    cls = getattr(errors, name, None)
    return isinstance(cls, type) and issubclass(cls, base)


def bad_inputs(ctx) -> dict:
    """Wrong sizes, dtypes and roots raise the same errors as on one node, before anything moves."""
    init(ctx)
    world = ctx.world_size
    seen = {}
    calls = {
        "ag_size": lambda: dist.all_gather_into_tensor(torch.zeros(world * 2 + 1), torch.ones(2)),
        "ag_dtype": lambda: dist.all_gather_into_tensor(torch.zeros(world * 2, dtype=torch.float64), torch.ones(2)),
        "ag_list_size": lambda: dist.all_gather([torch.zeros(3) for _ in range(world)], torch.ones(2)),
        "rs_size": lambda: dist.reduce_scatter_tensor(torch.zeros(2), torch.ones(world * 2 + 1)),
        "rs_dtype": lambda: dist.reduce_scatter_tensor(torch.zeros(2), torch.ones(world * 2, dtype=torch.int32)),
        "rs_avg_int": lambda: dist.reduce_scatter_tensor(torch.zeros(2, dtype=torch.int32),
                                                         torch.ones(world * 2, dtype=torch.int32),
                                                         op=dist.ReduceOp.AVG),
        "bcast_root": lambda: dist.distributed_c10d._get_default_group().broadcast([torch.ones(2)], _opts_root(world + 3)).wait(),
    }
    for name, fn in calls.items():
        try:
            fn()
            seen[name] = None
        except Exception as exc:  # noqa: BLE001
            seen[name] = (type(exc).__name__, str(exc))
    good = torch.zeros(world)  # and the group still works afterwards
    dist.all_gather_into_tensor(good, torch.full((1,), float(ctx.rank)))
    seen["after"] = good.tolist()
    return seen


def _opts_root(root: int):
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    return opts
