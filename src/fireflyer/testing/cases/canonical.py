"""Rank-side functions for the canonical-order tests: every rank checks its own result, bit for bit,
against one process summing all ranks' inputs in the canonical tree (``hfreduce.plans.canonical``)."""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from fireflyer.errors import FireflyerError
from fireflyer.hfreduce import HFReduceConfig
from fireflyer.hfreduce.plans.canonical import canonical_sum

OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG}


class Refusals(dict):
    """What each misuse gets: ``name -> "ErrorType: message"``, or ``"no error"`` where none was raised."""

    def attempt(self, name: str, fn) -> None:
        try:
            fn()
            self[name] = "no error"
        except FireflyerError as e:
            self[name] = f"{type(e).__name__}: {e}"


def term(seed: int, rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s input: values over many magnitudes, so the order of a sum shows in its bits."""
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    scale = torch.pow(10.0, torch.randint(-4, 5, (numel,), generator=g).to(torch.float64))
    return (torch.randn(numel, generator=g, dtype=torch.float64) * scale).clamp(-6e4, 6e4).to(dtype)


def expected(seed: int, world: int, numel: int, dtype: torch.dtype, op: str) -> torch.Tensor:
    """One process's result: the tree over every rank's term, AVG divided once, rounded once."""
    acc = canonical_sum([term(seed, r, numel, dtype) for r in range(world)], keep_accumulator=True)
    if op == "avg":
        acc = acc / world
    return acc.to(dtype)


def _bits(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def _group(ctx, config: HFReduceConfig):
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.PrefixStore("pg", ctx.store), rank=ctx.rank,
                                world_size=ctx.world_size)
    return dist.new_group(backend="hfreduce", pg_options=config)


def allreduce_cases(ctx, config: HFReduceConfig, cases: list[tuple[int, int, str, str]]) -> list[dict]:
    """``dist.all_reduce`` on a group made with ``config``, one call per (seed, numel, dtype, op);
    what each gives: its mismatches against :func:`expected` and its bits' digest."""
    group = _group(ctx, config)
    out = []
    for seed, numel, dtype_name, op in cases:
        dtype = getattr(torch, dtype_name)
        t = term(seed, ctx.rank, numel, dtype)
        dist.all_reduce(t, op=OPS[op], group=group)
        want = expected(seed, ctx.world_size, numel, dtype, op)
        out.append({"case": (seed, numel, dtype_name, op), "wrong": int((t.view(torch.uint8) != want.view(torch.uint8)).sum()),
                    "digest": _bits(t)})
    dist.destroy_process_group(group)
    return out


def reduce_scatter_cases(ctx, config: HFReduceConfig, cases: list[tuple[int, int, str, str, str]]) -> list[dict]:
    """Reduce-scatters on a group made with ``config``, one call per (seed, numel per rank, dtype, op, form):
    ``tensor`` (``dist.reduce_scatter_tensor``), ``list`` (``dist.reduce_scatter``) or ``async``
    (``dist.reduce_scatter_single`` with ``async_op=True``, as FSDP's canonical order calls it). Each
    rank's input is :func:`term` of ``numel * world`` elements, and it should get elements
    ``[rank*numel, (rank+1)*numel)`` of :func:`expected`; what each call gives: whether it is
    ``torch.equal`` to that, and its mismatched bytes."""
    group = _group(ctx, config)
    world, out = ctx.world_size, []
    for seed, numel, dtype_name, op, form in cases:
        dtype = getattr(torch, dtype_name)
        whole = term(seed, ctx.rank, numel * world, dtype)
        got = torch.full((numel,), float("nan"), dtype=dtype)
        if form == "list":
            dist.reduce_scatter(got, list(whole.split(numel)), op=OPS[op], group=group)
        elif form == "async":
            dist.reduce_scatter_single(got, whole, op=OPS[op], group=group, async_op=True).wait()
        else:
            dist.reduce_scatter_tensor(got, whole, op=OPS[op], group=group)
        want = expected(seed, world, numel * world, dtype, op)[ctx.rank * numel : (ctx.rank + 1) * numel]
        out.append({"case": (seed, numel, dtype_name, op, form), "equal": torch.equal(got, want),
                    "wrong": int((got.view(torch.uint8) != want.view(torch.uint8)).sum())})
    dist.destroy_process_group(group)
    return out


def fused_cases(ctx, config: HFReduceConfig, numels: list[int], seed: int) -> dict:
    """The same tensors reduced one by one, coalesced in one call, fused into one flat bucket, and
    asynchronously in flight together: every way gives the same bits."""
    group = _group(ctx, config)
    terms = [term(seed + i, ctx.rank, n, torch.float32) for i, n in enumerate(numels)]
    alone = [t.clone() for t in terms]
    for t in alone:
        dist.all_reduce(t, group=group)
    flat = torch.cat([t.clone() for t in terms])
    dist.all_reduce(flat, group=group)
    coalesced = [t.clone() for t in terms]
    group.allreduce_coalesced(coalesced).wait()
    pending = [t.clone() for t in terms]
    works = [dist.all_reduce(t, group=group, async_op=True) for t in pending]
    for w in works:
        w.wait()
    dist.destroy_process_group(group)
    return {"alone": [_bits(t) for t in alone], "flat": [_bits(t) for t in flat.split(numels)],
            "coalesced": [_bits(t) for t in coalesced], "async": [_bits(t) for t in pending],
            "expected": [_bits(expected(seed + i, ctx.world_size, n, torch.float32, "sum"))
                         for i, n in enumerate(numels)]}


def mixed_orders(ctx) -> str:
    """Rank 0 asks for the fast order and every other rank for the canonical one: the group refuses."""
    config = HFReduceConfig(order="fast" if ctx.rank == 0 else "canonical")
    try:
        _group(ctx, config)
    except Exception as exc:  # noqa: BLE001 - the test reads the message
        return f"{type(exc).__name__}: {exc}"
    return "formed"


def refused_layout(ctx) -> str:
    """A canonical group on a layout whose nodes are not subtrees of the tree over ranks."""
    try:
        _group(ctx, HFReduceConfig(order="canonical"))
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return "formed"
