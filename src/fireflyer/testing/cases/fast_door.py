"""Rank functions for test_fast_door.py: small ``dist.all_reduce`` calls through the fast door."""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist

from fireflyer.testing.cases.node_a2a import init


def ring_after(ctx, prefix: str, calls: int) -> dict:
    """``calls`` small all_reduces of one shape, twice over; what the flight ring held after each pass
    (the Python door's ring: run with ``FIREFLYER_HFREDUCE_DOOR=python``)."""
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


def records_after(ctx, prefix: str, calls: int) -> dict:
    """``calls`` small all_reduces of one shape, twice over, through the group's default door; after each pass
    the flight recorder's entries as it reports them, and how many objects the cycle collector tracks."""
    init(ctx, prefix)
    group = dist.group.WORLD
    t = torch.ones(7, 3)
    passes = []
    for _ in range(2):
        for _ in range(calls):
            t.fill_(1)
            dist.all_reduce(t)
        gc.collect()
        entries = group.comm.flight.entries()
        passes.append({"tracked": len(gc.get_objects()), "seqs": [e["collective_seq_id"] for e in entries],
                       "ids": [e["record_id"] for e in entries], "states": sorted({e["state"] for e in entries}),
                       "sizes": sorted({str(e["input_sizes"]) for e in entries}),
                       "settled": group.comm.flight.settled, "in_flight": group.comm.flight.in_flight()})
    return {"passes": passes, "right": bool((t == ctx.world_size).all()), "door": group.door}
