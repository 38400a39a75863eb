"""Rank functions for test_node_all_to_all.py: all_to_all_single through the arena on one node."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

_STATE: dict = {}


def init(ctx, prefix: str) -> None:
    import fireflyer.hfreduce  # noqa: F401 - registers the backend

    if _STATE.get("prefix") != prefix:
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("hfreduce", store=dist.PrefixStore(prefix, ctx.store), rank=ctx.rank,
                                world_size=ctx.world_size, timeout=timedelta(seconds=20))
        _STATE["prefix"] = prefix


def _rows(src: int, dst: int, scale: int) -> int:
    return (src * 5 + dst * 3) % 4 * scale  # uneven, zeros included


def _input(me: int, world: int, scale: int, cols: int) -> torch.Tensor:
    n = sum(_rows(me, d, scale) for d in range(world))
    return (torch.arange(n * cols, dtype=torch.float32) + 1000 * me).view(n, cols)


def _expected(me: int, world: int, scale: int, cols: int) -> torch.Tensor:
    parts = []
    for src in range(world):
        x = _input(src, world, scale, cols)
        start = sum(_rows(src, d, scale) for d in range(me))
        parts.append(x[start : start + _rows(src, me, scale)])
    return torch.cat(parts)


def exchange(ctx, prefix: str, scale: int, cols: int, async_ranks: list[int], big_rank: int = -1) -> dict:
    """One uneven all_to_all_single; ranks in ``async_ranks`` call it with async_op=True.
    ``big_rank`` sends 400x more rows than the others (its input does not fit its slot)."""
    init(ctx, prefix)
    me, world = ctx.rank, ctx.world_size

    def rows(src, dst):
        return _rows(src, dst, scale * (400 if src == big_rank else 1))

    x = torch.cat([(torch.arange(rows(me, d) * cols, dtype=torch.float32) + 1000 * me + 100 * d).view(-1, cols)
                   for d in range(world)])
    want = torch.cat([(torch.arange(rows(s, me) * cols, dtype=torch.float32) + 1000 * s + 100 * me).view(-1, cols)
                      for s in range(world)])
    out = torch.full_like(want, -1.0)
    kw = dict(output_split_sizes=[rows(s, me) for s in range(world)], input_split_sizes=[rows(me, d) for d in range(world)])
    if me in async_ranks:
        dist.all_to_all_single(out, x, async_op=True, **kw).wait()
    else:
        dist.all_to_all_single(out, x, **kw)
    kinds = [e["profiling_name"] for e in dist.group.WORLD.comm.flight.entries()]
    return {"right": bool(torch.equal(out, want)), "arena": kinds.count("nccl:all_to_all")}


def in_place(ctx, prefix: str) -> bool:
    init(ctx, prefix)
    me, world = ctx.rank, ctx.world_size
    t = torch.tensor([float(100 * me + d) for d in range(world)])
    dist.all_to_all_single(t, t)
    return t.tolist() == [float(100 * s + me) for s in range(world)]


def mismatch(ctx, prefix: str, what: str, odd: int) -> tuple[str, str, str]:
    """Rank ``odd`` disagrees: ``split`` (sends rank 0 one row more than it expects) or ``dtype``.
    Returns what the call raised (or "returned"), its message, and what the next collective raised."""
    init(ctx, prefix)
    me, world = ctx.rank, ctx.world_size
    rows_in = [1] * world
    dtype = torch.float32
    if me == odd and what == "split":
        rows_in[0] = 2
    if me == odd and what == "dtype":
        dtype = torch.float64
    x = torch.ones(sum(rows_in), dtype=dtype)
    out = torch.zeros(world, dtype=dtype)
    try:
        dist.all_to_all_single(out, x, [1] * world, rows_in)
        got = ("returned", "")
    except Exception as exc:  # noqa: BLE001 - what each rank saw is the result
        got = (type(exc).__name__, str(exc))
    try:  # whatever the call did here, the group has failed: the next one raises
        dist.all_reduce(torch.ones(3))
        after = "returned"
    except Exception as exc:  # noqa: BLE001
        after = type(exc).__name__
    return got[0], got[1], after
