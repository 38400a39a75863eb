"""Rank functions for test_fast_door.py: small ``dist.all_reduce`` calls through the fast door."""

from __future__ import annotations

import torch
import torch.distributed as dist

from fireflyer.testing.cases.node_a2a import init


def ring_after(ctx, prefix: str, calls: int) -> dict:
    """``calls`` small all_reduces of one shape, twice over; what the flight ring held after each pass."""
    init(ctx, prefix)
    t = torch.ones(7, 3)
    ring = dist.group.WORLD.comm.flight._ring
    passes = []
    for _ in range(2):
        for _ in range(calls):
            t.fill_(1)
            dist.all_reduce(t)
        passes.append({"entries": [id(e) for e in ring], "sizes": {id(e.input_sizes) for e in ring},
                       "seqs": sorted(e.seq for e in ring)})
    return {"passes": passes, "right": bool((t == ctx.world_size).all()), "capacity": len(ring)}
