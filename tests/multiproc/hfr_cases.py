"""Rank-side functions and references for the multi-process collective tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]
INTS = [torch.int32, torch.int64]
DTYPES = FLOATS + INTS


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
    if case.dtype in INTS:
        x = torch.randint(-1000, 1000, (n,), generator=g, dtype=case.dtype)
    else:
        x = (torch.randn(n, generator=g, dtype=torch.float64) * 3).to(case.dtype)
    return x


def _noncontig(x: torch.Tensor) -> torch.Tensor:
    """A non-contiguous view holding the same values in the same logical order."""
    n = x.numel()
    base = torch.empty(n, 2, dtype=x.dtype)
    base[:, 0] = x
    view = base[:, 0]
    assert not view.is_contiguous() or n <= 1
    return view


def run_case(ctx, case: Case) -> torch.Tensor:
    comm, rank, world = ctx.comm, ctx.rank, ctx.world_size
    x = make_input(case, rank, world)
    if case.noncontig:
        x = _noncontig(x)
    if case.kind == "allreduce":
        comm.allreduce(x, case.op).wait()
        return x.clone()
    if case.kind == "reduce_scatter":
        out = torch.full((case.numel,), 7, dtype=case.dtype) if case.dtype in INTS else torch.zeros(case.numel).to(case.dtype)
        comm.reduce_scatter(out, x, case.op).wait()
        return out
    if case.kind == "allgather":
        out = torch.zeros(case.numel * world, dtype=torch.float32).to(case.dtype)
        if case.noncontig:
            out = _noncontig(out)
        comm.allgather(out, x).wait()
        return out.clone()
    if case.kind == "broadcast":
        comm.broadcast(x, case.root).wait()
        return x.clone()
    raise ValueError(case.kind)


def reference(case: Case, world: int) -> list[torch.Tensor]:
    """Expected per-rank results in float64 (or int64), from every rank's input."""
    inputs = [make_input(case, r, world) for r in range(world)]
    wide = [x.to(torch.float64) if case.dtype in FLOATS else x.to(torch.int64) for x in inputs]
    if case.kind in ("allreduce", "reduce_scatter"):
        stacked = torch.stack(wide) if wide[0].numel() else torch.zeros(world, 0, dtype=wide[0].dtype)
        if case.op in ("sum", "avg"):
            full = stacked.sum(0)
            if case.op == "avg":
                full = full / world
        elif case.op == "min":
            full = stacked.min(0).values if stacked.shape[1] else stacked[0]
        else:
            full = stacked.max(0).values if stacked.shape[1] else stacked[0]
        if case.kind == "allreduce":
            return [full] * world
        k = case.numel
        return [full[r * k : (r + 1) * k] for r in range(world)]
    if case.kind == "allgather":
        return [torch.cat(wide)] * world
    if case.kind == "broadcast":
        return [wide[case.root]] * world
    raise ValueError(case.kind)


def tolerance(case: Case, world: int) -> float:
    """Absolute error allowed against the float64 reference: one rounding of the result plus fp32 accumulation."""
    if case.dtype in INTS or case.op in ("min", "max") or case.kind in ("allgather", "broadcast"):
        return 0.0
    scale = 3.0 * 4 * world  # |inputs| stay well below 4 sigma; the sum below world * that
    eps = {
        torch.float64: 2.0**-52,
        torch.float32: 2.0**-23,
        torch.float16: 2.0**-10,
        torch.bfloat16: 2.0**-7,
        torch.float8_e4m3fn: 2.0**-3,
        torch.float8_e5m2: 2.0**-2,
    }[case.dtype]
    return scale * (eps + world * 2.0**-23)


def ping(ctx) -> int:
    return ctx.rank


def layout_info(ctx) -> tuple[int, int, int, int]:
    c = ctx.comm
    return c.node, c.local_rank, c.local_size, c.num_nodes
